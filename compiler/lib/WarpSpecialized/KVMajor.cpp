//===- KVMajor.cpp - the sm_90a warp-specialized KV-major backward --------===//
//
// bwd and bwd_kv at head_dim 128, block_m 128 keys, block_n 64 queries: the
// products of the warpgroup schedule (Wgmma/KVMajor.h: Sᵀ = K Qᵀ and dPᵀ = V
// dOᵀ from shared memory, dV += Pᵀ dO and dK += dSᵀ Q with A from registers,
// dQ = dS K leaving by bulk reduction), with the query tiles' copies taken
// off the warps that compute. A CTA has three warpgroups:
//   warpgroup 2, the producer (setmaxnreg down to 24 registers): its 128
//     threads copy Q, dO, LSE and Delta of every query tile the CTA walks
//     (each query head of the KV head's group, the causal tiles first) into a
//     ring of two slots by cp.async, zero-filling rows past the item as the
//     other schedules do. Slot s has a "full" mbarrier (128 arrivals: each
//     producer thread after its copies have landed and passed
//     fence.proxy.async, so wgmma sees them) and an "empty" one (256
//     arrivals: every consumer thread once its last product on the slot has
//     retired);
//   warpgroups 0 and 1, the consumers (setmaxnreg up to 240): 64 keys each,
//     dK and dV in registers, exactly the warpgroup schedule's iteration,
//     waiting on the slot's full barrier instead of cp.async groups and a
//     CTA barrier. Where the two warpgroups must meet (K and V loaded, dSᵀ
//     stored for dQ, the dQ staging buffer written) they use named barrier 1
//     of their 256 threads; the producer never waits for them except on the
//     empty barriers.
// Pipeline iteration `it` (a counter over both loop parts, every head, every
// tile, the same on both sides) uses slot it % 2 in phase (it / 2) % 2.
//
//===----------------------------------------------------------------------===//
#include "WarpSpecialized.h"

#include "Wgmma/KVMajor.h"

using namespace mlir;
using namespace mlir::dualkv;

namespace {

/// Threads of the producer warpgroup, which follows the consumers.
constexpr int64_t kProducerThreads = 128;
/// Registers a thread after setmaxnreg: 128 x 24 + 256 x 240 = 384 x 168.
constexpr int32_t kProducerRegs = 24;
constexpr int32_t kConsumerRegs = 240;
constexpr int32_t kEntryRegs = 168;
/// Slots of the query-tile ring (the tile views' two buffers).
constexpr int64_t kSlots = 2;

class WarpSpecializedKVMajor : public WgmmaKVMajorEmitter {
public:
  WarpSpecializedKVMajor(KernelOp kernel, OpBuilder &b)
      : WgmmaKVMajorEmitter(kernel, b) {
    syncedThreads = threads();
  }

  /// The warpgroup schedule's buffers, then the ring's mbarriers.
  int64_t sharedBytes() const override {
    return barrierOffset() + 8 * 2 * kSlots + 1024;
  }

private:
  int64_t barrierOffset() const {
    return dqOffset() + (withDq ? blockN * dqRowBytes() : 0);
  }
  Value barrierAt(int64_t first, Value slot) {
    return sharedPtr(add(
        smemAddr, add(idx(barrierOffset() + 8 * first), mul(slot, idx(8)))));
  }
  Value fullBarrier(Value slot) { return barrierAt(0, slot); }
  Value emptyBarrier(Value slot) { return barrierAt(kSlots, slot); }
  Value sharedPtr(Value addr) {
    Value i32 = arith::IndexCastOp::create(b, loc, b.getI32Type(), addr);
    return LLVM::IntToPtrOp::create(
        b, loc, LLVM::LLVMPointerType::get(b.getContext(), 3), i32);
  }
  void waitParity(Value bar, Value parity) {
    NVVM::MBarrierTryWaitParityOp::create(
        b, loc, bar, arith::IndexCastOp::create(b, loc, b.getI32Type(), parity),
        i32c(0x989680));
  }
  void arrive(Value bar) {
    NVVM::MBarrierArriveOp::create(b, loc, Type(), bar, Value());
  }
  /// Slot and phase parity of pipeline iteration `it`.
  std::pair<Value, Value> slotOf(Value it) {
    return {remu(it, kSlots), remu(divu(it, kSlots), 2)};
  }

  LogicalResult emitBody() override;
  LogicalResult emitProducer();
  LogicalResult emitQLoop(QLoopOp op) override;
  void waitTile() override { waitParity(fullBarrier(curSlot), curPhase); }

  /// The consumers' pipeline iteration at the start of the next q_loop.
  Value ringIter;
  /// The slot of the consumers' current tile and its phase.
  Value curSlot, curPhase;
};

LogicalResult WarpSpecializedKVMajor::emitBody() {
  auto func = cast<gpu::GPUFuncOp>(entryBlock->getParentOp());
  func.setKnownBlockSizeAttr(
      b.getDenseI32ArrayAttr({int32_t(threads() + kProducerThreads), 1, 1}));
  func->setAttr("nvvm.maxnreg", b.getI32IntegerAttr(kEntryRegs));

  // Thread 0 initialises the ring's barriers before anyone uses them.
  emitIf(cmp(arith::CmpIPredicate::eq, tid, idx(0)), [&] {
    for (int64_t s = 0; s < kSlots; ++s) {
      NVVM::MBarrierInitOp::create(b, loc, fullBarrier(idx(s)),
                                   i32c(int32_t(kProducerThreads)), Value());
      NVVM::MBarrierInitOp::create(b, loc, emptyBarrier(idx(s)),
                                   i32c(int32_t(threads())), Value());
    }
  });
  gpu::BarrierOp::create(b, loc);

  auto role = scf::IfOp::create(
      b, loc, cmp(arith::CmpIPredicate::uge, tid, idx(threads())),
      /*withElseRegion=*/true);
  OpBuilder::InsertionGuard guard(b);
  b.setInsertionPointToStart(role.thenBlock());
  if (failed(emitProducer()))
    return failure();
  b.setInsertionPointToStart(role.elseBlock());
  NVVM::SetMaxRegisterOp::create(b, loc, kConsumerRegs,
                                 NVVM::SetMaxRegisterAction::increase);
  ringIter = idx(0);
  return WgmmaKVMajorEmitter::emitBody();
}

LogicalResult WarpSpecializedKVMajor::emitProducer() {
  NVVM::SetMaxRegisterOp::create(b, loc, kProducerRegs,
                                 NVVM::SetMaxRegisterAction::decrease);
  // The copies (copyTile, issueTileCopies) spread over threads() threads by
  // tid: here the producer's 128, numbered from 0.
  Value consumerTid = tid;
  int64_t consumerWarps = warps;
  tid = arith::SubIOp::create(b, loc, tid, idx(threads()));
  warps = kProducerThreads / 32;
  Value it = idx(0);
  for (Operation &op : kernel.getBody().front()) {
    auto loop = dyn_cast<QLoopOp>(op);
    if (!loop)
      continue;
    Value lb, ub;
    if (failed(qLoopBounds(loop, lb, ub)))
      return failure();
    auto heads = scf::ForOp::create(b, loc, idx(0), idx(groupSize), idx(1),
                                    ValueRange{it});
    {
      OpBuilder::InsertionGuard guard(b);
      b.setInsertionPointToStart(heads.getBody());
      head = add(mul(kvHead, idx(groupSize)), heads.getInductionVar());
      auto tiles =
          scf::ForOp::create(b, loc, lb, ub, idx(1), heads.getRegionIterArgs());
      {
        OpBuilder::InsertionGuard inner(b);
        b.setInsertionPointToStart(tiles.getBody());
        Value i = tiles.getInductionVar();
        Value at = tiles.getRegionIterArgs()[0];
        auto [slot, phase] = slotOf(at);
        // A fresh barrier completes phase "1" at once: the first pass over
        // the ring does not wait.
        waitParity(emptyBarrier(slot),
                   arith::XOrIOp::create(b, loc, phase, idx(1)));
        SmallVector<Value, 3> groups = issueTileCopies(
            i, slot, arith::ConstantIntOp::create(b, loc, 1, 1));
        // This thread's copies land, then reach wgmma (async proxy) and the
        // consumers through the full barrier's release.
        nvgpu::DeviceAsyncWaitOp::create(b, loc, groups.back(),
                                         b.getI32IntegerAttr(0));
        proxyFence();
        arrive(fullBarrier(slot));
        scf::YieldOp::create(b, loc, ValueRange{add(at, idx(1))});
      }
      scf::YieldOp::create(b, loc, tiles.getResults());
    }
    it = heads.getResult(0);
  }
  tid = consumerTid;
  warps = consumerWarps;
  return success();
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
      std::tie(curSlot, curPhase) = slotOf(at);
      SmallVector<Value, 4> views = tileViews(curSlot);
      qCur = views[0], doCur = views[1], lseCur = views[2], deltaCur = views[3];
      beginQIteration(curSlot);
      tileReady = false;
      aLane = opaque(lane);
      aG = divu(aLane, 4);
      aT = remu(aLane, 4);
      for (Operation &inner : op.getBody().front().without_terminator())
        if (failed(emitOp(&inner)))
          return failure();
      // endQIteration retires every product, so nothing reads the slot any
      // more when this thread hands it back.
      endQIteration();
      arrive(emptyBarrier(curSlot));
      SmallVector<Value> yielded;
      for (Value v : op.getBody().front().getTerminator()->getOperands())
        yielded.push_back(map.lookup(v));
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
  if (kernel.getProblem()->getHeadDim() != 128 ||
      kernel.getTiling()->getBlockM() != 128 ||
      kernel.getTiling()->getBlockN() != 64 ||
      kernel.getTiling()->getWarps() != 8)
    return kernel.emitOpError()
           << "the warp-specialized backward needs head_dim 128, block_m 128, "
              "block_n 64 and 8 consumer warps";
  return emitWith<WarpSpecializedKVMajor>(kernel, b, gpuModule, sharedBytes);
}
