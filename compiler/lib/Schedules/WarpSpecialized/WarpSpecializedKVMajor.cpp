//===- WarpSpecializedKVMajor.cpp - the sm_90a KV-major backward ----------===//
//
// bwd and bwd_kv at head_dim 64 and 128, block_m 128 keys, block_n 64 queries
// (bwd_kv at head_dim 64 also 128 queries, its default; and at head_dim 256,
// block_m 64, where the two consumer warpgroups share the keys and split the
// columns of dK, dV and dQ, and each thread adds its dQ values to global memory
// itself: KVMajorEmitter::splitWarpgroups, WgmmaKVProducts.h): the products of
// the warpgroup schedule, from a WgmmaKVProducts of its own
// (Lowering/Products/WgmmaKVProducts.h: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ from shared
// memory, dV += Pᵀ dO and dK += dSᵀ Q with A from registers, dQ = dS K
// leaving by bulk reduction), with the query tiles' copies taken off the
// warps that compute. A CTA has three warpgroups:
//   warpgroup 2, the producer (setmaxnreg down to 24 registers), for each
//   query tile the CTA walks (each query head of the KV head's group, the
//   causal tiles first):
//   - copies Q, dO, LSE and Delta into a ring of two slots by cp.async,
//     zero-filling rows past the item as the other schedules do. Slot s has a
//     "full" mbarrier (128 arrivals: each producer thread after its copies
//     have landed and passed fence.proxy.async, so wgmma sees them) and an
//     "empty" one (256 arrivals: every consumer thread once its last product
//     on the slot has retired);
//   - in bwd, then writes the previous tile's dQ: it waits until the
//     consumers have staged that tile's fp32 dQ in shared memory ("dq full",
//     256 arrivals), adds each query row to the fp32 accumulator with one
//     bulk reduction (cp.reduce.async.bulk, thread r row r), waits until they
//     have read the buffer and hands it back ("dq empty", 128 arrivals). The
//     consumers stage a tile's dQ at the end of its iteration, when the next
//     tile's copies are long issued, and never wait for the reductions;
//   warpgroups 0 and 1, the consumers (setmaxnreg up to 240): 64 keys each,
//     dK and dV in registers, the warpgroup schedule's products, waiting on
//     the slot's full barrier instead of cp.async groups and a CTA barrier.
//     At head_dim 128 they meet on named barrier 1 of their 256 threads once
//     per tile, after storing dSᵀ (each computes dQ for all 128 keys, 64 of
//     the columns). At head_dim 64 (half of 64 columns is not a wgmma) each
//     computes the dQ of its own 64 keys, all columns, meeting nobody: its
//     partial tile has a staging buffer of its own, and the producer
//     bulk-reduces both. Before a warpgroup
//     overwrites dSᵀ with the next tile's, it waits on "dq full" for the
//     last tile: every consumer thread arrives there after its dQ product
//     has retired, so the other warpgroup no longer reads the old dSᵀ.
// Pipeline iteration `it` (a counter over both loop parts, every head, every
// tile, the same on all sides) uses slot it % 2 in phase (it / 2) % 2, and
// the one dQ staging buffer in phase it % 2.
//
// With a tiling of 2 stages the producer loads Q and dO by TMA instead
// (FlashAttention-3's producer): one thread posts the tile's bytes on the
// slot's full barrier (mbarrier.expect_tx) and issues two tensor copies
// (kBwdWarpSpecializedParams' qMap and doMap, boxes of block_n rows); every
// producer thread still copies its LSE and Delta words by cp.async and
// arrives. A tensor copy cannot zero the rows past the item (it reads the
// tensor's next queries; past the tensor's end, zeros), so those queries'
// LSE is +inf there (issueStatCopies): P = 0, and they add nothing. Not a
// default: it took 6-11 % off the atomic backward at P 4K-16K on the H200 but
// nothing off split-dQ's bwd_kv, sm_90a's default (docs/performance.md).
//
//===----------------------------------------------------------------------===//
#include "WarpSpecialized.h"

#include "Lowering/Products/WgmmaKVProducts.h"
#include "Lowering/ScheduleEmitters.h"
#include "Lowering/Skeletons/KVMajorSkeleton.h"

using namespace mlir;
using namespace mlir::dualkv;

namespace {

/// Threads of the producer warpgroup, which follows the consumers.
constexpr int64_t kProducerThreads = 128;
/// Registers a thread after setmaxnreg, within 384 x 168: 128 x 24 + 256 x
/// 240 at head_dim 128 and for bwd_kv's 128-query tiles at head_dim 64;
/// 128 x 40 + 256 x 232 at head_dim 64 otherwise, where the
/// consumers need fewer and the producer's two dQ reductions a row more, and
/// at head_dim 256 with the TMA producer; 128 x 72 + 256 x 216 at head_dim
/// 256 when the producer copies Q and dO by cp.async, 512-byte rows (with 40
/// it spilled 88 bytes), which leaves the consumers, who hold half of dK and
/// dV, too few for a window or a score modifier (4 to 24 bytes of spills).
constexpr int32_t kProducerRegs = 24, kProducerRegs64 = 40,
                  kProducerRegsCopying256 = 72;
constexpr int32_t kConsumerRegs = 240, kConsumerRegs64 = 232,
                  kConsumerRegsCopying256 = 216;
constexpr int32_t kEntryRegs = 168;
/// Slots of the query-tile ring (the tile views' two buffers).
constexpr int64_t kSlots = 2;

class WarpSpecializedKVMajor : public KVMajorEmitter {
public:
  WarpSpecializedKVMajor(KernelOp kernel, OpBuilder &b)
      : KVMajorEmitter(kernel, b), wgmma(splitHost()) {
    useWgmmaTiles();
    copies.syncedThreads = threads();
    tmaQueryTiles =
        kernel.getTiling()->getStages() == ::dualkv::kKVMajorTmaStages;
  }

  ::dualkv::Schedule abiSchedule() const override {
    return ::dualkv::Schedule::WarpSpecialized;
  }

  /// The skeleton's buffers, the dQ staging buffers, then the mbarriers.
  int64_t sharedBytes() const override {
    return barrierOffset() + 8 * kBarriers + 1024;
  }

private:
  /// The products' host, the warp layout chosen first: at head_dim 256 both
  /// warpgroups hold all 64 keys (one m16 block a warp) and half of the
  /// query tile's columns of Sᵀ.
  KVProductsHost splitHost() {
    if (headDim == 256) {
      splitWarpgroups = true;
      mTiles = 1;
      nTiles = blockN / 16;
    }
    return productsHost();
  }
  /// full and empty of each slot, dq full, dq empty.
  static constexpr int64_t kBarriers = 2 * kSlots + 2;
  int64_t barrierOffset() const {
    return wgmma.dqOffset() +
           (stagesDq() ? dqBuffers() * blockN * wgmma.dqRowBytes() : 0);
  }
  /// head_dim 64: each warpgroup computes the dQ of its own 64 keys (a
  /// warpgroup cannot take half of 64 columns), so the warpgroups share
  /// nothing in a tile; their two partial dQ tiles have a staging buffer
  /// each and are both bulk-reduced.
  bool splitDq() const { return headDim == 64; }
  /// bwd's dQ leaves through the staging buffers and the producer's bulk
  /// reductions; with splitWarpgroups (head_dim 256, no shared memory left
  /// for a 64 x 256 fp32 tile) each consumer thread adds its own dQ values
  /// to global memory (KVMajorEmitter::reduceDqTile).
  bool stagesDq() const { return withDq && !splitWarpgroups; }
  int32_t producerRegs() const {
    if (splitWarpgroups && !tmaQueryTiles)
      return kProducerRegsCopying256;
    return fewProducerRegs() ? kProducerRegs : kProducerRegs64;
  }
  int32_t consumerRegs() const {
    if (splitWarpgroups && !tmaQueryTiles)
      return kConsumerRegsCopying256;
    return fewProducerRegs() ? kConsumerRegs : kConsumerRegs64;
  }
  /// 24 producer registers and 240 a consumer: at head_dim 128, and for
  /// bwd_kv's 128-query tiles at head_dim 64, whose consumers hold Sᵀ and dPᵀ
  /// of 64 keys x 128 queries and whose producer reduces no dQ.
  bool fewProducerRegs() const {
    if (splitWarpgroups)
      return false;
    return !splitDq() || (!withDq && blockN == 128);
  }
  int64_t dqBuffers() const { return splitDq() ? 2 : 1; }
  Value barrierAt(int64_t first, Value slot) {
    return sharedPtr(
        *this, add(wgmma.smemAddr,
                   add(idx(barrierOffset() + 8 * first), mul(slot, idx(8)))));
  }
  Value fullBarrier(Value slot) { return barrierAt(0, slot); }
  Value emptyBarrier(Value slot) { return barrierAt(kSlots, slot); }
  Value dqFullBarrier() { return barrierAt(2 * kSlots, idx(0)); }
  Value dqEmptyBarrier() { return barrierAt(2 * kSlots + 1, idx(0)); }
  /// Slot and phase parity of pipeline iteration `it`.
  RingSlot slotOf(Value it) { return ringSlot(*this, it, kSlots); }

  void layoutTiles() override { wgmma.layoutTiles(sharedBytes()); }
  void beginQIteration(Value parity) override { wgmma.beginQIteration(parity); }
  LogicalResult emitQKT(QKTOp op) override {
    wgmma.qkt(op);
    return success();
  }
  LogicalResult emitAccumulate(AccumulateOp op) override {
    wgmma.accumulate(op);
    return success();
  }
  LogicalResult emitBody() override;
  LogicalResult emitProducer();
  /// The producer's dQ duty for pipeline iteration `it`, whose tile starts
  /// at query `first` of the item in query head `tileHead`.
  void writeDq(Value it, Value first, Value tileHead);
  LogicalResult emitQLoop(QLoopOp op) override;
  void waitTile() override {
    waitParity(*this, fullBarrier(cur.slot), cur.parity);
  }
  /// Waits for the last tile's "dq full" phase (a fresh barrier passes the
  /// first tile through) before this warpgroup overwrites the dSᵀ that the
  /// other one may still read.
  void waitLastDqFull() {
    waitParity(*this, dqFullBarrier(),
               arith::XOrIOp::create(b, loc, remu(curIter, 2), idx(1)));
  }
  /// Only the products retire here: the dQ writer waits for its own
  /// reductions.
  void endQIteration() override { wgmma.retireAll(); }
  void endKernel() override {}
  LogicalResult emitAccumulateDq(AccumulateDqOp op) override {
    if (splitWarpgroups) {
      // dSᵀ is whole in shared memory (accumulate's barrier for dK came
      // before): the warpgroup's 128 columns in two products of 64, each
      // added to global dQ as soon as it is done.
      Value tile = map.lookup(op->getParentOfType<QLoopOp>().getTileIndex());
      Value first = mul(tile, idx(blockN));
      Value warpRow0 = mul(remu(ids.warp, 4), idx(16));
      Value warpCol0 = mul(wgmma.warpGroup, idx(headDim / 2));
      for (int64_t half = 0; half < 2; ++half)
        reduceDqTile(wgmma.splitDq(half), 1, headDim / 4 / 8, warpRow0,
                     warpCol0, half * headDim / 4, first);
      return success();
    }
    SmallVector<Value> ds = unpack(map.lookup(op.getDs()));
    // head_dim 64: dQ of the warpgroup's own 64 keys, 64 queries x 64
    // columns; only this warpgroup reads its dSᵀ rows.
    SmallVector<Value> acc;
    if (splitDq()) {
      acc = wgmma.dqOwnKeys(ds);
    } else {
      waitLastDqFull();
      acc = wgmma.dqWgmma(ds);
    }
    // The staging buffer is free once the writer has read the last tile's
    // (a fresh barrier lets the first pass through); the writer may read it
    // once all 256 consumer threads have stored their part.
    Value phase = remu(curIter, 2);
    waitParity(*this, dqEmptyBarrier(),
               arith::XOrIOp::create(b, loc, phase, idx(1)));
    if (splitDq())
      wgmma.stageDq(
          acc, idx(0),
          add(idx(wgmma.dqOffset()),
              mul(wgmma.warpGroup, idx(blockN * wgmma.dqRowBytes()))));
    else
      wgmma.stageDq(acc);
    proxyFence(*this);
    arrive(*this, dqFullBarrier());
    return success();
  }

  /// The producer loads Q and dO by TMA (a tiling of 2 stages).
  bool tmaQueryTiles = false;
  Value qMap, doMap;
  /// The consumers' pipeline iteration at the start of the next q_loop.
  Value ringIter;
  /// The consumers' current pipeline iteration, its slot and phase.
  Value curIter;
  RingSlot cur;
  /// Sᵀ, dPᵀ, dV, dK and dQ.
  WgmmaKVProducts wgmma;
};

LogicalResult WarpSpecializedKVMajor::emitBody() {
  gpu::GPUFuncOp func = fn.op();
  func.setKnownBlockSizeAttr(
      b.getDenseI32ArrayAttr({int32_t(threads() + kProducerThreads), 1, 1}));
  func->setAttr("nvvm.maxnreg", b.getI32IntegerAttr(kEntryRegs));

  // Thread 0 initialises the barriers before anyone uses them.
  emitIf(cmp(arith::CmpIPredicate::eq, ids.tid, idx(0)), [&] {
    for (int64_t s = 0; s < kSlots; ++s) {
      NVVM::MBarrierInitOp::create(b, loc, fullBarrier(idx(s)),
                                   i32c(int32_t(kProducerThreads)), Value());
      NVVM::MBarrierInitOp::create(b, loc, emptyBarrier(idx(s)),
                                   i32c(int32_t(threads())), Value());
    }
    if (stagesDq()) {
      NVVM::MBarrierInitOp::create(b, loc, dqFullBarrier(),
                                   i32c(int32_t(threads())), Value());
      NVVM::MBarrierInitOp::create(b, loc, dqEmptyBarrier(),
                                   i32c(int32_t(kProducerThreads)), Value());
    }
  });
  gpu::BarrierOp::create(b, loc);

  auto role = scf::IfOp::create(
      b, loc, cmp(arith::CmpIPredicate::uge, ids.tid, idx(threads())),
      /*withElseRegion=*/true);
  OpBuilder::InsertionGuard guard(b);
  b.setInsertionPointToStart(role.thenBlock());
  NVVM::SetMaxRegisterOp::create(b, loc, producerRegs(),
                                 NVVM::SetMaxRegisterAction::decrease);
  if (tmaQueryTiles)
    qMap = fn.param("qMap"), doMap = fn.param("doMap");
  // Producer threads numbered from 0: the copies (copyTile,
  // issueTileCopies) spread over threads() threads by tid.
  Value consumerTid = ids.tid;
  int64_t consumerWarps = warps;
  ids.tid = arith::SubIOp::create(b, loc, ids.tid, idx(threads()));
  warps = kProducerThreads / 32;
  if (failed(emitProducer()))
    return failure();
  ids.tid = consumerTid;
  warps = consumerWarps;
  b.setInsertionPointToStart(role.elseBlock());
  NVVM::SetMaxRegisterOp::create(b, loc, consumerRegs(),
                                 NVVM::SetMaxRegisterAction::increase);
  ringIter = idx(0);
  return KVMajorEmitter::emitBody();
}

LogicalResult WarpSpecializedKVMajor::emitProducer() {
  // Pipeline iteration, and the previous tile's first query and head (for
  // its dQ), across both loop parts and every head.
  Value it = idx(0), prevFirst = idx(0), prevHead = idx(0);
  for (Operation &op : kernel.getBody().front()) {
    auto loop = dyn_cast<QLoopOp>(op);
    if (!loop)
      continue;
    Value lb, ub;
    if (failed(qLoopBounds(loop, lb, ub)))
      return failure();
    auto heads = scf::ForOp::create(b, loc, idx(0), idx(groupSize), idx(1),
                                    ValueRange{it, prevFirst, prevHead});
    {
      OpBuilder::InsertionGuard guard(b);
      b.setInsertionPointToStart(heads.getBody());
      Value tileHead =
          add(mul(kvHead, idx(groupSize)), heads.getInductionVar());
      auto tiles =
          scf::ForOp::create(b, loc, lb, ub, idx(1), heads.getRegionIterArgs());
      {
        OpBuilder::InsertionGuard inner(b);
        b.setInsertionPointToStart(tiles.getBody());
        Value tile = tiles.getInductionVar();
        auto args = tiles.getRegionIterArgs();
        Value at = args[0];
        auto [slot, phase] = slotOf(at);
        head = tileHead;
        // A fresh barrier completes phase "1" at once: the first pass over
        // the ring does not wait.
        waitParity(*this, emptyBarrier(slot),
                   arith::XOrIOp::create(b, loc, phase, idx(1)));
        Value valid = arith::ConstantIntOp::create(b, loc, 1, 1);
        if (tmaQueryTiles) {
          // Thread 0 posts the two tiles' bytes before any can land, then
          // copies them; the phase also waits for every thread's arrival.
          Value first = mul(tile, idx(blockN));
          emitIf(cmp(arith::CmpIPredicate::eq, ids.tid, idx(0)), [&] {
            NVVM::MBarrierExpectTxOp::create(b, loc, fullBarrier(slot),
                                             i32c(int32_t(2 * tileBytes())),
                                             NVVM::MemScopeKind::CTA);
            Value row = add(qBegin, first);
            Value base = add(wgmma.smemAddr, mul(slot, idx(tileBytes())));
            tmaLoadTile(*this, qMap, add(base, idx(qOffset())), blockN,
                        rowStride, row, head, fullBarrier(slot));
            tmaLoadTile(*this, doMap, add(base, idx(doOffset())), blockN,
                        rowStride, row, head, fullBarrier(slot));
          });
          // issueStatCopies waits for its own copies.
          issueStatCopies(first, slot, valid, /*infinitePastItem=*/true);
          arrive(*this, fullBarrier(slot));
        } else {
          SmallVector<Value, 3> groups = issueTileCopies(tile, slot, valid);
          // This thread's copies land, then reach wgmma (async proxy) and
          // the consumers through the full barrier's release.
          nvgpu::DeviceAsyncWaitOp::create(b, loc, groups.back(),
                                           b.getI32IntegerAttr(0));
          proxyFence(*this);
          arrive(*this, fullBarrier(slot));
        }
        if (stagesDq())
          emitIf(cmp(arith::CmpIPredicate::ugt, at, idx(0)), [&] {
            writeDq(arith::SubIOp::create(b, loc, at, idx(1)), args[1],
                    args[2]);
          });
        scf::YieldOp::create(
            b, loc,
            ValueRange{add(at, idx(1)), mul(tile, idx(blockN)), tileHead});
      }
      scf::YieldOp::create(b, loc, tiles.getResults());
    }
    it = heads.getResult(0), prevFirst = heads.getResult(1),
    prevHead = heads.getResult(2);
  }
  if (stagesDq()) {
    // The last tile's dQ, then every reduction in global memory before the
    // CTA ends.
    emitIf(cmp(arith::CmpIPredicate::ugt, it, idx(0)), [&] {
      writeDq(arith::SubIOp::create(b, loc, it, idx(1)), prevFirst, prevHead);
    });
    bulkWait(*this, 0, /*readOnly=*/false);
  }
  return success();
}

void WarpSpecializedKVMajor::writeDq(Value it, Value first, Value tileHead) {
  head = tileHead;
  waitParity(*this, dqFullBarrier(), remu(it, 2));
  emitIf(cmp(arith::CmpIPredicate::ult, ids.tid, idx(blockN)), [&] {
    for (int64_t buffer = 0; buffer < dqBuffers(); ++buffer)
      wgmma.reduceDqRow(ids.tid, first, buffer);
  });
  bulkCommit(*this);
  bulkWait(*this, 0, /*readOnly=*/true);
  arrive(*this, dqEmptyBarrier());
}

LogicalResult WarpSpecializedKVMajor::emitQLoop(QLoopOp op) {
  Value lb, ub;
  if (failed(qLoopBounds(op, lb, ub)))
    return failure();
  SmallVector<Value> inits;
  for (Value v : op.getInits())
    inits.push_back(map.lookup(v));
  inits.push_back(ringIter);
  auto heads =
      scf::ForOp::create(b, loc, idx(0), idx(groupSize), idx(1), inits);
  {
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(heads.getBody());
    head = add(mul(kvHead, idx(groupSize)), heads.getInductionVar());
    auto tiles =
        scf::ForOp::create(b, loc, lb, ub, idx(1), heads.getRegionIterArgs());
    {
      OpBuilder::InsertionGuard inner(b);
      b.setInsertionPointToStart(tiles.getBody());
      map.map(op.getTileIndex(), tiles.getInductionVar());
      auto args = tiles.getRegionIterArgs();
      for (auto [from, to] : llvm::zip(op.getRegionIterArgs(), args))
        map.map(from, to);
      Value at = args.back();
      curIter = at;
      cur = slotOf(at);
      SmallVector<Value, 4> views = tileViews(cur.slot);
      qCur = views[0], doCur = views[1], lseCur = views[2], deltaCur = views[3];
      beginQIteration(cur.slot);
      tileReady = false;
      if (failed(emitQIterationOps(op)))
        return failure();
      // endQIteration retires every product, so nothing reads the slot any
      // more when this thread hands it back.
      endQIteration();
      arrive(*this, emptyBarrier(cur.slot));
      SmallVector<Value> yielded = qIterationYields(op);
      yielded.push_back(add(at, idx(1)));
      scf::YieldOp::create(b, loc, yielded);
    }
    scf::YieldOp::create(b, loc, tiles.getResults());
  }
  for (auto [from, to] : llvm::zip(op.getResults(), heads.getResults()))
    map.map(from, to);
  ringIter = heads.getResults().back();
  return success();
}

} // namespace

LogicalResult
mlir::dualkv::emitWarpSpecializedKVMajor(KernelOp kernel, OpBuilder &b,
                                         gpu::GPUModuleOp gpuModule,
                                         int64_t *sharedBytes) {
  static_assert(kSlots == 2, "the tile views hold two buffers");
  int64_t d = kernel.getProblem()->getHeadDim();
  int64_t blockM = kernel.getTiling()->getBlockM();
  if (d == 256) {
    if (blockM != 64 || kernel.getTiling()->getBlockN() != 64 ||
        kernel.getTiling()->getWarps() != 8)
      return kernel.emitOpError()
             << "the warp-specialized backward at head_dim 256 needs block_m "
                "64, block_n 64 and 8 consumer warps";
    return emitWith<WarpSpecializedKVMajor>(kernel, b, gpuModule, sharedBytes);
  }
  bool computesDq = kernel.getKind() == KernelKind::bwd;
  if (!::dualkv::warpSpecializedKVHeadDimFits(computesDq, d) || blockM != 128 ||
      !::dualkv::warpSpecializedKVQueryTileFits(
          computesDq, d, kernel.getTiling()->getBlockN()) ||
      kernel.getTiling()->getWarps() != 8)
    return kernel.emitOpError()
           << "the warp-specialized backward needs head_dim 64 or 128 (96 "
              "for bwd_kv), block_m 128, block_n 64 (128 for bwd_kv at "
              "head_dim 64) and 8 consumer warps";
  return emitWith<WarpSpecializedKVMajor>(kernel, b, gpuModule, sharedBytes);
}
