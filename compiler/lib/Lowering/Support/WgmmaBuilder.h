//===- WgmmaBuilder.h - wgmma.mma_async and its fences as inline PTX ------===//
//
// The builders of the warpgroup schedules (sm_90a): shared-memory matrix
// descriptors of the 128-byte swizzle (Lowering/Support/SharedTiles.h lays
// the tiles out), wgmma steps with A from shared memory or from registers,
// and the fence/commit/wait around them, as dualkv.wgmma* ops (lowered to PTX
// by dualkv-nvgpu-to-nvvm). Accumulators are fp32 registers, m64nN layout:
// warp w of a warpgroup holds rows 16w + g and 16w + g + 8.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_COMMON_WGMMABUILDER_H
#define DUALKV_COMPILER_COMMON_WGMMABUILDER_H

#include "dualkv/Compiler/Passes.h"

#include <string>

namespace mlir::dualkv {

class WgmmaBuilder {
public:
  /// `headDim` columns a tile (the N of regsA); products over the head
  /// dimension (overHeadDim) contract its first `contractDim` (0: all), which
  /// is head_dim 96 in tiles of 128 columns whose last 32 are zero.
  WgmmaBuilder(OpBuilder &b, Location loc, Type elemType, int64_t headDim,
               int64_t contractDim = 0)
      : b(b), loc(loc), elemType(elemType), headDim(headDim),
        contractDim(contractDim ? contractDim : headDim) {}

  void fence() { WgmmaFenceOp::create(b, loc); }
  void commit() { WgmmaCommitOp::create(b, loc); }
  /// Waits until at most `pending` wgmma groups are in flight. `regs` (fp32
  /// accumulators of those groups) pass through the wait, so nothing reads
  /// them before it.
  void wait(int64_t pending, MutableArrayRef<Value> regs) {
    waitKeeping(pending, regs, {});
  }
  /// wait(), with also the A registers `aRegs` of the retiring groups passed
  /// through, so nothing redefines them while wgmma may still read them.
  void waitKeeping(int64_t pending, MutableArrayRef<Value> regs,
                   MutableArrayRef<Value> aRegs) {
    SmallVector<Value> values(regs);
    values.append(aRegs.begin(), aRegs.end());
    auto op = WgmmaWaitOp::create(b, loc, ValueRange(values).getTypes(),
                                  b.getI64IntegerAttr(pending), values);
    for (size_t i = 0; i < values.size(); ++i)
      (i < regs.size() ? regs[i] : aRegs[i - regs.size()]) = op.getResult(i);
  }
  /// Shared-memory matrix descriptor of the 128-byte swizzle for the operand
  /// at shared address `addr` (1024-byte aligned atoms): leading and stride
  /// byte offsets `lbo`, `sbo`.
  Value desc(Value addr, int64_t lbo, int64_t sbo) {
    Type i64 = b.getI64Type();
    Value a = arith::IndexCastOp::create(b, loc, i64, addr);
    a = arith::ShRUIOp::create(b, loc, a,
                               arith::ConstantIntOp::create(b, loc, i64, 4));
    a = arith::AndIOp::create(
        b, loc, a, arith::ConstantIntOp::create(b, loc, i64, 0x3FFF));
    uint64_t fields = (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32) |
                      (uint64_t(1) << 62);
    return arith::OrIOp::create(
        b, loc, a, arith::ConstantIntOp::create(b, loc, i64, int64_t(fields)));
  }
  /// The descriptor `desc` moved `bytes` further (a multiple of 16; the
  /// address field does not overflow inside the 228 KB of shared memory).
  Value descPlus(Value desc, int64_t bytes) {
    if (!bytes)
      return desc;
    Type i64 = b.getI64Type();
    return arith::AddIOp::create(
        b, loc, desc, arith::ConstantIntOp::create(b, loc, i64, bytes >> 4));
  }
  /// acc (m64 x n fp32, n / 2 registers a thread; empty: start from zero) +=
  /// A B for one k16 step of a warpgroup. A is `aDesc` (shared memory,
  /// M-major when tnspA) or, when aDesc is null, the four registers `aRegs`
  /// (the m16n8k16 A fragment of the warp's 16 rows); B is `bDesc` (N-major
  /// when tnspB).
  SmallVector<Value> step(ArrayRef<Value> acc, int64_t n, Value aDesc,
                          ArrayRef<Value> aRegs, Value bDesc, bool tnspA,
                          bool tnspB) {
    SmallVector<Type> results(n / 2, b.getF32Type());
    auto op = WgmmaOp::create(b, loc, results, acc, aDesc,
                              aDesc ? ArrayRef<Value>() : aRegs, bDesc,
                              b.getI64IntegerAttr(n), TypeAttr::get(elemType),
                              tnspA ? b.getUnitAttr() : UnitAttr(),
                              tnspB ? b.getUnitAttr() : UnitAttr());
    return SmallVector<Value>(op.getResult());
  }

  /// acc (empty: from zero) += A Bᵀ over the head dimension: A (m64, `aDesc`)
  /// and B (n rows, `bDesc`) K-major swizzled tiles of `aRows` and `bRows`
  /// rows; contractDim / 16 k-steps of 32 bytes, the next atom every 4.
  SmallVector<Value> overHeadDim(SmallVector<Value> acc, int64_t n, Value aDesc,
                                 int64_t aRows, Value bDesc, int64_t bRows) {
    for (int64_t kt = 0; kt < contractDim / 16; ++kt) {
      int64_t off = (kt / 4) * 128, in = (kt % 4) * 32;
      acc = step(acc, n, descPlus(aDesc, off * aRows + in), {},
                 descPlus(bDesc, off * bRows + in), false, false);
    }
    return acc;
  }
  /// acc (m64 x D) += A B with A the packed A fragments `aRegs` (four a
  /// k-step) and B (`bDesc`, rows x D) N-major, 16 rows a k-step.
  SmallVector<Value> regsA(SmallVector<Value> acc, ArrayRef<Value> aRegs,
                           Value bDesc) {
    for (int64_t kk = 0; kk < int64_t(aRegs.size()) / 4; ++kk)
      acc = step(acc, headDim, Value(), aRegs.slice(kk * 4, 4),
                 descPlus(bDesc, kk * 16 * 128), false, true);
    return acc;
  }

private:
  OpBuilder &b;
  Location loc;
  Type elemType;
  int64_t headDim, contractDim;
};

} // namespace mlir::dualkv

#endif
