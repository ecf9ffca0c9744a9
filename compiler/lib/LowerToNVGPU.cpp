//===- LowerToNVGPU.cpp - dualkv-lower-to-nvgpu: the sm_80 schedule -------===//
//
// Turns a bound, tiled dualkv.kernel into a gpu.func. Query-major kernels
// (forward, deterministic dQ) are emitted here; the KV-major backward and the
// elementwise pre/post kernels in LowerBackward.cpp. Tile values are register
// fragments (Fragments.h); with MT = block_m / (16 * warps), NT = block_n / 8,
// DT = D / 8 their layouts are:
//   q_tile     memref<BM x (D+8) x E> in shared memory (A fragments via
//              ldmatrix); the deterministic dQ kernel holds dO the same way
//   kv_tile    memref<BN x (D+8) x E> in shared memory
//   scores     vector<MT*NT*4 x f32>  C fragments: rows g and g+8, cols 2t,
//   2t+1 probs      vector<MT*BN/16*4 x i32> A fragments of P (or dS), repacked
//   acc        vector<MT*DT*4 x f32>  C fragments of O (or dQ)
//   row_stats  vector<MT*2 x f32>     rows g and g+8 of each m16 block
//
// The forward's warpgroup schedule (wgmma: sm_90a, head_dim 128, MT = 1 with
// warps a multiple of 4; its default 128:128:8:2) keeps these register
// layouts: warp w holds rows 16w + g and 16w + g + 8, the m64nN accumulator
// layout of warpgroup w / 4. Q, K and V sit unpadded in the 128-byte swizzle
// (Fragments.h); S = Q Kᵀ reads both K-major (m64nBNk16, D / 16 k-steps) and
// O += P V takes P from registers and V N-major (m64n128k16, BN / 16
// k-steps); each waits for its own group.
//
//===----------------------------------------------------------------------===//
#include "Fragments.h"
#include "LowerBackward.h"
#include "WarpSpecialized/WarpSpecialized.h"

#include "dualkv/Compiler/Compiler.h"

#include "mlir/IR/IRMapping.h"
#include "llvm/ADT/TypeSwitch.h"

#include <limits>

namespace mlir::dualkv {
#define GEN_PASS_DEF_DUALKVLOWERTONVGPU
#include "dualkv/Compiler/Passes.h.inc"
} // namespace mlir::dualkv

using namespace mlir;
using namespace mlir::dualkv;

namespace {

/// Emits the gpu.func of one query-major kernel (fwd or bwd_dq). One method per
/// dualkv op.
class KernelEmitter : public FragmentBuilder {
public:
  KernelEmitter(KernelOp kernel, OpBuilder &b)
      : FragmentBuilder(b, kernel.getLoc(), kernel.getProblem()->getDtype(),
                        kernel.getProblem()->getHeadDim(),
                        kernel.getTiling()->getWarps()),
        kernel(kernel) {
    ProblemAttr p = *kernel.getProblem();
    TilingAttr t = *kernel.getTiling();
    blockM = t.getBlockM();
    blockN = t.getBlockN();
    groupSize = p.getNumQHeads() / p.getNumKvHeads();
    mTiles = blockM / (16 * warps);
    kTiles = headDim / 16;
    nTiles = blockN / 8;
    dTiles = headDim / 8;
    rowStride = headDim + kRowPad;
    stages = t.getStages();
    isDq = kernel.getKind() == KernelKind::bwd_dq;
    // sm_90a, head_dim 128, one m16 block a warp (block_m = 16 warps): the
    // warpgroup schedule (see the file comment).
    StringRef arch = *kernel.getArch();
    wgmma = hasWgmma(arch) && headDim == 128 && !isDq && mTiles == 1 &&
            blockM == 16 * warps && warps % 4 == 0 && blockN % 16 == 0 &&
            blockN <= 256;
    if (wgmma) {
      rowStride = headDim;
      wgmmaReadsTiles = true;
    }
  }

  /// Emits the gpu.func into `gpuModule`; returns failure with a diagnostic.
  LogicalResult emit(gpu::GPUModuleOp gpuModule);

  /// [Q][dO (bwd_dq)][K][V], rows padded.
  int64_t sharedBytes() const {
    // wgmma: 1 KB more, to align the buffers to the swizzle's 1024 bytes.
    return ((isDq ? 2 : 1) * blockM + 2 * blockN) * rowStride * 2 +
           (wgmma ? 1024 : 0);
  }

private:
  LogicalResult emitOp(Operation *op);
  LogicalResult emitLoadQ(LoadQOp op);
  LogicalResult emitInitAcc(InitAccOp op);
  LogicalResult emitInitStats(InitStatsOp op);
  LogicalResult emitKVLoop(KVLoopOp op);
  LogicalResult emitLoadKV(LoadKVOp op);
  LogicalResult emitQK(QKOp op);
  LogicalResult emitMask(MaskOp op);
  LogicalResult emitOnlineSoftmax(OnlineSoftmaxOp op);
  LogicalResult emitRescale(RescaleOp op);
  LogicalResult emitPV(PVOp op);
  LogicalResult emitStoreOutput(StoreOutputOp op);
  // The deterministic dQ kernel.
  LogicalResult emitLoadDout(LoadDoutOp op);
  LogicalResult emitLoadRowStats(LoadRowStatsOp op);
  LogicalResult emitRecomputeProbs(RecomputeProbsOp op);
  LogicalResult emitSoftmaxGrad(SoftmaxGradOp op);
  LogicalResult emitStoreDq(StoreDqOp op);
  /// The packed-token row of C-fragment row (mt, h) of this thread, relative
  /// to the segment start.
  Value fragmentRow(int64_t mt, int64_t h) {
    return add(add(qRow0, mul(warp, idx(16 * mTiles))),
               add(idx(mt * 16 + h * 8), g));
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
      stages;
  bool isDq = false, wgmma = false;
  // wgmma: the aligned shared base and, per KV iteration (an opaque copy, so
  // that LLVM keeps each k-step's descriptor as base + immediate instead of
  // hoisting them all into registers), the addresses of Q, K and V.
  Value smemAddr, qAddr, kAddr, vAddr;
  /// The scores of `op` as C fragments: wgmma, or mma.sync with ldmatrix.
  SmallVector<Value> qkWgmma();
  SmallVector<Value> qkMma(QKOp op);
  LogicalResult emitPVWgmma(PVOp op);
  // The prefetched key copy group of the current loop (stages >= 2), if any.
  Value prefetchedKey;

  // Kernel arguments (fwd: o, lse; bwd_dq: dout, dq, lse, delta).
  Value qPtr, kPtr, vPtr, oPtr, lsePtr, segPtr, doPtr, dqPtr, deltaPtr;
  Value qStrideT, qStrideH, kStrideT, kStrideH, vStrideT, vStrideH, oStrideT,
      oStrideH, lseStrideH, scaleLog2, doStrideT, doStrideH, deltaStrideH,
      scale;
  // Per-CTA values.
  Value head, kvHead;
  Value segStart, segLen, sharedStart, sharedLen, qRow0;
  Value kBuf, vBuf, qBuf, doBuf;
  IRMapping map;
};

LogicalResult KernelEmitter::emitLoadQ(LoadQOp op) {
  Value group = copyTile(qBuf, qPtr, blockM, segStart, qRow0, segLen, qStrideT,
                         mul(head, qStrideH), /*predicated=*/true, Value(),
                         /*swizzled=*/wgmma);
  waitAll(group);
  // Q stays in shared memory for the whole kernel: its A fragments are re-read
  // per k-step, which keeps ~32-64 registers a thread free for the accumulator.
  map.map(op.getResult(), qBuf);
  return success();
}

LogicalResult KernelEmitter::emitInitAcc(InitAccOp op) {
  map.map(op.getResult(), splat(mTiles * dTiles * 4, 0.0f));
  return success();
}

LogicalResult KernelEmitter::emitInitStats(InitStatsOp op) {
  map.map(op.getMax(),
          splat(mTiles * 2, -std::numeric_limits<float>::infinity()));
  map.map(op.getSum(), splat(mTiles * 2, 0.0f));
  return success();
}

LogicalResult KernelEmitter::emitKVLoop(KVLoopOp op) {
  Value lb, ub;
  switch (op.getPart()) {
  case LoopPart::all:
    return op.emitOpError() << "is not tiled: run dualkv-tile-regions first";
  case LoopPart::full:
    lb = idx(0);
    ub = op.getRegion() == KVRegion::shared ? divu(sharedLen, blockN)
                                            : divu(qRow0, blockN);
    break;
  case LoopPart::tail:
    lb = divu(sharedLen, blockN);
    ub = ceilDiv(sharedLen, blockN);
    break;
  case LoopPart::diagonal: {
    lb = divu(qRow0, blockN);
    Value qEnd = add(qRow0, idx(blockM));
    Value end =
        select(cmp(arith::CmpIPredicate::ult, qEnd, segLen), qEnd, segLen);
    ub = ceilDiv(end, blockN);
    break;
  }
  }
  SmallVector<Value> inits;
  for (Value v : op.getInits())
    inits.push_back(map.lookup(v));
  loopUpper = ub;
  prefetchedKey = Value();
  if (stages >= 2)
    prefetchedKey =
        issueKeyCopy(op, lb, cmp(arith::CmpIPredicate::ult, lb, ub));
  auto loop = scf::ForOp::create(b, loc, lb, ub, idx(1), inits);
  {
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(loop.getBody());
    map.map(op.getTileIndex(), loop.getInductionVar());
    for (auto [from, to] :
         llvm::zip(op.getRegionIterArgs(), loop.getRegionIterArgs()))
      map.map(from, to);
    pending.clear();
    if (wgmma) {
      Value base = opaque(smemAddr);
      int64_t kvOffset = blockM * rowStride * 2;
      qAddr = base;
      kAddr = add(base, idx(kvOffset));
      vAddr = add(base, idx(kvOffset + blockN * rowStride * 2));
    }
    for (Operation &inner : op.getBody().front().without_terminator())
      if (failed(emitOp(&inner)))
        return failure();
    // Every warp must be done reading this iteration's tiles before the next
    // iteration's copies overwrite them.
    gpu::BarrierOp::create(b, loc);
    SmallVector<Value> yielded;
    for (Value v : op.getBody().front().getTerminator()->getOperands())
      yielded.push_back(map.lookup(v));
    scf::YieldOp::create(b, loc, yielded);
  }
  for (auto [from, to] : llvm::zip(op.getResults(), loop.getResults()))
    map.map(from, to);
  if (prefetchedKey) {
    // The last iteration's prefetch (zero-filled) must land before the next
    // loop's prologue writes the same buffer.
    nvgpu::DeviceAsyncWaitOp::create(b, loc, prefetchedKey,
                                     b.getI32IntegerAttr(0));
    prefetchedKey = Value();
  }
  return success();
}

LogicalResult KernelEmitter::emitLoadKV(LoadKVOp op) {
  auto loop = op->getParentOfType<KVLoopOp>();
  bool shared = loop.getRegion() == KVRegion::shared;
  bool isKey = op.getOperand() == KVOperand::key;
  Value buf = isKey ? kBuf : vBuf;
  if (isKey && prefetchedKey) {
    // Issued by the loop prologue or the previous iteration; it is the oldest
    // group.
    pending.insert(pending.begin(), {op.getResult(), prefetchedKey});
    map.map(op.getResult(), buf);
    return success();
  }
  Value first = mul(map.lookup(op.getTile()), idx(blockN));
  Value group = copyTile(
      buf, isKey ? kPtr : vPtr, blockN, shared ? sharedStart : segStart, first,
      shared ? sharedLen : segLen, isKey ? kStrideT : vStrideT,
      mul(kvHead, isKey ? kStrideH : vStrideH),
      /*predicated=*/loop.getPart() != LoopPart::full, Value(),
      /*swizzled=*/wgmma);
  pending.push_back({op.getResult(), group});
  map.map(op.getResult(), buf);
  return success();
}

SmallVector<Value> KernelEmitter::qkWgmma() {
  // S = Q Kᵀ: warpgroup w owns query rows 64w..64w+63; both operands K-major
  // in the swizzled tiles.
  Value aDesc =
      wgmmaDesc(add(qAddr, mul(divu(warp, 4), idx(64 * 128))), 16, 1024);
  Value bDesc = wgmmaDesc(kAddr, 16, 1024);
  wgmmaFence();
  SmallVector<Value> s =
      wgmmaOverHeadDim({}, blockN, aDesc, blockM, bDesc, blockN);
  wgmmaCommit();
  wgmmaWait(0, s);
  return s;
}

LogicalResult KernelEmitter::emitPVWgmma(PVOp op) {
  // O += P V: P (the packed probabilities) from registers as A, V N-major
  // from its swizzled tile, block_n / 16 k-steps of 16 keys.
  SmallVector<Value> p = unpack(map.lookup(op.getProbs()));
  SmallVector<Value> acc = unpack(map.lookup(op.getAcc()));
  Value bDesc = wgmmaDesc(vAddr, blockN * 128, 1024);
  wgmmaFence();
  acc = wgmmaRegsA(acc, p, bDesc);
  wgmmaCommit();
  wgmmaWait(0, acc);
  map.map(op.getResult(), pack(acc));
  return success();
}

LogicalResult KernelEmitter::emitQK(QKOp op) {
  waitFor(op.getK());
  map.map(op.getResult(), pack(wgmma ? qkWgmma() : qkMma(op)));
  // The dQ kernel reads K again (dS K) after its scores: no key prefetch there.
  if (stages >= 2 && !isDq)
    prefetchNextKey(op);
  return success();
}

SmallVector<Value> KernelEmitter::qkMma(QKOp op) {
  Value qValue = map.lookup(op.getQ());
  Value kTile = map.lookup(op.getK());
  // A fragments of Q from shared memory: the same addressing as emitLoadQ.
  Value qQuad = divu(lane, 8);
  Value qRowInBlock = add(remu(lane, 8), mul(remu(qQuad, 2), idx(8)));
  Value qColInBlock = mul(divu(qQuad, 2), idx(8));
  SmallVector<Value> s(mTiles * nTiles * 4, f32c(0.0f));
  // B fragments of K (keys x d, "col-major" = K rows): matrices (keys 0-7, d
  // 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15).
  Value quad = divu(lane, 8);
  Value rowInBlock = add(remu(lane, 8), mul(divu(quad, 2), idx(8)));
  Value colInBlock = mul(remu(quad, 2), idx(8));
  for (int64_t kt = 0; kt < kTiles; ++kt) {
    SmallVector<SmallVector<Value, 4>> aFrags;
    for (int64_t mt = 0; mt < mTiles; ++mt) {
      Value row =
          add(add(mul(warp, idx(16 * mTiles)), idx(mt * 16)), qRowInBlock);
      aFrags.push_back(
          ldmatrix4(qValue, row, add(idx(kt * 16), qColInBlock), false));
    }
    for (int64_t np = 0; np < nTiles / 2; ++np) {
      auto r = ldmatrix4(kTile, add(idx(np * 16), rowInBlock),
                         add(idx(kt * 16), colInBlock), /*transpose=*/false);
      for (int64_t mt = 0; mt < mTiles; ++mt) {
        ArrayRef<Value> a = aFrags[mt];
        for (int64_t half = 0; half < 2; ++half) {
          int64_t nt = 2 * np + half;
          MutableArrayRef<Value> c(&s[(mt * nTiles + nt) * 4], 4);
          auto d = mma(a, {r[2 * half], r[2 * half + 1]}, c);
          std::copy(d.begin(), d.end(), c.begin());
        }
      }
    }
  }
  return s;
}

void KernelEmitter::prefetchNextKey(QKOp op) {
  // Every warp is done with this key tile: load the next one while softmax and
  // P·V run.
  auto loop = op->getParentOfType<KVLoopOp>();
  gpu::BarrierOp::create(b, loc);
  Value next = add(map.lookup(loop.getTileIndex()), idx(1));
  Value group =
      issueKeyCopy(loop, next, cmp(arith::CmpIPredicate::ult, next, loopUpper));
  pending.push_back({Value(), group});
}

Value KernelEmitter::issueKeyCopy(KVLoopOp loop, Value tile, Value tileValid) {
  bool shared = loop.getRegion() == KVRegion::shared;
  // Every row of a full tile is inside its region: only the tile index needs a
  // check.
  Value limit = shared ? sharedLen : segLen;
  if (loop.getPart() == LoopPart::full)
    limit = Value();
  return copyTile(kBuf, kPtr, blockN, shared ? sharedStart : segStart,
                  mul(tile, idx(blockN)), limit, kStrideT,
                  mul(kvHead, kStrideH), /*predicated=*/true, tileValid,
                  /*swizzled=*/wgmma);
}

LogicalResult KernelEmitter::emitMask(MaskOp op) {
  SmallVector<Value> s = unpack(map.lookup(op.getScores()));
  Value keyBase = mul(map.lookup(op.getTile()), idx(blockN));
  Value ninf = f32c(-std::numeric_limits<float>::infinity());
  for (int64_t mt = 0; mt < mTiles; ++mt)
    for (int64_t nt = 0; nt < nTiles; ++nt)
      for (int64_t c = 0; c < 4; ++c) {
        Value key = add(keyBase, add(idx(nt * 8 + (c % 2)), mul(t, idx(2))));
        Value drop;
        if (op.getKind() == MaskKind::causal) {
          Value row = add(add(qRow0, mul(warp, idx(16 * mTiles))),
                          add(idx(mt * 16 + (c / 2) * 8), g));
          drop = cmp(arith::CmpIPredicate::ugt, key, row);
        } else {
          drop = cmp(arith::CmpIPredicate::uge, key, sharedLen);
        }
        Value &v = s[(mt * nTiles + nt) * 4 + c];
        v = select(drop, ninf, v);
      }
  map.map(op.getResult(), pack(s));
  return success();
}

LogicalResult KernelEmitter::emitOnlineSoftmax(OnlineSoftmaxOp op) {
  SmallVector<Value> s = unpack(map.lookup(op.getScores()));
  SmallVector<Value> mOld = unpack(map.lookup(op.getMax()));
  SmallVector<Value> lOld = unpack(map.lookup(op.getSum()));
  SmallVector<Value> mNew(mOld.size()), lNew(lOld.size()), alpha(mOld.size());
  SmallVector<Value> p(s.size());
  Value ninf = f32c(-std::numeric_limits<float>::infinity());
  for (int64_t mt = 0; mt < mTiles; ++mt)
    for (int64_t h = 0; h < 2; ++h) {
      int64_t r = mt * 2 + h;
      auto at = [&](int64_t nt, int64_t e) -> Value & {
        return s[(mt * nTiles + nt) * 4 + h * 2 + e];
      };
      Value mx = at(0, 0);
      for (int64_t nt = 0; nt < nTiles; ++nt)
        for (int64_t e = 0; e < 2; ++e)
          if (nt || e)
            mx = arith::MaximumFOp::create(b, loc, mx, at(nt, e));
      // The four lanes of a quad hold the same row.
      mx = arith::MaximumFOp::create(b, loc, mx, shuffleXor(mx, 1));
      mx = arith::MaximumFOp::create(b, loc, mx, shuffleXor(mx, 2));
      Value scaled = arith::MulFOp::create(b, loc, mx, scaleLog2);
      mNew[r] = arith::MaximumFOp::create(b, loc, mOld[r], scaled);
      // A row with no allowed key yet keeps max -inf; subtract 0 so exp2 gives
      // 0, not NaN.
      Value isNinf = arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OEQ,
                                           mNew[r], ninf);
      Value mUse = select(isNinf, f32c(0.0f), mNew[r]);
      alpha[r] = exp2(arith::SubFOp::create(b, loc, mOld[r], mUse));
      Value negM = arith::NegFOp::create(b, loc, mUse);
      Value rowSum = f32c(0.0f);
      for (int64_t nt = 0; nt < nTiles; ++nt)
        for (int64_t e = 0; e < 2; ++e) {
          Value x = LLVM::FMAOp::create(b, loc, at(nt, e), scaleLog2, negM);
          Value pe = exp2(x);
          p[(mt * nTiles + nt) * 4 + h * 2 + e] = pe;
          rowSum = arith::AddFOp::create(b, loc, rowSum, pe);
        }
      // The running sum stays a per-lane partial; store_output reduces the
      // quad.
      lNew[r] = LLVM::FMAOp::create(b, loc, lOld[r], alpha[r], rowSum);
    }
  map.map(op.getProbs(), packAFragments(p));
  map.map(op.getNewMax(), pack(mNew));
  map.map(op.getNewSum(), pack(lNew));
  map.map(op.getAlpha(), pack(alpha));
  return success();
}

Value KernelEmitter::packAFragments(ArrayRef<Value> p) {
  return pack(FragmentBuilder::packAFragments(p, mTiles, nTiles));
}

LogicalResult KernelEmitter::emitLoadDout(LoadDoutOp op) {
  Value group = copyTile(doBuf, doPtr, blockM, segStart, qRow0, segLen,
                         doStrideT, mul(head, doStrideH), /*predicated=*/true);
  waitAll(group);
  map.map(op.getResult(), doBuf);
  return success();
}

LogicalResult KernelEmitter::emitLoadRowStats(LoadRowStatsOp op) {
  bool isLse = op.getStat() == StatKind::lse;
  Value ptr = isLse ? lsePtr : deltaPtr;
  Value headBase = mul(head, isLse ? lseStrideH : deltaStrideH);
  // Rows past the segment: LSE +inf (so P = 0), Delta 0.
  Value fill = f32c(isLse ? std::numeric_limits<float>::infinity() : 0.0f);
  SmallVector<Value> out;
  for (int64_t mt = 0; mt < mTiles; ++mt)
    for (int64_t h = 0; h < 2; ++h) {
      Value row = fragmentRow(mt, h);
      Value valid = cmp(arith::CmpIPredicate::ult, row, segLen);
      Value at = add(headBase, add(segStart, select(valid, row, idx(0))));
      Value v = memref::LoadOp::create(b, loc, ptr, ValueRange{at});
      // LSE moves to the log2 domain of the kernels' exp2.
      if (isLse)
        v = arith::MulFOp::create(b, loc, v, f32c(kLog2e));
      out.push_back(select(valid, v, fill));
    }
  map.map(op.getResult(), pack(out));
  return success();
}

LogicalResult KernelEmitter::emitRecomputeProbs(RecomputeProbsOp op) {
  SmallVector<Value> s = unpack(map.lookup(op.getScores()));
  SmallVector<Value> lse = unpack(map.lookup(op.getLse()));
  for (int64_t mt = 0; mt < mTiles; ++mt)
    for (int64_t nt = 0; nt < nTiles; ++nt)
      for (int64_t c = 0; c < 4; ++c) {
        Value &v = s[(mt * nTiles + nt) * 4 + c];
        Value negLse = arith::NegFOp::create(b, loc, lse[mt * 2 + c / 2]);
        v = exp2(LLVM::FMAOp::create(b, loc, v, scaleLog2, negLse));
      }
  map.map(op.getResult(), pack(s));
  return success();
}

LogicalResult KernelEmitter::emitSoftmaxGrad(SoftmaxGradOp op) {
  SmallVector<Value> p = unpack(map.lookup(op.getProbs()));
  SmallVector<Value> dp = unpack(map.lookup(op.getDprobs()));
  SmallVector<Value> delta = unpack(map.lookup(op.getDelta()));
  for (int64_t mt = 0; mt < mTiles; ++mt)
    for (int64_t nt = 0; nt < nTiles; ++nt)
      for (int64_t c = 0; c < 4; ++c) {
        int64_t i = (mt * nTiles + nt) * 4 + c;
        Value diff =
            arith::SubFOp::create(b, loc, dp[i], delta[mt * 2 + c / 2]);
        Value ps = arith::MulFOp::create(b, loc, p[i], scale);
        p[i] = arith::MulFOp::create(b, loc, ps, diff);
      }
  map.map(op.getResult(), packAFragments(p));
  return success();
}

LogicalResult KernelEmitter::emitStoreDq(StoreDqOp op) {
  SmallVector<Value> acc = unpack(map.lookup(op.getAcc()));
  for (int64_t mt = 0; mt < mTiles; ++mt)
    for (int64_t h = 0; h < 2; ++h) {
      Value row = fragmentRow(mt, h);
      auto inRange =
          scf::IfOp::create(b, loc, cmp(arith::CmpIPredicate::ult, row, segLen),
                            /*withElseRegion=*/false);
      OpBuilder::InsertionGuard guard(b);
      b.setInsertionPointToStart(inRange.thenBlock());
      Value rowBase =
          add(mul(add(segStart, row), oStrideT), mul(head, oStrideH));
      for (int64_t dt = 0; dt < dTiles; ++dt) {
        Value narrow = arith::TruncFOp::create(
            b, loc, VectorType::get({2}, elemType),
            pack({acc[(mt * dTiles + dt) * 4 + h * 2],
                  acc[(mt * dTiles + dt) * 4 + h * 2 + 1]}));
        Value col = add(idx(dt * 8), mul(t, idx(2)));
        vector::StoreOp::create(b, loc, narrow, dqPtr,
                                ValueRange{add(rowBase, col)});
      }
    }
  return success();
}

LogicalResult KernelEmitter::emitRescale(RescaleOp op) {
  SmallVector<Value> acc = unpack(map.lookup(op.getAcc()));
  SmallVector<Value> alpha = unpack(map.lookup(op.getAlpha()));
  for (int64_t mt = 0; mt < mTiles; ++mt)
    for (int64_t dt = 0; dt < dTiles; ++dt)
      for (int64_t c = 0; c < 4; ++c) {
        Value &v = acc[(mt * dTiles + dt) * 4 + c];
        v = arith::MulFOp::create(b, loc, v, alpha[mt * 2 + c / 2]);
      }
  map.map(op.getResult(), pack(acc));
  return success();
}

LogicalResult KernelEmitter::emitPV(PVOp op) {
  waitFor(op.getV());
  if (wgmma)
    return emitPVWgmma(op);
  SmallVector<Value> p = unpack(map.lookup(op.getProbs()));
  SmallVector<Value> acc = unpack(map.lookup(op.getAcc()));
  // V (keys x d, row-major in shared memory) is the B operand.
  mmaTransposedB(acc, p, map.lookup(op.getV()), lane, mTiles, nTiles / 2,
                 dTiles);
  map.map(op.getResult(), pack(acc));
  return success();
}

LogicalResult KernelEmitter::emitStoreOutput(StoreOutputOp op) {
  SmallVector<Value> acc = unpack(map.lookup(op.getAcc()));
  SmallVector<Value> m = unpack(map.lookup(op.getMax()));
  SmallVector<Value> l = unpack(map.lookup(op.getSum()));
  Value ln2 = f32c(0.6931471805599453f);
  for (int64_t mt = 0; mt < mTiles; ++mt)
    for (int64_t h = 0; h < 2; ++h) {
      int64_t r = mt * 2 + h;
      Value sum = l[r];
      sum = arith::AddFOp::create(b, loc, sum, shuffleXor(sum, 1));
      sum = arith::AddFOp::create(b, loc, sum, shuffleXor(sum, 2));
      Value inv = arith::DivFOp::create(b, loc, f32c(1.0f), sum);
      Value row = add(add(qRow0, mul(warp, idx(16 * mTiles))),
                      add(idx(mt * 16 + h * 8), g));
      auto inRange =
          scf::IfOp::create(b, loc, cmp(arith::CmpIPredicate::ult, row, segLen),
                            /*withElseRegion=*/false);
      OpBuilder::InsertionGuard guard(b);
      b.setInsertionPointToStart(inRange.thenBlock());
      Value token = add(segStart, row);
      Value rowBase = add(mul(token, oStrideT), mul(head, oStrideH));
      for (int64_t dt = 0; dt < dTiles; ++dt) {
        Value lo = arith::MulFOp::create(
            b, loc, acc[(mt * dTiles + dt) * 4 + h * 2], inv);
        Value hi = arith::MulFOp::create(
            b, loc, acc[(mt * dTiles + dt) * 4 + h * 2 + 1], inv);
        Value narrow = arith::TruncFOp::create(
            b, loc, VectorType::get({2}, elemType), pack({lo, hi}));
        Value col = add(idx(dt * 8), mul(t, idx(2)));
        vector::StoreOp::create(b, loc, narrow, oPtr,
                                ValueRange{add(rowBase, col)});
      }
      auto lead =
          scf::IfOp::create(b, loc, cmp(arith::CmpIPredicate::eq, t, idx(0)),
                            /*withElseRegion=*/false);
      b.setInsertionPointToStart(lead.thenBlock());
      // LSE in natural log: m is kept in the log2 domain of scaled scores.
      Value lse = arith::MulFOp::create(
          b, loc, arith::AddFOp::create(b, loc, m[r], log2(sum)), ln2);
      memref::StoreOp::create(b, loc, lse, lsePtr,
                              ValueRange{add(mul(head, lseStrideH), token)});
    }
  return success();
}

LogicalResult KernelEmitter::emitOp(Operation *op) {
  return llvm::TypeSwitch<Operation *, LogicalResult>(op)
      .Case([&](LoadQOp o) { return emitLoadQ(o); })
      .Case([&](InitAccOp o) { return emitInitAcc(o); })
      .Case([&](InitStatsOp o) { return emitInitStats(o); })
      .Case([&](KVLoopOp o) { return emitKVLoop(o); })
      .Case([&](LoadKVOp o) { return emitLoadKV(o); })
      .Case([&](QKOp o) { return emitQK(o); })
      .Case([&](MaskOp o) { return emitMask(o); })
      .Case([&](OnlineSoftmaxOp o) { return emitOnlineSoftmax(o); })
      .Case([&](RescaleOp o) { return emitRescale(o); })
      .Case([&](PVOp o) { return emitPV(o); })
      .Case([&](StoreOutputOp o) { return emitStoreOutput(o); })
      .Case([&](LoadDoutOp o) { return emitLoadDout(o); })
      .Case([&](LoadRowStatsOp o) { return emitLoadRowStats(o); })
      .Case([&](RecomputeProbsOp o) { return emitRecomputeProbs(o); })
      .Case([&](SoftmaxGradOp o) { return emitSoftmaxGrad(o); })
      .Case([&](StoreDqOp o) { return emitStoreDq(o); })
      .Default([&](Operation *o) {
        return o->emitOpError() << "has no sm_80 lowering";
      });
}

LogicalResult KernelEmitter::emit(gpu::GPUModuleOp gpuModule) {
  MLIRContext *ctx = b.getContext();
  auto workgroup =
      gpu::AddressSpaceAttr::get(ctx, gpu::AddressSpace::Workgroup);
  Type i64 = b.getI64Type(), f32 = b.getF32Type();
  Type elem = gmem(elemType), f32p = gmem(f32), i32p = gmem(b.getI32Type());
  // The order is the ABI the runtime launches (docs/backward-abi.md).
  SmallVector<Type> args;
  if (isDq) {
    args = {elem, elem, elem, elem, elem, f32p, f32p, i32p};
    args.append(12, i64);
    args.append({f32, f32});
  } else {
    args = {elem, elem, elem, elem, f32p, i32p};
    args.append(9, i64);
    args.push_back(f32);
  }
  Block &entry = createFunc(gpuModule, kernel.getSymName(), args);
  auto arg = [&](unsigned i) { return entry.getArgument(i); };
  auto idxArg = [&](unsigned i) { return indexArg(entry, i); };
  if (isDq) {
    // q, k, v, dout, dq, lse, delta, segs, 12 strides, scale, scale_log2. dq
    // takes the output's place (oPtr, oStride*).
    qPtr = arg(0), kPtr = arg(1), vPtr = arg(2), doPtr = arg(3), oPtr = arg(4),
    lsePtr = arg(5), deltaPtr = arg(6), segPtr = arg(7);
    qStrideT = idxArg(8), qStrideH = idxArg(9), kStrideT = idxArg(10),
    kStrideH = idxArg(11), vStrideT = idxArg(12), vStrideH = idxArg(13),
    doStrideT = idxArg(14), doStrideH = idxArg(15), oStrideT = idxArg(16),
    oStrideH = idxArg(17), lseStrideH = idxArg(18), deltaStrideH = idxArg(19);
    scale = arg(20);
    scaleLog2 = arg(21);
    dqPtr = oPtr;
  } else {
    qPtr = arg(0), kPtr = arg(1), vPtr = arg(2), oPtr = arg(3), lsePtr = arg(4),
    segPtr = arg(5);
    qStrideT = idxArg(6), qStrideH = idxArg(7), kStrideT = idxArg(8),
    kStrideH = idxArg(9), vStrideT = idxArg(10), vStrideH = idxArg(11),
    oStrideT = idxArg(12), oStrideH = idxArg(13), lseStrideH = idxArg(14);
    scaleLog2 = arg(15);
  }

  emitThreadIds();
  Value tileId = gpu::BlockIdOp::create(b, loc, gpu::Dimension::x);
  Value seg = gpu::BlockIdOp::create(b, loc, gpu::Dimension::y);
  head = gpu::BlockIdOp::create(b, loc, gpu::Dimension::z);
  kvHead = divu(head, groupSize);
  auto segField = [&](int64_t f) {
    Value v = memref::LoadOp::create(b, loc, segPtr,
                                     ValueRange{add(mul(seg, idx(4)), idx(f))});
    return toIndex(v);
  };
  segStart = segField(0), segLen = segField(1), sharedStart = segField(2),
  sharedLen = segField(3);

  // The grid covers the longest segment; heaviest (last) tiles go first.
  Value tilesHere = ceilDiv(segLen, blockM);
  auto live = scf::IfOp::create(
      b, loc, cmp(arith::CmpIPredicate::ult, tileId, tilesHere),
      /*withElseRegion=*/false);
  b.setInsertionPointToStart(live.thenBlock());
  Value m = arith::SubIOp::create(
      b, loc, arith::SubIOp::create(b, loc, tilesHere, idx(1)), tileId);
  qRow0 = mul(m, idx(blockM));

  auto bytes = MemRefType::get({ShapedType::kDynamic}, b.getI8Type(),
                               MemRefLayoutAttrInterface(), workgroup);
  Value smem = gpu::DynamicSharedMemoryOp::create(b, loc, bytes);
  // [Q: block_m rows][dO: block_m rows, bwd_dq][K: block_n rows][V: block_n
  // rows], each row padded.
  int64_t qBytes = blockM * rowStride * 2;
  int64_t kvOffset = (isDq ? 2 : 1) * qBytes;
  if (wgmma) {
    // Unpadded swizzled tiles from a 1024-byte aligned base.
    smemAddr = alignToSwizzle(smem, sharedBytes());
    qBuf = swizzledTile(smem, 0, blockM);
    kBuf = swizzledTile(smem, kvOffset, blockN);
    vBuf = swizzledTile(smem, kvOffset + blockN * rowStride * 2, blockN);
  } else {
    qBuf = sharedTile(smem, 0, blockM);
    if (isDq)
      doBuf = sharedTile(smem, qBytes, blockM);
    kBuf = sharedTile(smem, kvOffset, blockN);
    vBuf = sharedTile(smem, kvOffset + blockN * rowStride * 2, blockN);
  }

  for (Operation &op : kernel.getBody().front())
    if (failed(emitOp(&op)))
      return failure();

  b.setInsertionPointToEnd(&entry);
  gpu::ReturnOp::create(b, loc);
  return success();
}

/// The same rule as the runtime's (dualkv::usesWarpSpecializedForward).
bool usesWarpSpecialized(KernelOp kernel) {
  ::dualkv::KernelSpec spec;
  spec.kind = ::dualkv::KernelKind::Fwd;
  spec.arch = kernel.getArch()->str();
  spec.headDim = static_cast<int>(kernel.getProblem()->getHeadDim());
  TilingAttr t = *kernel.getTiling();
  spec.tiling = {
      static_cast<int>(t.getBlockM()), static_cast<int>(t.getBlockN()),
      static_cast<int>(t.getWarps()), static_cast<int>(t.getStages())};
  return ::dualkv::usesWarpSpecializedForward(spec);
}

struct LowerToNVGPUPass
    : public mlir::dualkv::impl::DualKVLowerToNVGPUBase<LowerToNVGPUPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    SmallVector<KernelOp> kernels(module.getOps<KernelOp>());
    if (kernels.empty())
      return;
    OpBuilder b(module.getContext());
    module->setAttr(gpu::GPUDialect::getContainerModuleAttrName(),
                    b.getUnitAttr());
    b.setInsertionPointToEnd(module.getBody());
    auto gpuModule =
        gpu::GPUModuleOp::create(b, module.getLoc(), "dualkv_kernels");
    for (KernelOp kernel : kernels) {
      if (!kernel.isBound()) {
        kernel.emitOpError()
            << "is not bound to a spec: run dualkv-bind-spec first";
        return signalPassFailure();
      }
      int64_t sharedBytes = 0;
      KernelKind kind = kernel.getKind();
      if (kind == KernelKind::fwd && usesWarpSpecialized(kernel)) {
        if (failed(
                emitWarpSpecializedForward(kernel, b, gpuModule, &sharedBytes)))
          return signalPassFailure();
      } else if (kind == KernelKind::fwd || kind == KernelKind::bwd_dq) {
        KernelEmitter emitter(kernel, b);
        if (failed(emitter.emit(gpuModule)))
          return signalPassFailure();
        sharedBytes = emitter.sharedBytes();
      } else if (failed(
                     emitBackwardKernel(kernel, b, gpuModule, &sharedBytes))) {
        return signalPassFailure();
      }
      // The launch reads these off the IR (and the runtime off KernelInfo).
      auto func = gpuModule.lookupSymbol<gpu::GPUFuncOp>(kernel.getSymName());
      func->setAttr("dualkv.shared_bytes", b.getI64IntegerAttr(sharedBytes));
      func->setAttr("dualkv.block_m",
                    b.getI64IntegerAttr(kernel.getTiling()->getBlockM()));
      kernel.erase();
    }
  }
};

} // namespace
