//===- WgmmaKVProducts.cpp - the KV-major backward's products by wgmma ----===//
//
// The wgmma products of bwd and bwd_kv (WgmmaKVProducts.h says how they
// compute). cp.async and st.shared writes reach wgmma and the bulk copies
// through fence.proxy.async before the barrier that publishes them.
//
//===----------------------------------------------------------------------===//
#include "Lowering/Products/WgmmaKVProducts.h"

#include <algorithm>
#include <string>

using namespace mlir;
using namespace mlir::dualkv;

void WgmmaKVProducts::layoutTiles(int64_t sharedBytes) {
  // Rows of whole swizzle atoms, unpadded (the emitter's rowStride).
  int64_t blockBytes = h.blockM * ::dualkv::swizzledTileDim(h.headDim) * 2;
  smemAddr = h.smemTiles.alignToSwizzle(h.smem, sharedBytes);
  warpGroup = o.divu(h.ids.warp, 4);
  h.kBuf = h.smemTiles.swizzledTile(h.smem, 0, h.blockM);
  h.vBuf = h.smemTiles.swizzledTile(h.smem, blockBytes, h.blockM);
  if (h.withDq)
    h.dsBuf =
        h.smemTiles.sharedTile(h.smem, h.layout.dsOffset(), h.blockM, h.blockN);
  else if (h.splitWarpgroups) // Pᵀ of even and odd iterations, then dSᵀ
    h.dsBuf = h.smemTiles.sharedTile(h.smem, h.layout.dsOffset(), 3 * h.blockM,
                                     h.blockN);
}

void WgmmaKVProducts::beginQIteration(Value parity) {
  // As aLane: an opaque base each iteration keeps LLVM from hoisting every
  // k-step's descriptor into registers of its own.
  Value base = opaque(o, smemAddr);
  kAddr = base;
  vAddr =
      o.add(base, o.idx(h.blockM * ::dualkv::swizzledTileDim(h.headDim) * 2));
  dsAddr = o.add(base, o.idx(h.layout.dsOffset()));
  qAddrCur = o.add(base, o.add(o.idx(h.layout.qOffset()),
                               o.mul(parity, o.idx(h.layout.tileBytes()))));
  doAddrCur = o.add(base, o.add(o.idx(h.layout.doOffset()),
                                o.mul(parity, o.idx(h.layout.tileBytes()))));
  if (h.splitWarpgroups)
    pRow0 = o.mul(parity, o.idx(h.blockM));
}

void WgmmaKVProducts::waitWgmma(Value result, MutableArrayRef<Value> newest) {
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
    h.map.map(inFlight[i].first, o.pack(out));
    at += out.size();
  }
  inFlight.erase(inFlight.begin(), inFlight.begin() + done);
}

void WgmmaKVProducts::issueQKTWgmma(QKTOp op) {
  if (h.splitWarpgroups) {
    // Each warpgroup all 64 keys x its BN / 2 queries (rows BN/2 w.. of the
    // tile, whole swizzle atoms).
    int64_t n = h.blockN / 2;
    Value aDesc = wg.desc(addrOf(h.map.lookup(op.getKv())), 16, 1024);
    Value bDesc = wg.desc(o.add(addrOf(h.map.lookup(op.getQ())),
                                o.mul(warpGroup, o.idx(n * 128))),
                          16, 1024);
    commitWgmma(op.getResult(),
                wg.overHeadDim({}, n, aDesc, h.blockM, bDesc, h.blockN));
    return;
  }
  // Each warpgroup 64 keys x BN queries, both operands K-major in shared
  // memory.
  Value aDesc = wg.desc(o.add(addrOf(h.map.lookup(op.getKv())),
                              o.mul(warpGroup, o.idx(64 * 128))),
                        16, 1024);
  Value bDesc = wg.desc(addrOf(h.map.lookup(op.getQ())), 16, 1024);
  commitWgmma(op.getResult(),
              wg.overHeadDim({}, h.blockN, aDesc, h.blockM, bDesc, h.blockN));
}

void WgmmaKVProducts::qkt(QKTOp op) {
  // Sᵀ = K Qᵀ issues dPᵀ = V dOᵀ (the tile's next qk_t) right behind it, so
  // the tensor cores compute dPᵀ while the warps turn Sᵀ into Pᵀ.
  bool issued = llvm::any_of(
      inFlight, [&](auto &f) { return f.first == op.getResult(); });
  if (!issued) {
    h.waitFor(h.map.lookup(op.getQ()));
    wg.fence();
    issueQKTWgmma(op);
    for (Operation *next = op->getNextNode(); next; next = next->getNextNode())
      if (auto dp = dyn_cast<QKTOp>(next)) {
        issueQKTWgmma(dp);
        break;
      }
  }
  waitWgmma(op.getResult());
}

void WgmmaKVProducts::accumulate(AccumulateOp op) {
  if (h.splitWarpgroups)
    return splitAccumulate(op);
  // acc (keys x D) += Xᵀ Y: X (Pᵀ or dSᵀ) from registers as A; Y (dO or Q,
  // queries x D) N-major from shared memory, BN / 16 k-steps of 16 rows.
  // Committed, not waited for: the next wait takes the accumulators along.
  Value y = h.map.lookup(op.getY());
  h.waitFor(y);
  SmallVector<Value> x = o.unpack(h.map.lookup(op.getX()));
  SmallVector<Value> acc = o.unpack(h.map.lookup(op.getAcc()));
  SmallVector<Value> xa = h.frags.packAFragments(x, 1, h.nTiles);
  Value bDesc = wg.desc(addrOf(y), h.blockN * 128, 1024);
  wg.fence();
  commitWgmma(op.getResult(), wg.regsA(acc, xa, bDesc));
}

void WgmmaKVProducts::splitAccumulate(AccumulateOp op) {
  // Xᵀ is Pᵀ (Y = dO) or dSᵀ (Y = Q). A warpgroup overwrites a buffer only
  // once the other's products that read it have retired (each iteration
  // retires all of its products at its end): it stores Pᵀ of iteration i
  // after passing the barriers of iteration i - 1, where the other arrived
  // after retiring iteration i - 2's products, the last to read this Pᵀ
  // buffer; it stores dSᵀ after passing the barrier of its own iteration's
  // Pᵀ, where the other arrived after retiring iteration i - 1's.
  Value y = h.map.lookup(op.getY());
  h.waitFor(y);
  bool isP = y == h.doCur;
  Value row0 = isP ? pRow0 : o.idx(splitDsRow());
  storeSplitT(o.unpack(h.map.lookup(op.getX())), row0);
  proxyFence(o);
  h.copies.syncThreads();
  // acc (keys x D/2 columns of warpgroup w) += Xᵀ (keys x BN, K-major) Y
  // (queries x its columns, N-major: 64-column atoms 2w and 2w + 1 of the
  // tile, BN x 128 bytes apart), BN / 16 k-steps of 32 bytes of Xᵀ rows and
  // 16 rows of Y.
  int64_t n = h.headDim / 2, tileRowBytes = h.blockN * 128;
  Value aDesc = wg.desc(splitRowAddr(row0), 16, 1024);
  Value bDesc =
      wg.desc(o.add(addrOf(y), o.mul(warpGroup, o.idx(n / 64 * tileRowBytes))),
              tileRowBytes, 1024);
  SmallVector<Value> acc = o.unpack(h.map.lookup(op.getAcc()));
  wg.fence();
  for (int64_t kk = 0; kk < h.blockN / 16; ++kk)
    acc = wg.step(acc, n, wg.descPlus(aDesc, kk * 32), {},
                  wg.descPlus(bDesc, kk * 16 * 128), false, true);
  commitWgmma(op.getResult(), acc);
}

void WgmmaKVProducts::storeSplitT(ArrayRef<Value> x, Value row0) {
  // Warp w holds keys 16 (w % 4) + g, queries from BN/2 (w / 4): 16-byte
  // chunk BN/16 (w / 4) + nt of its rows.
  storeScoresT(x, row0, o.remu(h.ids.warp, 4),
               o.mul(warpGroup, o.idx(h.blockN / 16)));
}

void WgmmaKVProducts::storeDsT(ArrayRef<Value> ds) {
  // Thread (g, t) of warp w holds keys 16w + g (+ 8), queries 8nt + 2t (+ 1).
  storeScoresT(ds, Value(), h.ids.warp, Value());
}

void WgmmaKVProducts::storeScoresT(ArrayRef<Value> x, Value row0,
                                   Value warpRows, Value chunk0) {
  // Keys x queries in the swizzled layout: row r (a key) holds BN = 64
  // queries, one 128-byte swizzle row, whose 16-byte chunk c sits at chunk
  // c ^ (r % 8); r % 8 = g.
  for (int64_t nt = 0; nt < h.nTiles; ++nt)
    for (int64_t half = 0; half < 2; ++half) {
      int64_t i = nt * 4 + half * 2;
      Value narrow =
          arith::TruncFOp::create(o.b, o.loc, VectorType::get({2}, h.elemType),
                                  o.pack({x[i], x[i + 1]}));
      Value row =
          o.add(o.mul(warpRows, o.idx(16)), o.add(o.idx(half * 8), h.aG));
      if (row0)
        row = o.add(row0, row);
      Value chunk = arith::XOrIOp::create(
          o.b, o.loc, chunk0 ? o.add(chunk0, o.idx(nt)) : o.idx(nt), h.aG);
      Value col = o.add(o.mul(chunk, o.idx(8)), o.mul(h.aT, o.idx(2)));
      vector::StoreOp::create(o.b, o.loc, narrow, h.dsBuf,
                              ValueRange{row, col});
    }
}

SmallVector<Value> WgmmaKVProducts::dqWgmma(ArrayRef<Value> ds) {
  storeDsT(ds);
  proxyFence(o);
  h.copies.syncThreads();
  // dQ (queries x D) = dS (queries x keys, M-major: dSᵀ) K (keys x D,
  // N-major); warpgroup w computes columns 64w..64w+63.
  return dqOfAtom(dsAddr, warpGroup);
}

SmallVector<Value> WgmmaKVProducts::splitDq(int64_t half) {
  return dqOfAtom(splitRowAddr(o.idx(splitDsRow())),
                  o.add(o.mul(warpGroup, o.idx(h.headDim / 128)), o.idx(half)));
}

SmallVector<Value> WgmmaKVProducts::dqOfAtom(Value dsT, Value atom) {
  // BM / 16 k-steps of 16 keys.
  Value aDesc = wg.desc(dsT, h.blockM * 128, 1024);
  Value bDesc = wg.desc(o.add(kAddr, o.mul(atom, o.idx(h.blockM * 128))),
                        h.blockM * 128, 1024);
  SmallVector<Value> acc;
  wg.fence();
  for (int64_t kk = 0; kk < h.blockM / 16; ++kk)
    acc = wg.step(acc, 64, wg.descPlus(aDesc, kk * 16 * 128), {},
                  wg.descPlus(bDesc, kk * 16 * 128), true, true);
  wg.commit();
  waitWgmma(Value(), acc);
  return acc;
}

SmallVector<Value> WgmmaKVProducts::dqOwnKeys(ArrayRef<Value> ds) {
  storeDsT(ds);
  proxyFence(o);
  // The warpgroup's 128 threads see each other's rows.
  namedBarrier(
      o,
      i32Of(o, o.add(o.idx(barrierId(KVMajorBarrier::Warpgroup0)), warpGroup)),
      128);
  // dQ (queries x D) = dS (queries x own keys, M-major: dSᵀ rows) K (own
  // keys x D, N-major), 4 k-steps of 16 keys.
  Value own = o.mul(warpGroup, o.idx(64 * 128));
  Value aDesc = wg.desc(o.add(dsAddr, own), h.blockM * 128, 1024);
  Value bDesc = wg.desc(o.add(kAddr, own), h.blockM * 128, 1024);
  SmallVector<Value> acc;
  wg.fence();
  for (int64_t kk = 0; kk < 4; ++kk)
    acc = wg.step(acc, h.headDim, wg.descPlus(aDesc, kk * 16 * 128), {},
                  wg.descPlus(bDesc, kk * 16 * 128), true, true);
  wg.commit();
  waitWgmma(Value(), acc);
  return acc;
}

void WgmmaKVProducts::stageDq(ArrayRef<Value> acc, Value colBase,
                              Value offset) {
  // Thread (g, t) of warp w holds rows 16 (w % 4) + g (+ 8), columns
  // colBase + 8 nt + 2t (+ 1) (dqWgmma: colBase 64 (w / 4)).
  auto workgroup = gpu::AddressSpaceAttr::get(o.b.getContext(),
                                              gpu::AddressSpace::Workgroup);
  int64_t rowFloats = dqRowBytes() / 4;
  auto type = MemRefType::get({h.blockN, rowFloats}, o.b.getF32Type(),
                              MemRefLayoutAttrInterface(), workgroup);
  Value buf =
      memref::ViewOp::create(o.b, o.loc, type, h.smem,
                             offset ? offset : o.idx(dqOffset()), ValueRange{});
  if (!colBase)
    colBase = o.mul(warpGroup, o.idx(64));
  for (int64_t nt = 0; nt < int64_t(acc.size()) / 4; ++nt)
    for (int64_t half = 0; half < 2; ++half) {
      int64_t i = nt * 4 + half * 2;
      Value row = o.add(o.mul(o.remu(h.ids.warp, 4), o.idx(16)),
                        o.add(o.idx(half * 8), h.aG));
      Value col = o.add(colBase, o.add(o.idx(nt * 8), o.mul(h.aT, o.idx(2))));
      vector::StoreOp::create(o.b, o.loc, o.pack({acc[i], acc[i + 1]}), buf,
                              ValueRange{row, col});
    }
}

void WgmmaKVProducts::reduceDqRow(Value row, Value first, int64_t buffer) {
  Value q = o.add(first, row);
  emitIf(o.cmp(arith::CmpIPredicate::ult, q, h.qLen), [&] {
    auto ptrType = LLVM::LLVMPointerType::get(o.b.getContext(), 1);
    Value dst =
        LLVM::GEPOp::create(o.b, o.loc, ptrType, o.b.getF32Type(), h.dqAccPtr,
                            ValueRange{arith::IndexCastOp::create(
                                o.b, o.loc, o.b.getI64Type(), h.dqAccRow(q))});
    Value src = arith::IndexCastOp::create(
        o.b, o.loc, o.b.getI32Type(),
        o.add(smemAddr,
              o.add(o.idx(dqOffset() + buffer * h.blockN * dqRowBytes()),
                    o.mul(row, o.idx(dqRowBytes())))));
    // Inline PTX: MLIR 22's NVVM has the tensor form of the bulk reduction
    // (nvvm.cp.async.bulk.tensor.reduce), not this one of contiguous bytes.
    inlinePtxF32(o.b, o.loc,
                 "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 "
                 "[$0], [$1], " +
                     std::to_string(h.headDim * 4) + ";",
                 "l,r", ValueRange{dst, src}, 0);
  });
}

void WgmmaKVProducts::reduceDqBulk(ArrayRef<Value> acc, Value first) {
  stageDq(acc);
  // The rows reach the bulk copies (async proxy) through the fence and the
  // barrier.
  proxyFence(o);
  h.copies.syncThreads();
  onDqIssuers([&] {
    reduceDqRow(h.ids.tid, first);
    bulkCommit(o);
  });
}
