//===- KernelAbi.h - the parameters of every kernel kind, in launch order -===//
//
// One table per kernel kind, read by the emitters (which build the gpu.func
// signature from it and find each argument by name) and by the runtime
// (which fills a launch's parameters by name: LaunchParams,
// runtime/lib/Validate.h). docs/backward-abi.md explains them. Needs no MLIR:
// the runtime-only library includes it.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_KERNELABI_H
#define DUALKV_COMPILER_KERNELABI_H

#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Export.h"

#include <array>
#include <cstddef>
#include <cstring>

namespace dualkv::abi {

/// How a parameter is passed. Pointers are 64-bit device addresses.
enum class ParamType {
  ElemPtr,   ///< E* (bf16 or fp16 tensor)
  F32Ptr,    ///< f32*
  I32Ptr,    ///< i32*
  F32Addr,   ///< f32*, a raw global pointer inside the kernel (vector
             ///< reductions are written against it)
  I64,       ///< int64_t
  F32,       ///< float
  TensorMap, ///< CUtensorMap, 128 bytes by value (a grid constant)
};

struct Param {
  const char *name;
  ParamType type;
};

constexpr ParamType E = ParamType::ElemPtr, F32P = ParamType::F32Ptr,
                    I32P = ParamType::I32Ptr, F32A = ParamType::F32Addr,
                    I64 = ParamType::I64, F32 = ParamType::F32,
                    TMAP = ParamType::TensorMap;

/// `base` followed by `extra`: a schedule's or a variant's table is its
/// kind's table with parameters appended, so the shared prefix is written
/// once.
template <size_t N, size_t M>
constexpr std::array<Param, N + M> join(const Param *base, const Param *extra) {
  std::array<Param, N + M> out{};
  for (size_t i = 0; i < N; ++i)
    out[i] = base[i];
  for (size_t i = 0; i < M; ++i)
    out[N + i] = extra[i];
  return out;
}
template <size_t N, size_t M>
constexpr std::array<Param, N + M> extend(const Param (&base)[N],
                                          const Param (&extra)[M]) {
  return join<N, M>(base, extra);
}
template <size_t N, size_t M>
constexpr std::array<Param, N + M> extend(const std::array<Param, N> &base,
                                          const Param (&extra)[M]) {
  return join<N, M>(base.data(), extra);
}

// clang-format off
/// fwd: grid (ceil(max segment / blockM), segments, Hq).
inline constexpr Param kFwdParams[] = {
    {"q", E},           {"k", E},           {"v", E},
    {"o", E},           {"lse", F32P},      {"segs", I32P},
    {"qStrideT", I64},  {"qStrideH", I64},  {"kStrideT", I64},
    {"kStrideH", I64},  {"vStrideT", I64},  {"vStrideH", I64},
    {"oStrideT", I64},  {"oStrideH", I64},  {"lseStrideH", I64},
    {"scaleLog2", F32}};

/// fwd in the warp-specialized schedule: the forward's parameters, then the
/// tensor maps of Q, K and V (head_dim, heads, tokens; boxes of 64 columns x
/// 1 head x block_m or block_n rows, 128-byte swizzle) and the plan's work
/// order (Plan::forwardTable). Grid (work items, 1, Hq).
inline constexpr auto kFwdWarpSpecializedParams =
    extend(kFwdParams, {{"qMap", TMAP}, {"kMap", TMAP}, {"vMap", TMAP}, {"order", I32P}});

/// The forward of prefix trees (KernelSpec::tree; mma_sync, wgmma): the
/// forward's parameters, then the plan's chain table.
inline constexpr auto kFwdTreeParams =
    extend(kFwdParams, {{"chain", I32P}});

/// The warp-specialized forward of prefix trees (KernelSpec::tree, by name):
/// its parameters, then the plan's chain table.
inline constexpr auto kFwdWarpSpecializedTreeParams =
    extend(kFwdWarpSpecializedParams, {{"chain", I32P}});

/// bwd_pre: grid (ceil(T / blockM), Hq).
inline constexpr Param kBwdPreParams[] = {
    {"o", E},          {"dout", E},          {"delta", F32P},
    {"oStrideT", I64}, {"oStrideH", I64},    {"doStrideT", I64},
    {"doStrideH", I64}, {"deltaStrideH", I64}, {"numTokens", I64}};

/// Appended to bwd_pre's table for a caller that differentiates the LSE
/// (KernelSpec::dlse): dLSE ([Hq][T] fp32) and its head stride.
inline constexpr Param kDlseParams[] = {{"dlse", F32P}, {"dlseStrideH", I64}};
/// Appended to a forward's table with sinks (KernelSpec::sinks): one logit
/// per query head, fp32 [Hq].
inline constexpr Param kSinkParams[] = {{"sinks", F32P}};
/// Appended to fwd's, bwd's, bwd_kv's and bwd_dq's table with a sliding
/// window (KernelSpec::window, after the others): W >= 1.
inline constexpr Param kWindowParams[] = {{"window", I64}};
/// Appended to fwd's, bwd's, bwd_kv's and bwd_dq's table with a score
/// modifier (KernelSpec::scoreMod, after the window's): each token's position
/// in its logical sequence (int32 [T], the plan's), the index of the launch's
/// first query head among all of them (the backward launches slices of the
/// heads; the modifier sees the head's index in the model), then the
/// modifier's tensors, as many as it takes (kernelParams' `scoreModInputs`).
inline constexpr Param kScoreModParams[] = {
    {"lpos", I32P},
    {"scoreModHead0", I64},
    {"score_mod_input0", F32P},
    {"score_mod_input1", F32P},
    {"score_mod_input2", F32P},
    {"score_mod_input3", F32P},
    {"score_mod_input4", F32P},
    {"score_mod_input5", F32P},
    {"score_mod_input6", F32P},
    {"score_mod_input7", F32P}};
/// Appended to bwd_pre's table with sinks (after kDlseParams, if both): the
/// forward's LSE, its head stride, the sinks and dL/dsinks [Hq] (fp32, added
/// to: the runtime zeroes it first).
inline constexpr Param kSinkGradParams[] = {
    {"lse", F32P}, {"lseStrideH", I64}, {"sinks", F32P}, {"dsinks", F32P}};

/// bwd and bwd_kv: grid (work items, Hkv).
inline constexpr Param kBwdParams[] = {
    {"q", E},           {"k", E},            {"v", E},
    {"dout", E},        {"dk", E},           {"dv", E},
    {"lse", F32P},      {"delta", F32P},     {"dqacc", F32A},
    {"dkacc", F32P},    {"dvacc", F32P},     {"items", I32P},
    {"qStrideT", I64},  {"qStrideH", I64},   {"kStrideT", I64},
    {"kStrideH", I64},  {"vStrideT", I64},   {"vStrideH", I64},
    {"doStrideT", I64}, {"doStrideH", I64},  {"dkStrideT", I64},
    {"dkStrideH", I64}, {"dvStrideT", I64},  {"dvStrideH", I64},
    {"lseStrideH", I64}, {"deltaStrideH", I64}, {"scale", F32},
    {"scaleLog2", F32}};

/// bwd and bwd_kv in the warp-specialized schedule: their parameters, then
/// the tensor maps of Q and dO (head_dim, heads, tokens; boxes of 64 columns
/// x 1 head x block_n rows, 128-byte swizzle), which the producer loads the
/// query tiles with when the tiling has 2 stages (with 1, by cp.async; the
/// maps are passed either way).
inline constexpr auto kBwdWarpSpecializedParams =
    extend(kBwdParams, {{"qMap", TMAP}, {"doMap", TMAP}});

/// bwd_post: grid (ceil(max(T, accRows) / blockM), Hq + Hkv).
inline constexpr Param kBwdPostParams[] = {
    {"dqacc", F32P},    {"dkacc", F32P},     {"dvacc", F32P},
    {"dq", E},          {"dk", E},           {"dv", E},
    {"accTokens", I32P}, {"dqStrideT", I64}, {"dqStrideH", I64},
    {"dkStrideT", I64}, {"dkStrideH", I64},  {"dvStrideT", I64},
    {"dvStrideH", I64}, {"numTokens", I64},  {"numAccRows", I64}};

/// bwd_dq: grid as the forward's.
inline constexpr Param kBwdDQParams[] = {
    {"q", E},           {"k", E},            {"v", E},
    {"dout", E},        {"dq", E},           {"lse", F32P},
    {"delta", F32P},    {"segs", I32P},      {"qStrideT", I64},
    {"qStrideH", I64},  {"kStrideT", I64},   {"kStrideH", I64},
    {"vStrideT", I64},  {"vStrideH", I64},   {"doStrideT", I64},
    {"doStrideH", I64}, {"dqStrideT", I64},  {"dqStrideH", I64},
    {"lseStrideH", I64}, {"deltaStrideH", I64}, {"scale", F32},
    {"scaleLog2", F32}};

/// bwd_dq in the warp-specialized schedule: bwd_dq's parameters, then the
/// tensor maps of Q, K, V and dO (as the warp-specialized forward's, dO like
/// Q) and the plan's forward work order (Plan::forwardTable). Grid (work
/// items, 1, Hq).
inline constexpr auto kBwdDQWarpSpecializedParams =
    extend(kBwdDQParams, {{"qMap", TMAP}, {"kMap", TMAP}, {"vMap", TMAP}, {"doMap", TMAP}, {"order", I32P}});

/// bwd_dq of prefix trees (KernelSpec::tree): bwd_dq's parameters, then the
/// plan's chain table.
inline constexpr auto kBwdDQTreeParams =
    extend(kBwdDQParams, {{"chain", I32P}});

/// The warp-specialized bwd_dq of prefix trees (KernelSpec::tree; sm_90a's
/// default at head_dim 64 and 128): its parameters, then the plan's chain
/// table.
inline constexpr auto kBwdDQWarpSpecializedTreeParams =
    extend(kBwdDQWarpSpecializedParams, {{"chain", I32P}});
// clang-format on

/// A kernel's parameters in launch order.
struct ParamTable {
  const Param *params;
  size_t size;
  const Param *begin() const { return params; }
  const Param *end() const { return params + size; }
  /// The position of parameter `name`, or -1.
  int indexOf(const char *name) const {
    for (size_t i = 0; i < size; ++i)
      if (std::strcmp(params[i].name, name) == 0)
        return static_cast<int>(i);
    return -1;
  }
};

template <size_t N>
constexpr ParamTable tableOf(const std::array<Param, N> &p) {
  return {p.data(), N};
}
template <size_t N> constexpr ParamTable tableOf(const Param (&p)[N]) {
  return {p, N};
}

/// The parameter table of `kind` in `schedule` (resolved); `tree`: the
/// query-major kernels of prefix trees (KernelSpec::tree). The schedule's
/// record says which (dualkv/Compiler/Schedule.h; Auto: the common tables).
/// The variants append their parameters: `dlse` (KernelSpec::dlse)
/// kDlseParams, then `sinks` (KernelSpec::sinks) kSinkParams (fwd) or
/// kSinkGradParams (bwd_pre), then `window` (KernelSpec::window)
/// kWindowParams, then a score modifier of `scoreModInputs` tensors (-1:
/// none) lpos, scoreModHead0 and that many tensors of kScoreModParams.
DUALKV_API ParamTable kernelParams(KernelKind kind,
                                   Schedule schedule = Schedule::Auto,
                                   bool tree = false, bool dlse = false,
                                   bool sinks = false, bool window = false,
                                   int scoreModInputs = -1);

} // namespace dualkv::abi

#endif
