//===- KVMajorSkeleton.h - what the KV-major backward's schedules share ---===//
//
// The KV-major backward (bwd, bwd_kv; docs/backward-abi.md) keeps a block of
// BM keys and values in shared memory; each warp owns MT = BM / (16 * warps)
// m16 blocks of those keys. Query tiles of BN rows stream past, double
// buffered: Q, dO, LSE and Delta of tile i + 1 are copied while tile i is
// computed. With NT = BN / 8 and DT = D / 8 the values are
//
//   kv_block    memref<BM x (D+8) x E>, shared memory (A fragments); V
//               DV + 8 wide (DV: the value head_dim)
//   q_block     memref<BN x (D+8) x E>, shared memory (B fragments); dO
//               DV + 8 wide
//   scores_t    vector<MT*NT*4 x f32>, C fragments: keys g and g + 8,
//               queries 2t and 2t + 1
//   col_stats   vector<NT*2 x f32>, queries 2t and 2t + 1 of each n8 tile
//   grad_acc    vector<MT*DT*4 x f32>, C fragments of dK or dV (DT = DV / 8)
//
// The two-dimensional layout (grid2d: 8 warps, BM = 128 and BN = 64, the
// fused kernel's default from sm_90 on in the mma.sync schedule, or at head_dim
// 256 BM = 64 and BN = 32 or 64) reads a third less shared memory a query and
// splits the head dimension of dK and dV across warps. S = Q Kᵀ and dP = dO Vᵀ
// (queries x keys, not transposed) are 2 x 4 warps of BN/2 queries x BM/4
// keys: scores_t holds BN/32 x BM/32 C fragments, queries g and g + 8, keys 2t
// and 2t + 1, and col_stats the BN/16 statistics of the thread's query rows;
// dK and dV are BM/32 x GC warps of 32 keys x D/GC, GC = 8 / (BM/32) (grad_acc:
// 2 x D/(8 GC) C fragments): 4 x 2 warps of 32 keys x D/2 at BM = 128, 2 x 4
// of 32 keys x 64 at BM = 64 and D = 256. Schedules/MmaSync/MmaSyncKVMajor.cpp
// says how the products are computed.
//
// KVMajorEmitter emits what every schedule shares: the work item, the loops
// over query heads and query tiles (the causal ones first), the double
// buffered copies, column statistics, masks, probabilities, dS, the stores
// of dK/dV and the reduction of dQ into global memory. A schedule derives
// from it and computes the products, itself or with a products component
// (Lowering/Products/) that it holds and hands a KVProductsHost. It holds the
// mma fragments' builders (MmaFragments.h), the tiles in shared memory and
// their copy groups (SharedTiles.h); BackwardEmitterBase, under it and the
// elementwise kernels, the kernel function and the thread ids
// (KernelFunction.h).
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_COMMON_KVMAJOR_H
#define DUALKV_COMPILER_COMMON_KVMAJOR_H

#include "Lowering/Support/KernelFunction.h"
#include "Lowering/Support/MmaFragments.h"
#include "Lowering/Support/SharedTiles.h"
#include "Lowering/TileOps/TileOps.h"
#include "ScoreMod/ScoreModIR.h"
#include "dualkv/Compiler/Schedule.h"

#include "mlir/IR/IRMapping.h"

#include <functional>

namespace mlir::dualkv {

/// Common set-up of a backward gpu.func: signature, launch bounds, entry.
class BackwardEmitterBase : public ScalarBuilder {
protected:
  BackwardEmitterBase(KernelOp kernel, OpBuilder &b)
      : ScalarBuilder(b, kernel.getLoc()),
        elemType(kernel.getProblem()->getDtype()),
        headDim(kernel.getProblem()->getHeadDim()),
        valueHeadDim(kernel.getProblem()->getValueHeadDim()),
        warps(kernel.getTiling()->getWarps()), fn(*this, elemType),
        kernel(kernel) {
    ProblemAttr p = *kernel.getProblem();
    numQHeads = p.getNumQHeads();
    numKVHeads = p.getNumKvHeads();
    groupSize = numQHeads / numKVHeads;
    blockM = kernel.getTiling()->getBlockM();
    blockN = kernel.getTiling()->getBlockN();
  }

  /// The element type, head_dim (Q, K, dQ and dK rows), the value head_dim
  /// (V, O, dO and dV rows), and warps a CTA.
  Type elemType;
  int64_t headDim, valueHeadDim, warps;
  int64_t threads() const { return warps * 32; }
  KernelFunction fn;
  ThreadIds ids;

  /// Two fp32 values rounded to the element type, stored at `at` of `ptr`.
  void storePair(Value ptr, Value at, Value lo, Value hi) {
    Value narrow = arith::TruncFOp::create(
        b, loc, VectorType::get({2}, elemType), pack({lo, hi}));
    vector::StoreOp::create(b, loc, narrow, ptr, ValueRange{at});
  }
  void atomicAdd(Value ptr, Value at, Value v) {
    memref::AtomicRMWOp::create(b, loc, arith::AtomicRMWKind::addf, v, ptr,
                                ValueRange{at});
  }
  /// Runs `body` only where `cond` holds.
  template <typename Fn> void emitIf(Value cond, Fn body) {
    auto ifOp = scf::IfOp::create(b, loc, cond, /*withElseRegion=*/false);
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(ifOp.thenBlock());
    body();
  }

  KernelOp kernel;
  int64_t numQHeads, numKVHeads, groupSize, blockM, blockN;
};

class KVMajorEmitter;

/// What a products component (Lowering/Products/) reads of the KV-major
/// emitter that holds it, handed over explicitly (productsHost()): the
/// builder, the constants, and the emitter's state and helpers by
/// reference, since the emitter moves them as it walks the kernel.
struct KVProductsHost {
  ScalarBuilder o;
  /// The shared-memory layout: qOffset(), doOffset(), dsOffset(),
  /// tileBytes(), and the skeleton's own sharedBytes() (where a schedule's
  /// buffers start).
  const KVMajorEmitter &layout;
  Type elemType;
  int64_t headDim, blockM, blockN, nTiles;
  bool withDq;
  /// KVMajorEmitter::splitWarpgroups.
  bool splitWarpgroups;
  IRMapping &map;
  ThreadIds &ids;
  MmaFragments &frags;
  SharedTiles &smemTiles;
  CopyGroups &copies;
  /// The dynamic shared memory and the tiles in it (the products' layout
  /// may place them).
  Value &smem, &kBuf, &vBuf, &dsBuf;
  /// The current query tile's Q and dO.
  Value &qCur, &doCur;
  /// The lane's g and t as shared-memory addresses see them (aG, aT).
  Value &aG, &aT;
  /// The item's queries and the fp32 dQ accumulator.
  Value &qLen, &dqAccPtr;
  /// Waits for query tile `tile` before its first read (waitFor).
  std::function<void(Value)> waitFor;
  /// The first element of query `q`'s row of the current head in the fp32
  /// dQ accumulator (dqAccRow).
  std::function<Value(Value)> dqAccRow;
};

/// The KV-major kernels bwd and bwd_kv (see the file comment).
class KVMajorEmitter : public BackwardEmitterBase {
public:
  KVMajorEmitter(KernelOp kernel, OpBuilder &b);
  virtual ~KVMajorEmitter() = default;

  LogicalResult emit(gpu::GPUModuleOp gpuModule);

  /// [K: BM][V: BM][Q: 2 x BN][dO: 2 x BN] rows of rowStride elements (V and
  /// dO: vRowStride; query tiles double buffered), dSᵀ (BM x dsRowStride) when
  /// the kernel computes dQ (grid2d: P and dS, BN x (BM+8) each), then LSE and
  /// Delta of the two query tiles in flight (fp32, statSlots() each).
  virtual int64_t sharedBytes() const {
    return statsOffset() + 4 * statSlots() * 4;
  }
  /// Floats of each LSE or Delta array: BN, or one a thread when there are
  /// more threads than queries (issueTileCopies).
  int64_t statSlots() const { return statSlotCount; }
  int64_t tileBytes() const { return blockN * rowStride * 2; }
  /// A dO tile's bytes.
  int64_t vTileBytes() const { return blockN * vRowStride * 2; }
  int64_t qOffset() const { return blockM * (rowStride + vRowStride) * 2; }
  int64_t doOffset() const { return qOffset() + 2 * tileBytes(); }
  int64_t dsOffset() const { return doOffset() + 2 * vTileBytes(); }
  int64_t statsOffset() const {
    if (grid2d) // P and dS, queries x keys
      return dsOffset() + 2 * blockN * (blockM + kRowPad) * 2;
    if (splitWarpgroups) // Pᵀ (two buffers) and dSᵀ, keys x queries
      return dsOffset() + 3 * blockM * blockN * 2;
    return dsOffset() + (withDq ? blockM * dsRowStride * 2 : 0);
  }

protected:
  /// ldmatrix, mma.sync, and the C-to-A repack of Pᵀ and dSᵀ.
  MmaFragments frags;
  /// K, V, the query tiles and dSᵀ in shared memory, and their copies;
  /// vTiles those of the value head_dim's rows (V, dO).
  SharedTiles smemTiles, vTiles;
  /// The copy groups of the current query tile.
  CopyGroups copies;

  // ---- the schedule's hooks ------------------------------------------------
  /// Places kBuf, vBuf (and dsBuf) in `smem`.
  virtual void layoutTiles() = 0;
  /// Called at the top of every query-tile iteration, before its copies
  /// (`parity`: the double buffer it reads), and at its end, before the
  /// barrier.
  virtual void beginQIteration(Value parity) {}
  virtual void endQIteration() {}
  /// Called once after the last op of the kernel, before it returns.
  virtual void endKernel() {}
  /// Waits until the current query tile (Q, dO, LSE, Delta) has landed
  /// and is visible to every computing thread (waitOncePerTile).
  virtual void waitTile() { copies.waitFor(lseCur); }
  /// Emits the kernel body's ops after the set-up, then endKernel().
  virtual LogicalResult emitBody();
  virtual LogicalResult emitQLoop(QLoopOp op);
  virtual LogicalResult emitQKT(QKTOp op) = 0;
  virtual LogicalResult emitAccumulate(AccumulateOp op) = 0;
  virtual LogicalResult emitAccumulateDq(AccumulateDqOp op) = 0;

  LogicalResult emitOp(Operation *op);
  LogicalResult emitLoadKVBlock(LoadKVBlockOp op);
  LogicalResult emitInitGrad(InitGradOp op);
  LogicalResult emitLoadQBlock(LoadQBlockOp op);
  LogicalResult emitLoadColStats(LoadColStatsOp op);
  /// What the tile-op library needs of this kernel: where the values of Sᵀ
  /// (or, grid2d, S) sit.
  TileEnv tileEnv();
  LogicalResult emitStoreKVGrads(StoreKVGradsOp op);

  /// Key row (relative to the block) of C-fragment row half `h` of m16 block
  /// `mt` of this thread.
  Value keyRow(int64_t mt, int64_t h) {
    Value warpRow = splitWarpgroups ? remu(ids.warp, 4) : ids.warp;
    return add(mul(warpRow, idx(16 * mTiles)),
               add(idx(mt * 16 + h * 8), ids.g));
  }
  /// Query column (relative to the tile) of element `e` of n8 tile `nt`.
  Value queryCol(int64_t nt, int64_t e) {
    return add(add(queryCol0(), idx(nt * 8 + e)), mul(ids.t, idx(2)));
  }
  /// The first query column of the warp's scores: its warpgroup's half of
  /// the tile with splitWarpgroups, else 0.
  Value queryCol0() {
    return splitWarpgroups ? mul(divu(ids.warp, 4), idx(blockN / 2)) : idx(0);
  }
  Value sQuery(int64_t mt, int64_t h) { // S layout: query row in the tile
    return add(mul(divu(ids.warp, 4), idx(blockN / 2)),
               add(idx(mt * 16 + h * 8), ids.g));
  }
  Value sKey(int64_t nt, int64_t e) { // S layout: key row in the block
    return add(mul(remu(ids.warp, 4), idx(blockM / 4)),
               add(idx(nt * 8 + e), mul(ids.t, idx(2))));
  }
  /// Rows and columns of the dK/dV accumulators: key row of half `h` of m16
  /// block `mt`, first column of n8 tile `dt` (`value`: of dV, whose rows
  /// are valueHeadDim wide).
  Value gradRow(int64_t mt, int64_t h) {
    if (!grid2d)
      return keyRow(mt, h);
    return add(mul(divu(ids.warp, gradColWarps()), idx(32)),
               add(idx(mt * 16 + h * 8), ids.g));
  }
  Value gradCol(int64_t dt, bool value = false) {
    Value col = add(idx(dt * 8), mul(ids.t, idx(2)));
    const int64_t width = gradWidth(value);
    if (splitWarpgroups)
      return add(mul(divu(ids.warp, 4), idx(width / 2)), col);
    return grid2d ? add(mul(remu(ids.warp, gradColWarps()),
                            idx(width / gradColWarps())),
                        col)
                  : col;
  }
  /// The columns of dK (or, `value`, dV).
  int64_t gradWidth(bool value) const { return value ? valueHeadDim : headDim; }
  /// Whether accumulate `op` adds to dV (its Y is dO), not dK (Y is Q).
  static bool accumulatesValueGrad(AccumulateOp op) {
    auto y = op.getY().getDefiningOp<LoadQBlockOp>();
    return y && y.getOperand() == QOperand::grad_output;
  }
  /// Whether the init_grad result `acc` becomes dV: followed through the
  /// q_loops it seeds to the accumulate or store_kv_grads that takes it.
  static bool seedsValueGrad(Value acc);
  /// grid2d: the warps that split the columns of dK and dV (each warp 32
  /// keys).
  int64_t gradColWarps() const { return warps / (blockM / 32); }
  int64_t gradMTiles() const { return grid2d ? 2 : mTiles; }
  int64_t scoreMTiles() const { return grid2d ? blockN / 32 : mTiles; }
  int64_t scoreNTiles() const { return grid2d ? blockM / 32 : nTiles; }
  /// The statistic (LSE, Delta) of score element `c` of tile (mt, nt): per
  /// query column in Sᵀ, per query row in S (grid2d).
  int64_t statIndex(int64_t mt, int64_t nt, int64_t c) const {
    return grid2d ? mt * 2 + c / 2 : nt * 2 + c % 2;
  }
  /// The n8 tiles of dK (or, `value`, dV) a thread accumulates.
  int64_t gradDTiles(bool value = false) const {
    const int64_t width = gradWidth(value);
    if (splitWarpgroups)
      return width / 2 / 8;
    return grid2d ? width / gradColWarps() / 8 : value ? vDTiles : dTiles;
  }
  /// The n8 tiles of dK (or dV) a thread stores: gradDTiles() but for the
  /// wgmma tiles of head_dim 96, whose last 4 of 16 are padding.
  int64_t storedGradDTiles(bool value = false) const {
    return splitWarpgroups || grid2d ? gradDTiles(value) : gradWidth(value) / 8;
  }
  /// With waitOncePerTile: once per query tile, before its first use, waits
  /// for all of the tile's copies (Q, dO, LSE, Delta; the next tile's stay
  /// in flight) and syncs the CTA, so later uses in the iteration need no
  /// barrier of their own. Otherwise waits for a tile wherever it is read
  /// (one barrier fewer there lets the 64-key bwd_kv spill).
  void waitFor(Value tile) {
    if (!waitOncePerTile)
      return copies.waitFor(tile);
    if (tileReady)
      return;
    waitTile();
    tileReady = true;
  }
  bool tileReady = false;

  /// Emits the ops of q_loop `op`'s body for the current tile (its views
  /// set, beginQIteration called).
  LogicalResult emitQIterationOps(QLoopOp op);
  /// What the body's yield yields, mapped.
  SmallVector<Value> qIterationYields(QLoopOp op);
  /// The query tiles [lb, ub) of the item that loop part `op` walks:
  /// the diagonal ones (which meet the block's keys) or the rest.
  LogicalResult qLoopBounds(QLoopOp op, Value &lb, Value &ub);

  /// dTiles: n8 tiles of a dK row; vDTiles: of a dV row.
  int64_t mTiles, nTiles, kTiles, dTiles, vDTiles, rowStride, vRowStride;
  /// The k-steps of `op`'s product: K Qᵀ contracts head_dim, V dOᵀ the
  /// value head_dim.
  int64_t contractTiles(QKTOp op) const;
  /// Floats of each LSE or Delta array (statSlots()).
  int64_t statSlotCount;
  /// Elements per row of dSᵀ in shared memory (one-block layouts).
  int64_t dsRowStride;
  bool withDq, grid2d = false, vectorRed = false;
  /// Two warpgroups share one m64 block of keys (BM = 64, head_dim 256, the
  /// warp-specialized bwd_kv): warpgroup w holds Sᵀ and dPᵀ of all keys and
  /// queries [BN/2 w, BN/2 (w + 1)) of the tile (MT = 1, NT = BN / 16), and
  /// columns [D/2 w, D/2 (w + 1)) of dK and dV; Pᵀ and dSᵀ meet in shared
  /// memory (dsOffset(): Pᵀ of even and odd iterations, then dSᵀ, BM x BN
  /// each) for the products.
  bool splitWarpgroups = false;
  /// Whether Q, dO, K and V are stored in the 128-byte swizzle
  /// (SharedTiles.h).
  bool swizzledTiles = false;
  bool waitOncePerTile = false;

  /// Adds the fp32 dQ C fragments `acc` (qmTiles x cTiles m16n8 tiles; rows
  /// from warpRow0, columns from warpCol0 + c0 of the query tile starting at
  /// query `first`) to global dQ.
  void reduceDqTile(ArrayRef<Value> acc, int64_t qmTiles, int64_t cTiles,
                    Value warpRow0, Value warpCol0, int64_t c0, Value first);
  /// The first element of query `q`'s row (relative to the item) of the
  /// current head in the fp32 dQ accumulator, [T][Hq][D].
  Value dqAccRow(Value q) {
    return mul(add(mul(add(qBegin, q), idx(numQHeads)), head), idx(headDim));
  }
  /// Field `f` of the CTA's work item, read from global memory.
  Value itemField(int64_t f, bool fresh = false);
  Value itemIndex;
  /// Adds `values` (1 or 4 consecutive fp32) at element `at` of global dQ;
  /// four values go in one vector reduction, predicated on `enabled`.
  void reduceDq(Value at, ArrayRef<Value> values, Value enabled = {});
  /// The lane as shared-memory addresses see it: inside the query loop an
  /// opaque copy made every iteration, so LLVM cannot hoist each ldmatrix
  /// address into a register of its own; the constant parts then fold into
  /// the instructions' immediate offsets.
  Value aLane, aG, aT;

  // Kernel arguments.
  Value qPtr, kPtr, vPtr, doPtr, dkPtr, dvPtr, lsePtr, deltaPtr, dqAccPtr,
      dkAccPtr, dvAccPtr, itemsPtr;
  Value qStrideT, qStrideH, kStrideT, kStrideH, vStrideT, vStrideH, doStrideT,
      doStrideH, dkStrideT, dkStrideH, dvStrideT, dvStrideH, lseStrideH,
      deltaStrideH, scale, scaleLog2;
  // Per-CTA values: the work item, the KV head, the current query head.
  Value kRow0, kvEnd, qBegin, qEnd, qLen, accRow, kvHead, head;
  /// With a sliding window: the item's logical shift d (its field 5), so a
  /// query i and key j of the item are lpos(i) - lpos(j) = i - j + d apart.
  Value windowShift;
  /// The sliding window W (the `window` parameter; null: none).
  Value window;
  /// A score modifier's parameters (scoreModInputs(kernel) >= 0).
  std::optional<ScoreModParams> scoreMod;
  Value smem, kBuf, vBuf, dsBuf;
  // The query tile of this iteration: Q, dO, LSE and Delta in shared memory.
  Value qCur, doCur, lseCur, deltaCur;
  /// Starts the copies of query tile `tile` (Q, dO, LSE, Delta) into buffer
  /// `parity`; nothing is read when !valid. Returns the three copy groups.
  SmallVector<Value, 3> issueTileCopies(Value tile, Value parity, Value valid);
  /// The schedule whose parameter table (KernelAbi.h) the kernel takes.
  virtual ::dualkv::Schedule abiSchedule() const {
    return ::dualkv::Schedule::Auto;
  }
  /// The LSE and Delta part of issueTileCopies: one copy group. Queries past
  /// the item read as 0, or with `infinitePastItem` as LSE +inf (P = 0) and
  /// Delta 0, for Q and dO rows that are not zero there (a TMA copy reads
  /// the tensor's next rows).
  Value issueStatCopies(Value first, Value parity, Value valid,
                        bool infinitePastItem = false);
  /// The views of buffer `parity` (a runtime value): Q, dO, LSE, Delta.
  SmallVector<Value, 4> tileViews(Value parity);
  IRMapping map;

  /// What a products component held by the schedule reads of this emitter.
  KVProductsHost productsHost();
  /// Lays the tiles out as the wgmma products read them (WgmmaKVProducts.h):
  /// unpadded rows in the 128-byte swizzle, dS^T rows of blockN elements, one
  /// wait per query tile, copies made visible to wgmma before the barrier.
  void useWgmmaTiles() {
    // Rows of whole swizzle atoms: head_dim 96 in 128 columns, dK and dV
    // accumulated over all of them and stored over 96 (storedGradDTiles).
    rowStride = ::dualkv::swizzledTileDim(headDim);
    vRowStride = ::dualkv::swizzledTileDim(valueHeadDim);
    dTiles = rowStride / 8;
    vDTiles = vRowStride / 8;
    smemTiles.setSwizzledTileCols(rowStride);
    vTiles.setSwizzledTileCols(vRowStride);
    dsRowStride = blockN;
    swizzledTiles = true;
    waitOncePerTile = true;
    copies.wgmmaReadsTiles = true;
  }
};

/// Emits bwd_pre or bwd_post (elementwise, the same on every arch).
LogicalResult emitElementwiseKernel(KernelOp kernel, OpBuilder &b,
                                    gpu::GPUModuleOp gpuModule,
                                    int64_t *sharedBytes);

} // namespace mlir::dualkv

#endif
