// DualKV's vocabulary: every enumeration that users, files and tools name, and
// every spelling of each value, in one table. The cache key, AOT file names and
// JSON, the tuning database, the tools' flags, the C API and the Python package
// (through dualkv_names()) all read it; nothing spells these values elsewhere.
#ifndef DUALKV_NAMES_H
#define DUALKV_NAMES_H

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace dualkv {

/// Fwd: the forward. Backward (docs/backward-abi.md): BwdPre (Delta), Bwd
/// (fused dK/dV/dQ, dQ by fp32 atomics), BwdPost (fp32 accumulators to the
/// element type); the split-dQ algorithm: BwdKV (dK/dV only) and BwdDQ (dQ,
/// query-major).
enum class KernelKind { Fwd, BwdPre, Bwd, BwdPost, BwdKV, BwdDQ };

/// The element type of q, k, v, o and the gradients.
enum class DType { BF16, FP16 };

/// How a kernel is computed, each in a folder of compiler/lib: MmaSync
/// (mma.sync, sm_80 and later; also bwd_pre and bwd_post, which are the same
/// everywhere), Wgmma (sm_90a, head_dim 128: the forward, the KV-major
/// backward and the dQ kernel, by name), WarpSpecialized (sm_90a's default:
/// the TMA forward at head_dim 64/128/256, the KV-major backward and the dQ
/// kernel at head_dim 64/128; prefix trees' too).
/// Auto means the default for the spec (resolveSpec).
enum class Schedule { Auto, MmaSync, Wgmma, WarpSpecialized };

/// Which kernels compute a backward (docs/backward-abi.md).
enum class BackwardAlgorithm {
  /// The runtime's choice (backwardAlgorithmFor): SplitDQ on sm_90a, prefix
  /// trees included; Atomic elsewhere (docs/performance.md).
  Auto,
  /// bwd (dK and dV of a key block in registers, dQ added with fp32 atomics
  /// into a workspace accumulator), then bwd_post (dQ converted).
  Atomic,
  /// bwd_kv (dK and dV, no dQ), then the query-major bwd_dq: no atomics, no
  /// accumulators, the same bits on every run. `deterministic` forces it.
  SplitDQ,
};

/// The order of the atomic backward's work items (docs/backward-abi.md):
/// the order their CTAs start in.
enum class BackwardOrder {
  /// The runtime's choice: LongestFirst.
  Auto,
  /// Decreasing query count (stable): the short items fill in behind the
  /// long ones at the end of a launch.
  LongestFirst,
  /// Increasing first query (stable: then the key tiles' order): the CTAs
  /// that run together reduce into nearby dQ rows and read nearby Q and dO,
  /// so the fp32 dQ accumulator's active rows can stay in L2 rather than
  /// spanning every query of the launch.
  QueryChunks,
};

namespace names {

/// One value and its spellings: `name` is the only one written anywhere
/// (files, keys, messages, flags, Python); `enumerator` is the C++ name that
/// generated code uses; `alias` (or null) is also accepted when parsing.
template <typename E> struct Row {
  E value;
  const char *name;
  const char *enumerator;
  const char *alias = nullptr;
};

inline constexpr Row<KernelKind> kKinds[] = {
    {KernelKind::Fwd, "fwd", "Fwd"},
    {KernelKind::BwdPre, "bwd_pre", "BwdPre"},
    {KernelKind::Bwd, "bwd", "Bwd"},
    {KernelKind::BwdPost, "bwd_post", "BwdPost"},
    {KernelKind::BwdKV, "bwd_kv", "BwdKV"},
    {KernelKind::BwdDQ, "bwd_dq", "BwdDQ"},
};
inline constexpr Row<DType> kDTypes[] = {
    {DType::BF16, "bf16", "BF16", "bfloat16"},
    {DType::FP16, "fp16", "FP16", "float16"},
};
inline constexpr Row<Schedule> kSchedules[] = {
    {Schedule::Auto, "auto", "Auto"},
    {Schedule::MmaSync, "mma_sync", "MmaSync"},
    {Schedule::Wgmma, "wgmma", "Wgmma"},
    {Schedule::WarpSpecialized, "warp_specialized", "WarpSpecialized"},
};
inline constexpr Row<BackwardAlgorithm> kAlgorithms[] = {
    {BackwardAlgorithm::Auto, "auto", "Auto"},
    {BackwardAlgorithm::Atomic, "atomic", "Atomic"},
    {BackwardAlgorithm::SplitDQ, "split_dq", "SplitDQ"},
};
inline constexpr Row<BackwardOrder> kOrders[] = {
    {BackwardOrder::Auto, "auto", "Auto"},
    {BackwardOrder::LongestFirst, "longest_first", "LongestFirst"},
    {BackwardOrder::QueryChunks, "query_chunks", "QueryChunks"},
};

template <typename E, size_t N>
constexpr const Row<E> &rowOf(const Row<E> (&rows)[N], E value) {
  for (const Row<E> &row : rows)
    if (row.value == value)
      return row;
  return rows[0]; // unreachable for a valid enumerator
}

template <typename E, size_t N>
std::optional<E> parse(const Row<E> (&rows)[N], std::string_view text) {
  for (const Row<E> &row : rows)
    if (text == row.name || (row.alias && text == row.alias))
      return row.value;
  return std::nullopt;
}

/// "a, b or c": every name of `rows`, for messages.
template <typename E, size_t N> std::string listOf(const Row<E> (&rows)[N]) {
  std::string text;
  for (size_t i = 0; i < N; ++i) {
    if (i > 0)
      text += i + 1 == N ? " or " : ", ";
    text += rows[i].name;
  }
  return text;
}

} // namespace names

inline const char *toString(KernelKind v) {
  return names::rowOf(names::kKinds, v).name;
}
inline const char *toString(DType v) {
  return names::rowOf(names::kDTypes, v).name;
}
inline const char *toString(Schedule v) {
  return names::rowOf(names::kSchedules, v).name;
}
inline const char *toString(BackwardAlgorithm v) {
  return names::rowOf(names::kAlgorithms, v).name;
}
inline const char *toString(BackwardOrder v) {
  return names::rowOf(names::kOrders, v).name;
}

/// The C++ enumerator of `v` ("Fwd"), for generated code.
inline const char *enumeratorOf(KernelKind v) {
  return names::rowOf(names::kKinds, v).enumerator;
}
inline const char *enumeratorOf(DType v) {
  return names::rowOf(names::kDTypes, v).enumerator;
}
inline const char *enumeratorOf(Schedule v) {
  return names::rowOf(names::kSchedules, v).enumerator;
}

/// The value spelled `text` (its name, or its alias), or nullopt.
inline std::optional<KernelKind> parseKernelKind(std::string_view text) {
  return names::parse(names::kKinds, text);
}
inline std::optional<DType> parseDType(std::string_view text) {
  return names::parse(names::kDTypes, text);
}
inline std::optional<Schedule> parseSchedule(std::string_view text) {
  return names::parse(names::kSchedules, text);
}
inline std::optional<BackwardAlgorithm>
parseBackwardAlgorithm(std::string_view text) {
  return names::parse(names::kAlgorithms, text);
}
inline std::optional<BackwardOrder> parseBackwardOrder(std::string_view text) {
  return names::parse(names::kOrders, text);
}

} // namespace dualkv

#endif
