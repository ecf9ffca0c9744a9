//===- MmaSyncQueryMajor.cpp - the mma.sync query-major kernels -----------===//
//
// The forward and the deterministic dQ kernel on sm_80 and later: Q, K and V
// in padded shared-memory rows (SharedTiles.h), S = Q Kᵀ and O += P V as
// mma.sync.m16n8k16 with ldmatrix operands; each warp owns MT m16 blocks of
// query rows.
//
//===----------------------------------------------------------------------===//
#include "Lowering/ScheduleEmitters.h"
#include "Lowering/Skeletons/QueryMajorSkeleton.h"
#include "Schedules/MmaSync/MmaSync.h"

using namespace mlir;
using namespace mlir::dualkv;

namespace {

class MmaSyncQueryMajorEmitter : public QueryMajorEmitter {
public:
  using QueryMajorEmitter::QueryMajorEmitter;

private:
  void layoutTiles(Value smem, int64_t qBytes, int64_t kvOffset) override {
    qBuf = smemTiles.sharedTile(smem, 0, blockM);
    if (isDq)
      doBuf = vTiles.sharedTile(smem, qBytes, blockM);
    kBuf = smemTiles.sharedTile(smem, kvOffset, blockN);
    vBuf = vTiles.sharedTile(smem, kvOffset + blockN * rowStride * 2, blockN);
  }
  SmallVector<Value> computeScores(QKOp op) override;
  SmallVector<Value> accumulatePV(ArrayRef<Value> p, SmallVector<Value> acc,
                                  Value vTile) override {
    // V (keys x d, row-major in shared memory) is the B operand; in the dQ
    // kernel K, from the CTA's block of dQ's columns (the forward loads
    // only its block of V's).
    frags.mmaTransposedB(acc, p, vTile, ids.lane, mTiles, nTiles / 2, dTiles,
                         isDq ? outputColumn0() : Value());
    return acc;
  }
};

SmallVector<Value> MmaSyncQueryMajorEmitter::computeScores(QKOp op) {
  Value qValue = map.lookup(op.getQ());
  Value kTile = map.lookup(op.getK());
  // A fragments of Q from shared memory: the same addressing as emitLoadQ.
  Value qQuad = divu(ids.lane, 8);
  Value qRowInBlock = add(remu(ids.lane, 8), mul(remu(qQuad, 2), idx(8)));
  Value qColInBlock = mul(divu(qQuad, 2), idx(8));
  SmallVector<Value> s(mTiles * nTiles * 4, f32c(0.0f));
  // B fragments of K (keys x d, "col-major" = K rows): matrices (keys 0-7, d
  // 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15).
  Value quad = divu(ids.lane, 8);
  Value rowInBlock = add(remu(ids.lane, 8), mul(divu(quad, 2), idx(8)));
  Value colInBlock = mul(remu(quad, 2), idx(8));
  for (int64_t kt = 0, steps = contractTiles(op); kt < steps; ++kt) {
    SmallVector<SmallVector<Value, 4>> aFrags;
    for (int64_t mt = 0; mt < mTiles; ++mt) {
      Value row =
          add(add(mul(ids.warp, idx(16 * mTiles)), idx(mt * 16)), qRowInBlock);
      aFrags.push_back(
          frags.ldmatrix4(qValue, row, add(idx(kt * 16), qColInBlock), false));
    }
    for (int64_t np = 0; np < nTiles / 2; ++np) {
      auto r =
          frags.ldmatrix4(kTile, add(idx(np * 16), rowInBlock),
                          add(idx(kt * 16), colInBlock), /*transpose=*/false);
      for (int64_t mt = 0; mt < mTiles; ++mt) {
        ArrayRef<Value> a = aFrags[mt];
        for (int64_t half = 0; half < 2; ++half) {
          int64_t nt = 2 * np + half;
          MutableArrayRef<Value> c(&s[(mt * nTiles + nt) * 4], 4);
          auto d = frags.mma(a, {r[2 * half], r[2 * half + 1]}, c);
          std::copy(d.begin(), d.end(), c.begin());
        }
      }
    }
  }
  return s;
}

} // namespace

LogicalResult mlir::dualkv::emitMmaSyncQueryMajor(KernelOp kernel, OpBuilder &b,
                                                  gpu::GPUModuleOp gpuModule,
                                                  int64_t *sharedBytes) {
  return emitWith<MmaSyncQueryMajorEmitter>(kernel, b, gpuModule, sharedBytes);
}
