//===- HopperSync.h - fences, bulk groups, mbarriers and TMA (sm_90a) -----===//
//
// The synchronisation of the sm_90a schedules, as free functions over a
// ScalarBuilder: the proxy fence that makes generic-proxy writes visible to
// wgmma and bulk copies, bulk-group commits and waits, named barriers,
// mbarrier waits and arrivals, the TMA load of a 128-byte-swizzled tile, and
// the slot and phase of a ring of mbarrier-guarded slots (RingSlot).
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_COMMON_HOPPERSYNC_H
#define DUALKV_COMPILER_COMMON_HOPPERSYNC_H

#include "Lowering/Support/Builders.h"

namespace mlir::dualkv {

/// An index as an i32.
inline Value i32Of(ScalarBuilder &o, Value index) {
  return arith::IndexCastOp::create(o.b, o.loc, o.b.getI32Type(), index);
}

/// Makes this thread's generic-proxy shared-memory writes (st.shared,
/// cp.async) visible to wgmma's reads (fence.proxy.async.shared::cta).
inline void proxyFence(ScalarBuilder &o) {
  MLIRContext *ctx = o.b.getContext();
  NVVM::FenceProxyOp::create(
      o.b, o.loc, NVVM::ProxyKindAttr::get(ctx, NVVM::ProxyKind::async_shared),
      NVVM::SharedSpaceAttr::get(ctx, NVVM::SharedSpace::shared_cta));
}
/// Commits the bulk copies and reductions issued so far into a bulk
/// group (cp.async.bulk.commit_group).
inline void bulkCommit(ScalarBuilder &o) {
  NVVM::CpAsyncBulkCommitGroupOp::create(o.b, o.loc);
}
/// Waits until at most `pending` of this thread's bulk groups are in
/// flight; with `readOnly`, only until they have read their sources
/// (cp.async.bulk.wait_group[.read]).
inline void bulkWait(ScalarBuilder &o, int32_t pending, bool readOnly) {
  NVVM::CpAsyncBulkWaitGroupOp::create(
      o.b, o.loc, o.b.getI32IntegerAttr(pending),
      readOnly ? o.b.getUnitAttr() : UnitAttr());
}

/// bar.sync on named barrier `id` (an i32) of `count` threads.
inline void namedBarrier(ScalarBuilder &o, Value id, int64_t count) {
  NVVM::BarrierOp::create(o.b, o.loc, Type(), id, o.i32c(int32_t(count)),
                          NVVM::BarrierReductionAttr(), Value());
}
/// A shared-memory address (index) as an LLVM shared pointer.
inline Value sharedPtr(ScalarBuilder &o, Value addr) {
  return LLVM::IntToPtrOp::create(
      o.b, o.loc, LLVM::LLVMPointerType::get(o.b.getContext(), 3),
      i32Of(o, addr));
}
/// Waits until the phase of mbarrier `bar` with parity `parity` (an
/// index) has completed.
inline void waitParity(ScalarBuilder &o, Value bar, Value parity) {
  NVVM::MBarrierTryWaitParityOp::create(o.b, o.loc, bar, i32Of(o, parity),
                                        o.i32c(0x989680));
}
/// Arrives on mbarrier `bar`.
inline void arrive(ScalarBuilder &o, Value bar) {
  NVVM::MBarrierArriveOp::create(o.b, o.loc, Type(), bar, Value());
}

/// TMA of `rows` x `cols` elements at token `row`, head `head` of the 3-D
/// tensor map `tensorMap` (head_dim, heads, tokens; boxes of 64 columns)
/// into the 128-byte-swizzled tile at shared address `dst`: cols / 64
/// boxes, one swizzle atom each, completing on mbarrier `bar`; from column
/// `col0` (if set) on.
inline void tmaLoadTile(ScalarBuilder &o, Value tensorMap, Value dst,
                        int64_t rows, int64_t cols, Value row, Value head,
                        Value bar, Value col0 = Value()) {
  auto cluster = LLVM::LLVMPointerType::get(o.b.getContext(), 7);
  for (int64_t a = 0; a < cols / 64; ++a) {
    Value to = LLVM::AddrSpaceCastOp::create(
        o.b, o.loc, cluster, sharedPtr(o, o.add(dst, o.idx(a * rows * 128))));
    Value col =
        col0 ? i32Of(o, o.add(col0, o.idx(a * 64))) : o.i32c(int32_t(a * 64));
    NVVM::CpAsyncBulkTensorGlobalToSharedClusterOp::create(
        o.b, o.loc, to, tensorMap,
        ValueRange{col, i32Of(o, head), i32Of(o, row)}, bar, ValueRange{},
        Value(), Value(), NVVM::TMALoadMode::TILE,
        /*isCTAOnly=*/false, NVVM::CTAGroupKindAttr(), Value());
  }
}

/// Where iteration `it` of a pipeline over a ring of mbarrier-guarded slots
/// stands: its slot, and the parity of the phase it waits for there.
struct RingSlot {
  Value slot, parity;
};
/// The slot and phase parity of iteration `it` of a ring of `slots` slots.
inline RingSlot ringSlot(ScalarBuilder &o, Value it, int64_t slots) {
  return {o.remu(it, slots), o.remu(o.divu(it, slots), 2)};
}

} // namespace mlir::dualkv

#endif
