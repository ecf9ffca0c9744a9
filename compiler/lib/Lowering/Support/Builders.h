//===- Builders.h - one-line builders of index and fp32 arithmetic --------===//
//
// The arithmetic every emitter and the tile-op library spell the same way:
// index and fp32 constants, index arithmetic, compares and selects, the
// approximate exp2/log2 the kernels' softmax uses, quad shuffles, and vectors
// of scalars. A value type over one OpBuilder and location, so free functions
// take it as their first argument instead of inheriting a base class.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_COMMON_BUILDERS_H
#define DUALKV_COMPILER_COMMON_BUILDERS_H

#include "dualkv/Compiler/Passes.h"

namespace mlir::dualkv {

/// log2(e): the kernels compute exp(x) as exp2(x * log2(e)).
constexpr float kLog2e = 1.4426950408889634f;
/// ln(2): LSE leaves the kernels in natural log.
constexpr float kLn2 = 0.6931471805599453f;

class ScalarBuilder {
public:
  ScalarBuilder(OpBuilder &b, Location loc) : b(b), loc(loc) {}

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
  /// The elements of the 1-D vector `vec` as scalars.
  SmallVector<Value> unpack(Value vec) {
    auto type = cast<VectorType>(vec.getType());
    SmallVector<Value> out;
    for (int64_t i = 0; i < type.getNumElements(); ++i)
      out.push_back(
          vector::ExtractOp::create(b, loc, vec, ArrayRef<int64_t>{i}));
    return out;
  }
  /// `elems` (of one type) as a 1-D vector.
  Value pack(ArrayRef<Value> elems) {
    auto type =
        VectorType::get({int64_t(elems.size())}, elems.front().getType());
    return vector::FromElementsOp::create(b, loc, type, elems);
  }

  OpBuilder &b;
  Location loc;
};

} // namespace mlir::dualkv

#endif
