//===- QueryMajorSkeleton.cpp - the query-major kernels' shared emission --===//
//
// Everything of the forward and the deterministic dQ kernel that does not
// depend on the schedule (QueryMajorSkeleton.h): the kernel's arguments, the
// loop bounds of the two KV regions, tile copies, masks, the online softmax and
// the epilogues.
//
//===----------------------------------------------------------------------===//
#include "Lowering/Skeletons/QueryMajorSkeleton.h"

#include "llvm/ADT/TypeSwitch.h"

#include <limits>

using namespace mlir;
using namespace mlir::dualkv;

QueryMajorEmitter::QueryMajorEmitter(KernelOp kernel, OpBuilder &b)
    : ScalarBuilder(b, kernel.getLoc()),
      elemType(kernel.getProblem()->getDtype()),
      headDim(kernel.getProblem()->getHeadDim()),
      columnBlocks(::dualkv::outputColumnBlocks(
          static_cast<::dualkv::KernelKind>(kernel.getKind()), headDim,
          kernel.getProblem()->getValueHeadDim())),
      valueHeadDim(kernel.getProblem()->getValueHeadDim() /
                   (kernel.getKind() == KernelKind::fwd ? columnBlocks : 1)),
      warps(kernel.getTiling()->getWarps()), fn(*this, elemType),
      frags(*this, elemType), smemTiles(*this, elemType, headDim),
      vTiles(*this, elemType, valueHeadDim), copies(*this), kernel(kernel) {
  ProblemAttr p = *kernel.getProblem();
  TilingAttr t = *kernel.getTiling();
  blockM = t.getBlockM();
  blockN = t.getBlockN();
  groupSize = p.getNumQHeads() / p.getNumKvHeads();
  mTiles = blockM / (16 * warps);
  kTiles = headDim / 16;
  nTiles = blockN / 8;
  stages = t.getStages();
  isDq = kernel.getKind() == KernelKind::bwd_dq;
  // The accumulator: O (value head_dim) or dQ (head_dim), the CTA's block
  // of their columns.
  outputCols = isDq ? headDim / columnBlocks : valueHeadDim;
  dTiles = outputCols / 8;
  rowStride = headDim + kRowPad;
  vRowStride = valueHeadDim + kRowPad;
}

int64_t QueryMajorEmitter::contractTiles(QKOp op) {
  auto kv = op.getK().getDefiningOp<LoadKVOp>();
  return kv && kv.getOperand() == KVOperand::value ? valueHeadDim / 16 : kTiles;
}

LogicalResult QueryMajorEmitter::emitLoadQ(LoadQOp op) {
  Value group =
      smemTiles.copyTile(ids.tid, threads(), qBuf, qPtr, blockM, segStart,
                         qRow0, segLen, qStrideT, mul(head, qStrideH),
                         /*predicated=*/true, Value(),
                         /*swizzled=*/swizzledTiles);
  copies.waitAll(group);
  // Q stays in shared memory for the whole kernel: its A fragments are re-read
  // per k-step, which keeps ~32-64 registers a thread free for the accumulator.
  map.map(op.getResult(), qBuf);
  return success();
}

LogicalResult QueryMajorEmitter::emitInitAcc(InitAccOp op) {
  map.map(op.getResult(), splat(*this, mTiles * dTiles * 4, 0.0f));
  return success();
}

LogicalResult QueryMajorEmitter::emitInitStats(InitStatsOp op) {
  map.map(op.getMax(),
          splat(*this, mTiles * 2, -std::numeric_limits<float>::infinity()));
  map.map(op.getSum(), splat(*this, mTiles * 2, 0.0f));
  return success();
}

LogicalResult QueryMajorEmitter::emitKVLoop(KVLoopOp op) {
  auto bounds = kvLoopTiles(*this, op.getPart(), op.getRegion(), qRow0, segLen,
                            sharedLen, blockM, blockN, window, sharedShift);
  if (!bounds)
    return op.emitOpError() << "is not tiled: run dualkv-tile-regions first";
  auto [lb, ub] = *bounds;
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
    copies.clear();
    beginKVIteration();
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

LogicalResult QueryMajorEmitter::emitChainLoop(ChainLoopOp op) {
  if (!chainPtr)
    return op.emitOpError() << "needs a tree kernel (#dualkv.problem<..., "
                               "tree = true>), which takes the chain table";
  // Row r of the chain table: {start, length, next, ranges}; row `segment`
  // is the segment's nearest ancestor range and `ranges` the number of
  // ranges from a row up to its root (0 for a root segment's empty row).
  auto field = [&](Value row, int64_t f) {
    return toIndex(memref::LoadOp::create(
        b, loc, chainPtr, ValueRange{add(mul(row, idx(4)), idx(f))}));
  };
  Value count = field(segIndex, 3);
  // The segment table's shared range, restored after the walk: nothing past
  // it may use a range of the loop body.
  Value tableStart = sharedStart, tableLen = sharedLen;
  // With a sliding window the walk also carries the lengths of the ranges
  // walked so far: a range's keys lie that many logical positions (its own
  // length included) before the segment's first token.
  const size_t walked = window ? 2 : 1;
  SmallVector<Value> inits{segIndex};
  if (window)
    inits.push_back(idx(0));
  for (Value v : op.getInits())
    inits.push_back(map.lookup(v));
  auto loop = scf::ForOp::create(b, loc, idx(0), count, idx(1), inits);
  {
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(loop.getBody());
    Value row = loop.getRegionIterArgs()[0];
    // The shared region of this iteration: one ancestor range.
    sharedStart = field(row, 0);
    sharedLen = field(row, 1);
    if (window)
      sharedShift = add(loop.getRegionIterArgs()[1], sharedLen);
    Value next = field(row, 2);
    for (auto [from, to] :
         llvm::zip(op.getRegionIterArgs(),
                   loop.getRegionIterArgs().drop_front(walked)))
      map.map(from, to);
    for (Operation &inner : op.getBody().front().without_terminator())
      if (failed(emitOp(&inner)))
        return failure();
    SmallVector<Value> yielded{next};
    if (window)
      yielded.push_back(sharedShift);
    for (Value v : op.getBody().front().getTerminator()->getOperands())
      yielded.push_back(map.lookup(v));
    scf::YieldOp::create(b, loc, yielded);
  }
  for (auto [from, to] :
       llvm::zip(op.getResults(), loop.getResults().drop_front(walked)))
    map.map(from, to);
  sharedStart = tableStart;
  sharedLen = tableLen;
  sharedShift = Value();
  return success();
}

LogicalResult QueryMajorEmitter::emitLoadKV(LoadKVOp op) {
  auto loop = op->getParentOfType<KVLoopOp>();
  bool shared = loop.getRegion() == KVRegion::shared;
  bool isKey = op.getOperand() == KVOperand::key;
  Value buf = isKey ? kBuf : vBuf;
  if (isKey && prefetchedKey) {
    // Issued by the loop prologue or the previous iteration; it is the oldest
    // group.
    copies.addOldest(op.getResult(), prefetchedKey);
    map.map(op.getResult(), buf);
    return success();
  }
  Value first = mul(map.lookup(op.getTile()), idx(blockN));
  // The forward reads its block of V's columns; the dQ kernel whole V rows
  // (dP contracts all of them).
  Value headOffset = isKey  ? mul(kvHead, kStrideH)
                     : isDq ? mul(kvHead, vStrideH)
                            : withColumnBlock(mul(kvHead, vStrideH));
  Value group =
      (isKey ? smemTiles : vTiles)
          .copyTile(ids.tid, threads(), buf, isKey ? kPtr : vPtr, blockN,
                    shared ? sharedStart : segStart, first,
                    shared ? sharedLen : segLen, isKey ? kStrideT : vStrideT,
                    headOffset,
                    /*predicated=*/!insideRegion(loop.getPart()), Value(),
                    /*swizzled=*/swizzledTiles);
  copies.add(op.getResult(), group);
  map.map(op.getResult(), buf);
  return success();
}

LogicalResult QueryMajorEmitter::emitQK(QKOp op) {
  copies.waitFor(op.getK());
  SmallVector<Value> scores = computeScores(op);
  // The softmax and masks index MT x NT C fragments a warp: a schedule whose
  // products lay out another count (wgmma at two m16 blocks a warp) would
  // have them read past the end.
  if (int64_t(scores.size()) != mTiles * nTiles * 4)
    return op.emitOpError()
           << "the " << stringifySchedule(*kernel.getSchedule())
           << " schedule gives " << scores.size()
           << " score registers a thread where the tiling's fragments need "
           << mTiles * nTiles * 4;
  map.map(op.getResult(), pack(scores));
  // The dQ kernel reads K again (dS K) after its scores: no key prefetch there.
  if (stages >= 2 && !isDq)
    prefetchNextKey(op);
  return success();
}

void QueryMajorEmitter::prefetchNextKey(QKOp op) {
  // Every warp is done with this key tile: load the next one while softmax and
  // P·V run.
  auto loop = op->getParentOfType<KVLoopOp>();
  gpu::BarrierOp::create(b, loc);
  Value next = add(map.lookup(loop.getTileIndex()), idx(1));
  Value group =
      issueKeyCopy(loop, next, cmp(arith::CmpIPredicate::ult, next, loopUpper));
  copies.add(Value(), group);
}

Value QueryMajorEmitter::issueKeyCopy(KVLoopOp loop, Value tile,
                                      Value tileValid) {
  bool shared = loop.getRegion() == KVRegion::shared;
  // Every row of a full tile is inside its region: only the tile index needs a
  // check.
  Value limit = shared ? sharedLen : segLen;
  if (insideRegion(loop.getPart()))
    limit = Value();
  return smemTiles.copyTile(
      ids.tid, threads(), kBuf, kPtr, blockN, shared ? sharedStart : segStart,
      mul(tile, idx(blockN)), limit, kStrideT, mul(kvHead, kStrideH),
      /*predicated=*/true, tileValid,
      /*swizzled=*/swizzledTiles);
}

Value QueryMajorEmitter::packAFragments(ArrayRef<Value> p) {
  return pack(frags.packAFragments(p, mTiles, nTiles));
}

LogicalResult QueryMajorEmitter::emitLoadDout(LoadDoutOp op) {
  Value group =
      vTiles.copyTile(ids.tid, threads(), doBuf, doPtr, blockM, segStart, qRow0,
                      segLen, doStrideT, mul(head, doStrideH),
                      /*predicated=*/true, Value(), /*swizzled=*/swizzledTiles);
  copies.waitAll(group);
  map.map(op.getResult(), doBuf);
  return success();
}

LogicalResult QueryMajorEmitter::emitLoadRowStats(LoadRowStatsOp op) {
  bool isLse = op.getStat() == StatKind::lse;
  Value ptr = isLse ? lsePtr : deltaPtr;
  Value headBase = mul(head, isLse ? lseStrideH : deltaStrideH);
  // Rows past the segment: LSE +inf (so P = 0), Delta 0.
  Value fill = f32c(isLse ? std::numeric_limits<float>::infinity() : 0.0f);
  SmallVector<Value> out;
  for (int64_t mt = 0; mt < mTiles; ++mt)
    for (int64_t h = 0; h < 2; ++h) {
      Value row = fragmentRow(mt, h);
      Value valid = cmp(arith::CmpIPredicate::ult, row, segLen);
      Value at = add(headBase, add(segStart, select(valid, row, idx(0))));
      Value v = memref::LoadOp::create(b, loc, ptr, ValueRange{at});
      // LSE moves to the log2 domain of the kernels' exp2.
      if (isLse)
        v = arith::MulFOp::create(b, loc, v, f32c(kLog2e));
      out.push_back(select(valid, v, fill));
    }
  map.map(op.getResult(), pack(out));
  return success();
}

LogicalResult QueryMajorEmitter::emitStoreDq(StoreDqOp op) {
  SmallVector<Value> acc = unpack(map.lookup(op.getAcc()));
  for (int64_t mt = 0; mt < mTiles; ++mt)
    for (int64_t h = 0; h < 2; ++h) {
      Value row = fragmentRow(mt, h);
      auto inRange =
          scf::IfOp::create(b, loc, cmp(arith::CmpIPredicate::ult, row, segLen),
                            /*withElseRegion=*/false);
      OpBuilder::InsertionGuard guard(b);
      b.setInsertionPointToStart(inRange.thenBlock());
      Value rowBase = withColumnBlock(
          add(mul(add(segStart, row), oStrideT), mul(head, oStrideH)));
      for (int64_t dt = 0; dt < dTiles; ++dt) {
        Value narrow = arith::TruncFOp::create(
            b, loc, VectorType::get({2}, elemType),
            pack({acc[(mt * dTiles + dt) * 4 + h * 2],
                  acc[(mt * dTiles + dt) * 4 + h * 2 + 1]}));
        Value col = add(idx(dt * 8), mul(ids.t, idx(2)));
        vector::StoreOp::create(b, loc, narrow, dqPtr,
                                ValueRange{add(rowBase, col)});
      }
    }
  return success();
}

LogicalResult QueryMajorEmitter::emitPV(PVOp op) {
  copies.waitFor(op.getV());
  SmallVector<Value> p = unpack(map.lookup(op.getProbs()));
  SmallVector<Value> acc = unpack(map.lookup(op.getAcc()));
  acc = accumulatePV(p, std::move(acc), map.lookup(op.getV()));
  if (int64_t(acc.size()) != mTiles * dTiles * 4)
    return op.emitOpError()
           << "the " << stringifySchedule(*kernel.getSchedule())
           << " schedule gives " << acc.size()
           << " accumulator registers a thread where the tiling's fragments "
              "need "
           << mTiles * dTiles * 4;
  map.map(op.getResult(), pack(acc));
  return success();
}

LogicalResult QueryMajorEmitter::emitStoreOutput(StoreOutputOp op) {
  SmallVector<Value> acc = unpack(map.lookup(op.getAcc()));
  SmallVector<Value> m = unpack(map.lookup(op.getMax()));
  SmallVector<Value> l = unpack(map.lookup(op.getSum()));
  // With attention sinks, the head's sink logit in the log2 domain.
  Value sinkLog2;
  if (hasSinks())
    sinkLog2 = tile::sinkLog2(*this, fn.param("sinks"), head);
  // O = acc / l and LSE = m + log2(l) (in natural log) of the rows inside the
  // segment.
  for (int64_t mt = 0; mt < mTiles; ++mt)
    for (int64_t h = 0; h < 2; ++h) {
      int64_t r = mt * 2 + h;
      Value sum = tile::rowSum(*this, l[r]);
      if (sinkLog2)
        sum = tile::addSink(*this, sum, m[r], sinkLog2);
      Value inv = arith::DivFOp::create(b, loc, f32c(1.0f), sum);
      Value row = add(add(qRow0, mul(ids.warp, idx(16 * mTiles))),
                      add(idx(mt * 16 + h * 8), ids.g));
      auto inRange =
          scf::IfOp::create(b, loc, cmp(arith::CmpIPredicate::ult, row, segLen),
                            /*withElseRegion=*/false);
      OpBuilder::InsertionGuard guard(b);
      b.setInsertionPointToStart(inRange.thenBlock());
      Value token = add(segStart, row);
      Value rowBase =
          withColumnBlock(add(mul(token, oStrideT), mul(head, oStrideH)));
      for (int64_t dt = 0; dt < dTiles; ++dt) {
        Value lo = arith::MulFOp::create(
            b, loc, acc[(mt * dTiles + dt) * 4 + h * 2], inv);
        Value hi = arith::MulFOp::create(
            b, loc, acc[(mt * dTiles + dt) * 4 + h * 2 + 1], inv);
        Value narrow = arith::TruncFOp::create(
            b, loc, VectorType::get({2}, elemType), pack({lo, hi}));
        Value col = add(idx(dt * 8), mul(ids.t, idx(2)));
        vector::StoreOp::create(b, loc, narrow, oPtr,
                                ValueRange{add(rowBase, col)});
      }
      // One CTA of a query tile's column blocks stores its LSE (each
      // computes the same).
      Value leads = cmp(arith::CmpIPredicate::eq, ids.t, idx(0));
      if (columnBlock)
        leads = arith::AndIOp::create(
            b, loc, leads, cmp(arith::CmpIPredicate::eq, columnBlock, idx(0)));
      auto lead = scf::IfOp::create(b, loc, leads, /*withElseRegion=*/false);
      b.setInsertionPointToStart(lead.thenBlock());
      Value lse = tile::logSumExp(*this, m[r], sum);
      memref::StoreOp::create(b, loc, lse, lsePtr,
                              ValueRange{add(mul(head, lseStrideH), token)});
    }
  return success();
}

LogicalResult QueryMajorEmitter::emitOp(Operation *op) {
  return llvm::TypeSwitch<Operation *, LogicalResult>(op)
      .Case([&](LoadQOp o) { return emitLoadQ(o); })
      .Case([&](InitAccOp o) { return emitInitAcc(o); })
      .Case([&](InitStatsOp o) { return emitInitStats(o); })
      .Case([&](KVLoopOp o) { return emitKVLoop(o); })
      .Case([&](ChainLoopOp o) { return emitChainLoop(o); })
      .Case([&](LoadKVOp o) { return emitLoadKV(o); })
      .Case([&](QKOp o) { return emitQK(o); })
      .Case([&](PVOp o) { return emitPV(o); })
      .Case([&](StoreOutputOp o) { return emitStoreOutput(o); })
      .Case([&](LoadDoutOp o) { return emitLoadDout(o); })
      .Case([&](LoadRowStatsOp o) { return emitLoadRowStats(o); })
      .Case([&](StoreDqOp o) { return emitStoreDq(o); })
      .Default([&](Operation *o) -> LogicalResult {
        if (isTileOp(o))
          return emitTileOp(o, *this, tileEnv(), map);
        return o->emitOpError() << "has no sm_80 lowering";
      });
}

TileEnv QueryMajorEmitter::tileEnv() {
  TileEnv env;
  env.layoutOf = [this](Value tile) {
    return queryMajorLayout(*this, mTiles, nTiles, qRow0,
                            mul(tile, idx(blockN)), ids.warp, ids.g, ids.t);
  };
  env.stat = queryMajorStats(nTiles);
  // The shared region of this point of the walk (a tree's ancestor range).
  env.bound = sharedLen;
  env.window = window;
  env.boundShift = sharedShift;
  env.scaleLog2 = scaleLog2, env.scale = scale;
  env.mTiles = mTiles, env.nTiles = nTiles, env.dTiles = dTiles;
  env.packOperand = [this](ArrayRef<Value> p) { return packAFragments(p); };
  if (scoreMod)
    env.siteOf = [this](Operation *op) {
      bool shared =
          op->getParentOfType<KVLoopOp>().getRegion() == KVRegion::shared;
      ScoreLayout layout = queryMajorLayout(
          *this, mTiles, nTiles, qRow0,
          mul(map.lookup(op->getOperand(op->getNumOperands() - 1)),
              idx(blockN)),
          ids.warp, ids.g, ids.t);
      return scoreMod->queryMajorSite(
          *this, layout, segStart, segLen, shared ? sharedStart : segStart,
          [this, shared] { return idx(shared ? 0 : 1); }, head);
    };
  return env;
}

LogicalResult QueryMajorEmitter::emit(gpu::GPUModuleOp gpuModule) {
  MLIRContext *ctx = b.getContext();
  auto workgroup =
      gpu::AddressSpaceAttr::get(ctx, gpu::AddressSpace::Workgroup);
  const bool tree = kernel.walksChain();
  fn.create(gpuModule, kernel.getSymName(), kernel.getKind(), threads(),
            ::dualkv::Schedule::Auto, tree, /*dlse=*/false, hasSinks(),
            hasWindow(kernel), scoreModInputs(kernel));
  if (hasWindow(kernel))
    window = fn.indexParam("window");
  if (int inputs = scoreModInputs(kernel); inputs >= 0)
    scoreMod = ScoreModParams::read(fn, inputs);
  qPtr = fn.param("q"), kPtr = fn.param("k"), vPtr = fn.param("v"),
  lsePtr = fn.param("lse"), segPtr = fn.param("segs");
  if (tree)
    chainPtr = fn.param("chain");
  if (isDq) {
    // dq takes the output's place (oPtr, oStride*).
    doPtr = fn.param("dout"), oPtr = fn.param("dq"),
    deltaPtr = fn.param("delta");
    qStrideT = fn.indexParam("qStrideT"), qStrideH = fn.indexParam("qStrideH"),
    kStrideT = fn.indexParam("kStrideT"), kStrideH = fn.indexParam("kStrideH"),
    vStrideT = fn.indexParam("vStrideT"), vStrideH = fn.indexParam("vStrideH"),
    doStrideT = fn.indexParam("doStrideT"),
    doStrideH = fn.indexParam("doStrideH"),
    oStrideT = fn.indexParam("dqStrideT"),
    oStrideH = fn.indexParam("dqStrideH"),
    lseStrideH = fn.indexParam("lseStrideH"),
    deltaStrideH = fn.indexParam("deltaStrideH");
    scale = fn.param("scale");
    dqPtr = oPtr;
  } else {
    oPtr = fn.param("o");
    qStrideT = fn.indexParam("qStrideT"), qStrideH = fn.indexParam("qStrideH"),
    kStrideT = fn.indexParam("kStrideT"), kStrideH = fn.indexParam("kStrideH"),
    vStrideT = fn.indexParam("vStrideT"), vStrideH = fn.indexParam("vStrideH"),
    oStrideT = fn.indexParam("oStrideT"), oStrideH = fn.indexParam("oStrideH"),
    lseStrideH = fn.indexParam("lseStrideH");
  }
  scaleLog2 = fn.param("scaleLog2");

  ids = ThreadIds::emit(*this);
  Value tileId = gpu::BlockIdOp::create(b, loc, gpu::Dimension::x);
  Value seg = gpu::BlockIdOp::create(b, loc, gpu::Dimension::y);
  head = gpu::BlockIdOp::create(b, loc, gpu::Dimension::z);
  if (columnBlocks > 1) {
    // z = head * blocks + the block of output columns this CTA computes.
    Value z = head;
    head = divu(z, columnBlocks);
    columnBlock = remu(z, columnBlocks);
  }
  segIndex = seg;
  kvHead = divu(head, groupSize);
  SegmentFields fields = segmentFields(*this, segPtr, seg);
  segStart = fields.start, segLen = fields.length,
  sharedStart = fields.sharedStart, sharedLen = fields.sharedLen;

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
  // [Q: block_m rows][dO: block_m rows, bwd_dq][K: block_n rows][V: block_n
  // rows], each row padded.
  int64_t qBytes = blockM * rowStride * 2;
  int64_t kvOffset = qBytes + (isDq ? blockM * vRowStride * 2 : 0);
  layoutTiles(smem, qBytes, kvOffset);

  for (Operation &op : kernel.getBody().front())
    if (failed(emitOp(&op)))
      return failure();

  b.setInsertionPointToEnd(&fn.entry());
  gpu::ReturnOp::create(b, loc);
  return success();
}
