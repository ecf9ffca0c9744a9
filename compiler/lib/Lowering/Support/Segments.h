//===- Segments.h - the plan's segments and the key tiles they walk -------===//
//
// What the query-major kernels read of the plan (docs/forward-abi.md): a
// segment's row of the segment table, and the key tiles each kv_loop part of
// the tiled template walks for one query tile of it.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_COMMON_SEGMENTS_H
#define DUALKV_COMPILER_COMMON_SEGMENTS_H

#include "Lowering/Support/Builders.h"

#include <optional>

namespace mlir::dualkv {

/// A segment's row of the plan's segment table, as indices: its tokens
/// [start, start + length) and the shared prompt tokens [sharedStart,
/// sharedStart + sharedLen) it sees.
struct SegmentFields {
  Value start, length, sharedStart, sharedLen;
};
/// Row `seg` of the plan's segment table `segPtr` (int32 [segments][4]:
/// start, length, shared_start, shared_len).
inline SegmentFields segmentFields(ScalarBuilder &o, Value segPtr, Value seg) {
  Value fields[4];
  for (int64_t f = 0; f < 4; ++f)
    fields[f] = o.toIndex(memref::LoadOp::create(
        o.b, o.loc, segPtr, ValueRange{o.add(o.mul(seg, o.idx(4)), o.idx(f))}));
  return {fields[0], fields[1], fields[2], fields[3]};
}

/// One past the last response tile that the query tile at `qRow0` (block_m
/// rows, within the segment's `segLen` tokens) sees.
inline Value diagonalEnd(ScalarBuilder &o, Value qRow0, Value segLen,
                         int64_t blockM, int64_t blockN) {
  Value qEnd = o.add(qRow0, o.idx(blockM));
  Value end =
      o.select(o.cmp(arith::CmpIPredicate::ult, qEnd, segLen), qEnd, segLen);
  return o.ceilDiv(end, blockN);
}

/// Whether every key tile of loop part `part` lies inside its region (the
/// full tiles and a window's far edge, both below the region's edge).
inline bool insideRegion(LoopPart part) {
  return part == LoopPart::full || part == LoopPart::window;
}

/// Whether `kernel` has a sliding window (#dualkv.problem<..., window =
/// true>): it takes W as its `window` parameter.
inline bool hasWindow(KernelOp kernel) {
  return kernel && kernel.getProblem() && kernel.getProblem()->getWindow();
}

/// Key tiles [lb, ub) of a loop.
struct TileRange {
  Value lb, ub;
};

/// max(a - c, 0) for index values a, c >= 0.
inline Value subClamped(ScalarBuilder &o, Value a, Value c) {
  return o.select(o.cmp(arith::CmpIPredicate::ugt, a, c),
                  arith::SubIOp::create(o.b, o.loc, a, c), o.idx(0));
}
inline Value minIndex(ScalarBuilder &o, Value a, Value b) {
  return o.select(o.cmp(arith::CmpIPredicate::ult, a, b), a, b);
}
inline Value maxIndex(ScalarBuilder &o, Value a, Value b) {
  return o.select(o.cmp(arith::CmpIPredicate::ugt, a, b), a, b);
}

/// Tiles [lb, ub) of `block_n` keys that kv_loop `part` of `region` walks
/// for the query tile at `qRow0` (block_m rows) of a segment of `segLen`
/// tokens that sees `sharedLen` prompt tokens: the prompt's full tiles and
/// its tail, the segment's full tiles below the tile and its causal
/// diagonal, or (part <masked>) all of a region's tiles, the full ones and
/// the edge. None for an untiled loop (part <all>).
///
/// With a sliding window W (`window`, an index >= 1; null: none) (query row q
/// of the segment is logical position sharedLen + q, shared key k is k, the
/// segment's key j is sharedLen + j; a key is seen when q's position minus its
/// own is below W), the tiles no row of the query tile sees are skipped: part
/// <window> is the region's tiles that some rows see and others do not
/// (masked), <full> those every row sees, and the edges (<tail>, <diagonal>)
/// keep their tiles, past the window's far edge. The parts stay in that order,
/// each with lb <= ub. A tree's ancestor range (the shared region of one step
/// of the chain walk) lies `sharedShift` logical positions before the
/// segment's first token (the lengths of the ranges walked so far, its own
/// included); null: sharedLen, as for a group's prompt.
inline std::optional<TileRange>
kvLoopTiles(ScalarBuilder &o, LoopPart part, KVRegion region, Value qRow0,
            Value segLen, Value sharedLen, int64_t blockM, int64_t blockN,
            Value window = Value(), Value sharedShift = Value()) {
  if (part == LoopPart::all)
    return std::nullopt;
  bool shared = region == KVRegion::shared;
  // Without a window: the full tiles [0, edgeLo), the edge [edgeLo, edgeHi).
  Value edgeLo = o.divu(shared ? sharedLen : qRow0, blockN);
  Value edgeHi = shared ? o.ceilDiv(sharedLen, blockN)
                        : diagonalEnd(o, qRow0, segLen, blockM, blockN);
  if (!window) {
    switch (part) {
    case LoopPart::full:
      return TileRange{o.idx(0), edgeLo};
    case LoopPart::tail:
    case LoopPart::diagonal:
      return TileRange{edgeLo, edgeHi};
    case LoopPart::masked:
      return TileRange{o.idx(0), edgeHi};
    default:
      return std::nullopt;
    }
  }
  // The first row's lowest key seen (in the region's frame) and the key from
  // which the last row sees every one, clamped at 0.
  Value first =
      shared ? o.add(sharedShift ? sharedShift : sharedLen, qRow0) : qRow0;
  Value lowKey = subClamped(o, o.add(first, o.idx(1)), window);
  Value allKey = subClamped(o, o.add(first, o.idx(blockM)), window);
  // The first tile some row sees: none of the prompt's when lowKey is past it.
  Value lo = o.divu(lowKey, blockN);
  if (shared)
    lo = o.select(o.cmp(arith::CmpIPredicate::uge, lowKey, sharedLen), edgeHi,
                  lo);
  // The first tile every row sees, at most the edge's first.
  Value fullLo =
      minIndex(o, maxIndex(o, o.ceilDiv(allKey, blockN), lo), edgeLo);
  switch (part) {
  case LoopPart::window:
    return TileRange{minIndex(o, lo, fullLo), fullLo};
  case LoopPart::full:
    return TileRange{fullLo, edgeLo};
  case LoopPart::tail:
  case LoopPart::diagonal:
    return TileRange{maxIndex(o, edgeLo, lo), edgeHi};
  case LoopPart::masked:
    return TileRange{lo, edgeHi};
  default:
    return std::nullopt;
  }
}

} // namespace mlir::dualkv

#endif
