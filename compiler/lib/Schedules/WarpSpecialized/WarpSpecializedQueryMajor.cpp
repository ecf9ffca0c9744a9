//===- WarpSpecializedQueryMajor.cpp - the sm_90a forward and dQ kernels --===//
//
// A CTA of three warpgroups computes block_m = 128 query rows of one head of
// one segment:
//   warpgroup 2, the producer (setmaxnreg down to 24 registers): one thread
//     loads Q once and then K and V tile after tile by TMA
//     (cp.async.bulk.tensor) into a ring of `stages` slots, each slot with a
//     "full" mbarrier (expect_tx: the TMA bytes) and an "empty" one;
//   warpgroups 0 and 1, the consumers (setmaxnreg up to 240): 64 query rows
//     each, S = Q Kᵀ and O += P V by wgmma; the scores of tile i + 1 are
//     issued before P V of tile i, so the softmax of tile i + 1 runs while
//     the tensor cores still multiply tile i (FlashAttention-3's
//     intra-warpgroup overlap); the two warpgroups take turns to issue their
//     GEMMs (QueryMajorBarrier::Turn0, Turn1), so one's softmax runs under the
//     other's GEMMs (ping-pong); at the end each stages its O through its rows
//     of the Q tile and stores whole rows (QueryMajorBarrier::Epilogue0,
//     Epilogue1).
// Every tile of the kernel's kv_loops (the shared prompt's full tiles and its
// masked tail, the response's full tiles and its causal diagonal) is one
// iteration of a single software pipeline, in the loops' order; the masks of
// the IR's edge loops are applied only to the iterations of those loops.
// The consumers walk the template: the pipeline issues the loop body's
// products (its qk ops and its pv) and emits every other op of the body
// through the tile-op library (Lowering/TileOps/TileOps.h) as soon as the
// values it reads are there, so a change to the template's math reaches this
// schedule as it reaches the others. The tiles sit in the 128-byte swizzle that
// both TMA (CU_TENSOR_MAP_SWIZZLE_ 128B, boxes of 64 columns) and wgmma read: D
// / 64 atoms of rows x 128 bytes. The runtime passes one CUtensorMap each for
// Q, K and V (3-D: head_dim, heads, tokens) as 128-byte grid-constant
// parameters after the forward's ABI, then the plan's forward work order
// (Plan::forwardTable): CTA x computes item x, the longest KV walks first.
//
// Prefix trees (KernelSpec::tree; the default on sm_90a, the dQ kernel's
// too): a segment's keys are its ancestor ranges,
// walked from the plan's chain table as the dualkv.chain_loop of the IR says
// (each range's full tiles, then its tail masked past the range's end), then
// its own region as above. The pipeline iterates over the ranges' tiles first:
// producer and consumers carry the walk's state (the row, the tile in it, and
// what is left) from one iteration to the next, reading a chain row only when a
// range begins.
//
// The dQ kernel (bwd_dq; the split-dQ backward's, sm_90a's default and the
// deterministic mode) is the same pipeline with three
// products a tile. The producer loads dO beside Q (one barrier for both);
// each consumer warpgroup holds its 64 rows' LSE and Delta in registers and,
// for tile i, issues S = Q Kᵀ and dP = dO Vᵀ, then dQ += dS K of tile i - 1
// behind them: P = exp2(S - LSE) is computed while dP and the previous dQ
// product still run, dS = P (dP - Delta) scale while the dQ product runs.
// K therefore stays in its slot until tile i + 1's products are issued, so
// the dQ kernel's ring is deeper (kDqWarpSpecializedStages). dQ leaves as
// the forward's O does, through the warpgroup's rows of the Q tile.
//
//===----------------------------------------------------------------------===//
#include "WarpSpecialized.h"

#include "Lowering/Support/HopperSync.h"
#include "Lowering/Support/KernelFunction.h"
#include "Lowering/Support/MmaFragments.h"
#include "Lowering/Support/Segments.h"
#include "Lowering/Support/SharedTiles.h"
#include "Lowering/Support/WgmmaBuilder.h"
#include "Lowering/TileOps/TileOps.h"
#include "dualkv/Compiler/Schedule.h"

#include <limits>
#include <tuple>

using namespace mlir;
using namespace mlir::dualkv;

namespace {

/// Threads of a warpgroup; the producer warpgroup follows the consumers.
constexpr int64_t kWarpgroupThreads = 128;
/// Registers a thread after setmaxnreg: 128 x 24 + 256 x 240 = 384 x 168.
constexpr int32_t kProducerRegs = 24;
constexpr int32_t kConsumerRegs = 240;
constexpr int32_t kEntryRegs = 168;

class WarpSpecializedForward : public ScalarBuilder {
public:
  WarpSpecializedForward(KernelOp kernel, OpBuilder &b)
      : ScalarBuilder(b, kernel.getLoc()),
        elemType(kernel.getProblem()->getDtype()),
        headDim(kernel.getProblem()->getHeadDim()),
        warps(kernel.getTiling()->getWarps()), fn(*this, elemType),
        frags(*this, elemType), smemTiles(*this, elemType, headDim),
        mma(b, kernel.getLoc(), kernel.getProblem()->getDtype(),
            kernel.getProblem()->getHeadDim()),
        kernel(kernel) {
    ProblemAttr p = *kernel.getProblem();
    TilingAttr t = *kernel.getTiling();
    blockM = t.getBlockM();
    blockN = t.getBlockN();
    stages = t.getStages();
    groupSize = p.getNumQHeads() / p.getNumKvHeads();
    nTiles = blockN / 8;
    dTiles = headDim / 8;
    isDq = kernel.getKind() == KernelKind::bwd_dq;
    isTree = kernel.walksChain();
    ring = ::dualkv::RingLayout::of(
        {int(blockM), int(blockN), int(warps), int(stages)}, int(headDim),
        isDq ? ::dualkv::KernelKind::BwdDQ : ::dualkv::KernelKind::Fwd);
  }

  LogicalResult emit(gpu::GPUModuleOp gpuModule);

  /// [Q][dO (bwd_dq)][K x stages][V x stages][mbarriers], 1 KB spare for
  /// the alignment: the schedule record's RingLayout.
  int64_t sharedBytes() const { return ring.total; }

private:
  /// The element type, head_dim, and the consumer warps a CTA.
  Type elemType;
  int64_t headDim, warps;
  int64_t threads() const { return warps * 32; }
  KernelFunction fn;
  ThreadIds ids;
  /// The A fragments of P (or dS) for wgmma's register operand.
  MmaFragments frags;
  /// The swizzled tiles the TMA fills and the epilogue stages through.
  SharedTiles smemTiles;

  /// One kv_loop of the tiled IR: its tiles [lb, ub) of `region`, the mask its
  /// scores pass through (if any), and its first iteration of the pipeline.
  struct Loop {
    KVRegion region;
    std::optional<MaskKind> mask;
    Value lb, ub, count, offset;
  };
  LogicalResult collectLoops();
  void emitProducer();
  LogicalResult emitConsumer();
  LogicalResult emitDqConsumer();

  /// Where the tiles and barriers sit: the layout the record counts.
  ::dualkv::RingLayout ring;
  // Barrier indices: Q full, then per slot K full, V full, K empty, V empty.
  Value barrier(int64_t index) {
    return sharedPtr(*this, add(smemAddr, idx(ring.barriers + 8 * index)));
  }
  Value barrierAt(int64_t first, Value slot) {
    return sharedPtr(*this, add(smemAddr, add(idx(ring.barriers + 8 * first),
                                              mul(slot, idx(8 * 4)))));
  }
  /// Shared addresses of ring slot `slot`'s K and V tiles.
  Value kAddrOf(Value slot) {
    return add(smemAddr, add(idx(ring.kRing), mul(slot, idx(ring.slotBytes))));
  }
  Value vAddrOf(Value slot) {
    return add(smemAddr, add(idx(ring.vRing), mul(slot, idx(ring.slotBytes))));
  }
  Value kFull(Value s) { return barrierAt(1, s); }
  Value vFull(Value s) { return barrierAt(2, s); }
  Value kEmpty(Value s) { return barrierAt(3, s); }
  Value vEmpty(Value s) { return barrierAt(4, s); }

  /// Ping-pong of the two consumer warpgroups (FlashAttention-3): a warpgroup
  /// issues its GEMMs only in its turn (QueryMajorBarrier::Turn0 + w, both
  /// warpgroups' 256 threads), then hands the turn to the other, so one's
  /// softmax runs under the other's GEMMs. Warpgroup 1 hands warpgroup 0 the
  /// first turn; each warpgroup takes as many turns as the other, and warpgroup
  /// 1 passes none on after its last, so both barriers end balanced.
  void turnBegin() {
    namedBarrier(
        *this,
        i32Of(*this, add(idx(barrierId(QueryMajorBarrier::Turn0)), wgIdx)),
        threads());
  }
  void turnEnd() {
    NVVM::BarrierArriveOp::create(
        b, loc,
        i32Of(*this,
              arith::SubIOp::create(
                  b, loc, idx(barrierId(QueryMajorBarrier::Turn1)), wgIdx)),
        i32c(int32_t(threads())));
  }
  /// turnEnd for warpgroup `w` only.
  void turnEndIf(int64_t w) {
    auto only =
        scf::IfOp::create(b, loc, cmp(arith::CmpIPredicate::eq, wgIdx, idx(w)),
                          /*withElseRegion=*/false);
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(only.thenBlock());
    turnEnd();
  }

  /// Slot and phase parity of pipeline iteration `i`.
  RingSlot slotOf(Value i) { return ringSlot(*this, i, stages); }
  /// The region start (a token) and tile index of pipeline iteration `i`.
  std::pair<Value, Value> tileOf(Value i);

  SmallVector<Value> scores(Value kAddr);
  SmallVector<Value> mask(ArrayRef<Value> s, MaskKind kind, Value tile);
  /// Applies the mask of every masked loop whose iterations include `i`.
  SmallVector<Value> maskEdges(SmallVector<Value> s, Value i);
  /// O and LSE of the consumer's rows inside the segment (through shared
  /// memory).
  void storeOutput(ArrayRef<Value> acc, ArrayRef<Value> m, ArrayRef<Value> l);
  /// The consumer's rows of `acc` (C fragments), times `rowScale[h]` if
  /// given, through its rows of the Q tile to `out` (strides `strideT`,
  /// `strideH`), rows inside the segment only.
  void storeRows(ArrayRef<Value> acc, ArrayRef<Value> rowScale, Value out,
                 Value strideT, Value strideH);
  /// The P V (dQ: dS K) product of `p` and the tile at `vAddr` into `acc`.
  void accumulate(MutableArrayRef<Value> acc, ArrayRef<Value> p, Value vAddr);
  /// bwd_dq: the scores (or dP) of this warpgroup's rows of the tile at
  /// `aOffset` (Q or dO) against the key tile at `kAddr` (K or V).
  SmallVector<Value> rowProducts(int64_t aOffset, Value kAddr);

  // ---- the template's tile program ---------------------------------------
  // The pipeline issues the body's products itself (the scores Q Kᵀ, the dQ
  // kernel's dP = dO Vᵀ, the accumulating P V or dS K) and emits the rest of
  // the body, op by op through the tile-op library, as soon as the values an
  // op reads are there: the scores' ops once the scores have landed, the
  // accumulator's (the forward's rescale) once the previous tile's product
  // has retired. Every kv_loop's body must be the first one's but for its
  // masks, which maskAt applies where the body masks the scores.
  LogicalResult collectTileProgram();
  /// A mapping for one tile: `state` bound to the body's iter_args other
  /// than the accumulator, in order (as packed vectors).
  IRMapping tileMapping(ArrayRef<SmallVector<Value>> state);
  /// Binds the result of the product `op` (a qk) to the fragment `values`;
  /// the scores pass through this iteration's masks (`masked`) first.
  void bindProduct(IRMapping &map, Operation *op, ArrayRef<Value> values);
  /// Emits, once each, the body's library ops whose operands `map` holds.
  LogicalResult emitReady(IRMapping &map, DenseSet<Operation *> &done);
  /// The values `map` gives the body's values `v` (a fragment each).
  SmallVector<Value> lookup(IRMapping &map, Value v) {
    return unpack(map.lookup(v));
  }
  /// The iter_args that are not the accumulator: the values the body's
  /// yield gives them after one tile.
  SmallVector<SmallVector<Value>> nextState(IRMapping &map);
  TileEnv tileEnv();
  /// The first value of the iter_arg whose first loop's init is `v`
  /// (init_stats, init_acc).
  SmallVector<Value> initialValue(Value v);
  /// `v`, or through chain_loop iter_args the value it starts from.
  static Value origin(Value v);
  ValueRange tileLoopInits() { return tileLoop.getInits(); }
  KVLoopOp lastKVLoop() {
    KVLoopOp last;
    for (Operation &op : kernel.getBody().front())
      if (auto loop = dyn_cast<KVLoopOp>(op))
        last = loop;
    return last;
  }
  /// The kernel's values the tiles read (the dQ kernel's LSE and Delta).
  IRMapping kernelValues;
  KVLoopOp tileLoop;
  QKOp scoresOp, dpOp;
  PVOp productOp;
  /// The iter_arg the product accumulates into.
  unsigned accArg = 0;

  // ---- prefix trees: the walk over the segment's ancestor ranges ---------
  /// Field `f` of row `row` of the chain table: {start, length, next,
  /// ranges}.
  Value chainField(Value row, int64_t f) {
    return toIndex(memref::LoadOp::create(
        b, loc, chainPtr, ValueRange{add(mul(row, idx(4)), idx(f))}));
  }
  /// The walk's state, as loop-carried values: {row, tile in the range,
  /// the range's tiles, its start, its length, ranges left after it}.
  enum WalkField { kRow, kTile, kTiles, kStart, kLen, kLeft, kWalkFields };
  /// The state at the walk's first tile (the tree's first non-empty range).
  SmallVector<Value> walkBegin();
  /// The state after `w`'s tile: the next tile of the range, else the first
  /// of the next non-empty range.
  SmallVector<Value> walkStep(ArrayRef<Value> w, bool advance);
  /// Sets chainIters: the tiles of every ancestor range of the segment.
  void countChainTiles();
  /// The region start and tile of pipeline iteration `i`, whose walk state
  /// is `w` (tree kernels) or empty.
  std::pair<Value, Value> tileAt(Value i, ArrayRef<Value> w);
  /// The masks of iteration `i` on its scores `s`.
  SmallVector<Value> maskAt(SmallVector<Value> s, Value i, ArrayRef<Value> w);
  /// The walk state of iteration i + 1 (empty without a tree).
  SmallVector<Value> walkAfter(Value i, ArrayRef<Value> w);

  WgmmaBuilder mma;
  KernelOp kernel;
  bool isDq = false, isTree = false;
  /// Tree kernels: the chain table, the segment's row, the chain's tiles
  /// (the pipeline's first iterations).
  Value chainPtr, segIndex, chainIters;
  int64_t blockM, blockN, stages, groupSize, nTiles, dTiles;
  SmallVector<Loop> loops;
  Value numIters;
  Value qMap, kMap, vMap, doMap;
  // o is dq, oStride* dq's strides in the dQ kernel.
  Value oPtr, lsePtr, segPtr, oStrideT, oStrideH, lseStrideH, scaleLog2;
  Value deltaPtr, deltaStrideH, scale;
  Value head, kvHead, segStart, segLen, sharedStart, sharedLen, qRow0;
  Value smemAddr, wgIdx, qTile;
};

LogicalResult WarpSpecializedForward::collectLoops() {
  Value offset = idx(0);
  for (Operation &op : kernel.getBody().front()) {
    auto loop = dyn_cast<KVLoopOp>(op);
    if (!loop)
      continue;
    Loop l;
    l.region = loop.getRegion();
    loop.getBody().walk([&](MaskOp m) { l.mask = m.getKind(); });
    auto bounds = kvLoopTiles(*this, loop.getPart(), l.region, qRow0, segLen,
                              sharedLen, blockM, blockN);
    if (!bounds)
      return loop.emitOpError()
             << "is not tiled: run dualkv-tile-regions first";
    l.lb = bounds->lb, l.ub = bounds->ub;
    l.count = arith::SubIOp::create(b, loc, l.ub, l.lb);
    l.offset = offset;
    offset = add(offset, l.count);
    loops.push_back(l);
  }
  if (loops.empty())
    return kernel.emitOpError() << "has no kv_loop to schedule";
  numIters = offset;
  return success();
}

std::pair<Value, Value> WarpSpecializedForward::tileOf(Value i) {
  Value start, tile;
  for (const Loop &l : loops) {
    Value s = l.region == KVRegion::shared ? sharedStart : segStart;
    Value j = add(l.lb, arith::SubIOp::create(b, loc, i, l.offset));
    if (!start) {
      start = s, tile = j;
      continue;
    }
    // Later loops start at or after earlier ones: the last that has begun owns
    // iteration i.
    Value begun = cmp(arith::CmpIPredicate::uge, i, l.offset);
    start = select(begun, s, start);
    tile = select(begun, j, tile);
  }
  return {start, tile};
}

SmallVector<Value> WarpSpecializedForward::walkBegin() {
  SmallVector<Value> w(kWalkFields);
  Value count = chainField(segIndex, 3);
  w[kRow] = segIndex;
  w[kTile] = idx(0);
  w[kStart] = chainField(segIndex, 0);
  w[kLen] = chainField(segIndex, 1);
  w[kTiles] = ceilDiv(w[kLen], blockN);
  // A root segment's row has no range (count 0): no tiles, nothing left.
  w[kLeft] = select(cmp(arith::CmpIPredicate::ugt, count, idx(0)),
                    arith::SubIOp::create(b, loc, count, idx(1)), idx(0));
  // Skip empty ranges, as walkStep does.
  return walkStep(w, /*advance=*/false);
}

SmallVector<Value> WarpSpecializedForward::walkStep(ArrayRef<Value> wIn,
                                                    bool advance) {
  SmallVector<Value> w(wIn);
  if (advance)
    w[kTile] = add(w[kTile], idx(1));
  // While the range is done and another follows: the next row's range.
  SmallVector<Type> types(kWalkFields, b.getIndexType());
  auto loop = scf::WhileOp::create(
      b, loc, types, w,
      [&](OpBuilder &, Location, ValueRange args) {
        Value more = arith::AndIOp::create(
            b, loc, cmp(arith::CmpIPredicate::uge, args[kTile], args[kTiles]),
            cmp(arith::CmpIPredicate::ugt, args[kLeft], idx(0)));
        scf::ConditionOp::create(b, loc, more, args);
      },
      [&](OpBuilder &, Location, ValueRange args) {
        SmallVector<Value> n(kWalkFields);
        n[kRow] = chainField(args[kRow], 2);
        n[kTile] = idx(0);
        n[kStart] = chainField(n[kRow], 0);
        n[kLen] = chainField(n[kRow], 1);
        n[kTiles] = ceilDiv(n[kLen], blockN);
        n[kLeft] = arith::SubIOp::create(b, loc, args[kLeft], idx(1));
        scf::YieldOp::create(b, loc, n);
      });
  return SmallVector<Value>(loop.getResults());
}

void WarpSpecializedForward::countChainTiles() {
  Value count = chainField(segIndex, 3);
  auto loop = scf::ForOp::create(b, loc, idx(0), count, idx(1),
                                 ValueRange{segIndex, idx(0)});
  {
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(loop.getBody());
    Value row = loop.getRegionIterArgs()[0];
    Value len = chainField(row, 1);
    Value tiles = ceilDiv(len, blockN);
    scf::YieldOp::create(b, loc,
                         ValueRange{chainField(row, 2),
                                    add(loop.getRegionIterArgs()[1], tiles)});
  }
  chainIters = loop.getResult(1);
}

std::pair<Value, Value> WarpSpecializedForward::tileAt(Value i,
                                                       ArrayRef<Value> w) {
  if (!isTree)
    return tileOf(i);
  Value inChain = cmp(arith::CmpIPredicate::ult, i, chainIters);
  Value own =
      select(inChain, idx(0), arith::SubIOp::create(b, loc, i, chainIters));
  auto [start, tile] = tileOf(own);
  return {select(inChain, w[kStart], start), select(inChain, w[kTile], tile)};
}

SmallVector<Value> WarpSpecializedForward::maskAt(SmallVector<Value> s, Value i,
                                                  ArrayRef<Value> w) {
  if (!isTree)
    return maskEdges(std::move(s), i);
  Value inChain = cmp(arith::CmpIPredicate::ult, i, chainIters);
  Value vec = pack(s);
  auto branch = scf::IfOp::create(b, loc, TypeRange{vec.getType()}, inChain,
                                  /*withElseRegion=*/true);
  {
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(branch.thenBlock());
    // A range's last tile, if partial: keys past the range's end.
    Value last =
        cmp(arith::CmpIPredicate::eq, add(w[kTile], idx(1)), w[kTiles]);
    Value partial =
        cmp(arith::CmpIPredicate::ne, remu(w[kLen], blockN), idx(0));
    auto tail = scf::IfOp::create(b, loc, TypeRange{vec.getType()},
                                  arith::AndIOp::create(b, loc, last, partial),
                                  /*withElseRegion=*/true);
    {
      OpBuilder::InsertionGuard inner(b);
      b.setInsertionPointToStart(tail.thenBlock());
      SmallVector<Value> masked(s);
      tile::mask(*this, masked, MaskKind::bound,
                 queryMajorLayout(*this, 1, nTiles, qRow0,
                                  mul(w[kTile], idx(blockN)), ids.warp, ids.g,
                                  ids.t),
                 w[kLen]);
      scf::YieldOp::create(b, loc, pack(masked));
      b.setInsertionPointToStart(tail.elseBlock());
      scf::YieldOp::create(b, loc, vec);
    }
    scf::YieldOp::create(b, loc, tail.getResult(0));
    b.setInsertionPointToStart(branch.elseBlock());
    Value own = arith::SubIOp::create(b, loc, i, chainIters);
    scf::YieldOp::create(b, loc, pack(maskEdges(s, own)));
  }
  return unpack(branch.getResult(0));
}

SmallVector<Value> WarpSpecializedForward::walkAfter(Value i,
                                                     ArrayRef<Value> w) {
  if (!isTree)
    return {};
  Value inChain = cmp(arith::CmpIPredicate::ult, i, chainIters);
  SmallVector<Type> types(kWalkFields, b.getIndexType());
  auto branch = scf::IfOp::create(b, loc, types, inChain,
                                  /*withElseRegion=*/true);
  {
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(branch.thenBlock());
    scf::YieldOp::create(b, loc, walkStep(w, /*advance=*/true));
    b.setInsertionPointToStart(branch.elseBlock());
    scf::YieldOp::create(b, loc, w);
  }
  return SmallVector<Value>(branch.getResults());
}

void WarpSpecializedForward::emitProducer() {
  NVVM::SetMaxRegisterOp::create(b, loc, kProducerRegs,
                                 NVVM::SetMaxRegisterAction::decrease);
  // One thread issues every load.
  Value leader = cmp(arith::CmpIPredicate::eq, ids.tid, idx(threads()));
  auto one = scf::IfOp::create(b, loc, leader, /*withElseRegion=*/false);
  OpBuilder::InsertionGuard guard(b);
  b.setInsertionPointToStart(one.thenBlock());
  Value qBar = barrier(0);
  // Q (and dO) fill the bytes before the K ring.
  NVVM::MBarrierArriveExpectTxOp::create(
      b, loc, Type(), qBar, i32c(int32_t(ring.kRing)), NVVM::MemScopeKind::CTA,
      false, Value());
  tmaLoadTile(*this, qMap, smemAddr, blockM, headDim, add(segStart, qRow0),
              head, qBar);
  if (isDq)
    tmaLoadTile(*this, doMap, add(smemAddr, idx(ring.dO)), blockM, headDim,
                add(segStart, qRow0), head, qBar);

  SmallVector<Value> walk;
  if (isTree)
    walk = walkBegin();
  auto loop = scf::ForOp::create(b, loc, idx(0), numIters, idx(1), walk);
  b.setInsertionPointToStart(loop.getBody());
  Value i = loop.getInductionVar();
  SmallVector<Value> w(loop.getRegionIterArgs());
  auto [slot, parity] = slotOf(i);
  // A fresh barrier completes phase "1" at once: the first pass over the ring
  // does not wait.
  Value free = arith::XOrIOp::create(b, loc, parity, idx(1));
  auto [start, tile] = tileAt(i, w);
  Value row = add(start, mul(tile, idx(blockN)));
  Value slotBytes = mul(slot, idx(ring.slotBytes));
  waitParity(*this, kEmpty(slot), free);
  NVVM::MBarrierArriveExpectTxOp::create(
      b, loc, Type(), kFull(slot), i32c(int32_t(ring.slotBytes)),
      NVVM::MemScopeKind::CTA, false, Value());
  tmaLoadTile(*this, kMap, add(smemAddr, add(idx(ring.kRing), slotBytes)),
              blockN, headDim, row, kvHead, kFull(slot));
  waitParity(*this, vEmpty(slot), free);
  NVVM::MBarrierArriveExpectTxOp::create(
      b, loc, Type(), vFull(slot), i32c(int32_t(ring.slotBytes)),
      NVVM::MemScopeKind::CTA, false, Value());
  tmaLoadTile(*this, vMap, add(smemAddr, add(idx(ring.vRing), slotBytes)),
              blockN, headDim, row, kvHead, vFull(slot));
  if (isTree)
    scf::YieldOp::create(b, loc, walkAfter(i, w));
}

SmallVector<Value> WarpSpecializedForward::scores(Value kAddr) {
  // Warpgroup w owns query rows 64w..64w+63; both operands K-major. The Q
  // address is made opaque per use so LLVM rebuilds its descriptors instead
  // of keeping all of them live across the loop.
  Value qAddr =
      add(opaque(*this, smemAddr), mul(divu(ids.warp, 4), idx(64 * 128)));
  Value aDesc = mma.desc(qAddr, 16, 1024);
  Value bDesc = mma.desc(kAddr, 16, 1024);
  return mma.overHeadDim({}, blockN, aDesc, blockM, bDesc, blockN);
}

void WarpSpecializedForward::accumulate(MutableArrayRef<Value> acc,
                                        ArrayRef<Value> p, Value vAddr) {
  // Its own fence: the P V group is issued behind the scores' group, and
  // ptxas serialises a group whose inputs (descriptors, P) were defined after
  // the last fence.
  Value desc = mma.desc(vAddr, blockN * 128, 1024);
  mma.fence();
  SmallVector<Value> out = mma.regsA(SmallVector<Value>(acc), p, desc);
  std::copy(out.begin(), out.end(), acc.begin());
}

SmallVector<Value> WarpSpecializedForward::mask(ArrayRef<Value> sIn,
                                                MaskKind kind, Value tile) {
  SmallVector<Value> s(sIn);
  tile::mask(*this, s, kind,
             queryMajorLayout(*this, 1, nTiles, qRow0, mul(tile, idx(blockN)),
                              ids.warp, ids.g, ids.t),
             sharedLen);
  return s;
}

SmallVector<Value> WarpSpecializedForward::maskEdges(SmallVector<Value> s,
                                                     Value i) {
  for (const Loop &l : loops) {
    if (!l.mask)
      continue;
    Value in = arith::AndIOp::create(
        b, loc, cmp(arith::CmpIPredicate::uge, i, l.offset),
        cmp(arith::CmpIPredicate::ult, i, add(l.offset, l.count)));
    Value vec = pack(s);
    auto edge = scf::IfOp::create(b, loc, TypeRange{vec.getType()}, in,
                                  /*withElseRegion=*/true);
    {
      OpBuilder::InsertionGuard guard(b);
      b.setInsertionPointToStart(edge.thenBlock());
      Value j = add(l.lb, arith::SubIOp::create(b, loc, i, l.offset));
      scf::YieldOp::create(b, loc, pack(mask(s, *l.mask, j)));
      b.setInsertionPointToStart(edge.elseBlock());
      scf::YieldOp::create(b, loc, vec);
    }
    s = unpack(edge.getResult(0));
  }
  return s;
}

LogicalResult WarpSpecializedForward::collectTileProgram() {
  // A loop's ops, masks aside: what every loop of the pipeline must share.
  auto signature = [](KVLoopOp loop) {
    SmallVector<std::pair<StringRef, DictionaryAttr>> ops;
    for (Operation &op : loop.getBody().front())
      if (!isa<MaskOp>(op))
        ops.push_back({op.getName().getStringRef(), op.getAttrDictionary()});
    return ops;
  };
  auto readsQ = [](Value v) {
    return isa_and_nonnull<LoadQOp>(v.getDefiningOp());
  };
  // Every kv_loop, a tree's chain_loop's included, in pipeline order.
  SmallVector<KVLoopOp> all;
  kernel.getBody().walk<WalkOrder::PreOrder>(
      [&](KVLoopOp loop) { all.push_back(loop); });
  for (KVLoopOp loop : all) {
    if (!tileLoop)
      tileLoop = loop;
    else if (signature(loop) != signature(tileLoop))
      return loop.emitOpError()
             << "differs from the first kv_loop in more than its masks: the "
                "warp-specialized schedule runs every loop's tiles through "
                "one pipeline";
    WalkResult masks = loop.getBody().walk([&](MaskOp mask) {
      auto qk = mask.getScores().getDefiningOp<QKOp>();
      if (qk && readsQ(qk.getQ()))
        return WalkResult::advance();
      mask.emitOpError() << "masks values other than the scores Q Kᵀ, which "
                            "is where the warp-specialized pipeline masks";
      return WalkResult::interrupt();
    });
    if (masks.wasInterrupted())
      return failure();
  }
  if (!tileLoop)
    return kernel.emitOpError() << "has no kv_loop to schedule";
  Block &body = tileLoop.getBody().front();
  for (Operation &op : body.without_terminator()) {
    if (auto qk = dyn_cast<QKOp>(op)) {
      bool fromQ = readsQ(qk.getQ());
      bool fromDout = isa_and_nonnull<LoadDoutOp>(qk.getQ().getDefiningOp());
      QKOp &slot = fromQ ? scoresOp : dpOp;
      if ((!fromQ && !fromDout) || slot)
        return qk.emitOpError() << "is not a product the warp-specialized "
                                   "pipeline issues (one Q Kᵀ, and dO Vᵀ in "
                                   "the dQ kernel)";
      slot = qk;
    } else if (auto pv = dyn_cast<PVOp>(op)) {
      if (productOp)
        return pv.emitOpError() << "is a second accumulating product; the "
                                   "warp-specialized pipeline issues one";
      productOp = pv;
    } else if (!isa<LoadKVOp, MaskOp>(op) && !isTileOp(&op)) {
      return op.emitOpError()
             << "has no place in the warp-specialized pipeline (neither a "
                "load, a product nor an op of the tile-op library)";
    }
  }
  if (!scoresOp || !productOp || (isDq != bool(dpOp)))
    return tileLoop.emitOpError()
           << "does not compute what the warp-specialized "
           << (isDq ? "dQ kernel" : "forward") << " pipelines: Q Kᵀ, "
           << (isDq ? "dO Vᵀ, " : "") << "and one accumulating product";
  Operation *yield = body.getTerminator();
  auto acc = llvm::find(yield->getOperands(), productOp.getResult());
  if (acc == yield->operand_end())
    return tileLoop.emitOpError()
           << "does not carry its product's accumulator to the next tile";
  accArg = acc - yield->operand_begin();
  for (auto [j, init] : llvm::enumerate(tileLoop.getInits())) {
    Operation *def = origin(init).getDefiningOp();
    if (j == accArg ? !isa_and_nonnull<InitAccOp>(def)
                    : !isa_and_nonnull<InitStatsOp>(def))
      return tileLoop.emitOpError()
             << "starts iter_arg " << j << " from a value the warp-specialized "
             << "pipeline does not build (init_acc for the accumulator, "
                "init_stats for the rest)";
  }
  return success();
}

IRMapping
WarpSpecializedForward::tileMapping(ArrayRef<SmallVector<Value>> state) {
  IRMapping map = kernelValues;
  Block &body = tileLoop.getBody().front();
  size_t next = 0;
  for (unsigned j = 0, e = body.getNumArguments() - 1; j < e; ++j)
    if (j != accArg)
      map.map(body.getArgument(1 + j), pack(state[next++]));
  return map;
}

void WarpSpecializedForward::bindProduct(IRMapping &map, Operation *op,
                                         ArrayRef<Value> values) {
  map.map(op->getResult(0), pack(values));
}

LogicalResult WarpSpecializedForward::emitReady(IRMapping &map,
                                                DenseSet<Operation *> &done) {
  for (Operation &op : tileLoop.getBody().front().without_terminator()) {
    if (done.contains(&op))
      continue;
    // The skeleton bound the scores masked (maskAt): a mask passes them on.
    if (auto mask = dyn_cast<MaskOp>(op)) {
      if (!map.contains(mask.getScores()))
        continue;
      map.map(mask.getResult(), map.lookup(mask.getScores()));
    } else {
      if (!isTileOp(&op) || !llvm::all_of(op.getOperands(), [&](Value v) {
            return map.contains(v);
          }))
        continue;
      if (failed(emitTileOp(&op, *this, tileEnv(), map)))
        return failure();
    }
    done.insert(&op);
  }
  return success();
}

SmallVector<SmallVector<Value>>
WarpSpecializedForward::nextState(IRMapping &map) {
  SmallVector<SmallVector<Value>> state;
  Operation *yield = tileLoop.getBody().front().getTerminator();
  for (auto [j, v] : llvm::enumerate(yield->getOperands()))
    if (j != accArg)
      state.push_back(lookup(map, v));
  return state;
}

TileEnv WarpSpecializedForward::tileEnv() {
  TileEnv env;
  env.stat = queryMajorStats(nTiles);
  env.scaleLog2 = scaleLog2, env.scale = scale;
  env.mTiles = 1, env.nTiles = nTiles, env.dTiles = dTiles;
  env.packOperand = [this](ArrayRef<Value> p) {
    return pack(frags.packAFragments(p, 1, nTiles));
  };
  return env;
}

Value WarpSpecializedForward::origin(Value v) {
  // Through a chain_loop's iter_args to the values it starts from.
  while (auto arg = dyn_cast<BlockArgument>(v)) {
    auto chain = dyn_cast<ChainLoopOp>(arg.getOwner()->getParentOp());
    if (!chain)
      break;
    v = chain.getInits()[llvm::find(chain.getRegionIterArgs(), arg) -
                         chain.getRegionIterArgs().begin()];
  }
  return v;
}

SmallVector<Value> WarpSpecializedForward::initialValue(Value init) {
  Value v = origin(init);
  if (auto stats = v.getDefiningOp<InitStatsOp>())
    return unpack(splat(
        *this, 2,
        v == stats.getMax() ? -std::numeric_limits<float>::infinity() : 0.0f));
  return unpack(splat(*this, dTiles * 4, 0.0f));
}

/// Loop-carried values of the pipeline: parts, flattened in order.
struct Carried {
  SmallVector<SmallVector<Value>> parts;
  SmallVector<Value> flat() const {
    SmallVector<Value> out;
    for (const SmallVector<Value> &p : parts)
      out.append(p);
    return out;
  }
  /// `values` cut into parts of the sizes of `shape`'s.
  static Carried like(const Carried &shape, ValueRange values) {
    Carried c;
    size_t at = 0;
    for (const SmallVector<Value> &p : shape.parts) {
      c.parts.emplace_back(values.begin() + at, values.begin() + at + p.size());
      at += p.size();
    }
    return c;
  }
};

LogicalResult WarpSpecializedForward::emitConsumer() {
  NVVM::SetMaxRegisterOp::create(b, loc, kConsumerRegs,
                                 NVVM::SetMaxRegisterAction::increase);
  waitParity(*this, barrier(0), idx(0));

  // The iter_args' first values: the first loop's inits.
  SmallVector<SmallVector<Value>> state;
  for (auto [j, init] : llvm::enumerate(tileLoopInits()))
    if (j != accArg)
      state.push_back(initialValue(init));
  wgIdx = divu(ids.warp, 4);
  // Iteration 0: its scores and the ops on them. Its product accumulates
  // into init_acc's zeros, so the ops on the accumulator (the rescale) have
  // nothing to do.
  turnEndIf(1);
  Value first = idx(0);
  waitParity(*this, kFull(first), idx(0));
  turnBegin();
  mma.fence();
  SmallVector<Value> s = scores(kAddrOf(first));
  mma.commit();
  turnEnd();
  mma.wait(0, s);
  arrive(*this, kEmpty(first));
  SmallVector<Value> walk;
  if (isTree)
    walk = walkBegin();
  IRMapping map = tileMapping(state);
  DenseSet<Operation *> done;
  bindProduct(map, scoresOp, maskAt(s, first, walk));
  if (failed(emitReady(map, done)))
    return failure();
  SmallVector<Value> p = lookup(map, productOp.getProbs());
  state = nextState(map);
  SmallVector<Value> acc = initialValue(tileLoopInits()[accArg]);
  walk = walkAfter(first, walk);

  // Iterations 1..n-1: scores of i, then the product of i - 1 behind them.
  // Carried: the product's accumulator, the other iter_args, the product's
  // operand, the tree walk.
  Carried carried;
  carried.parts.push_back(acc);
  carried.parts.append(state);
  carried.parts.push_back(p);
  carried.parts.push_back(walk);
  const size_t pPart = carried.parts.size() - 2;
  auto loop =
      scf::ForOp::create(b, loc, idx(1), numIters, idx(1), carried.flat());
  {
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(loop.getBody());
    Value i = loop.getInductionVar();
    Carried in = Carried::like(carried, loop.getRegionIterArgs());
    SmallVector<Value> acc = in.parts[0], p = in.parts[pPart],
                       w = in.parts.back();
    auto [slot, parity] = slotOf(i);
    auto [prevSlot, prevParity] =
        slotOf(arith::SubIOp::create(b, loc, i, idx(1)));
    waitParity(*this, kFull(slot), parity);
    waitParity(*this, vFull(prevSlot), prevParity);
    turnBegin();
    mma.fence();
    SmallVector<Value> s = scores(kAddrOf(slot));
    mma.commit();
    accumulate(acc, p, vAddrOf(prevSlot));
    mma.commit();
    turnEnd();
    mma.wait(1, s);
    arrive(*this, kEmpty(slot));
    IRMapping map = tileMapping(ArrayRef(in.parts).slice(1, pPart - 1));
    DenseSet<Operation *> done;
    bindProduct(map, scoresOp, maskAt(s, i, w));
    if (failed(emitReady(map, done)))
      return failure();
    SmallVector<Value> pNext = lookup(map, productOp.getProbs());
    // P passes through the wait too: the P V group reads its registers until
    // it retires, and LLVM would otherwise give them to the next tile's P.
    mma.waitKeeping(0, acc, p);
    arrive(*this, vEmpty(prevSlot));
    map.map(tileLoop.getBody().front().getArgument(1 + accArg), pack(acc));
    if (failed(emitReady(map, done)))
      return failure();
    Carried out;
    out.parts.push_back(lookup(map, productOp.getAcc()));
    out.parts.append(nextState(map));
    out.parts.push_back(pNext);
    out.parts.push_back(walkAfter(i, w));
    scf::YieldOp::create(b, loc, out.flat());
  }
  Carried last = Carried::like(carried, loop.getResults());
  acc = last.parts[0], p = last.parts[pPart];

  // The last tile's product.
  auto [lastSlot, lastParity] =
      slotOf(arith::SubIOp::create(b, loc, numIters, idx(1)));
  waitParity(*this, vFull(lastSlot), lastParity);
  turnBegin();
  accumulate(acc, p, vAddrOf(lastSlot));
  mma.commit();
  turnEndIf(0);
  mma.wait(0, acc);
  arrive(*this, vEmpty(lastSlot));
  // The epilogue reads the last loop's results.
  IRMapping results = kernelValues;
  KVLoopOp lastLoop = lastKVLoop();
  size_t next = 1;
  for (auto [j, r] : llvm::enumerate(lastLoop.getResults()))
    results.map(r, pack(j == accArg ? acc : last.parts[next++]));
  kernel.getBody().walk([&](StoreOutputOp store) {
    storeOutput(lookup(results, store.getAcc()),
                lookup(results, store.getMax()),
                lookup(results, store.getSum()));
  });
  return success();
}

void WarpSpecializedForward::storeOutput(ArrayRef<Value> acc, ArrayRef<Value> m,
                                         ArrayRef<Value> l) {
  SmallVector<Value> inv;
  for (int64_t h = 0; h < 2; ++h) {
    Value sum = tile::rowSum(*this, l[h]);
    inv.push_back(arith::DivFOp::create(b, loc, f32c(1.0f), sum));
    Value row = add(qRow0, add(mul(ids.warp, idx(16)), add(idx(h * 8), ids.g)));
    Value lead = arith::AndIOp::create(
        b, loc, cmp(arith::CmpIPredicate::eq, ids.t, idx(0)),
        cmp(arith::CmpIPredicate::ult, row, segLen));
    auto lseIf = scf::IfOp::create(b, loc, lead, /*withElseRegion=*/false);
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(lseIf.thenBlock());
    Value lse = tile::logSumExp(*this, m[h], sum);
    memref::StoreOp::create(
        b, loc, lse, lsePtr,
        ValueRange{add(mul(head, lseStrideH), add(segStart, row))});
  }
  storeRows(acc, inv, oPtr, oStrideT, oStrideH);
}

void WarpSpecializedForward::storeRows(ArrayRef<Value> acc,
                                       ArrayRef<Value> rowScale, Value out,
                                       Value strideT, Value strideH) {
  // The rows go through this warpgroup's 64 rows of the Q tile (its last
  // scores are done, so Q is free), in the same swizzle, then out as 16-byte
  // row chunks: every warp of the group writes whole rows, coalesced.
  proxyFence(*this);
  for (int64_t h = 0; h < 2; ++h) {
    Value r =
        add(mul(ids.warp, idx(16)), add(idx(h * 8), ids.g)); // row in the tile
    for (int64_t dt = 0; dt < dTiles; ++dt) {
      Value lo = acc[dt * 4 + h * 2], hi = acc[dt * 4 + h * 2 + 1];
      if (!rowScale.empty()) {
        lo = arith::MulFOp::create(b, loc, lo, rowScale[h]);
        hi = arith::MulFOp::create(b, loc, hi, rowScale[h]);
      }
      Value narrow = arith::TruncFOp::create(
          b, loc, VectorType::get({2}, elemType), pack({lo, hi}));
      SmallVector<Value, 2> at =
          smemTiles.swizzledIndex(r, idx(dt * 8), blockM);
      vector::StoreOp::create(
          b, loc, narrow, qTile,
          ValueRange{at[0], add(at[1], mul(ids.t, idx(2)))});
    }
  }
  // The warpgroup's 128 threads see each other's rows.
  namedBarrier(
      *this,
      i32Of(*this, add(idx(barrierId(QueryMajorBarrier::Epilogue0)), wgIdx)),
      kWarpgroupThreads);
  int64_t chunks = headDim / 8;
  int64_t rowsPerPass = kWarpgroupThreads / chunks;
  Value lt = remu(ids.tid, kWarpgroupThreads);
  Value c = mul(remu(lt, chunks), idx(8));
  auto vec8 = VectorType::get({8}, elemType);
  for (int64_t pass = 0; pass * rowsPerPass < 64; ++pass) {
    Value r = add(mul(wgIdx, idx(64)),
                  add(idx(pass * rowsPerPass), divu(lt, chunks)));
    SmallVector<Value, 2> at = smemTiles.swizzledIndex(r, c, blockM);
    Value chunk =
        vector::LoadOp::create(b, loc, vec8, qTile, ValueRange{at[0], at[1]});
    Value row = add(qRow0, r);
    auto inRange =
        scf::IfOp::create(b, loc, cmp(arith::CmpIPredicate::ult, row, segLen),
                          /*withElseRegion=*/false);
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(inRange.thenBlock());
    Value token = add(segStart, row);
    Value offset = add(add(mul(token, strideT), mul(head, strideH)), c);
    vector::StoreOp::create(b, loc, chunk, out, ValueRange{offset});
  }
}

SmallVector<Value> WarpSpecializedForward::rowProducts(int64_t aOffset,
                                                       Value kAddr) {
  // As scores(): warpgroup w's rows 64w..64w+63 of Q (or dO), both operands
  // K-major, the A address opaque per use.
  Value aAddr = add(opaque(*this, smemAddr),
                    add(idx(aOffset), mul(divu(ids.warp, 4), idx(64 * 128))));
  Value aDesc = mma.desc(aAddr, 16, 1024);
  Value bDesc = mma.desc(kAddr, 16, 1024);
  return mma.overHeadDim({}, blockN, aDesc, blockM, bDesc, blockN);
}

LogicalResult WarpSpecializedForward::emitDqConsumer() {
  NVVM::SetMaxRegisterOp::create(b, loc, kConsumerRegs,
                                 NVVM::SetMaxRegisterAction::increase);
  wgIdx = divu(ids.warp, 4);
  // The rows' LSE (in the log2 domain of the kernels' exp2) and Delta; rows
  // past the segment: LSE +inf (P = 0), Delta 0.
  SmallVector<Value> lse, delta;
  for (int64_t h = 0; h < 2; ++h) {
    Value row = add(qRow0, add(mul(ids.warp, idx(16)), add(idx(h * 8), ids.g)));
    Value valid = cmp(arith::CmpIPredicate::ult, row, segLen);
    Value token = add(segStart, select(valid, row, idx(0)));
    Value l = memref::LoadOp::create(
        b, loc, lsePtr, ValueRange{add(mul(head, lseStrideH), token)});
    l = arith::MulFOp::create(b, loc, l, f32c(kLog2e));
    lse.push_back(
        select(valid, l, f32c(std::numeric_limits<float>::infinity())));
    Value d = memref::LoadOp::create(
        b, loc, deltaPtr, ValueRange{add(mul(head, deltaStrideH), token)});
    delta.push_back(select(valid, d, f32c(0.0f)));
  }
  kernel.getBody().walk([&](LoadRowStatsOp op) {
    kernelValues.map(op.getResult(),
                     pack(op.getStat() == StatKind::lse ? lse : delta));
  });
  waitParity(*this, barrier(0), idx(0));

  // Iteration 0: S and dP, then the ops on them (P, dS).
  turnEndIf(1);
  Value first = idx(0);
  waitParity(*this, kFull(first), idx(0));
  waitParity(*this, vFull(first), idx(0));
  turnBegin();
  mma.fence();
  SmallVector<Value> s = rowProducts(0, kAddrOf(first));
  mma.commit();
  SmallVector<Value> dp = rowProducts(ring.dO, vAddrOf(first));
  mma.commit();
  turnEnd();
  mma.wait(1, s);
  // Prefix trees: the walk over the ancestor ranges, as the forward's.
  SmallVector<Value> walk;
  if (isTree)
    walk = walkBegin();
  IRMapping map = tileMapping({});
  DenseSet<Operation *> done;
  bindProduct(map, scoresOp, maskAt(s, first, walk));
  if (failed(emitReady(map, done)))
    return failure();
  mma.wait(0, dp);
  arrive(*this, vEmpty(first));
  bindProduct(map, dpOp, dp);
  if (failed(emitReady(map, done)))
    return failure();
  SmallVector<Value> ds = lookup(map, productOp.getProbs());
  SmallVector<Value> acc = initialValue(tileLoopInits()[accArg]);
  walk = walkAfter(first, walk);

  // Iterations 1..n-1: S and dP of i, then the product (dQ += dS K) of i - 1
  // behind them.
  Carried carried;
  carried.parts.push_back(acc);
  carried.parts.push_back(ds);
  carried.parts.push_back(walk);
  auto loop =
      scf::ForOp::create(b, loc, idx(1), numIters, idx(1), carried.flat());
  {
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(loop.getBody());
    Value i = loop.getInductionVar();
    Carried in = Carried::like(carried, loop.getRegionIterArgs());
    SmallVector<Value> acc = in.parts[0], ds = in.parts[1], w = in.parts[2];
    auto [slot, parity] = slotOf(i);
    auto [prevSlot, prevParity] =
        slotOf(arith::SubIOp::create(b, loc, i, idx(1)));
    (void)prevParity; // K of i - 1 has landed: its scores were computed
    waitParity(*this, kFull(slot), parity);
    waitParity(*this, vFull(slot), parity);
    turnBegin();
    mma.fence();
    SmallVector<Value> s = rowProducts(0, kAddrOf(slot));
    mma.commit();
    SmallVector<Value> dp = rowProducts(ring.dO, vAddrOf(slot));
    mma.commit();
    accumulate(acc, ds, kAddrOf(prevSlot));
    mma.commit();
    turnEnd();
    mma.wait(2, s);
    IRMapping map = tileMapping({});
    DenseSet<Operation *> done;
    bindProduct(map, scoresOp, maskAt(s, i, w));
    if (failed(emitReady(map, done)))
      return failure();
    mma.wait(1, dp);
    arrive(*this, vEmpty(slot));
    bindProduct(map, dpOp, dp);
    if (failed(emitReady(map, done)))
      return failure();
    SmallVector<Value> dsNext = lookup(map, productOp.getProbs());
    // dS of i - 1 passes through the wait too: the dQ group reads its
    // registers until it retires.
    mma.waitKeeping(0, acc, ds);
    arrive(*this, kEmpty(prevSlot));
    map.map(tileLoop.getBody().front().getArgument(1 + accArg), pack(acc));
    if (failed(emitReady(map, done)))
      return failure();
    Carried out;
    out.parts.push_back(lookup(map, productOp.getAcc()));
    out.parts.push_back(dsNext);
    out.parts.push_back(walkAfter(i, w));
    scf::YieldOp::create(b, loc, out.flat());
  }
  Carried last = Carried::like(carried, loop.getResults());
  acc = last.parts[0], ds = last.parts[1];

  // The last tile's dQ product.
  auto [lastSlot, lastParity] =
      slotOf(arith::SubIOp::create(b, loc, numIters, idx(1)));
  (void)lastParity;
  turnBegin();
  accumulate(acc, ds, kAddrOf(lastSlot));
  mma.commit();
  turnEndIf(0);
  mma.waitKeeping(0, acc, ds);
  arrive(*this, kEmpty(lastSlot));
  // The epilogue stores the last loop's accumulator.
  IRMapping results = kernelValues;
  results.map(lastKVLoop().getResult(accArg), pack(acc));
  kernel.getBody().walk([&](StoreDqOp store) {
    storeRows(lookup(results, store.getAcc()), {}, oPtr, oStrideT, oStrideH);
  });
  return success();
}

LogicalResult WarpSpecializedForward::emit(gpu::GPUModuleOp gpuModule) {
  // The spec was checked against the schedule's record (checkSpec, in the
  // dualkv.kernel verifier and again by dualkv-lower-to-nvgpu): the kind,
  // tiling, head_dim and shared memory fit this emitter.
  Block &entry =
      fn.create(gpuModule, kernel.getSymName(), kernel.getKind(), threads(),
                ::dualkv::Schedule::WarpSpecialized, isTree);
  auto func = cast<gpu::GPUFuncOp>(entry.getParentOp());
  int64_t total = threads() + kWarpgroupThreads;
  func.setKnownBlockSizeAttr(b.getDenseI32ArrayAttr({int32_t(total), 1, 1}));
  func->setAttr("nvvm.maxnreg", b.getI32IntegerAttr(kEntryRegs));
  lsePtr = fn.param("lse"), segPtr = fn.param("segs");
  lseStrideH = fn.indexParam("lseStrideH");
  if (isDq) {
    // dq takes the output's place (oPtr, oStride*).
    oPtr = fn.param("dq"), oStrideT = fn.indexParam("dqStrideT"),
    oStrideH = fn.indexParam("dqStrideH");
    deltaPtr = fn.param("delta"), deltaStrideH = fn.indexParam("deltaStrideH");
    scale = fn.param("scale");
    doMap = fn.param("doMap");
  } else {
    oPtr = fn.param("o"), oStrideT = fn.indexParam("oStrideT"),
    oStrideH = fn.indexParam("oStrideH");
  }
  scaleLog2 = fn.param("scaleLog2");
  qMap = fn.param("qMap"), kMap = fn.param("kMap"), vMap = fn.param("vMap");
  Value workPtr = fn.param("order");

  ids = ThreadIds::emit(*this);
  // Block x takes work item x of the plan's forward order ({segment, query
  // tile}, heaviest first), block z is the head.
  Value item = gpu::BlockIdOp::create(b, loc, gpu::Dimension::x);
  auto workField = [&](int64_t f) {
    return toIndex(memref::LoadOp::create(
        b, loc, workPtr, ValueRange{add(mul(item, idx(2)), idx(f))}));
  };
  Value seg = workField(0);
  segIndex = seg;
  if (isTree)
    chainPtr = fn.param("chain");
  qRow0 = mul(workField(1), idx(blockM));
  head = gpu::BlockIdOp::create(b, loc, gpu::Dimension::z);
  kvHead = divu(head, groupSize);
  SegmentFields fields = segmentFields(*this, segPtr, seg);
  segStart = fields.start, segLen = fields.length,
  sharedStart = fields.sharedStart, sharedLen = fields.sharedLen;

  auto workgroup =
      gpu::AddressSpaceAttr::get(b.getContext(), gpu::AddressSpace::Workgroup);
  auto bytes = MemRefType::get({ShapedType::kDynamic}, b.getI8Type(),
                               MemRefLayoutAttrInterface(), workgroup);
  Value smem = gpu::DynamicSharedMemoryOp::create(b, loc, bytes);
  smemAddr = smemTiles.alignToSwizzle(smem, sharedBytes());
  qTile = smemTiles.swizzledTile(smem, 0, blockM);
  if (failed(collectLoops()) || failed(collectTileProgram()))
    return failure();
  if (isTree) {
    // The ancestor ranges' tiles come first.
    countChainTiles();
    numIters = add(chainIters, numIters);
  }

  // Thread 0 initialises the barriers: Q and every "full" barrier complete on
  // the producer's arrival plus the TMA bytes, every "empty" one when all 256
  // consumer threads are done with the slot.
  {
    auto init = scf::IfOp::create(
        b, loc, cmp(arith::CmpIPredicate::eq, ids.tid, idx(0)),
        /*withElseRegion=*/false);
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(init.thenBlock());
    NVVM::MBarrierInitOp::create(b, loc, barrier(0), i32c(1), Value());
    for (int64_t s = 0; s < stages; ++s) {
      Value slot = idx(s);
      NVVM::MBarrierInitOp::create(b, loc, kFull(slot), i32c(1), Value());
      NVVM::MBarrierInitOp::create(b, loc, vFull(slot), i32c(1), Value());
      NVVM::MBarrierInitOp::create(b, loc, kEmpty(slot),
                                   i32c(int32_t(threads())), Value());
      NVVM::MBarrierInitOp::create(b, loc, vEmpty(slot),
                                   i32c(int32_t(threads())), Value());
    }
  }
  gpu::BarrierOp::create(b, loc);

  auto role = scf::IfOp::create(
      b, loc, cmp(arith::CmpIPredicate::uge, ids.tid, idx(threads())),
      /*withElseRegion=*/true);
  {
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(role.thenBlock());
    emitProducer();
    b.setInsertionPointToStart(role.elseBlock());
    if (failed(isDq ? emitDqConsumer() : emitConsumer()))
      return failure();
  }

  b.setInsertionPointToEnd(&entry);
  gpu::ReturnOp::create(b, loc);
  return success();
}

} // namespace

LogicalResult
mlir::dualkv::emitWarpSpecializedForward(KernelOp kernel, OpBuilder &b,
                                         gpu::GPUModuleOp gpuModule,
                                         int64_t *sharedBytes) {
  WarpSpecializedForward emitter(kernel, b);
  if (failed(emitter.emit(gpuModule)))
    return failure();
  *sharedBytes = emitter.sharedBytes();
  return success();
}
