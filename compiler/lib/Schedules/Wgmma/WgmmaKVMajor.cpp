//===- WgmmaKVMajor.cpp - the warpgroup schedule of the KV-major backward -===//
//
// sm_90a, BM = 128, BN = 64, 8 warps, D = 128 (the default there, for bwd and
// bwd_kv). It keeps the one-m16-block register layout of
// Lowering/Skeletons/KVMajorSkeleton.h (MT = 1: warp w holds keys 16w + g and
// 16w + g + 8, the wgmma m64nN accumulator layout of warpgroup w / 4) and
// computes every product with wgmma.mma_async: the emitter holds a
// WgmmaKVProducts (Lowering/Products/WgmmaKVProducts.h says how they compute)
// and adds the schedule's pipeline: cp.async copies of the query tiles,
// waited for once a tile behind a CTA barrier, and dQ = dS K over all 128
// keys, each warpgroup 64 queries x 64 columns.
//
// dQ leaves through shared memory: the warps store their fp32 C fragments in
// a BN x D buffer (rows padded by 8 floats, conflict-free), and one thread a
// query row adds the row to the fp32 dQ accumulator with one bulk reduction
// (cp.reduce.async.bulk .add.f32, 4 D bytes) instead of D / 4 vector atomics
// spread over every thread. The issuing threads wait until the bulk copies
// have read the buffer before the iteration ends (so its next write, and the
// kernel's exit, find it free).
//
//===----------------------------------------------------------------------===//
#include "Lowering/Products/WgmmaKVProducts.h"
#include "Lowering/ScheduleEmitters.h"
#include "Lowering/Skeletons/KVMajorSkeleton.h"
#include "Schedules/Wgmma/Wgmma.h"

using namespace mlir;
using namespace mlir::dualkv;

namespace {

class WgmmaKVMajorEmitter : public KVMajorEmitter {
public:
  WgmmaKVMajorEmitter(KernelOp kernel, OpBuilder &b)
      : KVMajorEmitter(kernel, b), wgmma(productsHost()) {
    useWgmmaTiles();
  }

  /// The dQ staging buffer (bwd), then 1 KB more, to align the buffers to
  /// the swizzle's 1024 bytes.
  int64_t sharedBytes() const override {
    return wgmma.dqOffset() + (withDq ? blockN * wgmma.dqRowBytes() : 0) + 1024;
  }

private:
  void layoutTiles() override { wgmma.layoutTiles(sharedBytes()); }
  void beginQIteration(Value parity) override { wgmma.beginQIteration(parity); }
  void endQIteration() override {
    wgmma.retireAll();
    if (withDq)
      wgmma.onDqIssuers([&] { bulkWait(*this, 0, /*readOnly=*/true); });
  }
  void endKernel() override {
    // Every bulk reduction has reached global memory before the CTA ends.
    if (withDq)
      wgmma.onDqIssuers([&] { bulkWait(*this, 0, /*readOnly=*/false); });
  }
  LogicalResult emitQKT(QKTOp op) override {
    wgmma.qkt(op);
    return success();
  }
  LogicalResult emitAccumulate(AccumulateOp op) override {
    wgmma.accumulate(op);
    return success();
  }
  LogicalResult emitAccumulateDq(AccumulateDqOp op) override {
    SmallVector<Value> ds = unpack(map.lookup(op.getDs()));
    Value tile = map.lookup(op->getParentOfType<QLoopOp>().getTileIndex());
    SmallVector<Value> acc = wgmma.dqWgmma(ds);
    wgmma.reduceDqBulk(acc, mul(tile, idx(blockN)));
    return success();
  }

  /// Sᵀ, dPᵀ, dV, dK and dQ.
  WgmmaKVProducts wgmma;
};

} // namespace

LogicalResult mlir::dualkv::emitWgmmaKVMajor(KernelOp kernel, OpBuilder &b,
                                             gpu::GPUModuleOp gpuModule,
                                             int64_t *sharedBytes) {
  return emitWith<WgmmaKVMajorEmitter>(kernel, b, gpuModule, sharedBytes);
}
