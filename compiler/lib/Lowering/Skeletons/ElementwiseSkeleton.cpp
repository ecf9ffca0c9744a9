//===- ElementwiseSkeleton.cpp - bwd_pre and bwd_post, on every arch ------===//
//
// A warp per row, each lane D / 32 contiguous elements (DV / 32 of O, dO and
// dV): Delta = rowsum(O dO) before the backward, the fp32 accumulators to the
// element type after it (docs/backward-abi.md).
//
//===----------------------------------------------------------------------===//
#include "Lowering/ScheduleEmitters.h"
#include "Lowering/Skeletons/KVMajorSkeleton.h"

using namespace mlir;
using namespace mlir::dualkv;

namespace {

class ElementwiseEmitter : public BackwardEmitterBase {
public:
  ElementwiseEmitter(KernelOp kernel, OpBuilder &b)
      : BackwardEmitterBase(kernel, b) {}
  LogicalResult emit(gpu::GPUModuleOp gpuModule);
  /// Registers only.
  int64_t sharedBytes() const { return 0; }

private:
  /// Calls body(row) for rows [first, first + blockM) below `limit`, one warp
  /// per row.
  template <typename Fn> void forEachRow(Value first, Value limit, Fn body) {
    int64_t rowsPerWarp = blockM / warps;
    auto loop = scf::ForOp::create(b, loc, idx(0), idx(rowsPerWarp), idx(1));
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(loop.getBody());
    Value row = add(
        first, add(mul(ids.warp, idx(rowsPerWarp)), loop.getInductionVar()));
    emitIf(cmp(arith::CmpIPredicate::ult, row, limit), [&] { body(row); });
  }
  /// `width`: the row's elements (0: headDim).
  Value loadVec(Value ptr, Value at, Type elem, int64_t width = 0) {
    return vector::LoadOp::create(
        b, loc, VectorType::get({perLane(width)}, elem), ptr, ValueRange{at});
  }
  int64_t perLane(int64_t width = 0) const {
    return (width ? width : headDim) / 32;
  }
  Value laneCol(int64_t width = 0) {
    return mul(ids.lane, idx(perLane(width)));
  }
  /// bwd_pre of a caller that differentiates the LSE
  /// (#dualkv.problem<..., dlse = true>): Delta - dLSE.
  bool subtractsDlse() {
    return kernel.getProblem() && kernel.getProblem()->getDlse();
  }
  /// bwd_pre with attention sinks (#dualkv.problem<..., sinks = true>): it
  /// also adds each row's share of dL/dsinks.
  bool hasSinks() {
    return kernel.getProblem() && kernel.getProblem()->getSinks();
  }
  LogicalResult emitPre();
  LogicalResult emitPost();
};

LogicalResult ElementwiseEmitter::emitPre() {
  Value o = fn.param("o"), dout = fn.param("dout"), delta = fn.param("delta");
  Value oT = fn.indexParam("oStrideT"), oH = fn.indexParam("oStrideH"),
        doT = fn.indexParam("doStrideT"), doH = fn.indexParam("doStrideH"),
        deltaH = fn.indexParam("deltaStrideH"),
        tokens = fn.indexParam("numTokens");
  Value block = gpu::BlockIdOp::create(b, loc, gpu::Dimension::x);
  Value head = gpu::BlockIdOp::create(b, loc, gpu::Dimension::y);
  // O and dO rows: the value head_dim.
  const int64_t w = valueHeadDim;
  auto f32Vec = VectorType::get({perLane(w)}, b.getF32Type());
  forEachRow(mul(block, idx(blockM)), tokens, [&](Value row) {
    Value ov = loadVec(o, add(add(mul(row, oT), mul(head, oH)), laneCol(w)),
                       elemType, w);
    Value dv = loadVec(
        dout, add(add(mul(row, doT), mul(head, doH)), laneCol(w)), elemType, w);
    Value prod =
        arith::MulFOp::create(b, loc, arith::ExtFOp::create(b, loc, f32Vec, ov),
                              arith::ExtFOp::create(b, loc, f32Vec, dv));
    Value sum =
        vector::ReductionOp::create(b, loc, vector::CombiningKind::ADD, prod);
    for (int32_t offset : {16, 8, 4, 2, 1})
      sum = arith::AddFOp::create(b, loc, sum, shuffleXor(sum, offset));
    emitIf(cmp(arith::CmpIPredicate::eq, ids.lane, idx(0)), [&] {
      if (subtractsDlse()) {
        // d(loss)/dLSE enters every dS as + P dLSE: Delta' = Delta - dLSE.
        Value dlse = memref::LoadOp::create(
            b, loc, fn.param("dlse"),
            ValueRange{add(mul(head, fn.indexParam("dlseStrideH")), row)});
        sum = arith::SubFOp::create(b, loc, sum, dlse);
      }
      memref::StoreOp::create(b, loc, sum, delta,
                              ValueRange{add(mul(head, deltaH), row)});
      if (hasSinks()) {
        // dL/dsink_h = -sum_i exp(sink_h - LSE_i) Delta'_i: each row adds
        // its term (fp32 atomics; the runtime zeroes dsinks first).
        Value lse = memref::LoadOp::create(
            b, loc, fn.param("lse"),
            ValueRange{add(mul(head, fn.indexParam("lseStrideH")), row)});
        Value sink =
            memref::LoadOp::create(b, loc, fn.param("sinks"), ValueRange{head});
        Value p = exp2(arith::MulFOp::create(
            b, loc, arith::SubFOp::create(b, loc, sink, lse), f32c(kLog2e)));
        Value term = arith::NegFOp::create(
            b, loc, arith::MulFOp::create(b, loc, p, sum));
        atomicAdd(fn.param("dsinks"), head, term);
      }
    });
  });
  return success();
}

LogicalResult ElementwiseEmitter::emitPost() {
  Value dqAcc = fn.param("dqacc"), dkAcc = fn.param("dkacc"),
        dvAcc = fn.param("dvacc"), dq = fn.param("dq"), dk = fn.param("dk"),
        dv = fn.param("dv"), accTokens = fn.param("accTokens");
  Value dqT = fn.indexParam("dqStrideT"), dqH = fn.indexParam("dqStrideH"),
        dkT = fn.indexParam("dkStrideT"), dkH = fn.indexParam("dkStrideH"),
        dvT = fn.indexParam("dvStrideT"), dvH = fn.indexParam("dvStrideH"),
        tokens = fn.indexParam("numTokens"),
        accRows = fn.indexParam("numAccRows");
  Value block = gpu::BlockIdOp::create(b, loc, gpu::Dimension::x);
  Value y = gpu::BlockIdOp::create(b, loc, gpu::Dimension::y);
  Value first = mul(block, idx(blockM));
  auto convert = [&](Value src, Value srcAt, Value dst, Value dstAt,
                     int64_t width = 0) {
    Value v = loadVec(src, srcAt, b.getF32Type(), width);
    auto narrowType = VectorType::get({perLane(width)}, elemType);
    vector::StoreOp::create(b, loc,
                            arith::TruncFOp::create(b, loc, narrowType, v), dst,
                            ValueRange{dstAt});
  };
  auto isQ = scf::IfOp::create(
      b, loc, cmp(arith::CmpIPredicate::ult, y, idx(numQHeads)),
      /*withElseRegion=*/true);
  {
    // dQ of query head y: [T][Hq][D] fp32 to dq.
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(isQ.thenBlock());
    forEachRow(first, tokens, [&](Value row) {
      Value src =
          add(mul(add(mul(row, idx(numQHeads)), y), idx(headDim)), laneCol());
      convert(dqAcc, src, dq, add(add(mul(row, dqT), mul(y, dqH)), laneCol()));
    });
  }
  {
    // Prompt dK/dV of KV head y - Hq: accumulator row r belongs to token
    // accTokens[r].
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(isQ.elseBlock());
    Value kvHead = arith::SubIOp::create(b, loc, y, idx(numQHeads));
    forEachRow(first, accRows, [&](Value row) {
      Value token =
          toIndex(memref::LoadOp::create(b, loc, accTokens, ValueRange{row}));
      Value accKey = add(mul(row, idx(numKVHeads)), kvHead);
      Value src = add(mul(accKey, idx(headDim)), laneCol());
      convert(dkAcc, src, dk,
              add(add(mul(token, dkT), mul(kvHead, dkH)), laneCol()));
      // dV rows: the value head_dim ([rows][Hkv][DV] in its accumulator).
      const int64_t w = valueHeadDim;
      Value vSrc = w == headDim ? src : add(mul(accKey, idx(w)), laneCol(w));
      convert(dvAcc, vSrc, dv,
              add(add(mul(token, dvT), mul(kvHead, dvH)), laneCol(w)), w);
    });
  }
  return success();
}

LogicalResult ElementwiseEmitter::emit(gpu::GPUModuleOp gpuModule) {
  if (blockM % warps != 0)
    return kernel.emitOpError()
           << "block_m (" << blockM << ") must split evenly over " << warps
           << " warps";
  bool pre = kernel.getKind() == KernelKind::bwd_pre;
  fn.create(gpuModule, kernel.getSymName(), kernel.getKind(), threads(),
            ::dualkv::Schedule::Auto, /*tree=*/false, subtractsDlse(),
            hasSinks());
  ids = ThreadIds::emit(*this);
  if (failed(pre ? emitPre() : emitPost()))
    return failure();
  gpu::ReturnOp::create(b, loc);
  return success();
}

} // namespace

LogicalResult mlir::dualkv::emitElementwiseKernel(KernelOp kernel, OpBuilder &b,
                                                  gpu::GPUModuleOp gpuModule,
                                                  int64_t *sharedBytes) {
  return emitWith<ElementwiseEmitter>(kernel, b, gpuModule, sharedBytes);
}
