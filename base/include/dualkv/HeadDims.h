// The head dimensions DualKV's kernels take: one list that the compiler's spec
// check, the runtime's argument checks, the tuning database and the tools'
// flags all read, and the words their messages use for it.
#ifndef DUALKV_HEADDIMS_H
#define DUALKV_HEADDIMS_H

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>

namespace dualkv {

/// Every kernel kind takes these head dimensions with query, key and value
/// rows of equal width. 96 is not a multiple of the 128-byte swizzle's 64
/// elements: sm_90a's warp-specialized tiles of it are 128 columns wide, the
/// TMA zero-filling the last 32 (docs/architecture.md). 512 (Gemma 4's
/// global layers): the query-major kernels compute O and dQ in two CTAs of
/// 256 columns each (outputColumnBlocks, dualkv/Compiler/KernelSpec.h).
inline constexpr int kHeadDims[] = {64, 96, 128, 256, 512};

/// A query/key head_dim and the value head_dim a kernel takes with it.
struct HeadShape {
  int qk, v;
};
/// The pairs with a value head_dim apart from the query/key one: MLA's 192
/// (128 + 64 rotary) with 128 (DeepSeek-V3, Kimi K2).
inline constexpr HeadShape kSplitHeadShapes[] = {{192, 128}};

/// Whether `headDim` is one of kHeadDims (query, key and value rows alike).
inline bool isSupportedHeadDim(int64_t headDim) {
  for (int d : kHeadDims)
    if (headDim == d)
      return true;
  return false;
}

/// Whether query/key rows of `headDim` and value rows of `valueHeadDim` are
/// a shape some kernel takes: equal and in kHeadDims, or in
/// kSplitHeadShapes.
inline bool isSupportedHeadShape(int64_t headDim, int64_t valueHeadDim) {
  if (headDim == valueHeadDim)
    return isSupportedHeadDim(headDim);
  for (HeadShape s : kSplitHeadShapes)
    if (headDim == s.qk && valueHeadDim == s.v)
      return true;
  return false;
}

/// Whether `headDim` is a query/key head_dim of some shape (kHeadDims and
/// the split shapes' query/key widths), for flags that take it alone.
inline bool isQueryKeyHeadDim(int64_t headDim) {
  for (HeadShape s : kSplitHeadShapes)
    if (headDim == s.qk)
      return true;
  return isSupportedHeadDim(headDim);
}

/// "64, 96, 128, 256 or 512", for messages.
inline std::string headDimChoices() {
  std::string list;
  for (size_t i = 0; i < std::size(kHeadDims); ++i)
    list += (i == 0                          ? ""
             : i + 1 == std::size(kHeadDims) ? " or "
                                             : ", ") +
            std::to_string(kHeadDims[i]);
  return list;
}

/// "64, 96, 128, 256 or 512 with an equal value head_dim, or 192 with value
/// head_dim 128", for messages about a (head_dim, value head_dim) pair.
inline std::string headShapeChoices() {
  std::string list = headDimChoices() + " with an equal value head_dim";
  for (size_t i = 0; i < std::size(kSplitHeadShapes); ++i)
    list += (i + 1 == std::size(kSplitHeadShapes) ? ", or " : ", ") +
            std::to_string(kSplitHeadShapes[i].qk) + " with value head_dim " +
            std::to_string(kSplitHeadShapes[i].v);
  return list;
}

/// The head shape in kernel and file names: "d128", and "d192v128" when the
/// value rows are narrower.
inline std::string headShapeName(int64_t headDim, int64_t valueHeadDim) {
  return "d" + std::to_string(headDim) +
         (valueHeadDim == headDim ? "" : "v" + std::to_string(valueHeadDim));
}

} // namespace dualkv

#endif // DUALKV_HEADDIMS_H
