//===- QueryMajorSkeleton.h - what the query-major schedules share --------===//
//
// Query-major kernels (the forward, the deterministic dQ) walk the two KV
// regions of one query tile. Tile values are register fragments
// (MmaFragments.h); with MT = block_m / (16 * warps), NT = block_n / 8,
// DT = D / 8 their layouts are:
//   q_tile     memref<BM x (D+8) x E> in shared memory (A fragments via
//              ldmatrix); the deterministic dQ kernel holds dO the same way,
//              DV + 8 wide (DV: the value head_dim)
//   kv_tile    memref<BN x (D+8) x E> in shared memory (V: DV + 8)
//   scores     vector<MT*NT*4 x f32>  C fragments: rows g and g+8, cols 2t,
//              2t+1
//   probs      vector<MT*BN/16*4 x i32> A fragments of P (or dS), repacked
//   acc        vector<MT*DT*4 x f32>  C fragments of O (DT = DV / 8) or dQ
//   row_stats  vector<MT*2 x f32>     rows g and g+8 of each m16 block
// QueryMajorEmitter emits everything but the two products and the tiles'
// place in shared memory: the loop bounds of the two regions (in tree kernels
// the walk over the segment's ancestor ranges, dualkv.chain_loop), the copies,
// the masks, the online softmax, the epilogue. A schedule (MmaSync/, Wgmma/)
// derives from it and fills in those hooks. It holds the kernel function and
// thread ids (KernelFunction.h), the mma fragments' builders
// (MmaFragments.h), the tiles in shared memory and their copy groups
// (SharedTiles.h), and reads the segment table (Segments.h).
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_COMMON_QUERYMAJOR_H
#define DUALKV_COMPILER_COMMON_QUERYMAJOR_H

#include "Lowering/Support/KernelFunction.h"
#include "Lowering/Support/MmaFragments.h"
#include "Lowering/Support/Segments.h"
#include "Lowering/Support/SharedTiles.h"
#include "Lowering/TileOps/TileOps.h"
#include "ScoreMod/ScoreModIR.h"

#include "mlir/IR/IRMapping.h"

namespace mlir::dualkv {

/// Emits the gpu.func of one query-major kernel (fwd or bwd_dq). One method per
/// dualkv op.
class QueryMajorEmitter : public ScalarBuilder {
public:
  QueryMajorEmitter(KernelOp kernel, OpBuilder &b);
  virtual ~QueryMajorEmitter() = default;

  /// Emits the gpu.func into `gpuModule`; returns failure with a diagnostic.
  LogicalResult emit(gpu::GPUModuleOp gpuModule);

  /// [Q][dO (bwd_dq)][K][V], rows of rowStride elements (dO and V:
  /// vRowStride).
  virtual int64_t sharedBytes() const {
    return ((blockM + blockN) * rowStride +
            ((isDq ? blockM : 0) + blockN) * vRowStride) *
           2;
  }

protected:
  /// The element type, head_dim (Q and K rows), the blocks of output
  /// columns (outputColumnBlocks: 2 at head_dim 512, each CTA one), the
  /// value head_dim (V, O and dO rows; the forward's: its block of them),
  /// and warps a CTA.
  Type elemType;
  int64_t headDim, columnBlocks, valueHeadDim, warps;
  int64_t threads() const { return warps * 32; }
  KernelFunction fn;
  ThreadIds ids;
  /// ldmatrix, mma.sync, and the C-to-A repack of P.
  MmaFragments frags;
  /// Q, dO, K and V in shared memory, and their copies; vTiles those of
  /// the value head_dim's rows (V, dO).
  SharedTiles smemTiles, vTiles;
  /// The copy groups of the current KV iteration.
  CopyGroups copies;

  // ---- the schedule's hooks ------------------------------------------------
  /// Places the tiles in the dynamic shared memory `smem` (qBuf, doBuf,
  /// kBuf, vBuf): Q at 0, dO at qBytes, K at kvOffset, V after K.
  virtual void layoutTiles(Value smem, int64_t qBytes, int64_t kvOffset) = 0;
  /// Called at the top of every KV iteration.
  virtual void beginKVIteration() {}
  /// The scores S = Q Kᵀ of `op` as C fragments (K has landed).
  virtual SmallVector<Value> computeScores(QKOp op) = 0;
  /// acc += P V with P the packed probabilities `p` and V in `vTile` (landed).
  virtual SmallVector<Value>
  accumulatePV(ArrayRef<Value> p, SmallVector<Value> acc, Value vTile) = 0;

  LogicalResult emitOp(Operation *op);
  LogicalResult emitLoadQ(LoadQOp op);
  LogicalResult emitInitAcc(InitAccOp op);
  LogicalResult emitInitStats(InitStatsOp op);
  LogicalResult emitKVLoop(KVLoopOp op);
  /// Tree kernels: the body once per ancestor range of the segment, the
  /// shared region bound to it (docs/forward-abi.md, the chain table).
  LogicalResult emitChainLoop(ChainLoopOp op);
  LogicalResult emitLoadKV(LoadKVOp op);
  LogicalResult emitQK(QKOp op);
  LogicalResult emitPV(PVOp op);
  LogicalResult emitStoreOutput(StoreOutputOp op);
  // The deterministic dQ kernel.
  LogicalResult emitLoadDout(LoadDoutOp op);
  LogicalResult emitLoadRowStats(LoadRowStatsOp op);
  LogicalResult emitStoreDq(StoreDqOp op);
  /// What the tile-op library needs of this kernel at this point of the
  /// walk (the masks' shared bound changes along a tree's chain).
  TileEnv tileEnv();
  /// The packed-token row of C-fragment row (mt, h) of this thread, relative
  /// to the segment start.
  Value fragmentRow(int64_t mt, int64_t h) {
    return add(add(qRow0, mul(ids.warp, idx(16 * mTiles))),
               add(idx(mt * 16 + h * 8), ids.g));
  }
  /// P (fp32, C layout) repacked as A fragments of the element type: keys
  /// 16kk..16kk+15 are the C fragments of n-tiles 2kk, 2kk+1.
  Value packAFragments(ArrayRef<Value> p);
  /// stages >= 2: after the scores of tile j, start copying key tile j + 1.
  void prefetchNextKey(QKOp op);
  /// Copies key tile `tile` of `loop`'s region; rows past the region, or all
  /// rows when !tileValid, are zero-filled from a valid address.
  Value issueKeyCopy(KVLoopOp loop, Value tile, Value tileValid);
  Value loopUpper;

  KernelOp kernel;
  int64_t blockM, blockN, groupSize, mTiles, kTiles, nTiles, dTiles, rowStride,
      vRowStride, stages;
  /// The accumulator's columns: the CTA's block of O's or dQ's.
  int64_t outputCols;
  /// The k-steps of `op`'s product: Q Kᵀ contracts head_dim, dO Vᵀ the value
  /// head_dim.
  int64_t contractTiles(QKOp op);
  bool isDq = false;
  /// The sliding window W (the `window` parameter; null: none).
  Value window;
  /// A forward with attention sinks (#dualkv.problem<..., sinks = true>).
  bool hasSinks() {
    return !isDq && kernel.getProblem() && kernel.getProblem()->getSinks();
  }
  /// Whether the tiles are stored in the 128-byte swizzle (SharedTiles.h).
  bool swizzledTiles = false;
  // The prefetched key copy group of the current loop (stages >= 2), if any.
  Value prefetchedKey;

  // Kernel arguments (fwd: o, lse; bwd_dq: dout, dq, lse, delta).
  Value qPtr, kPtr, vPtr, oPtr, lsePtr, segPtr, doPtr, dqPtr, deltaPtr;
  /// The plan's chain table (tree kernels only).
  Value chainPtr;
  Value qStrideT, qStrideH, kStrideT, kStrideH, vStrideT, vStrideH, oStrideT,
      oStrideH, lseStrideH, scaleLog2, doStrideT, doStrideH, deltaStrideH,
      scale;
  // Per-CTA values.
  Value head, kvHead, segIndex;
  /// The CTA's block of output columns (null: one block).
  Value columnBlock;
  /// The first of the CTA's block of output columns (null: one block).
  Value outputColumn0() {
    return columnBlock ? mul(columnBlock, idx(outputCols)) : Value();
  }
  /// `offset` (elements) moved to the CTA's block of output columns: the
  /// forward's V and O rows, the dQ kernel's dQ rows.
  Value withColumnBlock(Value offset) {
    return columnBlock ? add(offset, outputColumn0()) : offset;
  }
  Value segStart, segLen, sharedStart, sharedLen, qRow0;
  /// With a sliding window, inside a tree's chain walk: how many logical
  /// positions the current ancestor range starts before the segment (null:
  /// sharedLen, a group's prompt).
  Value sharedShift;
  /// A score modifier's parameters (scoreModInputs(kernel) >= 0).
  std::optional<ScoreModParams> scoreMod;
  Value kBuf, vBuf, qBuf, doBuf;
  IRMapping map;
};

} // namespace mlir::dualkv

#endif
