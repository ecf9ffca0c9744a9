//===- WgmmaQueryMajor.cpp - the warpgroup query-major kernels ------------===//
//
// sm_90a, head_dim 128, one m16 block a warp (block_m = 16 warps, warps a
// multiple of 4; the default 128:128:8:2). The register layouts of
// Lowering/Skeletons/QueryMajorSkeleton.h stay: warp w holds rows 16w + g and
// 16w + g + 8, the m64nN accumulator layout of warpgroup w / 4. Q, K and V sit
// unpadded in the 128-byte swizzle (SharedTiles.h); S = Q Kᵀ reads both K-major
// (m64nBNk16, D / 16 k-steps) and O += P V takes P from registers and V N-major
// (m64n128k16, BN / 16 k-steps); each waits for its own group.
//
// The deterministic dQ kernel (bwd_dq) runs the same two products on other
// tiles: S = Q Kᵀ and dP = dO Vᵀ (A = Q or dO, B = K or V, both K-major), and
// dQ += dS K (dS from registers, K N-major).
//
//===----------------------------------------------------------------------===//
#include "Lowering/ScheduleEmitters.h"
#include "Lowering/Skeletons/QueryMajorSkeleton.h"
#include "Lowering/Support/WgmmaBuilder.h"
#include "Schedules/Wgmma/Wgmma.h"

using namespace mlir;
using namespace mlir::dualkv;

namespace {

class WgmmaQueryMajorEmitter : public QueryMajorEmitter {
public:
  WgmmaQueryMajorEmitter(KernelOp kernel, OpBuilder &b)
      : QueryMajorEmitter(kernel, b), wg(b, loc, elemType, headDim) {
    rowStride = headDim;
    vRowStride = valueHeadDim;
    swizzledTiles = true;
    copies.wgmmaReadsTiles = true;
  }

  /// 1 KB more, to align the buffers to the swizzle's 1024 bytes.
  int64_t sharedBytes() const override {
    return QueryMajorEmitter::sharedBytes() + 1024;
  }

private:
  void layoutTiles(Value smem, int64_t qBytes, int64_t kvOffset) override {
    // Unpadded swizzled tiles from a 1024-byte aligned base.
    doOffset = qBytes;
    kOffset = kvOffset;
    vOffset = kvOffset + blockN * rowStride * 2;
    smemAddr = smemTiles.alignToSwizzle(smem, sharedBytes());
    qBuf = smemTiles.swizzledTile(smem, 0, blockM);
    if (isDq)
      doBuf = smemTiles.swizzledTile(smem, doOffset, blockM);
    kBuf = smemTiles.swizzledTile(smem, kOffset, blockN);
    vBuf = smemTiles.swizzledTile(smem, vOffset, blockN);
  }
  void beginKVIteration() override {
    Value base = opaque(*this, smemAddr);
    qAddr = base;
    doAddr = add(base, idx(doOffset));
    kAddr = add(base, idx(kOffset));
    vAddr = add(base, idx(vOffset));
  }
  /// The shared address of tile `buf` (qBuf, doBuf, kBuf or vBuf).
  Value addrOf(Value buf) {
    if (buf == doBuf)
      return doAddr;
    if (buf == kBuf)
      return kAddr;
    if (buf == vBuf)
      return vAddr;
    return qAddr;
  }
  SmallVector<Value> computeScores(QKOp op) override;
  SmallVector<Value> accumulatePV(ArrayRef<Value> p, SmallVector<Value> acc,
                                  Value vTile) override;

  WgmmaBuilder wg;
  // The aligned shared base and, per KV iteration (an opaque copy, so that
  // LLVM keeps each k-step's descriptor as base + immediate instead of
  // hoisting them all into registers), the addresses of Q, K and V.
  Value smemAddr, qAddr, doAddr, kAddr, vAddr;
  /// Where layoutTiles placed dO, K and V (bytes from the aligned base).
  int64_t doOffset = 0, kOffset = 0, vOffset = 0;
};

SmallVector<Value> WgmmaQueryMajorEmitter::computeScores(QKOp op) {
  // S = Q Kᵀ (dP = dO Vᵀ): warpgroup w owns query rows 64w..64w+63; both
  // operands K-major in the swizzled tiles.
  Value aDesc = wg.desc(
      add(addrOf(map.lookup(op.getQ())), mul(divu(ids.warp, 4), idx(64 * 128))),
      16, 1024);
  Value bDesc = wg.desc(addrOf(map.lookup(op.getK())), 16, 1024);
  wg.fence();
  SmallVector<Value> s =
      wg.overHeadDim({}, blockN, aDesc, blockM, bDesc, blockN);
  wg.commit();
  wg.wait(0, s);
  return s;
}

SmallVector<Value> WgmmaQueryMajorEmitter::accumulatePV(ArrayRef<Value> p,
                                                        SmallVector<Value> acc,
                                                        Value vTile) {
  // O += P V (dQ += dS K): P from registers as A, V (K) N-major from its
  // swizzled tile, block_n / 16 k-steps of 16 keys.
  Value bDesc = wg.desc(addrOf(vTile), blockN * 128, 1024);
  wg.fence();
  acc = wg.regsA(acc, p, bDesc);
  wg.commit();
  wg.wait(0, acc);
  return acc;
}

} // namespace

LogicalResult mlir::dualkv::emitWgmmaQueryMajor(KernelOp kernel, OpBuilder &b,
                                                gpu::GPUModuleOp gpuModule,
                                                int64_t *sharedBytes) {
  return emitWith<WgmmaQueryMajorEmitter>(kernel, b, gpuModule, sharedBytes);
}
