//===- WgmmaKVProducts.h - the KV-major backward's products by wgmma ------===//
//
// The products of the KV-major backward (bwd, bwd_kv) as wgmma.mma_async on
// sm_90a, for a KV-major emitter (Lowering/Skeletons/KVMajorSkeleton.h) to
// hold: the wgmma schedule's (Schedules/Wgmma/WgmmaKVMajor.cpp) and the
// warp-specialized one's (Schedules/WarpSpecialized/WarpSpecializedKVMajor.cpp)
// each hold one. BM = 128 keys, BN = 64 queries, 8 computing warps.
//
// The register layout is the skeleton's one-m16-block layout (MT = 1: warp w
// holds keys 16w + g and 16w + g + 8, the wgmma m64nN accumulator layout of
// warpgroup w / 4): warpgroup w owns keys 64w..64w+63. K, V, Q and dO sit in
// shared memory in the 128-byte swizzle (SharedTiles.h), no padding
// (layoutTiles, beginQIteration). Sᵀ = K Qᵀ and dPᵀ = V dOᵀ read both
// operands K-major from shared memory (m64n64k16, D / 16 k-steps), dPᵀ issued
// right behind Sᵀ (qkt); dV += Pᵀ dO and dK += dSᵀ Q take A from registers
// (Pᵀ, dSᵀ packed as for mma.sync) and B N-major from the tile (m64nDk16, 4
// k-steps), committed but not waited for until the next product needs its
// registers (accumulate); dQ = dS K reads dSᵀ (stored swizzled, keys x
// queries) M-major and K N-major: each warpgroup 64 queries x 64 columns
// over all 128 keys at D = 128 (dqWgmma), or 64 queries x D over its own 64
// keys (dqOwnKeys).
//
// With the emitter's splitWarpgroups (BM = 64 keys at head_dim 256, bwd_kv,
// as FlashAttention-3's head_dim-256 backward splits its tiles) the two
// warpgroups share the keys instead: warpgroup w computes Sᵀ and dPᵀ of all
// 64 keys and queries BN/2 w.. (m64n32, D / 16 k-steps), stores its Pᵀ and
// dSᵀ (bf16/fp16, swizzled) in shared memory, and after a barrier of both
// takes A from there for columns D/2 w.. of dV += Pᵀ dO and dK += dSᵀ Q
// (m64n128, BN / 16 k-steps): dK and dV of 64 keys x 256 columns would be
// 256 registers a thread in one warpgroup, and a split of the reduction
// (queries) would need both accumulators whole in each. Pᵀ has two buffers
// (iteration parity), so that one barrier before each product suffices
// (splitAccumulate says why).
//
// dQ leaves through shared memory: the warps store their fp32 C fragments in
// a BN x D staging buffer (rows padded by 8 floats, conflict-free; stageDq),
// and one thread a query row adds the row to the fp32 dQ accumulator with one
// bulk reduction (cp.reduce.async.bulk .add.f32, 4 D bytes; reduceDqRow).
//
// What the products read of their emitter comes in explicitly, as a
// KVProductsHost (KVMajorSkeleton.h): its builder state, tiles and helpers by
// reference, since the emitter moves them as it walks the kernel. The
// emitter keeps rows of D elements (rowStride = D, dsRowStride = BN), the
// tiles swizzled, and waits for a query tile once.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_PRODUCTS_WGMMAKVPRODUCTS_H
#define DUALKV_COMPILER_PRODUCTS_WGMMAKVPRODUCTS_H

#include "Lowering/Skeletons/KVMajorSkeleton.h"
#include "Lowering/Support/WgmmaBuilder.h"

#include <utility>

namespace mlir::dualkv {

class WgmmaKVProducts {
public:
  explicit WgmmaKVProducts(KVProductsHost host)
      : h(std::move(host)), o(h.o),
        wg(o.b, o.loc, h.elemType, ::dualkv::swizzledTileDim(h.headDim),
           h.headDim) {}

  /// Where the dQ staging buffers start: after the skeleton's buffers.
  int64_t dqOffset() const { return h.layout.KVMajorEmitter::sharedBytes(); }
  /// A dQ row: D floats and 8 of padding, so that the 8 rows of a C fragment
  /// store fall in different banks; a multiple of 16 bytes, as bulk copies
  /// need.
  int64_t dqRowBytes() const { return (h.headDim + 8) * 4; }

  /// Places K, V (swizzled) and dSᵀ in the emitter's dynamic shared memory of
  /// `sharedBytes` bytes (1024 of them spare for the alignment).
  void layoutTiles(int64_t sharedBytes);
  /// The shared addresses of the buffers for this query-tile iteration
  /// (`parity`: the double buffer of Q and dO it reads).
  void beginQIteration(Value parity);
  /// Waits for every wgmma group still in flight.
  void retireAll() {
    if (!inFlight.empty())
      waitWgmma(Value());
  }

  /// Sᵀ = K Qᵀ (or dPᵀ = V dOᵀ) of `op`, waited for; Sᵀ issues the tile's
  /// dPᵀ right behind it, so the tensor cores compute dPᵀ while the warps
  /// turn Sᵀ into Pᵀ.
  void qkt(QKTOp op);
  /// acc += Xᵀ Y of `op`, committed, not waited for.
  void accumulate(AccumulateOp op);
  /// accumulate with splitWarpgroups: Xᵀ (the warpgroup's query columns) to
  /// shared memory, a barrier of both warpgroups, then the warpgroup's
  /// columns of acc from A in shared memory.
  void splitAccumulate(AccumulateOp op);
  /// dQ = dS K at D = 128: dSᵀ to shared memory, a barrier of the computing
  /// threads, each warpgroup 64 queries x 64 columns over all keys; returns the
  /// warp's C fragments (rows 16 (warp % 4) + g, + 8, columns from 64 (warp /
  /// 4)). Whatever must precede overwriting the last tile's dSᵀ comes before
  /// the call.
  SmallVector<Value> dqWgmma(ArrayRef<Value> ds);
  /// dQ of the warpgroup's own 64 keys, 64 queries x D (head_dim 64, where a
  /// warpgroup cannot take half of 64 columns): dSᵀ to shared memory, a
  /// barrier of the warpgroup's 128 threads (named barrier Warpgroup0 + w).
  SmallVector<Value> dqOwnKeys(ArrayRef<Value> ds);
  /// splitWarpgroups: dQ columns D/2 w + 64 half.. (64 of them) of the
  /// query tile, dS (M-major: dSᵀ, whole in shared memory) times K, BM / 16
  /// k-steps of 16 keys, waited for; the warp's C fragments (queries 16
  /// (warp % 4) + g, + 8).
  SmallVector<Value> splitDq(int64_t half);
  /// dQ of 64 queries x the 64 columns of K's swizzle atom `atom` = dS
  /// (M-major: dSᵀ at shared address `dsT`) K, BM keys, waited for.
  SmallVector<Value> dqOfAtom(Value dsT, Value atom);
  /// Stores the warp's dQ C fragments in a staging buffer: dqWgmma's by
  /// default (columns from 64 (warp / 4), the buffer at dqOffset()), else
  /// columns from `colBase` into the buffer at byte `offset`.
  void stageDq(ArrayRef<Value> acc, Value colBase = {}, Value offset = {});
  /// Issues the bulk reduction of row `row` of staging buffer `buffer` (query
  /// `first` + row of the item) into the fp32 dQ accumulator, if that query
  /// is in the item.
  void reduceDqRow(Value row, Value first, int64_t buffer = 0);
  /// Stores the warp's dQ C fragments (dqWgmma's) in the staging buffer and
  /// adds each query row of the tile starting at query `first` to the fp32
  /// dQ accumulator with one bulk reduction.
  void reduceDqBulk(ArrayRef<Value> acc, Value first);
  /// Runs `body` on the threads that issue dQ's bulk reductions: thread r
  /// for query row r of the tile.
  template <typename Fn> void onDqIssuers(Fn body) {
    emitIf(o.cmp(arith::CmpIPredicate::ult, h.ids.tid, o.idx(h.blockN)), body);
  }

  /// The aligned shared address of the dynamic shared memory (layoutTiles).
  Value smemAddr;
  /// The warp's warpgroup, warp / 4.
  Value warpGroup;

private:
  KVProductsHost h;
  ScalarBuilder o;
  WgmmaBuilder wg;
  // Shared addresses of the buffers for the descriptors (beginQIteration).
  Value kAddr, vAddr, dsAddr, qAddrCur, doAddrCur;
  /// splitWarpgroups: this iteration's Pᵀ buffer (its first row in dsBuf).
  Value pRow0;
  /// splitWarpgroups: dsBuf's first row of dSᵀ, after the two Pᵀ buffers.
  int64_t splitDsRow() const { return 2 * h.blockM; }
  /// The shared address of dsBuf's row `row` (BN elements a row).
  Value splitRowAddr(Value row) {
    return o.add(dsAddr, o.mul(row, o.idx(h.blockN * 2)));
  }
  /// wgmma groups committed but not waited for, oldest first: the dialect
  /// value each computes and its accumulator registers. A wait takes the
  /// finished ones along and remaps their values.
  SmallVector<std::pair<Value, SmallVector<Value>>> inFlight;

  template <typename Fn> void emitIf(Value cond, Fn body) {
    auto ifOp = scf::IfOp::create(o.b, o.loc, cond, /*withElseRegion=*/false);
    OpBuilder::InsertionGuard guard(o.b);
    o.b.setInsertionPointToStart(ifOp.thenBlock());
    body();
  }
  /// Commits the wgmma group just issued, which computes `result` into
  /// `regs`, and maps `result` to them (to be read once waited for).
  void commitWgmma(Value result, ArrayRef<Value> regs) {
    wg.commit();
    h.map.map(result, o.pack(regs));
    inFlight.push_back({result, SmallVector<Value>(regs)});
  }
  /// Waits until the group computing `result` is done; with a null `result`
  /// until every group is, `newest` (the registers of a group committed
  /// outside inFlight) passing through the wait as well.
  void waitWgmma(Value result, MutableArrayRef<Value> newest = {});
  /// Issues Sᵀ = K Qᵀ (or dPᵀ = V dOᵀ) of `op` as one group.
  void issueQKTWgmma(QKTOp op);
  /// Stores the warp's dSᵀ rows (keys 16 warp + g, + 8) in dsBuf, swizzled.
  void storeDsT(ArrayRef<Value> ds);
  /// splitWarpgroups: stores the warp's Xᵀ values (keys 16 (warp % 4) + g,
  /// + 8; queries BN/2 (warp / 4) + 8 nt + 2t, + 1) at rows `row0`.. of
  /// dsBuf (BM x BN swizzled buffers one after another).
  void storeSplitT(ArrayRef<Value> x, Value row0);
  /// What storeDsT and storeSplitT share: the warp's Xᵀ values (keys 16
  /// `warpRows` + g, + 8; queries of 16-byte chunks `chunk0` + nt, none: 0)
  /// at rows `row0` (none: 0).. of dsBuf.
  void storeScoresT(ArrayRef<Value> x, Value row0, Value warpRows,
                    Value chunk0);
  /// The shared address of buffer `buf` (kBuf, vBuf, qCur, doCur, dsBuf).
  Value addrOf(Value buf) {
    if (buf == h.kBuf)
      return kAddr;
    if (buf == h.vBuf)
      return vAddr;
    if (buf == h.qCur)
      return qAddrCur;
    if (buf == h.doCur)
      return doAddrCur;
    return dsAddr;
  }
};

} // namespace mlir::dualkv

#endif
