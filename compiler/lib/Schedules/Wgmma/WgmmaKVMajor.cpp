//===- WgmmaKVMajor.cpp - the warpgroup schedule of the KV-major backward -===//
//
// sm_90a, BM = 128, BN = 64, 8 warps, D = 128 (the default there, for bwd and
// bwd_kv). It keeps the one-m16-block register layout of
// Lowering/Skeletons/KVMajorSkeleton.h (MT = 1: warp w holds keys 16w + g and
// 16w + g + 8, the wgmma m64nN accumulator layout of warpgroup w / 4) and moves
// every product to wgmma.mma_async: K, V, Q and dO sit in shared memory in the
// 128-byte swizzle (SharedTiles.h), no padding. Sᵀ = K Qᵀ and dPᵀ = V dOᵀ read
// both operands K-major from shared memory (m64n64k16, 8 k-steps); dV += Pᵀ dO
// and dK += dSᵀ Q take A from registers (Pᵀ, dSᵀ packed as for mma.sync) and B
// N-major from the tile (m64n128k16, 4 k-steps), committed but not waited for
// until the next product needs its registers; dQ = dS K reads dSᵀ (stored
// swizzled, keys x queries) M-major and K N-major, each warpgroup 64 queries x
// 64 columns. cp.async and st.shared writes reach wgmma through
// fence.proxy.async before the barrier that publishes them.
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
#include "Schedules/Wgmma/WgmmaKVMajor.h"
#include "Lowering/ScheduleEmitters.h"
#include "Schedules/Wgmma/Wgmma.h"

using namespace mlir;
using namespace mlir::dualkv;

void WgmmaKVMajorEmitter::waitWgmma(Value result,
                                    MutableArrayRef<Value> newest) {
  size_t done = inFlight.size();
  if (result)
    done = llvm::find_if(inFlight, [&](auto &f) { return f.first == result; }) -
           inFlight.begin() + 1;
  SmallVector<Value> regs(newest.begin(), newest.end());
  for (size_t i = 0; i < done; ++i)
    regs.append(inFlight[i].second);
  wg.wait(int64_t(inFlight.size() - done), regs);
  std::copy(regs.begin(), regs.begin() + newest.size(), newest.begin());
  size_t at = newest.size();
  for (size_t i = 0; i < done; ++i) {
    ArrayRef<Value> out(&regs[at], inFlight[i].second.size());
    map.map(inFlight[i].first, pack(out));
    at += out.size();
  }
  inFlight.erase(inFlight.begin(), inFlight.begin() + done);
}

void WgmmaKVMajorEmitter::issueQKTWgmma(QKTOp op) {
  // Each warpgroup 64 keys x BN queries, both operands K-major in shared
  // memory.
  Value aDesc = wg.desc(
      add(addrOf(map.lookup(op.getKv())), mul(warpGroup, idx(64 * 128))), 16,
      1024);
  Value bDesc = wg.desc(addrOf(map.lookup(op.getQ())), 16, 1024);
  commitWgmma(op.getResult(),
              wg.overHeadDim({}, blockN, aDesc, blockM, bDesc, blockN));
}

LogicalResult WgmmaKVMajorEmitter::emitQKT(QKTOp op) {
  // Sᵀ = K Qᵀ issues dPᵀ = V dOᵀ (the tile's next qk_t) right behind it, so
  // the tensor cores compute dPᵀ while the warps turn Sᵀ into Pᵀ.
  bool issued = llvm::any_of(
      inFlight, [&](auto &f) { return f.first == op.getResult(); });
  if (!issued) {
    waitFor(map.lookup(op.getQ()));
    wg.fence();
    issueQKTWgmma(op);
    for (Operation *next = op->getNextNode(); next; next = next->getNextNode())
      if (auto dp = dyn_cast<QKTOp>(next)) {
        issueQKTWgmma(dp);
        break;
      }
  }
  waitWgmma(op.getResult());
  return success();
}

LogicalResult WgmmaKVMajorEmitter::emitAccumulate(AccumulateOp op) {
  // acc (keys x D) += Xᵀ Y: X (Pᵀ or dSᵀ) from registers as A; Y (dO or Q,
  // queries x D) N-major from shared memory, BN / 16 k-steps of 16 rows.
  // Committed, not waited for: the next wait takes the accumulators along.
  Value y = map.lookup(op.getY());
  waitFor(y);
  SmallVector<Value> x = unpack(map.lookup(op.getX()));
  SmallVector<Value> acc = unpack(map.lookup(op.getAcc()));
  SmallVector<Value> xa = frags.packAFragments(x, 1, nTiles);
  Value bDesc = wg.desc(addrOf(y), blockN * 128, 1024);
  wg.fence();
  commitWgmma(op.getResult(), wg.regsA(acc, xa, bDesc));
  return success();
}

void WgmmaKVMajorEmitter::storeDsT(ArrayRef<Value> ds) {
  // dSᵀ (keys x queries) to shared memory in the swizzled layout: thread
  // (g, t) of warp w holds keys 16w + g (+ 8), queries 8nt + 2t (+ 1); key %
  // 8 = g.
  for (int64_t nt = 0; nt < nTiles; ++nt)
    for (int64_t h = 0; h < 2; ++h) {
      int64_t i = nt * 4 + h * 2;
      Value narrow = arith::TruncFOp::create(
          b, loc, VectorType::get({2}, elemType), pack({ds[i], ds[i + 1]}));
      Value row = add(mul(ids.warp, idx(16)), add(idx(h * 8), aG));
      Value chunk = arith::XOrIOp::create(b, loc, idx(nt), aG);
      Value col = add(mul(chunk, idx(8)), mul(aT, idx(2)));
      vector::StoreOp::create(b, loc, narrow, dsBuf, ValueRange{row, col});
    }
}

SmallVector<Value> WgmmaKVMajorEmitter::dqWgmma(ArrayRef<Value> ds) {
  beforeDsStore();
  storeDsT(ds);
  proxyFence(*this);
  copies.syncThreads();
  // dQ (queries x D) = dS (queries x keys, M-major: dSᵀ) K (keys x D,
  // N-major); warpgroup w computes columns 64w..64w+63, BM / 16 k-steps of 16
  // keys.
  Value aDesc = wg.desc(dsAddr, blockM * 128, 1024);
  Value bDesc = wg.desc(add(kAddr, mul(warpGroup, idx(blockM * 128))),
                        blockM * 128, 1024);
  SmallVector<Value> acc;
  wg.fence();
  for (int64_t kk = 0; kk < blockM / 16; ++kk)
    acc = wg.step(acc, 64, wg.descPlus(aDesc, kk * 16 * 128), {},
                  wg.descPlus(bDesc, kk * 16 * 128), true, true);
  wg.commit();
  waitWgmma(Value(), acc);
  return acc;
}

void WgmmaKVMajorEmitter::stageDq(ArrayRef<Value> acc, Value colBase,
                                  Value offset) {
  // Thread (g, t) of warp w holds rows 16 (w % 4) + g (+ 8), columns
  // colBase + 8 nt + 2t (+ 1) (dqWgmma: colBase 64 (w / 4)).
  auto workgroup =
      gpu::AddressSpaceAttr::get(b.getContext(), gpu::AddressSpace::Workgroup);
  int64_t rowFloats = dqRowBytes() / 4;
  auto type = MemRefType::get({blockN, rowFloats}, b.getF32Type(),
                              MemRefLayoutAttrInterface(), workgroup);
  Value buf = memref::ViewOp::create(
      b, loc, type, smem, offset ? offset : idx(dqOffset()), ValueRange{});
  if (!colBase)
    colBase = mul(warpGroup, idx(64));
  for (int64_t nt = 0; nt < int64_t(acc.size()) / 4; ++nt)
    for (int64_t h = 0; h < 2; ++h) {
      int64_t i = nt * 4 + h * 2;
      Value row = add(mul(remu(ids.warp, 4), idx(16)), add(idx(h * 8), aG));
      Value col = add(colBase, add(idx(nt * 8), mul(aT, idx(2))));
      vector::StoreOp::create(b, loc, pack({acc[i], acc[i + 1]}), buf,
                              ValueRange{row, col});
    }
}

void WgmmaKVMajorEmitter::reduceDqRow(Value row, Value first, int64_t buffer) {
  Value q = add(first, row);
  emitIf(cmp(arith::CmpIPredicate::ult, q, qLen), [&] {
    auto ptrType = LLVM::LLVMPointerType::get(b.getContext(), 1);
    Value dst = LLVM::GEPOp::create(b, loc, ptrType, b.getF32Type(), dqAccPtr,
                                    ValueRange{arith::IndexCastOp::create(
                                        b, loc, b.getI64Type(), dqAccRow(q))});
    Value src = arith::IndexCastOp::create(
        b, loc, b.getI32Type(),
        add(smemAddr, add(idx(dqOffset() + buffer * blockN * dqRowBytes()),
                          mul(row, idx(dqRowBytes())))));
    // Inline PTX: MLIR 22's NVVM has the tensor form of the bulk reduction
    // (nvvm.cp.async.bulk.tensor.reduce), not this one of contiguous bytes.
    inlinePtxF32(b, loc,
                 "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 "
                 "[$0], [$1], " +
                     std::to_string(headDim * 4) + ";",
                 "l,r", ValueRange{dst, src}, 0);
  });
}

void WgmmaKVMajorEmitter::reduceDqBulk(ArrayRef<Value> acc, Value first) {
  stageDq(acc);
  // The rows reach the bulk copies (async proxy) through the fence and the
  // barrier.
  proxyFence(*this);
  copies.syncThreads();
  onDqIssuers([&] {
    reduceDqRow(ids.tid, first);
    bulkCommit(*this);
  });
}

LogicalResult mlir::dualkv::emitWgmmaKVMajor(KernelOp kernel, OpBuilder &b,
                                             gpu::GPUModuleOp gpuModule,
                                             int64_t *sharedBytes) {
  return emitWith<WgmmaKVMajorEmitter>(kernel, b, gpuModule, sharedBytes);
}
