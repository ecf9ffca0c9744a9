//===- MmaSyncKVMajor.cpp - the mma.sync KV-major backward ----------------===//
//
// bwd and bwd_kv on sm_80 and later (Lowering/Skeletons/KVMajorSkeleton.h has
// the register layouts). Every product is mma.sync.m16n8k16 with ldmatrix
// operands.
//
// One-block layouts: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ take A from the key block and
// B from the query tile; dV += Pᵀ dO and dK += dSᵀ Q take A from registers
// (Pᵀ, dSᵀ repacked) and B transposed from the tile. dQ of a query tile is
// dS K: dSᵀ goes through shared memory (BM x (BN+8)), comes back transposed
// by ldmatrix.trans as A fragments, and the warps, each with whole m16 blocks
// of queries (and part of the columns when there are fewer blocks than
// warps), add their fp32 products to global dQ: red.global.add.v4.f32 on
// sm_90 and later, scalar atomics before.
//
// The two-dimensional layout (grid2d) computes S and dP as queries x keys
// (2 x 4 warps of BN/2 x BM/4), puts P and dS in shared memory (BN x (BM+8)
// each), computes dV += Pᵀ dO and dK += dSᵀ Q as BM/32 x GC warps of 32 keys
// x D/GC (GC = 8 / (BM/32): 4 x 2 warps of 32 keys x D/2 at BM = 128) with A
// read back by ldmatrix.trans, and dQ = dS K as 2 x 4 warps of BN/2 queries x
// D/4 with A read straight from dS (bwd only). Each query tile is waited for
// once (one barrier for Q, dO, LSE and Delta).
//
// head_dim 256 takes it at BM = 64 (BN = 32 or 64, 8 warps): dK and dV of 64
// keys x 256 columns are 128 fp32 registers a thread only when all 8 warps
// share them, 2 x 4 warps of 32 keys x 64 columns; the one-block layout would
// give each of 4 warps 16 keys x 256 columns of each, 256 registers.
//
//===----------------------------------------------------------------------===//
#include "Lowering/ScheduleEmitters.h"
#include "Lowering/Skeletons/KVMajorSkeleton.h"
#include "Schedules/MmaSync/MmaSync.h"

#include <algorithm>

using namespace mlir;
using namespace mlir::dualkv;

namespace {

/// dQ columns a warp computes at a time: 16 fp32 registers of dQ beside dK,
/// dV and dS.
constexpr int64_t kDqChunkCols = 32;

class MmaSyncKVMajorEmitter : public KVMajorEmitter {
public:
  MmaSyncKVMajorEmitter(KernelOp kernel, OpBuilder &b)
      : KVMajorEmitter(kernel, b) {
    // 128 keys, 64-query tiles and 8 warps take the two-dimensional warp
    // layout (see the file comment), as do 64 keys in 8 warps at head_dim 192
    // and 256, and 32 at 512.
    grid2d = ::dualkv::kvMajorGrid2d(blockM, blockN, warps, headDim);
    waitOncePerTile = grid2d;
  }

private:
  void layoutTiles() override {
    int64_t blockBytes = blockM * rowStride * 2;
    kBuf = smemTiles.sharedTile(smem, 0, blockM);
    vBuf = vTiles.sharedTile(smem, blockBytes, blockM);
    if (grid2d) {
      dsBuf = smemTiles.sharedTile(smem, dsOffset(), blockN, blockM + kRowPad);
      pBuf = smemTiles.sharedTile(smem,
                                  dsOffset() + blockN * (blockM + kRowPad) * 2,
                                  blockN, blockM + kRowPad);
    } else if (withDq) {
      dsBuf = smemTiles.sharedTile(smem, dsOffset(), blockM, blockN + kRowPad);
    }
  }
  void beginQIteration(Value) override { storedScores.clear(); }
  LogicalResult emitQKT(QKTOp op) override;
  LogicalResult emitAccumulate(AccumulateOp op) override;
  LogicalResult emitAccumulateDq(AccumulateDqOp op) override;

  /// A fragments of the warp's m16 block `mt` of `buf` (row-major, rows
  /// padded) at k-step `kt`.
  SmallVector<Value, 4> rowMajorA(Value buf, int64_t mt, int64_t kt);
  /// c (C fragments of aFrags.size() m16 blocks x nTotal n8 tiles) += A B at
  /// k-step kt: A the given fragments; B's n16 blocks np read by ldmatrix
  /// (not transposed) at rows bRow + 16 np, columns bCol + 16 kt of bBuf (n
  /// along the rows, k along the columns): matrices (n 0-7, k 0-7), (n 0-7,
  /// k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15); an odd last n8 tile the
  /// first two.
  void mmaRowsB(MutableArrayRef<Value> c,
                ArrayRef<SmallVector<Value, 4>> aFrags, Value bBuf, Value bRow,
                Value bCol, int64_t kt, int64_t nTotal);

  // The two-dimensional layout (grid2d).
  LogicalResult emitQKT2d(QKTOp op);
  LogicalResult emitAccumulate2d(AccumulateOp op);
  /// Stores the fp32 C fragments `x` (S layout) as E into `buf` (queries x
  /// keys) and syncs the CTA.
  void storeScores2d(ArrayRef<Value> x, Value buf);
  Value pBuf;
  /// The scores (mapped values) already in dsBuf or pBuf this iteration.
  DenseMap<Value, Value> storedScores;
};

SmallVector<Value, 4> MmaSyncKVMajorEmitter::rowMajorA(Value buf, int64_t mt,
                                                       int64_t kt) {
  // Matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
  // (rows 8-15, k 8-15): lane l addresses row l % 8 + 8 * ((l / 8) % 2).
  Value quad = divu(aLane, 8);
  Value row = add(remu(aLane, 8), mul(remu(quad, 2), idx(8)));
  Value col = mul(divu(quad, 2), idx(8));
  Value r = add(add(mul(ids.warp, idx(16 * mTiles)), idx(mt * 16)), row);
  return frags.ldmatrix4(buf, r, add(idx(kt * 16), col), /*transpose=*/false);
}

LogicalResult MmaSyncKVMajorEmitter::emitQKT(QKTOp op) {
  if (grid2d)
    return emitQKT2d(op);
  waitFor(map.lookup(op.getQ()));
  Value aBuf = map.lookup(op.getKv());
  Value bBuf = map.lookup(op.getQ());
  SmallVector<Value> s(mTiles * nTiles * 4, f32c(0.0f));
  // B fragments of the query tile rows: matrices (rows 0-7, d 0-7), (rows 0-7,
  // d 8-15), (rows 8-15, d 0-7), (rows 8-15, d 8-15).
  Value quad = divu(aLane, 8);
  Value rowInBlock = add(remu(aLane, 8), mul(divu(quad, 2), idx(8)));
  Value colInBlock = mul(remu(quad, 2), idx(8));
  for (int64_t kt = 0, steps = contractTiles(op); kt < steps; ++kt) {
    SmallVector<SmallVector<Value, 4>> aFrags;
    for (int64_t mt = 0; mt < mTiles; ++mt)
      aFrags.push_back(rowMajorA(aBuf, mt, kt));
    mmaRowsB(s, aFrags, bBuf, rowInBlock, colInBlock, kt, nTiles);
  }
  map.map(op.getResult(), pack(s));
  return success();
}

void MmaSyncKVMajorEmitter::mmaRowsB(MutableArrayRef<Value> c,
                                     ArrayRef<SmallVector<Value, 4>> aFrags,
                                     Value bBuf, Value bRow, Value bCol,
                                     int64_t kt, int64_t nTotal) {
  // Pairs of n8 tiles by ldmatrix.x4; an odd last tile (the two-dimensional
  // layout's 8 keys a warp at 32 keys) by ldmatrix.x2 at the same addresses,
  // whose first 16 lanes address its two matrices.
  for (int64_t np = 0; np < (nTotal + 1) / 2; ++np) {
    const int64_t halves = std::min<int64_t>(2, nTotal - 2 * np);
    Value row = add(idx(np * 16), bRow), col = add(idx(kt * 16), bCol);
    auto r = halves == 2 ? frags.ldmatrix4(bBuf, row, col, /*transpose=*/false)
                         : frags.ldmatrix2(bBuf, row, col, /*transpose=*/false);
    for (int64_t mt = 0; mt < int64_t(aFrags.size()); ++mt)
      for (int64_t half = 0; half < halves; ++half) {
        MutableArrayRef<Value> acc(&c[(mt * nTotal + 2 * np + half) * 4], 4);
        auto d = frags.mma(aFrags[mt], {r[2 * half], r[2 * half + 1]}, acc);
        std::copy(d.begin(), d.end(), acc.begin());
      }
  }
}

LogicalResult MmaSyncKVMajorEmitter::emitAccumulate(AccumulateOp op) {
  if (grid2d)
    return emitAccumulate2d(op);
  waitFor(map.lookup(op.getY()));
  SmallVector<Value> x = unpack(map.lookup(op.getX()));
  SmallVector<Value> acc = unpack(map.lookup(op.getAcc()));
  // X (keys x queries) as A fragments; Y (queries x d, row-major) is B.
  SmallVector<Value> xa = frags.packAFragments(x, mTiles, nTiles);
  frags.mmaTransposedB(acc, xa, map.lookup(op.getY()), aLane, mTiles,
                       nTiles / 2, gradDTiles(accumulatesValueGrad(op)));
  map.map(op.getResult(), pack(acc));
  return success();
}

LogicalResult MmaSyncKVMajorEmitter::emitQKT2d(QKTOp op) {
  // S = Q Kᵀ (or dP = dO Vᵀ): queries x keys, A from the query tile, B from
  // the key block; each warp 32 queries x 32 keys.
  Value aBuf = map.lookup(op.getQ());
  Value bBuf = map.lookup(op.getKv());
  waitFor(aBuf);
  const int64_t sm = scoreMTiles(), sn = scoreNTiles();
  SmallVector<Value> s(sm * sn * 4, f32c(0.0f));
  Value quad = divu(aLane, 8);
  // A: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
  // (rows 8-15, k 8-15). B: (keys 0-7, k 0-7), (keys 0-7, k 8-15), (keys
  // 8-15, k 0-7), (keys 8-15, k 8-15).
  Value aRow = add(mul(divu(ids.warp, 4), idx(blockN / 2)),
                   add(remu(aLane, 8), mul(remu(quad, 2), idx(8))));
  Value aCol = mul(divu(quad, 2), idx(8));
  Value bRow = add(mul(remu(ids.warp, 4), idx(blockM / 4)),
                   add(remu(aLane, 8), mul(divu(quad, 2), idx(8))));
  Value bCol = mul(remu(quad, 2), idx(8));
  for (int64_t kt = 0, steps = contractTiles(op); kt < steps; ++kt) {
    SmallVector<SmallVector<Value, 4>> aFrags;
    for (int64_t mt = 0; mt < sm; ++mt)
      aFrags.push_back(frags.ldmatrix4(aBuf, add(aRow, idx(mt * 16)),
                                       add(aCol, idx(kt * 16)),
                                       /*transpose=*/false));
    mmaRowsB(s, aFrags, bBuf, bRow, bCol, kt, /*nTotal=*/sn);
  }
  map.map(op.getResult(), pack(s));
  return success();
}

void MmaSyncKVMajorEmitter::storeScores2d(ArrayRef<Value> x, Value buf) {
  const int64_t sm = scoreMTiles(), sn = scoreNTiles();
  for (int64_t mt = 0; mt < sm; ++mt)
    for (int64_t nt = 0; nt < sn; ++nt)
      for (int64_t h = 0; h < 2; ++h) {
        int64_t i = (mt * sn + nt) * 4 + h * 2;
        Value narrow = arith::TruncFOp::create(
            b, loc, VectorType::get({2}, elemType), pack({x[i], x[i + 1]}));
        vector::StoreOp::create(b, loc, narrow, buf,
                                ValueRange{sQuery(mt, h), sKey(nt, 0)});
      }
  gpu::BarrierOp::create(b, loc);
}

LogicalResult MmaSyncKVMajorEmitter::emitAccumulate2d(AccumulateOp op) {
  // acc (keys x D) += Xᵀ Y: X (P or dS, queries x keys) goes to shared memory
  // and comes back transposed as A fragments (ldmatrix.trans); Y (dO or Q,
  // queries x D) is B, transposed. Each warp: 32 keys x D/GC.
  Value y = map.lookup(op.getY());
  waitFor(y);
  Value xv = map.lookup(op.getX());
  Value buf = y == doCur ? pBuf : dsBuf;
  if (!storedScores.count(xv)) {
    storeScores2d(unpack(xv), buf);
    storedScores[xv] = buf;
  }
  SmallVector<Value> acc = unpack(map.lookup(op.getAcc()));
  const bool value = accumulatesValueGrad(op);
  const int64_t gdt = gradDTiles(value), gcw = gradColWarps();
  Value quad = divu(aLane, 8);
  // A (keys x queries) from X (queries x keys) by ldmatrix.trans: matrix j
  // holds keys + 8 (j % 2), queries + 8 (j / 2).
  Value aQuery = add(remu(aLane, 8), mul(divu(quad, 2), idx(8)));
  Value aKey =
      add(mul(divu(ids.warp, gcw), idx(32)), mul(remu(quad, 2), idx(8)));
  // B (queries x D) by ldmatrix.trans: (q 0-7, d 0-7), (q 8-15, d 0-7),
  // (q 0-7, d 8-15), (q 8-15, d 8-15).
  Value bQuery = add(remu(aLane, 8), mul(remu(quad, 2), idx(8)));
  Value bCol = add(mul(remu(ids.warp, gcw), idx(gradWidth(value) / gcw)),
                   mul(divu(quad, 2), idx(8)));
  for (int64_t kk = 0; kk < blockN / 16; ++kk) {
    SmallVector<Value, 4> aFrags[2];
    for (int64_t mt = 0; mt < 2; ++mt)
      aFrags[mt] = frags.ldmatrix4(buf, add(aQuery, idx(kk * 16)),
                                   add(aKey, idx(mt * 16)), /*transpose=*/true);
    for (int64_t dp = 0; dp < gdt / 2; ++dp) {
      auto r =
          frags.ldmatrix4(y, add(bQuery, idx(kk * 16)), add(bCol, idx(dp * 16)),
                          /*transpose=*/true);
      for (int64_t mt = 0; mt < 2; ++mt)
        for (int64_t half = 0; half < 2; ++half) {
          MutableArrayRef<Value> c(&acc[(mt * gdt + 2 * dp + half) * 4], 4);
          auto d = frags.mma(aFrags[mt], {r[2 * half], r[2 * half + 1]}, c);
          std::copy(d.begin(), d.end(), c.begin());
        }
    }
  }
  map.map(op.getResult(), pack(acc));
  return success();
}

LogicalResult MmaSyncKVMajorEmitter::emitAccumulateDq(AccumulateDqOp op) {
  SmallVector<Value> ds = unpack(map.lookup(op.getDs()));
  Value kTile = map.lookup(op.getK());
  Value tile = map.lookup(op->getParentOfType<QLoopOp>().getTileIndex());
  if (grid2d) {
    // dS (queries x keys) is in shared memory once dK has used it.
    if (!storedScores.count(map.lookup(op.getDs())))
      storeScores2d(ds, dsBuf);
  } else {
    // dSᵀ to shared memory in the element type, keys x queries.
    for (int64_t mt = 0; mt < mTiles; ++mt)
      for (int64_t nt = 0; nt < nTiles; ++nt)
        for (int64_t h = 0; h < 2; ++h) {
          int64_t i = (mt * nTiles + nt) * 4 + h * 2;
          Value narrow = arith::TruncFOp::create(
              b, loc, VectorType::get({2}, elemType), pack({ds[i], ds[i + 1]}));
          Value row = add(mul(ids.warp, idx(16 * mTiles)),
                          add(idx(mt * 16 + h * 8), aG));
          Value col = add(idx(nt * 8), mul(aT, idx(2)));
          vector::StoreOp::create(b, loc, narrow, dsBuf, ValueRange{row, col});
        }
    gpu::BarrierOp::create(b, loc);
  }
  // dQ (queries x D) = dS (queries x keys) K (keys x D). The BN / 16 m16
  // blocks of queries are dealt to the warps; when there are fewer blocks
  // than warps, the warps sharing a block split its columns. Each warp
  // computes its part kDqChunkCols columns at a time, so few fp32 registers of
  // dQ live beside dK and dV.
  int64_t rowBlocks = blockN / 16;
  int64_t qmTiles = std::max<int64_t>(rowBlocks / warps, 1);
  int64_t colSplit = std::max<int64_t>(warps / rowBlocks, 1);
  if (grid2d) // 2 x 4 warps of BN/2 queries x D/4
    qmTiles = blockN / 32, colSplit = 4;
  int64_t warpCols = headDim / colSplit;
  int64_t chunkCols = std::min<int64_t>(warpCols, kDqChunkCols);
  Value warpRow0 = colSplit == 1 ? mul(ids.warp, idx(16 * qmTiles))
                                 : mul(remu(ids.warp, rowBlocks), idx(16));
  Value warpCol0 =
      colSplit == 1 ? idx(0) : mul(divu(ids.warp, rowBlocks), idx(warpCols));
  if (grid2d) {
    warpRow0 = mul(divu(ids.warp, 4), idx(blockN / 2));
    warpCol0 = mul(remu(ids.warp, 4), idx(warpCols));
  }
  int64_t kSteps = blockM / 16;
  Value quad = divu(aLane, 8);
  Value first = mul(tile, idx(blockN));
  // ldmatrix addresses: A (dS from dSᵀ, transposed: matrix j = quad holds
  // queries + 8 (j % 2), keys + 8 (j / 2)) and B (K rows, transposed, as V in
  // the forward).
  Value aKeyRow = add(remu(aLane, 8), mul(divu(quad, 2), idx(8)));
  Value aQueryCol = add(warpRow0, mul(remu(quad, 2), idx(8)));
  Value bRow = add(remu(aLane, 8), mul(remu(quad, 2), idx(8)));
  Value bCol = add(warpCol0, mul(divu(quad, 2), idx(8)));
  // grid2d: A is dS itself (queries x keys, row-major).
  Value aRow2d = add(warpRow0, add(remu(aLane, 8), mul(remu(quad, 2), idx(8))));
  Value aCol2d = mul(divu(quad, 2), idx(8));
  for (int64_t c0 = 0; c0 < warpCols; c0 += chunkCols) {
    // The last chunk may be narrower (head_dim 96: 48 columns a warp are
    // chunks of 32 and 16).
    int64_t cTiles = std::min(chunkCols, warpCols - c0) / 8;
    SmallVector<Value> acc(qmTiles * cTiles * 4, f32c(0.0f));
    for (int64_t kk = 0; kk < kSteps; ++kk) {
      SmallVector<SmallVector<Value, 4>> aFrags;
      for (int64_t qm = 0; qm < qmTiles; ++qm)
        aFrags.push_back(
            grid2d ? frags.ldmatrix4(dsBuf, add(aRow2d, idx(qm * 16)),
                                     add(idx(kk * 16), aCol2d),
                                     /*transpose=*/false)
                   : frags.ldmatrix4(dsBuf, add(idx(kk * 16), aKeyRow),
                                     add(aQueryCol, idx(qm * 16)),
                                     /*transpose=*/true));
      // Pairs of n8 tiles by ldmatrix.x4; an odd last tile (head_dim 96:
      // 24 columns a warp) by ldmatrix.x2 at the same addresses.
      for (int64_t dp = 0; dp < (cTiles + 1) / 2; ++dp) {
        int64_t halves = std::min<int64_t>(2, cTiles - 2 * dp);
        Value row = add(idx(kk * 16), bRow), col = add(bCol, idx(c0 + dp * 16));
        auto r = halves == 2
                     ? frags.ldmatrix4(kTile, row, col, /*transpose=*/true)
                     : frags.ldmatrix2(kTile, row, col, /*transpose=*/true);
        for (int64_t qm = 0; qm < qmTiles; ++qm)
          for (int64_t half = 0; half < halves; ++half) {
            MutableArrayRef<Value> c(&acc[(qm * cTiles + 2 * dp + half) * 4],
                                     4);
            auto d = frags.mma(aFrags[qm], {r[2 * half], r[2 * half + 1]}, c);
            std::copy(d.begin(), d.end(), c.begin());
          }
      }
    }
    reduceDqTile(acc, qmTiles, cTiles, warpRow0, warpCol0, c0, first);
  }
  return success();
}

} // namespace

LogicalResult mlir::dualkv::emitMmaSyncKVMajor(KernelOp kernel, OpBuilder &b,
                                               gpu::GPUModuleOp gpuModule,
                                               int64_t *sharedBytes) {
  return emitWith<MmaSyncKVMajorEmitter>(kernel, b, gpuModule, sharedBytes);
}
