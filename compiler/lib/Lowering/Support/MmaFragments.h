//===- MmaFragments.h - register fragments of mma.sync.m16n8k16 -----------===//
//
// Fragments of mma.sync.m16n8k16 are held as flat vectors (each op unpacks
// the fragments it reads into scalars and packs what it writes, so LLVM keeps
// everything in registers): A fragments of four i32 registers (two elements
// each), B fragments of two, C fragments of four fp32 values. Within a warp,
// lane = 4 * g + t (ThreadIds, KernelFunction.h): a C fragment holds rows g
// and g + 8, columns 2t and 2t + 1 of its 16 x 8 tile. MmaFragments builds
// the fragments, ldmatrix and the products; beside it, fresh fp32 vectors,
// opaque index copies and inline PTX, which wgmma's schedules use as well.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_COMMON_MMAFRAGMENTS_H
#define DUALKV_COMPILER_COMMON_MMAFRAGMENTS_H

#include "Lowering/Support/Builders.h"

#include <array>
#include <optional>
#include <string>

namespace mlir::dualkv {

/// Volatile inline PTX with `results` f32 results (returned), for
/// instructions MLIR 22's NVVM dialect has no op for (each use says which);
/// ties between results and operands are spelled in `constraints`.
inline SmallVector<Value> inlinePtxF32(OpBuilder &b, Location loc,
                                       StringRef code, std::string constraints,
                                       ValueRange operands, int64_t results) {
  Type resType;
  if (results) {
    SmallVector<Type> fields(results, b.getF32Type());
    resType = LLVM::LLVMStructType::getLiteral(b.getContext(), fields);
  }
  auto op = LLVM::InlineAsmOp::create(
      b, loc, resType, operands, code, constraints,
      /*has_side_effects=*/true, /*is_align_stack=*/false,
      LLVM::tailcallkind::TailCallKind::None, LLVM::AsmDialectAttr(),
      ArrayAttr());
  SmallVector<Value> out;
  for (int64_t i = 0; i < results; ++i)
    out.push_back(LLVM::ExtractValueOp::create(b, loc, op.getResult(0),
                                               ArrayRef<int64_t>{i}));
  return out;
}

/// A copy of the index `v` that LLVM cannot see through or move: an
/// (index-width, 32-bit) register move in volatile inline assembly. Inline
/// PTX on purpose: no NVVM op is opaque to LLVM's optimisers.
inline Value opaque(ScalarBuilder &o, Value v) {
  OpBuilder &b = o.b;
  Value i32 = arith::IndexCastOp::create(b, o.loc, b.getI32Type(), v);
  auto asmOp = LLVM::InlineAsmOp::create(
      b, o.loc, b.getI32Type(), ValueRange{i32}, "mov.b32 $0, $1;", "=r,r",
      /*has_side_effects=*/true, /*is_align_stack=*/false,
      LLVM::tailcallkind::TailCallKind::None, LLVM::AsmDialectAttr(),
      ArrayAttr());
  return o.toIndex(asmOp.getResult(0));
}

/// A vector of `n` fp32 values all equal to `v` (fresh accumulators and
/// statistics).
inline Value splat(ScalarBuilder &o, int64_t n, float v) {
  auto type = VectorType::get({n}, o.b.getF32Type());
  return arith::ConstantOp::create(o.b, o.loc, type,
                                   DenseElementsAttr::get(type, v));
}

/// The fragments of mma.sync.m16n8k16 over elements of `elemType` (f16 or
/// bf16), ldmatrix, and the products.
class MmaFragments {
public:
  MmaFragments(ScalarBuilder o, Type elemType) : o(o), elemType(elemType) {}

  /// Two fp32 values rounded to the element type and packed into one i32
  /// register.
  Value packPair(Value lo, Value hi) {
    OpBuilder &b = o.b;
    Value pair = o.pack({lo, hi});
    Value narrow =
        arith::TruncFOp::create(b, o.loc, VectorType::get({2}, elemType), pair);
    Value asInt = vector::BitCastOp::create(
        b, o.loc, VectorType::get({1}, b.getI32Type()), narrow);
    return vector::ExtractOp::create(b, o.loc, asInt, ArrayRef<int64_t>{0});
  }
  /// ldmatrix.x4 at (row, col) of `buf`: four i32 registers, one per 8x8
  /// matrix.
  SmallVector<Value, 4> ldmatrix4(Value buf, Value row, Value col,
                                  bool transpose) {
    return ldmatrix(buf, row, col, transpose, 4);
  }
  /// ldmatrix.x2 at (row, col) of `buf`: two i32 registers, the matrices
  /// lanes 0-7 and 8-15 address (the others' addresses are ignored). With
  /// the addresses of ldmatrix4's (k 0-7, n 0-7), (k 8-15, n 0-7), ...
  /// order, the B fragment of the first n8 tile: head_dim 96's odd 8-column
  /// tile.
  SmallVector<Value, 4> ldmatrix2(Value buf, Value row, Value col,
                                  bool transpose) {
    return ldmatrix(buf, row, col, transpose, 2);
  }
  SmallVector<Value, 4> ldmatrix(Value buf, Value row, Value col,
                                 bool transpose, int64_t count) {
    OpBuilder &b = o.b;
    auto vecType = VectorType::get({count, 2}, elemType);
    Value m = nvgpu::LdMatrixOp::create(b, o.loc, vecType, buf,
                                        ValueRange{row, col}, transpose, count);
    SmallVector<Value, 4> regs;
    for (int64_t i = 0; i < count; ++i) {
      Value pair = vector::ExtractOp::create(b, o.loc, m, ArrayRef<int64_t>{i});
      Value asInt = vector::BitCastOp::create(
          b, o.loc, VectorType::get({1}, b.getI32Type()), pair);
      regs.push_back(
          vector::ExtractOp::create(b, o.loc, asInt, ArrayRef<int64_t>{0}));
    }
    return regs;
  }
  /// d = a * b + c for one m16n8k16 tile; a: 4 i32, b: 2 i32, c: 4 f32.
  SmallVector<Value, 4> mma(ArrayRef<Value> a, ArrayRef<Value> bfrag,
                            ArrayRef<Value> c) {
    OpBuilder &b = o.b;
    Location loc = o.loc;
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

  /// fp32 C fragments of mTiles x nTiles (m16 x n8) tiles repacked as A
  /// fragments (two elements a register) of a product over their columns:
  /// k-step kk covers columns 16kk..16kk+15, the C fragments of n-tiles 2kk
  /// and 2kk + 1.
  SmallVector<Value> packAFragments(ArrayRef<Value> c, int64_t mTiles,
                                    int64_t nTiles) {
    SmallVector<Value> a;
    for (int64_t mt = 0; mt < mTiles; ++mt)
      for (int64_t kk = 0; kk < nTiles / 2; ++kk) {
        auto at = [&](int64_t nt, int64_t i) {
          return c[(mt * nTiles + nt) * 4 + i];
        };
        a.push_back(packPair(at(2 * kk, 0), at(2 * kk, 1)));
        a.push_back(packPair(at(2 * kk, 2), at(2 * kk, 3)));
        a.push_back(packPair(at(2 * kk + 1, 0), at(2 * kk + 1, 1)));
        a.push_back(packPair(at(2 * kk + 1, 2), at(2 * kk + 1, 3)));
      }
    return a;
  }
  /// acc (mTiles x dTiles C fragments) += A B, with A the packed fragments
  /// of mTiles x kSteps m16k16 blocks (packAFragments) and B the first
  /// 16 kSteps rows of `bBuf` (row-major, padded rows; k along the rows,
  /// n = dTiles * 8 along the columns), read with ldmatrix.trans: matrices
  /// (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
  /// `lane` gives the ldmatrix addresses; `bCol0` (if set) the first of B's
  /// columns in `bBuf`.
  void mmaTransposedB(MutableArrayRef<Value> acc, ArrayRef<Value> a, Value bBuf,
                      Value lane, int64_t mTiles, int64_t kSteps,
                      int64_t dTiles, Value bCol0 = Value()) {
    Value quad = o.divu(lane, 8);
    Value rowInBlock = o.add(o.remu(lane, 8), o.mul(o.remu(quad, 2), o.idx(8)));
    Value colInBlock = o.mul(o.divu(quad, 2), o.idx(8));
    if (bCol0)
      colInBlock = o.add(bCol0, colInBlock);
    for (int64_t kk = 0; kk < kSteps; ++kk)
      for (int64_t dp = 0; dp < dTiles / 2; ++dp) {
        auto r = ldmatrix4(bBuf, o.add(o.idx(kk * 16), rowInBlock),
                           o.add(o.idx(dp * 16), colInBlock),
                           /*transpose=*/true);
        for (int64_t mt = 0; mt < mTiles; ++mt) {
          ArrayRef<Value> am(&a[(mt * kSteps + kk) * 4], 4);
          for (int64_t half = 0; half < 2; ++half) {
            MutableArrayRef<Value> c(&acc[(mt * dTiles + 2 * dp + half) * 4],
                                     4);
            auto d = mma(am, {r[2 * half], r[2 * half + 1]}, c);
            std::copy(d.begin(), d.end(), c.begin());
          }
        }
      }
  }

private:
  ScalarBuilder o;
  Type elemType;
};

} // namespace mlir::dualkv

#endif
