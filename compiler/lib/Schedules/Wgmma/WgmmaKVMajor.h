//===- WgmmaKVMajor.h - the warpgroup schedule of the KV-major backward ---===//
//
// The emitter of Schedules/Wgmma/WgmmaKVMajor.cpp (its file comment says how it
// computes), declared here so that the warp-specialized backward
// (Schedules/WarpSpecialized/WarpSpecializedKVMajor.cpp) computes its products
// the same way.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_WGMMA_KVMAJOR_H
#define DUALKV_COMPILER_WGMMA_KVMAJOR_H

#include "Lowering/Skeletons/KVMajorSkeleton.h"
#include "Lowering/Support/WgmmaBuilder.h"

namespace mlir::dualkv {

class WgmmaKVMajorEmitter : public KVMajorEmitter {
public:
  WgmmaKVMajorEmitter(KernelOp kernel, OpBuilder &b)
      : KVMajorEmitter(kernel, b), wg(b, loc, elemType, headDim) {
    rowStride = headDim;
    dsRowStride = blockN;
    swizzledTiles = true;
    waitOncePerTile = true;
    copies.wgmmaReadsTiles = true;
  }

  /// The dQ staging buffer (bwd), then 1 KB more, to align the buffers to
  /// the swizzle's 1024 bytes.
  int64_t sharedBytes() const override {
    return dqOffset() + (withDq ? blockN * dqRowBytes() : 0) + 1024;
  }
  int64_t dqOffset() const { return KVMajorEmitter::sharedBytes(); }
  /// A dQ row: D floats and 8 of padding, so that the 8 rows of a C fragment
  /// store fall in different banks; a multiple of 16 bytes, as bulk copies
  /// need.
  int64_t dqRowBytes() const { return (headDim + 8) * 4; }

protected:
  void layoutTiles() override {
    int64_t blockBytes = blockM * rowStride * 2;
    smemAddr = smemTiles.alignToSwizzle(smem, sharedBytes());
    warpGroup = divu(ids.warp, 4);
    kBuf = smemTiles.swizzledTile(smem, 0, blockM);
    vBuf = smemTiles.swizzledTile(smem, blockBytes, blockM);
    if (withDq)
      dsBuf = smemTiles.sharedTile(smem, dsOffset(), blockM, blockN);
  }
  void beginQIteration(Value parity) override {
    // As aLane: an opaque base each iteration keeps LLVM from hoisting every
    // k-step's descriptor into registers of its own.
    Value base = opaque(*this, smemAddr);
    kAddr = base;
    vAddr = add(base, idx(blockM * rowStride * 2));
    dsAddr = add(base, idx(dsOffset()));
    qAddrCur = add(base, add(idx(qOffset()), mul(parity, idx(tileBytes()))));
    doAddrCur = add(base, add(idx(doOffset()), mul(parity, idx(tileBytes()))));
  }
  void endQIteration() override {
    if (!inFlight.empty())
      waitWgmma(Value());
    if (withDq)
      onDqIssuers([&] { bulkWait(*this, 0, /*readOnly=*/true); });
  }
  void endKernel() override {
    // Every bulk reduction has reached global memory before the CTA ends.
    if (withDq)
      onDqIssuers([&] { bulkWait(*this, 0, /*readOnly=*/false); });
  }
  LogicalResult emitQKT(QKTOp op) override;
  LogicalResult emitAccumulate(AccumulateOp op) override;
  LogicalResult emitAccumulateDq(AccumulateDqOp op) override {
    SmallVector<Value> ds = unpack(map.lookup(op.getDs()));
    Value tile = map.lookup(op->getParentOfType<QLoopOp>().getTileIndex());
    SmallVector<Value> acc = dqWgmma(ds);
    reduceDqBulk(acc, mul(tile, idx(blockN)));
    return success();
  }
  /// Runs `body` on the threads that issue dQ's bulk reductions: thread r
  /// for query row r of the tile.
  template <typename Fn> void onDqIssuers(Fn body) {
    emitIf(cmp(arith::CmpIPredicate::ult, ids.tid, idx(blockN)), body);
  }
  /// Stores the warp's dQ C fragments (dqWgmma's) in the staging buffer and
  /// adds each query row of the tile starting at query `first` to the fp32
  /// dQ accumulator with one bulk reduction.
  void reduceDqBulk(ArrayRef<Value> acc, Value first);
  /// Stores the warp's dSᵀ rows (keys 16 warp + g, + 8) in dsBuf, swizzled.
  void storeDsT(ArrayRef<Value> ds);
  /// Called in dqWgmma before this warp stores dSᵀ: whatever must precede
  /// overwriting the last tile's (a barrier in dqWgmma orders it here).
  virtual void beforeDsStore() {}
  /// Stores the warp's dQ C fragments in a staging buffer: dqWgmma's by
  /// default (columns from 64 (warp / 4), the buffer at dqOffset()), else
  /// columns from `colBase` into the buffer at byte `offset`.
  void stageDq(ArrayRef<Value> acc, Value colBase = {}, Value offset = {});
  /// Issues the bulk reduction of row `row` of staging buffer `buffer` (query
  /// `first` + row of the item) into the fp32 dQ accumulator, if that query
  /// is in the item.
  void reduceDqRow(Value row, Value first, int64_t buffer = 0);

  WgmmaBuilder wg;
  // Warpgroup w (warps 4w..4w+3) owns keys 64w..64w+63; its warps hold the
  // same C fragments as the one-m16-block layout (keys 16 warp + g, + 8), so
  // masking, softmax and the stores are shared with it. Shared addresses of
  // the buffers for the descriptors:
  Value smemAddr, kAddr, vAddr, dsAddr, qAddrCur, doAddrCur;
  Value warpGroup;
  /// wgmma groups committed but not waited for, oldest first: the dialect
  /// value each computes and its accumulator registers. A wait takes the
  /// finished ones along and remaps their values.
  SmallVector<std::pair<Value, SmallVector<Value>>> inFlight;
  /// Commits the wgmma group just issued, which computes `result` into
  /// `regs`, and maps `result` to them (to be read once waited for).
  void commitWgmma(Value result, ArrayRef<Value> regs) {
    wg.commit();
    map.map(result, pack(regs));
    inFlight.push_back({result, SmallVector<Value>(regs)});
  }
  /// Waits until the group computing `result` is done; with a null `result`
  /// until every group is, `newest` (the registers of a group committed
  /// outside inFlight) passing through the wait as well.
  void waitWgmma(Value result, MutableArrayRef<Value> newest = {});
  /// Issues Sᵀ = K Qᵀ (or dPᵀ = V dOᵀ) of `op` as one group.
  void issueQKTWgmma(QKTOp op);
  /// The shared address of buffer `buf` (kBuf, vBuf, qCur, doCur, dsBuf).
  Value addrOf(Value buf) {
    if (buf == kBuf)
      return kAddr;
    if (buf == vBuf)
      return vAddr;
    if (buf == qCur)
      return qAddrCur;
    if (buf == doCur)
      return doAddrCur;
    return dsAddr;
  }
  /// dQ = dS K with wgmma: dSᵀ to shared memory, each warpgroup 64 queries x
  /// D/2; returns the warp's C fragments (rows 16 (warp % 4) + g, + 8).
  SmallVector<Value> dqWgmma(ArrayRef<Value> ds);
};

} // namespace mlir::dualkv

#endif
