//===- LowerToNVGPU.cpp - dualkv-lower-to-nvgpu: the sm_80 schedule
//--------===//
//
// Turns a bound, tiled dualkv.kernel into a gpu.func. Tile values become
// per-thread register fragments of mma.sync.m16n8k16 held as flat vectors: each
// op unpacks the fragments it reads into scalars and packs what it writes, so
// LLVM keeps everything in registers. The data layout (lane = 4 * g + t within
// a warp):
//   q_tile     memref<BM x (D+8) x E> in shared memory (A fragments via
//   ldmatrix) probs      vector<MT*BN/16*4 x i32> A fragments of P (C layout of
//   S, repacked) scores     vector<MT*NT*4 x f32>  C fragments: rows g and g+8,
//   cols 2t, 2t+1 acc        vector<MT*DT*4 x f32>  C fragments of O row_stats
//   vector<MT*2 x f32>     rows g and g+8 of each m16 block kv_tile memref<BN x
//   (D+8) x E> in shared memory (rows padded against bank
//              conflicts of ldmatrix)
// where MT = block_m / (16 * warps), NT = block_n / 8, DT = D / 8.
//
//===----------------------------------------------------------------------===//
#include "dualkv/Compiler/Passes.h"

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

/// Global tensors are passed as bare pointers; a static 1-D shape this large
/// lets the bare-pointer calling convention apply while indexing stays
/// unchecked.
constexpr int64_t kUnboundedElements = std::numeric_limits<int32_t>::max();
/// Shared-memory rows are padded by 8 elements (16 bytes): row r starts 4r
/// banks later, so the 8 row addresses of one ldmatrix phase hit distinct
/// banks.
constexpr int64_t kRowPad = 8;

/// Emits the gpu.func of one kernel. One method per dualkv op.
class KernelEmitter {
public:
  KernelEmitter(KernelOp kernel, OpBuilder &b)
      : kernel(kernel), b(b), loc(kernel.getLoc()) {
    ProblemAttr p = *kernel.getProblem();
    TilingAttr t = *kernel.getTiling();
    blockM = t.getBlockM();
    blockN = t.getBlockN();
    warps = t.getWarps();
    headDim = p.getHeadDim();
    groupSize = p.getNumQHeads() / p.getNumKvHeads();
    elemType = p.getDtype();
    mTiles = blockM / (16 * warps);
    kTiles = headDim / 16;
    nTiles = blockN / 8;
    dTiles = headDim / 8;
    rowStride = headDim + kRowPad;
    stages = t.getStages();
  }

  /// Emits the gpu.func into `gpuModule`; returns failure with a diagnostic.
  LogicalResult emit(gpu::GPUModuleOp gpuModule);

  int64_t sharedBytes() const { return (blockM + 2 * blockN) * rowStride * 2; }

private:
  // ---- small builders ------------------------------------------------------
  Value idx(int64_t v) { return arith::ConstantIndexOp::create(b, loc, v); }
  Value i32c(int32_t v) { return arith::ConstantIntOp::create(b, loc, v, 32); }
  Value f32c(float v) {
    return arith::ConstantFloatOp::create(b, loc, b.getF32Type(), APFloat(v));
  }
  Value add(Value x, Value y) { return arith::AddIOp::create(b, loc, x, y); }
  Value mul(Value x, Value y) { return arith::MulIOp::create(b, loc, x, y); }
  Value divu(Value x, int64_t y) {
    return arith::DivUIOp::create(b, loc, x, idx(y));
  }
  Value remu(Value x, int64_t y) {
    return arith::RemUIOp::create(b, loc, x, idx(y));
  }
  Value ceilDiv(Value x, int64_t y) { return divu(add(x, idx(y - 1)), y); }
  Value cmp(arith::CmpIPredicate pred, Value x, Value y) {
    return arith::CmpIOp::create(b, loc, pred, x, y);
  }
  Value select(Value c, Value x, Value y) {
    return arith::SelectOp::create(b, loc, c, x, y);
  }
  Value toIndex(Value i32) {
    return arith::IndexCastOp::create(b, loc, b.getIndexType(), i32);
  }
  Value intrinsic(StringRef name, Value x) {
    return LLVM::CallIntrinsicOp::create(b, loc, b.getF32Type(),
                                         b.getStringAttr(name), ValueRange{x})
        .getResult(0);
  }
  Value exp2(Value x) { return intrinsic("llvm.nvvm.ex2.approx.ftz.f", x); }
  Value log2(Value x) { return intrinsic("llvm.nvvm.lg2.approx.ftz.f", x); }
  Value shuffleXor(Value v, int32_t offset) {
    return gpu::ShuffleOp::create(b, loc, v, i32c(offset), i32c(32),
                                  gpu::ShuffleMode::XOR)
        .getShuffleResult();
  }

  SmallVector<Value> unpack(Value vec) {
    auto type = cast<VectorType>(vec.getType());
    SmallVector<Value> out;
    for (int64_t i = 0; i < type.getNumElements(); ++i)
      out.push_back(
          vector::ExtractOp::create(b, loc, vec, ArrayRef<int64_t>{i}));
    return out;
  }
  Value pack(ArrayRef<Value> elems) {
    auto type =
        VectorType::get({int64_t(elems.size())}, elems.front().getType());
    return vector::FromElementsOp::create(b, loc, type, elems);
  }
  /// Two fp32 values rounded to the element type and packed into one i32
  /// register.
  Value packPair(Value lo, Value hi) {
    Value pair = pack({lo, hi});
    Value narrow =
        arith::TruncFOp::create(b, loc, VectorType::get({2}, elemType), pair);
    Value asInt = vector::BitCastOp::create(
        b, loc, VectorType::get({1}, b.getI32Type()), narrow);
    return vector::ExtractOp::create(b, loc, asInt, ArrayRef<int64_t>{0});
  }
  /// ldmatrix.x4 at (row, col) of `buf`: four i32 registers, one per 8x8
  /// matrix.
  SmallVector<Value, 4> ldmatrix4(Value buf, Value row, Value col,
                                  bool transpose) {
    auto vecType = VectorType::get({4, 2}, elemType);
    Value m = nvgpu::LdMatrixOp::create(b, loc, vecType, buf,
                                        ValueRange{row, col}, transpose, 4);
    SmallVector<Value, 4> regs;
    for (int64_t i = 0; i < 4; ++i) {
      Value pair = vector::ExtractOp::create(b, loc, m, ArrayRef<int64_t>{i});
      Value asInt = vector::BitCastOp::create(
          b, loc, VectorType::get({1}, b.getI32Type()), pair);
      regs.push_back(
          vector::ExtractOp::create(b, loc, asInt, ArrayRef<int64_t>{0}));
    }
    return regs;
  }
  /// d = a * b + c for one m16n8k16 tile; a: 4 i32, b: 2 i32, c: 4 f32.
  SmallVector<Value, 4> mma(ArrayRef<Value> a, ArrayRef<Value> bfrag,
                            ArrayRef<Value> c) {
    bool bf16 = elemType.isBF16();
    auto operand = [&](Value r) -> Value {
      if (bf16)
        return r;
      Value v = vector::FromElementsOp::create(
          b, loc, VectorType::get({1}, b.getI32Type()), ValueRange{r});
      return vector::BitCastOp::create(b, loc,
                                       VectorType::get({2}, b.getF16Type()), v);
    };
    SmallVector<Value> av, bv;
    for (Value r : a)
      av.push_back(operand(r));
    for (Value r : bfrag)
      bv.push_back(operand(r));
    Type f32 = b.getF32Type();
    auto resType =
        LLVM::LLVMStructType::getLiteral(b.getContext(), {f32, f32, f32, f32});
    NVVM::MMATypes ptx = bf16 ? NVVM::MMATypes::bf16 : NVVM::MMATypes::f16;
    Value d = NVVM::MmaOp::create(
        b, loc, resType, av, bv, c, {16, 8, 16}, std::nullopt, std::nullopt,
        std::array<NVVM::MMATypes, 2>{ptx, ptx},
        std::array<NVVM::MMALayout, 2>{NVVM::MMALayout::row,
                                       NVVM::MMALayout::col});
    SmallVector<Value, 4> out;
    for (int64_t i = 0; i < 4; ++i)
      out.push_back(
          LLVM::ExtractValueOp::create(b, loc, d, ArrayRef<int64_t>{i}));
    return out;
  }

  // ---- tiles ---------------------------------------------------------------
  /// Issues cp.async copies of `rows` rows of one head into `buf`: row r comes
  /// from token start + first + r and is zero-filled when first + r >= limit
  /// (with `predicated`). Returns the copy group.
  Value copyTile(Value buf, Value base, int64_t rows, Value start, Value first,
                 Value limit, Value strideT, Value headOffset, bool predicated,
                 Value tileValid = {});
  int64_t threads() const { return warps * 32; }

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
  /// Waits until the copy group that filled `tile` has landed, then syncs the
  /// CTA.
  void waitFor(Value tile);
  /// stages >= 2: after the scores of tile j, start copying key tile j + 1.
  void prefetchNextKey(QKOp op);
  /// Copies key tile `tile` of `loop`'s region; rows past the region, or all
  /// rows when !tileValid, are zero-filled from a valid address.
  Value issueKeyCopy(KVLoopOp loop, Value tile, Value tileValid);
  Value loopUpper;

  KernelOp kernel;
  OpBuilder &b;
  Location loc;
  int64_t blockM, blockN, warps, headDim, groupSize, mTiles, kTiles, nTiles,
      dTiles, rowStride, stages;
  // The prefetched key copy group of the current loop (stages >= 2), if any.
  Value prefetchedKey;
  Type elemType;

  // Kernel arguments.
  Value qPtr, kPtr, vPtr, oPtr, lsePtr, segPtr;
  Value qStrideT, qStrideH, kStrideT, kStrideH, vStrideT, vStrideH, oStrideT,
      oStrideH, lseStrideH, scaleLog2;
  // Per-CTA and per-thread values.
  Value tid, lane, warp, g, t, head, kvHead;
  Value segStart, segLen, sharedStart, sharedLen, qRow0;
  Value kBuf, vBuf, qBuf;
  // Copy groups issued in the current loop iteration, oldest first.
  SmallVector<std::pair<Value, Value>> pending; // (smem tile, group token)
  IRMapping map;
};

Value KernelEmitter::copyTile(Value buf, Value base, int64_t rows, Value start,
                              Value first, Value limit, Value strideT,
                              Value headOffset, bool predicated,
                              Value tileValid) {
  int64_t chunksPerRow = headDim / 8; // 16-byte chunks
  // threads is a multiple of chunksPerRow (>= 128 threads, <= 32 chunks a row):
  // every thread copies the same column of rows row0, row0 + rowsPerPass, ...
  // so the global addresses differ by a constant stride and stay cheap in
  // registers.
  int64_t rowsPerPass = threads() / chunksPerRow;
  Value row0 = divu(tid, chunksPerRow);
  Value col = mul(remu(tid, chunksPerRow), idx(8));
  Value colOffset = add(headOffset, col);
  SmallVector<Value> tokens;
  for (int64_t i = 0; i * rowsPerPass < rows; ++i) {
    Value r = add(row0, idx(i * rowsPerPass));
    Value rel = add(first, r);
    Value srcElems;
    Value row = rel;
    if (predicated) {
      // A null limit means every row of the tile is inside its region.
      Value valid =
          limit ? cmp(arith::CmpIPredicate::ult, rel, limit) : tileValid;
      if (limit && tileValid)
        valid = arith::AndIOp::create(b, loc, valid, tileValid);
      // Out-of-range rows read nothing (src-size 0 zero-fills) from a valid
      // address.
      row = select(valid, rel, idx(0));
      srcElems = select(valid, idx(8), idx(0));
    }
    Value src = add(mul(add(start, row), strideT), colOffset);
    Value tok = nvgpu::DeviceAsyncCopyOp::create(
        b, loc, buf, ValueRange{r, col}, base, ValueRange{src},
        b.getIndexAttr(8), srcElems, b.getUnitAttr());
    tokens.push_back(tok);
  }
  return nvgpu::DeviceAsyncCreateGroupOp::create(b, loc, tokens);
}

void KernelEmitter::waitFor(Value tile) {
  auto it = llvm::find_if(pending,
                          [&](auto &p) { return p.first && p.first == tile; });
  assert(it != pending.end() && "tile was not loaded in this iteration");
  int32_t younger = static_cast<int32_t>(pending.end() - it - 1);
  nvgpu::DeviceAsyncWaitOp::create(b, loc, it->second,
                                   b.getI32IntegerAttr(younger));
  gpu::BarrierOp::create(b, loc);
}

LogicalResult KernelEmitter::emitLoadQ(LoadQOp op) {
  Value group = copyTile(qBuf, qPtr, blockM, segStart, qRow0, segLen, qStrideT,
                         mul(head, qStrideH), /*predicated=*/true);
  nvgpu::DeviceAsyncWaitOp::create(b, loc, group, b.getI32IntegerAttr(0));
  gpu::BarrierOp::create(b, loc);
  // Q stays in shared memory for the whole kernel: its A fragments are re-read
  // per k-step, which keeps ~32-64 registers a thread free for the accumulator.
  map.map(op.getResult(), qBuf);
  return success();
}

LogicalResult KernelEmitter::emitInitAcc(InitAccOp op) {
  auto type = VectorType::get({mTiles * dTiles * 4}, b.getF32Type());
  map.map(op.getResult(),
          arith::ConstantOp::create(b, loc, type,
                                    DenseElementsAttr::get(type, 0.0f)));
  return success();
}

LogicalResult KernelEmitter::emitInitStats(InitStatsOp op) {
  auto type = VectorType::get({mTiles * 2}, b.getF32Type());
  float ninf = -std::numeric_limits<float>::infinity();
  map.map(op.getMax(), arith::ConstantOp::create(
                           b, loc, type, DenseElementsAttr::get(type, ninf)));
  map.map(op.getSum(), arith::ConstantOp::create(
                           b, loc, type, DenseElementsAttr::get(type, 0.0f)));
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
      /*predicated=*/loop.getPart() != LoopPart::full);
  pending.push_back({op.getResult(), group});
  map.map(op.getResult(), buf);
  return success();
}

LogicalResult KernelEmitter::emitQK(QKOp op) {
  waitFor(op.getK());
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
  map.map(op.getResult(), pack(s));
  if (stages >= 2)
    prefetchNextKey(op);
  return success();
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
                  mul(kvHead, kStrideH), /*predicated=*/true, tileValid);
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
  // P as A fragments: keys 16kk..16kk+15 are the C fragments of n-tiles 2kk,
  // 2kk+1.
  SmallVector<Value> pa;
  for (int64_t mt = 0; mt < mTiles; ++mt)
    for (int64_t kk = 0; kk < nTiles / 2; ++kk) {
      auto c = [&](int64_t nt, int64_t i) {
        return p[(mt * nTiles + nt) * 4 + i];
      };
      pa.push_back(packPair(c(2 * kk, 0), c(2 * kk, 1)));
      pa.push_back(packPair(c(2 * kk, 2), c(2 * kk, 3)));
      pa.push_back(packPair(c(2 * kk + 1, 0), c(2 * kk + 1, 1)));
      pa.push_back(packPair(c(2 * kk + 1, 2), c(2 * kk + 1, 3)));
    }
  map.map(op.getProbs(), pack(pa));
  map.map(op.getNewMax(), pack(mNew));
  map.map(op.getNewSum(), pack(lNew));
  map.map(op.getAlpha(), pack(alpha));
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
  SmallVector<Value> p = unpack(map.lookup(op.getProbs()));
  SmallVector<Value> acc = unpack(map.lookup(op.getAcc()));
  Value vTile = map.lookup(op.getV());
  // B fragments of V (keys x d, row-major in smem) need ldmatrix.trans:
  // matrices (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys
  // 8-15, d 8-15).
  Value quad = divu(lane, 8);
  Value rowInBlock = add(remu(lane, 8), mul(remu(quad, 2), idx(8)));
  Value colInBlock = mul(divu(quad, 2), idx(8));
  int64_t kSteps = nTiles / 2;
  for (int64_t kk = 0; kk < kSteps; ++kk)
    for (int64_t dp = 0; dp < dTiles / 2; ++dp) {
      auto r = ldmatrix4(vTile, add(idx(kk * 16), rowInBlock),
                         add(idx(dp * 16), colInBlock), /*transpose=*/true);
      for (int64_t mt = 0; mt < mTiles; ++mt) {
        ArrayRef<Value> a(&p[(mt * kSteps + kk) * 4], 4);
        for (int64_t half = 0; half < 2; ++half) {
          MutableArrayRef<Value> c(&acc[(mt * dTiles + 2 * dp + half) * 4], 4);
          auto d = mma(a, {r[2 * half], r[2 * half + 1]}, c);
          std::copy(d.begin(), d.end(), c.begin());
        }
      }
    }
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
      .Default([&](Operation *o) {
        return o->emitOpError() << "has no sm_80 lowering";
      });
}

LogicalResult KernelEmitter::emit(gpu::GPUModuleOp gpuModule) {
  MLIRContext *ctx = b.getContext();
  auto global = gpu::AddressSpaceAttr::get(ctx, gpu::AddressSpace::Global);
  auto workgroup =
      gpu::AddressSpaceAttr::get(ctx, gpu::AddressSpace::Workgroup);
  auto gmem = [&](Type e) {
    return MemRefType::get({kUnboundedElements}, e, MemRefLayoutAttrInterface(),
                           global);
  };
  Type i64 = b.getI64Type(), f32 = b.getF32Type();
  SmallVector<Type> args = {gmem(elemType), gmem(elemType),
                            gmem(elemType), gmem(elemType),
                            gmem(f32),      gmem(b.getI32Type())};
  args.append(9, i64);
  args.push_back(f32);

  b.setInsertionPointToEnd(gpuModule.getBody());
  auto func = gpu::GPUFuncOp::create(b, loc, kernel.getSymName(),
                                     b.getFunctionType(args, {}));
  func->setAttr(gpu::GPUDialect::getKernelFuncAttrName(), b.getUnitAttr());
  // Becomes .maxntid: ptxas may then use up to 255 registers a thread.
  func.setKnownBlockSizeAttr(
      b.getDenseI32ArrayAttr({int32_t(threads()), 1, 1}));
  // Without .maxnreg ptxas may trade registers for occupancy and spill; one CTA
  // of these tiles a scheduler is the design point, so allow the full register
  // file.
  func->setAttr("nvvm.maxnreg", b.getI32IntegerAttr(255));
  Block &entry = func.getBody().front();
  b.setInsertionPointToStart(&entry);
  auto arg = [&](unsigned i) { return entry.getArgument(i); };
  qPtr = arg(0), kPtr = arg(1), vPtr = arg(2), oPtr = arg(3), lsePtr = arg(4),
  segPtr = arg(5);
  auto idxArg = [&](unsigned i) {
    return arith::IndexCastOp::create(b, loc, b.getIndexType(), arg(i))
        .getResult();
  };
  qStrideT = idxArg(6), qStrideH = idxArg(7), kStrideT = idxArg(8),
  kStrideH = idxArg(9), vStrideT = idxArg(10), vStrideH = idxArg(11),
  oStrideT = idxArg(12), oStrideH = idxArg(13), lseStrideH = idxArg(14);
  scaleLog2 = arg(15);

  tid = gpu::ThreadIdOp::create(b, loc, gpu::Dimension::x);
  lane = remu(tid, 32);
  warp = divu(tid, 32);
  g = divu(lane, 4);
  t = remu(lane, 4);
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
  auto tileType = [&](int64_t rows) {
    return MemRefType::get({rows, rowStride}, elemType,
                           MemRefLayoutAttrInterface(), workgroup);
  };
  // [Q: block_m rows][K: block_n rows][V: block_n rows], each row padded.
  int64_t kvOffset = blockM * rowStride * 2;
  qBuf = memref::ViewOp::create(b, loc, tileType(blockM), smem, idx(0),
                                ValueRange{});
  kBuf = memref::ViewOp::create(b, loc, tileType(blockN), smem, idx(kvOffset),
                                ValueRange{});
  vBuf = memref::ViewOp::create(b, loc, tileType(blockN), smem,
                                idx(kvOffset + blockN * rowStride * 2),
                                ValueRange{});

  for (Operation &op : kernel.getBody().front())
    if (failed(emitOp(&op)))
      return failure();

  b.setInsertionPointToEnd(&entry);
  gpu::ReturnOp::create(b, loc);
  return success();
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
      KernelEmitter emitter(kernel, b);
      if (failed(emitter.emit(gpuModule)))
        return signalPassFailure();
      // The launch reads these off the IR (and the runtime off KernelInfo).
      auto func = gpuModule.lookupSymbol<gpu::GPUFuncOp>(kernel.getSymName());
      func->setAttr("dualkv.shared_bytes",
                    b.getI64IntegerAttr(emitter.sharedBytes()));
      func->setAttr("dualkv.block_m",
                    b.getI64IntegerAttr(kernel.getTiling()->getBlockM()));
      kernel.erase();
    }
  }
};

} // namespace
