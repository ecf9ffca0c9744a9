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

/// Key tiles [lb, ub) of a loop.
struct TileRange {
  Value lb, ub;
};
/// Tiles [lb, ub) of `block_n` keys that kv_loop `part` of `region` walks
/// for the query tile at `qRow0` (block_m rows) of a segment of `segLen`
/// tokens that sees `sharedLen` prompt tokens: the prompt's full tiles and
/// its tail, the segment's full tiles below the tile and its causal
/// diagonal, or (part <masked>) all of a region's tiles, the full ones and
/// the edge. None for an untiled loop (part <all>).
inline std::optional<TileRange> kvLoopTiles(ScalarBuilder &o, LoopPart part,
                                            KVRegion region, Value qRow0,
                                            Value segLen, Value sharedLen,
                                            int64_t blockM, int64_t blockN) {
  switch (part) {
  case LoopPart::all:
    return std::nullopt;
  case LoopPart::full: {
    Value lb = o.idx(0);
    return TileRange{lb, region == KVRegion::shared ? o.divu(sharedLen, blockN)
                                                    : o.divu(qRow0, blockN)};
  }
  case LoopPart::tail: {
    Value lb = o.divu(sharedLen, blockN);
    return TileRange{lb, o.ceilDiv(sharedLen, blockN)};
  }
  case LoopPart::diagonal: {
    Value lb = o.divu(qRow0, blockN);
    return TileRange{lb, diagonalEnd(o, qRow0, segLen, blockM, blockN)};
  }
  case LoopPart::masked: {
    // From the full tiles' first to the edge's last.
    Value lb = o.idx(0);
    return TileRange{lb, region == KVRegion::shared
                             ? o.ceilDiv(sharedLen, blockN)
                             : diagonalEnd(o, qRow0, segLen, blockM, blockN)};
  }
  }
  return std::nullopt;
}

} // namespace mlir::dualkv

#endif
