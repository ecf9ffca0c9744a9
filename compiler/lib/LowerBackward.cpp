//===- LowerBackward.cpp - the KV-major backward and its pre/post kernels -===//
//
// dualkv-lower-to-nvgpu for kinds bwd, bwd_kv, bwd_pre and bwd_post
// (docs/backward-abi.md). The KV-major kernel keeps a block of BM keys and
// values in shared memory; each warp owns MT = BM / (16 * warps) m16 blocks
// of those keys. Query tiles of BN rows stream past, double buffered: Q, dO,
// LSE and Delta of tile i + 1 are copied while tile i is computed. With
// NT = BN / 8 and DT = D / 8 the values are
//
//   kv_block    memref<BM x (D+8) x E>, shared memory (A fragments)
//   q_block     memref<BN x (D+8) x E>, shared memory (B fragments)
//   scores_t    vector<MT*NT*4 x f32>, C fragments: keys g and g + 8,
//               queries 2t and 2t + 1
//   col_stats   vector<NT*2 x f32>, queries 2t and 2t + 1 of each n8 tile
//   grad_acc    vector<MT*DT*4 x f32>, C fragments of dK or dV
//
// dQ of a query tile is dS K: dSᵀ goes through shared memory (BM x (BN+8)),
// comes back transposed by ldmatrix.trans as A fragments, and the warps,
// each with whole m16 blocks of queries (and part of the columns when there
// are fewer blocks than warps), add their fp32 products to global dQ:
// red.global.add.v4.f32 on sm_90 and later, scalar atomics before.
//
// The two-dimensional layout (grid2d: BM = 128, BN = 64, 8 warps; the fused
// kernel's default from sm_90 on) reads a third less shared memory a
// query. S = Q Kᵀ and dP = dO Vᵀ (queries x keys, not transposed) are 2 x 4
// warps of 32 queries x 32 keys: scores_t holds 2 x 4 C fragments, queries g
// and g + 8, keys 2t and 2t + 1, and col_stats the 4 statistics of the
// thread's query rows. P and dS go to shared memory (BN x (BM+8) each); dV +=
// Pᵀ dO and dK += dSᵀ Q are 4 x 2 warps of 32 keys x D/2 (grad_acc: 2 x D/16
// C fragments), their A read back by ldmatrix.trans; dQ = dS K is 2 x 4 warps
// of 32 queries x D/4 with A read straight from dS (bwd only). Each query tile
// is waited for once (one barrier for Q, dO, LSE and Delta).
//
// The warpgroup schedule (wgmma: sm_90a, BM = 128, BN = 64, 8 warps, D =
// 128; the default there, for bwd and bwd_kv) keeps the one-m16-block
// register layout (MT = 1: warp w holds keys 16w + g and 16w + g + 8, the
// wgmma m64nN accumulator layout of warpgroup w / 4) and moves every product
// to wgmma.mma_async: K, V, Q and dO sit in shared memory in the 128-byte
// swizzle (Fragments.h), no padding. Sᵀ = K Qᵀ and dPᵀ = V dOᵀ read both
// operands K-major from shared memory (m64n64k16, 8 k-steps); dV += Pᵀ dO and
// dK += dSᵀ Q take A from registers (Pᵀ, dSᵀ packed as for mma.sync) and B
// N-major from the tile (m64n128k16, 4 k-steps), committed but not waited for
// until the next product needs its registers; dQ = dS K reads dSᵀ (stored
// swizzled, keys x queries) M-major and K N-major, each warpgroup 64 queries x
// 64 columns. cp.async and st.shared writes reach wgmma through
// fence.proxy.async before the barrier that publishes them.
//
//===----------------------------------------------------------------------===//
#include "LowerBackward.h"
#include "Fragments.h"
#include "dualkv/Compiler/Compiler.h"

#include "mlir/IR/IRMapping.h"
#include "llvm/ADT/TypeSwitch.h"

#include <algorithm>

using namespace mlir;
using namespace mlir::dualkv;

namespace {

/// dQ columns a warp computes at a time: 16 fp32 registers of dQ beside dK,
/// dV and dS.
constexpr int64_t kDqChunkCols = 32;

/// Common set-up of a backward gpu.func: signature, launch bounds, entry.
class BackwardEmitterBase : public FragmentBuilder {
protected:
  BackwardEmitterBase(KernelOp kernel, OpBuilder &b)
      : FragmentBuilder(b, kernel.getLoc(), kernel.getProblem()->getDtype(),
                        kernel.getProblem()->getHeadDim(),
                        kernel.getTiling()->getWarps()),
        kernel(kernel) {
    ProblemAttr p = *kernel.getProblem();
    numQHeads = p.getNumQHeads();
    numKVHeads = p.getNumKvHeads();
    groupSize = numQHeads / numKVHeads;
    blockM = kernel.getTiling()->getBlockM();
    blockN = kernel.getTiling()->getBlockN();
  }

  /// Two fp32 values rounded to the element type, stored at `at` of `ptr`.
  void storePair(Value ptr, Value at, Value lo, Value hi) {
    Value narrow = arith::TruncFOp::create(
        b, loc, VectorType::get({2}, elemType), pack({lo, hi}));
    vector::StoreOp::create(b, loc, narrow, ptr, ValueRange{at});
  }
  void atomicAdd(Value ptr, Value at, Value v) {
    memref::AtomicRMWOp::create(b, loc, arith::AtomicRMWKind::addf, v, ptr,
                                ValueRange{at});
  }
  /// Runs `body` only where `cond` holds.
  template <typename Fn> void emitIf(Value cond, Fn body) {
    auto ifOp = scf::IfOp::create(b, loc, cond, /*withElseRegion=*/false);
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(ifOp.thenBlock());
    body();
  }

  KernelOp kernel;
  int64_t numQHeads, numKVHeads, groupSize, blockM, blockN;
};

//===----------------------------------------------------------------------===//
// bwd, bwd_kv
//===----------------------------------------------------------------------===//

class KVMajorEmitter : public BackwardEmitterBase {
public:
  KVMajorEmitter(KernelOp kernel, OpBuilder &b)
      : BackwardEmitterBase(kernel, b) {
    mTiles = blockM / (16 * warps);
    nTiles = blockN / 8;
    kTiles = headDim / 16;
    dTiles = headDim / 8;
    rowStride = headDim + kRowPad;
    withDq = kernel.getKind() == KernelKind::bwd;
    // 128 keys, 64-query tiles and 8 warps take the two-dimensional warp
    // layout (see the file comment).
    grid2d = blockM == 128 && blockN == 64 && warps == 8;
    // sm_90 and later add four fp32 values with one vector reduction.
    int sm = 0;
    StringRef arch = *kernel.getArch();
    // sm_90a at 128 keys x 64-query tiles x 8 warps, head_dim 128: the
    // warpgroup schedule (see the file comment).
    wgmma = hasWgmma(arch) && blockM == 128 && blockN == 64 && warps == 8 &&
            headDim == 128;
    if (arch.consume_front("sm_"))
      (void)arch.take_while(llvm::isDigit).getAsInteger(10, sm);
    vectorRed = sm >= 90;
    if (wgmma) {
      grid2d = false;
      rowStride = headDim;
      wgmmaReadsTiles = true;
    }
  }

  LogicalResult emit(gpu::GPUModuleOp gpuModule);

  /// [K: BM][V: BM][Q: 2 x BN][dO: 2 x BN] padded rows (query tiles double
  /// buffered), dSᵀ (BM x (BN+8)) when the kernel computes dQ, then LSE and
  /// Delta of the two query tiles in flight (fp32).
  int64_t sharedBytes() const {
    // wgmma: 1 KB more, to align the buffers to the swizzle's 1024 bytes.
    return statsOffset() + 4 * blockN * 4 + (wgmma ? 1024 : 0);
  }
  int64_t tileBytes() const { return blockN * rowStride * 2; }
  int64_t qOffset() const { return 2 * blockM * rowStride * 2; }
  int64_t doOffset() const { return qOffset() + 2 * tileBytes(); }
  int64_t dsOffset() const { return doOffset() + 2 * tileBytes(); }
  int64_t statsOffset() const {
    if (grid2d) // P and dS, queries x keys
      return dsOffset() + 2 * blockN * (blockM + kRowPad) * 2;
    int64_t dsRow = wgmma ? blockN : blockN + kRowPad;
    return dsOffset() + (withDq ? blockM * dsRow * 2 : 0);
  }

private:
  LogicalResult emitOp(Operation *op);
  LogicalResult emitLoadKVBlock(LoadKVBlockOp op);
  LogicalResult emitInitGrad(InitGradOp op);
  LogicalResult emitQLoop(QLoopOp op);
  LogicalResult emitLoadQBlock(LoadQBlockOp op);
  LogicalResult emitLoadColStats(LoadColStatsOp op);
  LogicalResult emitQKT(QKTOp op);
  LogicalResult emitMask(MaskOp op);
  LogicalResult emitRecomputeProbs(RecomputeProbsOp op);
  LogicalResult emitSoftmaxGrad(SoftmaxGradOp op);
  LogicalResult emitAccumulate(AccumulateOp op);
  LogicalResult emitAccumulateDq(AccumulateDqOp op);
  LogicalResult emitStoreKVGrads(StoreKVGradsOp op);

  /// Key row (relative to the block) of C-fragment row half `h` of m16 block
  /// `mt` of this thread.
  Value keyRow(int64_t mt, int64_t h) {
    return add(mul(warp, idx(16 * mTiles)), add(idx(mt * 16 + h * 8), g));
  }
  /// Query column (relative to the tile) of element `e` of n8 tile `nt`.
  Value queryCol(int64_t nt, int64_t e) {
    return add(idx(nt * 8 + e), mul(t, idx(2)));
  }
  /// A fragments of the warp's m16 block `mt` of `buf` (row-major, rows
  /// padded) at k-step `kt`.
  SmallVector<Value, 4> rowMajorA(Value buf, int64_t mt, int64_t kt);

  // The two-dimensional layout (grid2d): S and dP as 2 x 4 warps of 32
  // queries x 32 keys, P and dS through shared memory (queries x keys), dK
  // and dV as 4 x 2 warps of 32 keys x D/2, dQ as 2 x 4 warps of 32 queries
  // x D/4.
  LogicalResult emitQKT2d(QKTOp op);
  /// c (C fragments of aFrags.size() m16 blocks x nTotal n8 tiles) += A B at
  /// k-step kt: A the given fragments; B's n16 blocks np read by ldmatrix
  /// (not transposed) at rows bRow + 16 np, columns bCol + 16 kt of bBuf (n
  /// along the rows, k along the columns): matrices (n 0-7, k 0-7), (n 0-7,
  /// k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
  void mmaRowsB(MutableArrayRef<Value> c,
                ArrayRef<SmallVector<Value, 4>> aFrags, Value bBuf, Value bRow,
                Value bCol, int64_t kt, int64_t nTotal);
  LogicalResult emitAccumulate2d(AccumulateOp op);
  /// Stores the fp32 C fragments `x` (S layout) as E into `buf` (queries x
  /// keys) and syncs the CTA.
  void storeScores2d(ArrayRef<Value> x, Value buf);
  Value sQuery(int64_t mt, int64_t h) { // S layout: query row in the tile
    return add(mul(divu(warp, 4), idx(32)), add(idx(mt * 16 + h * 8), g));
  }
  Value sKey(int64_t nt, int64_t e) { // S layout: key row in the block
    return add(mul(remu(warp, 4), idx(32)),
               add(idx(nt * 8 + e), mul(t, idx(2))));
  }
  /// Rows and columns of the dK/dV accumulators: key row of half `h` of m16
  /// block `mt`, first column of n8 tile `dt`.
  Value gradRow(int64_t mt, int64_t h) {
    if (!grid2d)
      return keyRow(mt, h);
    return add(mul(divu(warp, 2), idx(32)), add(idx(mt * 16 + h * 8), g));
  }
  Value gradCol(int64_t dt) {
    Value col = add(idx(dt * 8), mul(t, idx(2)));
    return grid2d ? add(mul(remu(warp, 2), idx(headDim / 2)), col) : col;
  }
  int64_t gradMTiles() const { return grid2d ? 2 : mTiles; }
  int64_t scoreMTiles() const { return grid2d ? 2 : mTiles; }
  int64_t scoreNTiles() const { return grid2d ? 4 : nTiles; }
  /// The statistic (LSE, Delta) of score element `c` of tile (mt, nt): per
  /// query column in Sᵀ, per query row in S (grid2d).
  int64_t statIndex(int64_t mt, int64_t nt, int64_t c) const {
    return grid2d ? mt * 2 + c / 2 : nt * 2 + c % 2;
  }
  int64_t gradDTiles() const { return grid2d ? headDim / 16 : dTiles; }
  /// grid2d: once per query tile, before its first use, waits for all of the
  /// tile's copies (Q, dO, LSE, Delta; the next tile's stay in flight) and
  /// syncs the CTA, so later uses in the iteration need no barrier of their
  /// own. The other layouts wait for a tile wherever it is read (one barrier
  /// fewer there lets the 64-key bwd_kv spill).
  void waitFor(Value tile) {
    if (!grid2d && !wgmma)
      return FragmentBuilder::waitFor(tile);
    if (tileReady)
      return;
    FragmentBuilder::waitFor(lseCur);
    tileReady = true;
  }
  bool tileReady = false;
  Value pBuf;
  /// The scores (mapped values) already in dsBuf or pBuf this iteration.
  DenseMap<Value, Value> storedScores;

  int64_t mTiles, nTiles, kTiles, dTiles, rowStride;
  bool withDq, grid2d = false, vectorRed = false, wgmma = false;

  // The warpgroup schedule (wgmma): warpgroup w (warps 4w..4w+3) owns keys
  // 64w..64w+63; its warps hold the same C fragments as the one-m16-block
  // layout (keys 16 warp + g, + 8), so masking, softmax and the stores are
  // shared with it. Shared addresses of the buffers for the descriptors:
  Value smemAddr, kAddr, vAddr, dsAddr, qAddrCur, doAddrCur;
  Value warpGroup;
  /// wgmma groups committed but not waited for, oldest first: the dialect
  /// value each computes and its accumulator registers. A wait takes the
  /// finished ones along and remaps their values.
  SmallVector<std::pair<Value, SmallVector<Value>>> inFlight;
  /// Commits the wgmma group just issued, which computes `result` into
  /// `regs`, and maps `result` to them (to be read once waited for).
  void commitWgmma(Value result, ArrayRef<Value> regs) {
    wgmmaCommit();
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
  LogicalResult emitQKTWgmma(QKTOp op);
  LogicalResult emitAccumulateWgmma(AccumulateOp op);
  /// dQ = dS K with wgmma: dSᵀ to shared memory, each warpgroup 64 queries x
  /// D/2; returns the warp's C fragments (rows 16 (warp % 4) + g, + 8).
  SmallVector<Value> dqWgmma(ArrayRef<Value> ds);
  /// Adds the fp32 dQ C fragments `acc` (qmTiles x cTiles m16n8 tiles; rows
  /// from warpRow0, columns from warpCol0 + c0 of the query tile starting at
  /// query `first`) to global dQ.
  void reduceDqTile(ArrayRef<Value> acc, int64_t qmTiles, int64_t cTiles,
                    Value warpRow0, Value warpCol0, int64_t c0, Value first);
  /// Field `f` of the CTA's work item, read from global memory.
  Value itemField(int64_t f, bool fresh = false) {
    Value item = fresh ? opaque(itemIndex) : itemIndex;
    Value v = memref::LoadOp::create(
        b, loc, itemsPtr,
        ValueRange{add(mul(item, idx(::dualkv::kBwdItemFields)), idx(f))});
    return toIndex(v);
  }
  Value itemIndex;
  /// Adds `values` (1 or 4 consecutive fp32) at element `at` of global dQ;
  /// four values go in one vector reduction, predicated on `enabled`.
  void reduceDq(Value at, ArrayRef<Value> values, Value enabled = {});
  /// The lane as shared-memory addresses see it: inside the query loop an
  /// opaque copy made every iteration, so LLVM cannot hoist each ldmatrix
  /// address into a register of its own; the constant parts then fold into
  /// the instructions' immediate offsets.
  Value aLane, aG, aT;

  // Kernel arguments.
  Value qPtr, kPtr, vPtr, doPtr, dkPtr, dvPtr, lsePtr, deltaPtr, dqAccPtr,
      dkAccPtr, dvAccPtr, itemsPtr;
  Value qStrideT, qStrideH, kStrideT, kStrideH, vStrideT, vStrideH, doStrideT,
      doStrideH, dkStrideT, dkStrideH, dvStrideT, dvStrideH, lseStrideH,
      deltaStrideH, scale, scaleLog2;
  // Per-CTA values: the work item, the KV head, the current query head.
  Value kRow0, kvEnd, qBegin, qEnd, qLen, accRow, kvHead, head;
  Value smem, kBuf, vBuf, dsBuf;
  // The query tile of this iteration: Q, dO, LSE and Delta in shared memory.
  Value qCur, doCur, lseCur, deltaCur;
  /// Starts the copies of query tile `tile` (Q, dO, LSE, Delta) into buffer
  /// `parity`; nothing is read when !valid. Returns the three copy groups.
  SmallVector<Value, 3> issueTileCopies(Value tile, Value parity, Value valid);
  /// The views of buffer `parity` (a runtime value): Q, dO, LSE, Delta.
  SmallVector<Value, 4> tileViews(Value parity);
  IRMapping map;
};

SmallVector<Value, 4> KVMajorEmitter::rowMajorA(Value buf, int64_t mt,
                                                int64_t kt) {
  // Matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
  // (rows 8-15, k 8-15): lane l addresses row l % 8 + 8 * ((l / 8) % 2).
  Value quad = divu(aLane, 8);
  Value row = add(remu(aLane, 8), mul(remu(quad, 2), idx(8)));
  Value col = mul(divu(quad, 2), idx(8));
  Value r = add(add(mul(warp, idx(16 * mTiles)), idx(mt * 16)), row);
  return ldmatrix4(buf, r, add(idx(kt * 16), col), /*transpose=*/false);
}

LogicalResult KVMajorEmitter::emitLoadKVBlock(LoadKVBlockOp op) {
  bool isKey = op.getOperand() == KVOperand::key;
  Value buf = isKey ? kBuf : vBuf;
  Value group = copyTile(buf, isKey ? kPtr : vPtr, blockM, idx(0), kRow0, kvEnd,
                         isKey ? kStrideT : vStrideT,
                         mul(kvHead, isKey ? kStrideH : vStrideH),
                         /*predicated=*/true, Value(), /*swizzled=*/wgmma);
  // Loaded once per CTA: wait right away.
  waitAll(group);
  map.map(op.getResult(), buf);
  return success();
}

LogicalResult KVMajorEmitter::emitInitGrad(InitGradOp op) {
  map.map(op.getResult(), splat(gradMTiles() * gradDTiles() * 4, 0.0f));
  return success();
}

LogicalResult KVMajorEmitter::emitQLoop(QLoopOp op) {
  // Query tiles [0, diagEnd) meet the block's keys (qBegin >= kRow0): they
  // need the causal mask; the rest see every key of the block.
  Value numTiles = ceilDiv(qLen, blockN);
  Value reach = arith::SubIOp::create(b, loc, add(kRow0, idx(blockM)), qBegin);
  reach = select(cmp(arith::CmpIPredicate::sgt, reach, idx(0)), reach, idx(0));
  Value diagEnd = ceilDiv(reach, blockN);
  diagEnd = select(cmp(arith::CmpIPredicate::ult, diagEnd, numTiles), diagEnd,
                   numTiles);
  Value lb, ub;
  switch (op.getPart()) {
  case LoopPart::all:
    return op.emitOpError() << "is not tiled: run dualkv-tile-regions first";
  case LoopPart::tail:
    return op.emitOpError() << "has no sm_80 lowering for part tail";
  case LoopPart::diagonal:
    lb = idx(0);
    ub = diagEnd;
    break;
  case LoopPart::full:
    lb = diagEnd;
    ub = numTiles;
    break;
  }
  SmallVector<Value> inits;
  for (Value v : op.getInits())
    inits.push_back(map.lookup(v));
  // Every query head of the KV head's group, then its query tiles.
  auto heads =
      scf::ForOp::create(b, loc, idx(0), idx(groupSize), idx(1), inits);
  {
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(heads.getBody());
    head = add(mul(kvHead, idx(groupSize)), heads.getInductionVar());
    // The first tile's copies; every iteration then starts the next tile's
    // into the other buffer before computing on its own.
    SmallVector<Value, 3> first =
        issueTileCopies(lb, idx(0), cmp(arith::CmpIPredicate::ult, lb, ub));
    auto tiles =
        scf::ForOp::create(b, loc, lb, ub, idx(1), heads.getRegionIterArgs());
    {
      OpBuilder::InsertionGuard inner(b);
      b.setInsertionPointToStart(tiles.getBody());
      Value i = tiles.getInductionVar();
      map.map(op.getTileIndex(), i);
      for (auto [from, to] :
           llvm::zip(op.getRegionIterArgs(), tiles.getRegionIterArgs()))
        map.map(from, to);
      Value parity = remu(arith::SubIOp::create(b, loc, i, lb), 2);
      SmallVector<Value, 4> views = tileViews(parity);
      qCur = views[0], doCur = views[1], lseCur = views[2], deltaCur = views[3];
      if (wgmma) {
        // As aLane below: an opaque base each iteration keeps LLVM from
        // hoisting every k-step's descriptor into registers of its own.
        Value base = opaque(smemAddr);
        kAddr = base;
        vAddr = add(base, idx(blockM * rowStride * 2));
        dsAddr = add(base, idx(dsOffset()));
        qAddrCur =
            add(base, add(idx(qOffset()), mul(parity, idx(tileBytes()))));
        doAddrCur =
            add(base, add(idx(doOffset()), mul(parity, idx(tileBytes()))));
      }
      pending.clear();
      storedScores.clear();
      tileReady = false;
      pending.push_back({qCur, first[0]});
      pending.push_back({doCur, first[1]});
      pending.push_back({lseCur, first[2]});
      Value next = add(i, idx(1));
      for (Value group :
           issueTileCopies(next, arith::SubIOp::create(b, loc, idx(1), parity),
                           cmp(arith::CmpIPredicate::ult, next, ub)))
        pending.push_back({Value(), group});
      aLane = opaque(lane);
      aG = divu(aLane, 4);
      aT = remu(aLane, 4);
      for (Operation &inner : op.getBody().front().without_terminator())
        if (failed(emitOp(&inner)))
          return failure();
      if (!inFlight.empty())
        waitWgmma(Value());
      // Every warp must be done with this tile's shared memory before the
      // next iteration's copies overwrite it.
      gpu::BarrierOp::create(b, loc);
      SmallVector<Value> yielded;
      for (Value v : op.getBody().front().getTerminator()->getOperands())
        yielded.push_back(map.lookup(v));
      scf::YieldOp::create(b, loc, yielded);
    }
    // The last iteration's (empty) prefetch lands before the buffers are
    // written again.
    nvgpu::DeviceAsyncWaitOp::create(b, loc, first[0], b.getI32IntegerAttr(0));
    scf::YieldOp::create(b, loc, tiles.getResults());
  }
  for (auto [from, to] : llvm::zip(op.getResults(), heads.getResults()))
    map.map(from, to);
  return success();
}

SmallVector<Value, 4> KVMajorEmitter::tileViews(Value parity) {
  auto workgroup =
      gpu::AddressSpaceAttr::get(b.getContext(), gpu::AddressSpace::Workgroup);
  auto tileType = wgmma
                      ? MemRefType::get({blockN * headDim / 64, 64}, elemType,
                                        MemRefLayoutAttrInterface(), workgroup)
                      : MemRefType::get({blockN, rowStride}, elemType,
                                        MemRefLayoutAttrInterface(), workgroup);
  auto statType = MemRefType::get({blockN}, b.getF32Type(),
                                  MemRefLayoutAttrInterface(), workgroup);
  auto view = [&](MemRefType type, int64_t base, int64_t stride) {
    return memref::ViewOp::create(b, loc, type, smem,
                                  add(idx(base), mul(parity, idx(stride))),
                                  ValueRange{})
        .getResult();
  };
  int64_t statBytes = blockN * 4;
  return {view(tileType, qOffset(), tileBytes()),
          view(tileType, doOffset(), tileBytes()),
          view(statType, statsOffset(), statBytes),
          view(statType, statsOffset() + 2 * statBytes, statBytes)};
}

SmallVector<Value, 3> KVMajorEmitter::issueTileCopies(Value tile, Value parity,
                                                      Value valid) {
  SmallVector<Value, 4> views = tileViews(parity);
  Value first = mul(tile, idx(blockN));
  SmallVector<Value, 3> groups;
  groups.push_back(copyTile(views[0], qPtr, blockN, qBegin, first, qLen,
                            qStrideT, mul(head, qStrideH),
                            /*predicated=*/true, valid, /*swizzled=*/wgmma));
  groups.push_back(copyTile(views[1], doPtr, blockN, qBegin, first, qLen,
                            doStrideT, mul(head, doStrideH),
                            /*predicated=*/true, valid, /*swizzled=*/wgmma));
  // LSE and Delta, 4 bytes a query (rows need not be 16-byte aligned).
  // Queries past the item read as 0: their Q and dO rows are zero too, so
  // P = 1 meets dO = 0 and dP - Delta = 0, and they add nothing.
  // With more threads than queries, threads j and j + BN copy the same value
  // to the same place (harmless), which keeps every copy unconditional.
  SmallVector<Value> tokens;
  for (int64_t j0 = 0; j0 < blockN; j0 += threads()) {
    Value j = threads() >= blockN ? remu(tid, blockN) : add(tid, idx(j0));
    Value col = add(first, j);
    Value ok = arith::AndIOp::create(b, loc, valid,
                                     cmp(arith::CmpIPredicate::ult, col, qLen));
    Value token = add(qBegin, select(ok, col, idx(0)));
    Value count = select(ok, idx(1), idx(0));
    for (auto [dst, src, strideH] :
         {std::tuple{views[2], lsePtr, lseStrideH},
          std::tuple{views[3], deltaPtr, deltaStrideH}})
      tokens.push_back(nvgpu::DeviceAsyncCopyOp::create(
          b, loc, dst, ValueRange{j}, src,
          ValueRange{add(mul(head, strideH), token)}, b.getIndexAttr(1), count,
          UnitAttr()));
  }
  groups.push_back(nvgpu::DeviceAsyncCreateGroupOp::create(b, loc, tokens));
  return groups;
}

LogicalResult KVMajorEmitter::emitLoadQBlock(LoadQBlockOp op) {
  // Copied by the loop (issueTileCopies); waited for where it is read.
  map.map(op.getResult(), op.getOperand() == QOperand::query ? qCur : doCur);
  return success();
}

LogicalResult KVMajorEmitter::emitLoadColStats(LoadColStatsOp op) {
  waitFor(lseCur);
  bool isLse = op.getStat() == StatKind::lse;
  Value buf = isLse ? lseCur : deltaCur;
  SmallVector<Value> out;
  if (grid2d) {
    // Per query row of the S layout: rows g and g + 8 of each m16 block.
    for (int64_t mt = 0; mt < 2; ++mt)
      for (int64_t h = 0; h < 2; ++h) {
        Value v =
            memref::LoadOp::create(b, loc, buf, ValueRange{sQuery(mt, h)});
        if (isLse)
          v = arith::MulFOp::create(b, loc, v, f32c(kLog2e));
        out.push_back(v);
      }
    map.map(op.getResult(), pack(out));
    return success();
  }
  for (int64_t nt = 0; nt < nTiles; ++nt)
    for (int64_t e = 0; e < 2; ++e) {
      Value v = memref::LoadOp::create(
          b, loc, buf, ValueRange{add(idx(nt * 8 + e), mul(aT, idx(2)))});
      // LSE moves to the log2 domain of the kernels' exp2.
      if (isLse)
        v = arith::MulFOp::create(b, loc, v, f32c(kLog2e));
      out.push_back(v);
    }
  map.map(op.getResult(), pack(out));
  return success();
}

LogicalResult KVMajorEmitter::emitQKT(QKTOp op) {
  if (grid2d)
    return emitQKT2d(op);
  if (wgmma)
    return emitQKTWgmma(op);
  waitFor(map.lookup(op.getQ()));
  Value aBuf = map.lookup(op.getKv());
  Value bBuf = map.lookup(op.getQ());
  SmallVector<Value> s(mTiles * nTiles * 4, f32c(0.0f));
  // B fragments of the query tile rows: matrices (rows 0-7, d 0-7), (rows 0-7,
  // d 8-15), (rows 8-15, d 0-7), (rows 8-15, d 8-15).
  Value quad = divu(aLane, 8);
  Value rowInBlock = add(remu(aLane, 8), mul(divu(quad, 2), idx(8)));
  Value colInBlock = mul(remu(quad, 2), idx(8));
  for (int64_t kt = 0; kt < kTiles; ++kt) {
    SmallVector<SmallVector<Value, 4>> aFrags;
    for (int64_t mt = 0; mt < mTiles; ++mt)
      aFrags.push_back(rowMajorA(aBuf, mt, kt));
    mmaRowsB(s, aFrags, bBuf, rowInBlock, colInBlock, kt, nTiles);
  }
  map.map(op.getResult(), pack(s));
  return success();
}

void KVMajorEmitter::mmaRowsB(MutableArrayRef<Value> c,
                              ArrayRef<SmallVector<Value, 4>> aFrags,
                              Value bBuf, Value bRow, Value bCol, int64_t kt,
                              int64_t nTotal) {
  for (int64_t np = 0; np < nTotal / 2; ++np) {
    auto r = ldmatrix4(bBuf, add(idx(np * 16), bRow), add(idx(kt * 16), bCol),
                       /*transpose=*/false);
    for (int64_t mt = 0; mt < int64_t(aFrags.size()); ++mt)
      for (int64_t half = 0; half < 2; ++half) {
        MutableArrayRef<Value> acc(&c[(mt * nTotal + 2 * np + half) * 4], 4);
        auto d = mma(aFrags[mt], {r[2 * half], r[2 * half + 1]}, acc);
        std::copy(d.begin(), d.end(), acc.begin());
      }
  }
}

LogicalResult KVMajorEmitter::emitMask(MaskOp op) {
  SmallVector<Value> s = unpack(map.lookup(op.getScores()));
  Value first = add(qBegin, mul(map.lookup(op.getTile()), idx(blockN)));
  Value ninf = f32c(-std::numeric_limits<float>::infinity());
  const int64_t sm = scoreMTiles(), sn = scoreNTiles();
  for (int64_t mt = 0; mt < sm; ++mt)
    for (int64_t nt = 0; nt < sn; ++nt)
      for (int64_t c = 0; c < 4; ++c) {
        Value key = add(kRow0, grid2d ? sKey(nt, c % 2) : keyRow(mt, c / 2));
        Value query =
            add(first, grid2d ? sQuery(mt, c / 2) : queryCol(nt, c % 2));
        Value &v = s[(mt * sn + nt) * 4 + c];
        v = select(cmp(arith::CmpIPredicate::ugt, key, query), ninf, v);
      }
  map.map(op.getResult(), pack(s));
  return success();
}

LogicalResult KVMajorEmitter::emitRecomputeProbs(RecomputeProbsOp op) {
  SmallVector<Value> s = unpack(map.lookup(op.getScores()));
  SmallVector<Value> lse = unpack(map.lookup(op.getLse()));
  SmallVector<Value> negLse;
  for (Value v : lse)
    negLse.push_back(arith::NegFOp::create(b, loc, v));
  const int64_t sm = scoreMTiles(), sn = scoreNTiles();
  for (int64_t mt = 0; mt < sm; ++mt)
    for (int64_t nt = 0; nt < sn; ++nt)
      for (int64_t c = 0; c < 4; ++c) {
        Value &v = s[(mt * sn + nt) * 4 + c];
        v = exp2(LLVM::FMAOp::create(b, loc, v, scaleLog2,
                                     negLse[statIndex(mt, nt, c)]));
      }
  map.map(op.getResult(), pack(s));
  return success();
}

LogicalResult KVMajorEmitter::emitSoftmaxGrad(SoftmaxGradOp op) {
  SmallVector<Value> p = unpack(map.lookup(op.getProbs()));
  SmallVector<Value> dp = unpack(map.lookup(op.getDprobs()));
  SmallVector<Value> delta = unpack(map.lookup(op.getDelta()));
  const int64_t sm = scoreMTiles(), sn = scoreNTiles();
  for (int64_t mt = 0; mt < sm; ++mt)
    for (int64_t nt = 0; nt < sn; ++nt)
      for (int64_t c = 0; c < 4; ++c) {
        int64_t i = (mt * sn + nt) * 4 + c;
        Value diff =
            arith::SubFOp::create(b, loc, dp[i], delta[statIndex(mt, nt, c)]);
        Value ps = arith::MulFOp::create(b, loc, p[i], scale);
        p[i] = arith::MulFOp::create(b, loc, ps, diff);
      }
  map.map(op.getResult(), pack(p));
  return success();
}

LogicalResult KVMajorEmitter::emitAccumulate(AccumulateOp op) {
  if (grid2d)
    return emitAccumulate2d(op);
  if (wgmma)
    return emitAccumulateWgmma(op);
  waitFor(map.lookup(op.getY()));
  SmallVector<Value> x = unpack(map.lookup(op.getX()));
  SmallVector<Value> acc = unpack(map.lookup(op.getAcc()));
  // X (keys x queries) as A fragments; Y (queries x d, row-major) is B.
  SmallVector<Value> xa = packAFragments(x, mTiles, nTiles);
  mmaTransposedB(acc, xa, map.lookup(op.getY()), aLane, mTiles, nTiles / 2,
                 dTiles);
  map.map(op.getResult(), pack(acc));
  return success();
}

void KVMajorEmitter::waitWgmma(Value result, MutableArrayRef<Value> newest) {
  size_t done = inFlight.size();
  if (result)
    done = llvm::find_if(inFlight, [&](auto &f) { return f.first == result; }) -
           inFlight.begin() + 1;
  SmallVector<Value> regs(newest.begin(), newest.end());
  for (size_t i = 0; i < done; ++i)
    regs.append(inFlight[i].second);
  wgmmaWait(int64_t(inFlight.size() - done), regs);
  std::copy(regs.begin(), regs.begin() + newest.size(), newest.begin());
  size_t at = newest.size();
  for (size_t i = 0; i < done; ++i) {
    ArrayRef<Value> out(&regs[at], inFlight[i].second.size());
    map.map(inFlight[i].first, pack(out));
    at += out.size();
  }
  inFlight.erase(inFlight.begin(), inFlight.begin() + done);
}

void KVMajorEmitter::issueQKTWgmma(QKTOp op) {
  // Each warpgroup 64 keys x BN queries, both operands K-major in shared
  // memory.
  Value aDesc = wgmmaDesc(
      add(addrOf(map.lookup(op.getKv())), mul(warpGroup, idx(64 * 128))), 16,
      1024);
  Value bDesc = wgmmaDesc(addrOf(map.lookup(op.getQ())), 16, 1024);
  commitWgmma(op.getResult(),
              wgmmaOverHeadDim({}, blockN, aDesc, blockM, bDesc, blockN));
}

LogicalResult KVMajorEmitter::emitQKTWgmma(QKTOp op) {
  // Sᵀ = K Qᵀ issues dPᵀ = V dOᵀ (the tile's next qk_t) right behind it, so
  // the tensor cores compute dPᵀ while the warps turn Sᵀ into Pᵀ.
  bool issued = llvm::any_of(
      inFlight, [&](auto &f) { return f.first == op.getResult(); });
  if (!issued) {
    waitFor(map.lookup(op.getQ()));
    wgmmaFence();
    issueQKTWgmma(op);
    for (Operation *next = op->getNextNode(); next; next = next->getNextNode())
      if (auto dp = dyn_cast<QKTOp>(next)) {
        issueQKTWgmma(dp);
        break;
      }
  }
  waitWgmma(op.getResult());
  return success();
}

LogicalResult KVMajorEmitter::emitAccumulateWgmma(AccumulateOp op) {
  // acc (keys x D) += Xᵀ Y: X (Pᵀ or dSᵀ) from registers as A; Y (dO or Q,
  // queries x D) N-major from shared memory, BN / 16 k-steps of 16 rows.
  // Committed, not waited for: the next wait takes the accumulators along.
  Value y = map.lookup(op.getY());
  waitFor(y);
  SmallVector<Value> x = unpack(map.lookup(op.getX()));
  SmallVector<Value> acc = unpack(map.lookup(op.getAcc()));
  SmallVector<Value> xa = packAFragments(x, 1, nTiles);
  Value bDesc = wgmmaDesc(addrOf(y), blockN * 128, 1024);
  wgmmaFence();
  commitWgmma(op.getResult(), wgmmaRegsA(acc, xa, bDesc));
  return success();
}

SmallVector<Value> KVMajorEmitter::dqWgmma(ArrayRef<Value> ds) {
  // dSᵀ (keys x queries) to shared memory in the swizzled layout: thread
  // (g, t) of warp w holds keys 16w + g (+ 8), queries 8nt + 2t (+ 1); key %
  // 8 = g.
  for (int64_t nt = 0; nt < nTiles; ++nt)
    for (int64_t h = 0; h < 2; ++h) {
      int64_t i = nt * 4 + h * 2;
      Value narrow = arith::TruncFOp::create(
          b, loc, VectorType::get({2}, elemType), pack({ds[i], ds[i + 1]}));
      Value row = add(mul(warp, idx(16)), add(idx(h * 8), aG));
      Value chunk = arith::XOrIOp::create(b, loc, idx(nt), aG);
      Value col = add(mul(chunk, idx(8)), mul(aT, idx(2)));
      vector::StoreOp::create(b, loc, narrow, dsBuf, ValueRange{row, col});
    }
  proxyFence();
  gpu::BarrierOp::create(b, loc);
  // dQ (queries x D) = dS (queries x keys, M-major: dSᵀ) K (keys x D,
  // N-major); warpgroup w computes columns 64w..64w+63, BM / 16 k-steps of 16
  // keys.
  Value aDesc = wgmmaDesc(dsAddr, blockM * 128, 1024);
  Value bDesc = wgmmaDesc(add(kAddr, mul(warpGroup, idx(blockM * 128))),
                          blockM * 128, 1024);
  SmallVector<Value> acc;
  wgmmaFence();
  for (int64_t kk = 0; kk < blockM / 16; ++kk)
    acc = wgmmaStep(acc, 64, descPlus(aDesc, kk * 16 * 128), {},
                    descPlus(bDesc, kk * 16 * 128), true, true);
  wgmmaCommit();
  waitWgmma(Value(), acc);
  return acc;
}

LogicalResult KVMajorEmitter::emitQKT2d(QKTOp op) {
  // S = Q Kᵀ (or dP = dO Vᵀ): queries x keys, A from the query tile, B from
  // the key block; each warp 32 queries x 32 keys.
  Value aBuf = map.lookup(op.getQ());
  Value bBuf = map.lookup(op.getKv());
  waitFor(aBuf);
  SmallVector<Value> s(2 * 4 * 4, f32c(0.0f));
  Value quad = divu(aLane, 8);
  // A: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
  // (rows 8-15, k 8-15). B: (keys 0-7, k 0-7), (keys 0-7, k 8-15), (keys
  // 8-15, k 0-7), (keys 8-15, k 8-15).
  Value aRow = add(mul(divu(warp, 4), idx(32)),
                   add(remu(aLane, 8), mul(remu(quad, 2), idx(8))));
  Value aCol = mul(divu(quad, 2), idx(8));
  Value bRow = add(mul(remu(warp, 4), idx(32)),
                   add(remu(aLane, 8), mul(divu(quad, 2), idx(8))));
  Value bCol = mul(remu(quad, 2), idx(8));
  for (int64_t kt = 0; kt < kTiles; ++kt) {
    SmallVector<SmallVector<Value, 4>> aFrags;
    for (int64_t mt = 0; mt < 2; ++mt)
      aFrags.push_back(ldmatrix4(aBuf, add(aRow, idx(mt * 16)),
                                 add(aCol, idx(kt * 16)), /*transpose=*/false));
    mmaRowsB(s, aFrags, bBuf, bRow, bCol, kt, /*nTotal=*/4);
  }
  map.map(op.getResult(), pack(s));
  return success();
}

void KVMajorEmitter::storeScores2d(ArrayRef<Value> x, Value buf) {
  for (int64_t mt = 0; mt < 2; ++mt)
    for (int64_t nt = 0; nt < 4; ++nt)
      for (int64_t h = 0; h < 2; ++h) {
        int64_t i = (mt * 4 + nt) * 4 + h * 2;
        Value narrow = arith::TruncFOp::create(
            b, loc, VectorType::get({2}, elemType), pack({x[i], x[i + 1]}));
        vector::StoreOp::create(b, loc, narrow, buf,
                                ValueRange{sQuery(mt, h), sKey(nt, 0)});
      }
  gpu::BarrierOp::create(b, loc);
}

LogicalResult KVMajorEmitter::emitAccumulate2d(AccumulateOp op) {
  // acc (keys x D) += Xᵀ Y: X (P or dS, queries x keys) goes to shared memory
  // and comes back transposed as A fragments (ldmatrix.trans); Y (dO or Q,
  // queries x D) is B, transposed. Each warp: 32 keys x D/2.
  Value y = map.lookup(op.getY());
  waitFor(y);
  Value xv = map.lookup(op.getX());
  Value buf = y == doCur ? pBuf : dsBuf;
  if (!storedScores.count(xv)) {
    storeScores2d(unpack(xv), buf);
    storedScores[xv] = buf;
  }
  SmallVector<Value> acc = unpack(map.lookup(op.getAcc()));
  const int64_t gdt = headDim / 16;
  Value quad = divu(aLane, 8);
  // A (keys x queries) from X (queries x keys) by ldmatrix.trans: matrix j
  // holds keys + 8 (j % 2), queries + 8 (j / 2).
  Value aQuery = add(remu(aLane, 8), mul(divu(quad, 2), idx(8)));
  Value aKey = add(mul(divu(warp, 2), idx(32)), mul(remu(quad, 2), idx(8)));
  // B (queries x D) by ldmatrix.trans: (q 0-7, d 0-7), (q 8-15, d 0-7),
  // (q 0-7, d 8-15), (q 8-15, d 8-15).
  Value bQuery = add(remu(aLane, 8), mul(remu(quad, 2), idx(8)));
  Value bCol =
      add(mul(remu(warp, 2), idx(headDim / 2)), mul(divu(quad, 2), idx(8)));
  for (int64_t kk = 0; kk < blockN / 16; ++kk) {
    SmallVector<Value, 4> aFrags[2];
    for (int64_t mt = 0; mt < 2; ++mt)
      aFrags[mt] = ldmatrix4(buf, add(aQuery, idx(kk * 16)),
                             add(aKey, idx(mt * 16)), /*transpose=*/true);
    for (int64_t dp = 0; dp < gdt / 2; ++dp) {
      auto r = ldmatrix4(y, add(bQuery, idx(kk * 16)), add(bCol, idx(dp * 16)),
                         /*transpose=*/true);
      for (int64_t mt = 0; mt < 2; ++mt)
        for (int64_t half = 0; half < 2; ++half) {
          MutableArrayRef<Value> c(&acc[(mt * gdt + 2 * dp + half) * 4], 4);
          auto d = mma(aFrags[mt], {r[2 * half], r[2 * half + 1]}, c);
          std::copy(d.begin(), d.end(), c.begin());
        }
    }
  }
  map.map(op.getResult(), pack(acc));
  return success();
}

LogicalResult KVMajorEmitter::emitAccumulateDq(AccumulateDqOp op) {
  SmallVector<Value> ds = unpack(map.lookup(op.getDs()));
  Value kTile = map.lookup(op.getK());
  Value tile = map.lookup(op->getParentOfType<QLoopOp>().getTileIndex());
  if (wgmma) {
    SmallVector<Value> acc = dqWgmma(ds);
    reduceDqTile(acc, 1, 8, mul(remu(warp, 4), idx(16)),
                 mul(warpGroup, idx(64)), 0, mul(tile, idx(blockN)));
    return success();
  }
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
          Value row =
              add(mul(warp, idx(16 * mTiles)), add(idx(mt * 16 + h * 8), aG));
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
  if (grid2d) // 2 x 4 warps of 32 queries x D/4
    qmTiles = 2, colSplit = 4;
  int64_t warpCols = headDim / colSplit;
  int64_t chunkCols = std::min<int64_t>(warpCols, kDqChunkCols);
  Value warpRow0 = colSplit == 1 ? mul(warp, idx(16 * qmTiles))
                                 : mul(remu(warp, rowBlocks), idx(16));
  Value warpCol0 =
      colSplit == 1 ? idx(0) : mul(divu(warp, rowBlocks), idx(warpCols));
  if (grid2d) {
    warpRow0 = mul(divu(warp, 4), idx(32));
    warpCol0 = mul(remu(warp, 4), idx(warpCols));
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
    int64_t cTiles = chunkCols / 8;
    SmallVector<Value> acc(qmTiles * cTiles * 4, f32c(0.0f));
    for (int64_t kk = 0; kk < kSteps; ++kk) {
      SmallVector<SmallVector<Value, 4>> aFrags;
      for (int64_t qm = 0; qm < qmTiles; ++qm)
        aFrags.push_back(grid2d ? ldmatrix4(dsBuf, add(aRow2d, idx(qm * 16)),
                                            add(idx(kk * 16), aCol2d),
                                            /*transpose=*/false)
                                : ldmatrix4(dsBuf, add(idx(kk * 16), aKeyRow),
                                            add(aQueryCol, idx(qm * 16)),
                                            /*transpose=*/true));
      for (int64_t dp = 0; dp < cTiles / 2; ++dp) {
        auto r = ldmatrix4(kTile, add(idx(kk * 16), bRow),
                           add(bCol, idx(c0 + dp * 16)), /*transpose=*/true);
        for (int64_t qm = 0; qm < qmTiles; ++qm)
          for (int64_t half = 0; half < 2; ++half) {
            MutableArrayRef<Value> c(&acc[(qm * cTiles + 2 * dp + half) * 4],
                                     4);
            auto d = mma(aFrags[qm], {r[2 * half], r[2 * half + 1]}, c);
            std::copy(d.begin(), d.end(), c.begin());
          }
      }
    }
    reduceDqTile(acc, qmTiles, cTiles, warpRow0, warpCol0, c0, first);
  }
  return success();
}

void KVMajorEmitter::reduceDqTile(ArrayRef<Value> acc, int64_t qmTiles,
                                  int64_t cTiles, Value warpRow0,
                                  Value warpCol0, int64_t c0, Value first) {
  {
    // Add to the fp32 dQ of the queries inside the item, [T][Hq][D].
    auto rowBase = [&](Value q) {
      return add(
          mul(add(mul(add(qBegin, q), idx(numQHeads)), head), idx(headDim)),
          warpCol0);
    };
    for (int64_t qm = 0; qm < qmTiles; ++qm) {
      Value row0 = add(first, add(warpRow0, idx(qm * 16)));
      if (!vectorRed) {
        for (int64_t h = 0; h < 2; ++h) {
          Value q = add(row0, add(idx(h * 8), g));
          emitIf(cmp(arith::CmpIPredicate::ult, q, qLen), [&] {
            Value base = add(rowBase(q), mul(t, idx(2)));
            for (int64_t dt = 0; dt < cTiles; ++dt)
              for (int64_t e = 0; e < 2; ++e)
                reduceDq(add(base, idx(c0 + dt * 8 + e)),
                         {acc[(qm * cTiles + dt) * 4 + h * 2 + e]});
          });
        }
        continue;
      }
      // Lanes t and t ^ 1 trade halves: even t then holds columns 2t..2t+3
      // of row g, odd t those of row g + 8 (from column 2t - 2), and each
      // adds its four with one red.global.add.v4.f32.
      Value odd = cmp(arith::CmpIPredicate::eq, remu(t, 2), idx(1));
      Value q = add(row0, add(select(odd, idx(8), idx(0)), g));
      Value col = mul(arith::SubIOp::create(b, loc, t, remu(t, 2)), idx(2));
      // Straight-line code, the row check a predicate of each reduction: a
      // tile's four values die right after its shuffles.
      Value inItem = cmp(arith::CmpIPredicate::ult, q, qLen);
      Value base = add(rowBase(q), col);
      for (int64_t dt = 0; dt < cTiles; ++dt) {
        ArrayRef<Value> c(&acc[(qm * cTiles + dt) * 4], 4);
        Value send0 = select(odd, c[0], c[2]), send1 = select(odd, c[1], c[3]);
        Value got0 = shuffleXor(send0, 1), got1 = shuffleXor(send1, 1);
        reduceDq(add(base, idx(c0 + dt * 8)),
                 {select(odd, got0, c[0]), select(odd, got1, c[1]),
                  select(odd, c[2], got0), select(odd, c[3], got1)},
                 inItem);
      }
    }
  }
}

void KVMajorEmitter::reduceDq(Value at, ArrayRef<Value> values, Value enabled) {
  auto ptrType = LLVM::LLVMPointerType::get(b.getContext(), 1);
  Value offset = arith::IndexCastOp::create(b, loc, b.getI32Type(), at);
  Value ptr = LLVM::GEPOp::create(b, loc, ptrType, b.getF32Type(), dqAccPtr,
                                  ValueRange{offset});
  if (values.size() == 1) {
    LLVM::AtomicRMWOp::create(b, loc, LLVM::AtomicBinOp::fadd, ptr, values[0],
                              LLVM::AtomicOrdering::monotonic);
    return;
  }
  // A masked-off lane issues nothing, so its address may point anywhere.
  SmallVector<Value> operands = {ptr};
  operands.append(values.begin(), values.end());
  operands.push_back(arith::ExtUIOp::create(b, loc, b.getI32Type(), enabled));
  LLVM::InlineAsmOp::create(
      b, loc, Type(), operands,
      "{ .reg .pred p; setp.ne.b32 p, $5, 0; "
      "@p red.global.add.v4.f32 [$0], {$1, $2, $3, $4}; }",
      "l,f,f,f,f,r", /*has_side_effects=*/true, /*is_align_stack=*/false,
      LLVM::tailcallkind::TailCallKind::None, LLVM::AsmDialectAttr(),
      ArrayAttr());
}

LogicalResult KVMajorEmitter::emitStoreKVGrads(StoreKVGradsOp op) {
  SmallVector<Value> dk = unpack(map.lookup(op.getDk()));
  SmallVector<Value> dv = unpack(map.lookup(op.getDv()));
  // Read again rather than kept in registers through the query loops.
  kRow0 = itemField(0, /*fresh=*/true);
  kvEnd = itemField(1, /*fresh=*/true);
  accRow = itemField(4, /*fresh=*/true);
  Value kvLen = arith::SubIOp::create(b, loc, kvEnd, kRow0);
  auto direct = scf::IfOp::create(
      b, loc,
      arith::CmpIOp::create(b, loc, arith::CmpIPredicate::slt, accRow, idx(0)),
      /*withElseRegion=*/true);
  {
    // The item owns its keys: write dK and dV in the element type.
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(direct.thenBlock());
    for (int64_t mt = 0; mt < gradMTiles(); ++mt)
      for (int64_t h = 0; h < 2; ++h) {
        Value r = gradRow(mt, h);
        emitIf(cmp(arith::CmpIPredicate::ult, r, kvLen), [&] {
          Value token = add(kRow0, r);
          Value kBase = add(mul(token, dkStrideT), mul(kvHead, dkStrideH));
          Value vBase = add(mul(token, dvStrideT), mul(kvHead, dvStrideH));
          for (int64_t dt = 0; dt < gradDTiles(); ++dt) {
            int64_t i = (mt * gradDTiles() + dt) * 4 + h * 2;
            Value col = gradCol(dt);
            storePair(dkPtr, add(kBase, col), dk[i], dk[i + 1]);
            storePair(dvPtr, add(vBase, col), dv[i], dv[i + 1]);
          }
        });
      }
  }
  {
    // Several items share these prompt keys: add to the fp32 accumulators,
    // [rows][Hkv][D].
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(direct.elseBlock());
    for (int64_t mt = 0; mt < gradMTiles(); ++mt)
      for (int64_t h = 0; h < 2; ++h) {
        Value r = gradRow(mt, h);
        emitIf(cmp(arith::CmpIPredicate::ult, r, kvLen), [&] {
          Value base = mul(add(mul(add(accRow, r), idx(numKVHeads)), kvHead),
                           idx(headDim));
          for (int64_t dt = 0; dt < gradDTiles(); ++dt)
            for (int64_t e = 0; e < 2; ++e) {
              int64_t i = (mt * gradDTiles() + dt) * 4 + h * 2 + e;
              Value at = add(base, add(gradCol(dt), idx(e)));
              atomicAdd(dkAccPtr, at, dk[i]);
              atomicAdd(dvAccPtr, at, dv[i]);
            }
        });
      }
  }
  return success();
}

LogicalResult KVMajorEmitter::emitOp(Operation *op) {
  return llvm::TypeSwitch<Operation *, LogicalResult>(op)
      .Case([&](LoadKVBlockOp o) { return emitLoadKVBlock(o); })
      .Case([&](InitGradOp o) { return emitInitGrad(o); })
      .Case([&](QLoopOp o) { return emitQLoop(o); })
      .Case([&](LoadQBlockOp o) { return emitLoadQBlock(o); })
      .Case([&](LoadColStatsOp o) { return emitLoadColStats(o); })
      .Case([&](QKTOp o) { return emitQKT(o); })
      .Case([&](MaskOp o) { return emitMask(o); })
      .Case([&](RecomputeProbsOp o) { return emitRecomputeProbs(o); })
      .Case([&](SoftmaxGradOp o) { return emitSoftmaxGrad(o); })
      .Case([&](AccumulateOp o) { return emitAccumulate(o); })
      .Case([&](AccumulateDqOp o) { return emitAccumulateDq(o); })
      .Case([&](StoreKVGradsOp o) { return emitStoreKVGrads(o); })
      .Default([&](Operation *o) {
        return o->emitOpError()
               << "has no sm_80 lowering in a "
               << stringifyKernelKind(kernel.getKind()) << " kernel";
      });
}

LogicalResult KVMajorEmitter::emit(gpu::GPUModuleOp gpuModule) {
  if (withDq && blockN / 16 < warps &&
      (warps % (blockN / 16) != 0 || headDim % (warps / (blockN / 16) * 16)))
    return kernel.emitOpError()
           << "block_n (" << blockN << ") and " << warps
           << " warps do not split the dQ tile into whole m16 x n16 blocks";
  if (blockN % 16 != 0)
    return kernel.emitOpError()
           << "block_n (" << blockN << ") must be a multiple of 16";
  Type i64 = b.getI64Type(), f32 = b.getF32Type();
  Type elem = gmem(elemType), f32p = gmem(f32);
  // docs/backward-abi.md: q, k, v, dout, dk, dv, lse, delta, dqacc, dkacc,
  // dvacc, items, 14 strides, scale, scale_log2.
  // dQ's accumulator is a raw global pointer: its vector reductions are
  // written against it directly.
  Type dqAccType = LLVM::LLVMPointerType::get(b.getContext(), 1);
  SmallVector<Type> args = {elem,      elem, elem, elem,
                            elem,      elem, f32p, f32p,
                            dqAccType, f32p, f32p, gmem(b.getI32Type())};
  args.append(14, i64);
  args.append({f32, f32});
  Block &entry = createFunc(gpuModule, kernel.getSymName(), args);
  auto arg = [&](unsigned i) { return entry.getArgument(i); };
  qPtr = arg(0), kPtr = arg(1), vPtr = arg(2), doPtr = arg(3), dkPtr = arg(4),
  dvPtr = arg(5), lsePtr = arg(6), deltaPtr = arg(7), dqAccPtr = arg(8),
  dkAccPtr = arg(9), dvAccPtr = arg(10), itemsPtr = arg(11);
  qStrideT = indexArg(entry, 12), qStrideH = indexArg(entry, 13),
  kStrideT = indexArg(entry, 14), kStrideH = indexArg(entry, 15),
  vStrideT = indexArg(entry, 16), vStrideH = indexArg(entry, 17),
  doStrideT = indexArg(entry, 18), doStrideH = indexArg(entry, 19),
  dkStrideT = indexArg(entry, 20), dkStrideH = indexArg(entry, 21),
  dvStrideT = indexArg(entry, 22), dvStrideH = indexArg(entry, 23),
  lseStrideH = indexArg(entry, 24), deltaStrideH = indexArg(entry, 25);
  scale = arg(26);
  scaleLog2 = arg(27);

  emitThreadIds();
  Value item = gpu::BlockIdOp::create(b, loc, gpu::Dimension::x);
  kvHead = gpu::BlockIdOp::create(b, loc, gpu::Dimension::y);
  itemIndex = item;
  kRow0 = itemField(0), kvEnd = itemField(1), qBegin = itemField(2),
  qEnd = itemField(3), accRow = itemField(4);
  qLen = arith::SubIOp::create(b, loc, qEnd, qBegin);

  auto workgroup =
      gpu::AddressSpaceAttr::get(b.getContext(), gpu::AddressSpace::Workgroup);
  auto bytes = MemRefType::get({ShapedType::kDynamic}, b.getI8Type(),
                               MemRefLayoutAttrInterface(), workgroup);
  smem = gpu::DynamicSharedMemoryOp::create(b, loc, bytes);
  int64_t blockBytes = blockM * rowStride * 2;
  if (wgmma) {
    smemAddr = alignToSwizzle(smem, sharedBytes());
    warpGroup = divu(warp, 4);
    kBuf = swizzledTile(smem, 0, blockM);
    vBuf = swizzledTile(smem, blockBytes, blockM);
    if (withDq)
      dsBuf = sharedTile(smem, dsOffset(), blockM, blockN);
  } else {
    kBuf = sharedTile(smem, 0, blockM);
    vBuf = sharedTile(smem, blockBytes, blockM);
  }
  if (grid2d) {
    dsBuf = sharedTile(smem, dsOffset(), blockN, blockM + kRowPad);
    pBuf = sharedTile(smem, dsOffset() + blockN * (blockM + kRowPad) * 2,
                      blockN, blockM + kRowPad);
  } else if (withDq && !wgmma) {
    dsBuf = sharedTile(smem, dsOffset(), blockM, blockN + kRowPad);
  }

  for (Operation &op : kernel.getBody().front())
    if (failed(emitOp(&op)))
      return failure();
  gpu::ReturnOp::create(b, loc);
  return success();
}

//===----------------------------------------------------------------------===//
// bwd_pre, bwd_post: a warp per row, each lane D / 32 contiguous elements
//===----------------------------------------------------------------------===//

class ElementwiseEmitter : public BackwardEmitterBase {
public:
  ElementwiseEmitter(KernelOp kernel, OpBuilder &b)
      : BackwardEmitterBase(kernel, b) {}
  LogicalResult emit(gpu::GPUModuleOp gpuModule);

private:
  /// Calls body(row) for rows [first, first + blockM) below `limit`, one warp
  /// per row.
  template <typename Fn> void forEachRow(Value first, Value limit, Fn body) {
    int64_t rowsPerWarp = blockM / warps;
    auto loop = scf::ForOp::create(b, loc, idx(0), idx(rowsPerWarp), idx(1));
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(loop.getBody());
    Value row =
        add(first, add(mul(warp, idx(rowsPerWarp)), loop.getInductionVar()));
    emitIf(cmp(arith::CmpIPredicate::ult, row, limit), [&] { body(row); });
  }
  Value loadVec(Value ptr, Value at, Type elem) {
    return vector::LoadOp::create(b, loc, VectorType::get({perLane()}, elem),
                                  ptr, ValueRange{at});
  }
  int64_t perLane() const { return headDim / 32; }
  Value laneCol() { return mul(lane, idx(perLane())); }
  LogicalResult emitPre(Block &entry);
  LogicalResult emitPost(Block &entry);
};

LogicalResult ElementwiseEmitter::emitPre(Block &entry) {
  // o, dout, delta, oStrideT, oStrideH, doStrideT, doStrideH, deltaStrideH, T.
  Value o = entry.getArgument(0), dout = entry.getArgument(1),
        delta = entry.getArgument(2);
  Value oT = indexArg(entry, 3), oH = indexArg(entry, 4),
        doT = indexArg(entry, 5), doH = indexArg(entry, 6),
        deltaH = indexArg(entry, 7), tokens = indexArg(entry, 8);
  Value block = gpu::BlockIdOp::create(b, loc, gpu::Dimension::x);
  Value head = gpu::BlockIdOp::create(b, loc, gpu::Dimension::y);
  auto f32Vec = VectorType::get({perLane()}, b.getF32Type());
  forEachRow(mul(block, idx(blockM)), tokens, [&](Value row) {
    Value ov =
        loadVec(o, add(add(mul(row, oT), mul(head, oH)), laneCol()), elemType);
    Value dv = loadVec(dout, add(add(mul(row, doT), mul(head, doH)), laneCol()),
                       elemType);
    Value prod =
        arith::MulFOp::create(b, loc, arith::ExtFOp::create(b, loc, f32Vec, ov),
                              arith::ExtFOp::create(b, loc, f32Vec, dv));
    Value sum =
        vector::ReductionOp::create(b, loc, vector::CombiningKind::ADD, prod);
    for (int32_t offset : {16, 8, 4, 2, 1})
      sum = arith::AddFOp::create(b, loc, sum, shuffleXor(sum, offset));
    emitIf(cmp(arith::CmpIPredicate::eq, lane, idx(0)), [&] {
      memref::StoreOp::create(b, loc, sum, delta,
                              ValueRange{add(mul(head, deltaH), row)});
    });
  });
  return success();
}

LogicalResult ElementwiseEmitter::emitPost(Block &entry) {
  // dqacc, dkacc, dvacc, dq, dk, dv, accTokens, dqStrideT, dqStrideH,
  // dkStrideT, dkStrideH, dvStrideT, dvStrideH, T, numAccRows.
  Value dqAcc = entry.getArgument(0), dkAcc = entry.getArgument(1),
        dvAcc = entry.getArgument(2), dq = entry.getArgument(3),
        dk = entry.getArgument(4), dv = entry.getArgument(5),
        accTokens = entry.getArgument(6);
  Value dqT = indexArg(entry, 7), dqH = indexArg(entry, 8),
        dkT = indexArg(entry, 9), dkH = indexArg(entry, 10),
        dvT = indexArg(entry, 11), dvH = indexArg(entry, 12),
        tokens = indexArg(entry, 13), accRows = indexArg(entry, 14);
  Value block = gpu::BlockIdOp::create(b, loc, gpu::Dimension::x);
  Value y = gpu::BlockIdOp::create(b, loc, gpu::Dimension::y);
  Value first = mul(block, idx(blockM));
  auto narrowType = VectorType::get({perLane()}, elemType);
  auto convert = [&](Value src, Value srcAt, Value dst, Value dstAt) {
    Value v = loadVec(src, srcAt, b.getF32Type());
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
      Value src = add(mul(add(mul(row, idx(numKVHeads)), kvHead), idx(headDim)),
                      laneCol());
      convert(dkAcc, src, dk,
              add(add(mul(token, dkT), mul(kvHead, dkH)), laneCol()));
      convert(dvAcc, src, dv,
              add(add(mul(token, dvT), mul(kvHead, dvH)), laneCol()));
    });
  }
  return success();
}

LogicalResult ElementwiseEmitter::emit(gpu::GPUModuleOp gpuModule) {
  if (blockM % warps != 0)
    return kernel.emitOpError()
           << "block_m (" << blockM << ") must split evenly over " << warps
           << " warps";
  Type i64 = b.getI64Type();
  Type elem = gmem(elemType), f32p = gmem(b.getF32Type());
  bool pre = kernel.getKind() == KernelKind::bwd_pre;
  SmallVector<Type> args;
  if (pre) {
    args = {elem, elem, f32p};
    args.append(6, i64);
  } else {
    args = {f32p, f32p, f32p, elem, elem, elem, gmem(b.getI32Type())};
    args.append(8, i64);
  }
  Block &entry = createFunc(gpuModule, kernel.getSymName(), args);
  emitThreadIds();
  if (failed(pre ? emitPre(entry) : emitPost(entry)))
    return failure();
  gpu::ReturnOp::create(b, loc);
  return success();
}

} // namespace

LogicalResult mlir::dualkv::emitBackwardKernel(KernelOp kernel, OpBuilder &b,
                                               gpu::GPUModuleOp gpuModule,
                                               int64_t *sharedBytes) {
  switch (kernel.getKind()) {
  case KernelKind::bwd:
  case KernelKind::bwd_kv: {
    KVMajorEmitter emitter(kernel, b);
    *sharedBytes = emitter.sharedBytes();
    return emitter.emit(gpuModule);
  }
  case KernelKind::bwd_pre:
  case KernelKind::bwd_post: {
    ElementwiseEmitter emitter(kernel, b);
    *sharedBytes = 0;
    return emitter.emit(gpuModule);
  }
  case KernelKind::fwd:
  case KernelKind::bwd_dq:
    break;
  }
  return kernel.emitOpError() << "is not a KV-major or elementwise kernel";
}
