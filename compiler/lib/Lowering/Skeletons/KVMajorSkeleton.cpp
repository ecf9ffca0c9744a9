//===- KVMajorSkeleton.cpp - the KV-major backward's shared emission ------===//
//
// Everything of bwd and bwd_kv that does not depend on the schedule
// (KVMajorSkeleton.h).
//
//===----------------------------------------------------------------------===//
#include "Lowering/Skeletons/KVMajorSkeleton.h"
#include "Lowering/Support/Segments.h"
#include "dualkv/Compiler/Compiler.h"

#include "llvm/ADT/TypeSwitch.h"

#include <algorithm>
#include <limits>

using namespace mlir;
using namespace mlir::dualkv;

KVMajorEmitter::KVMajorEmitter(KernelOp kernel, OpBuilder &b)
    : BackwardEmitterBase(kernel, b), frags(*this, elemType),
      smemTiles(*this, elemType, headDim),
      vTiles(*this, elemType, valueHeadDim), copies(*this) {
  mTiles = blockM / (16 * warps);
  nTiles = blockN / 8;
  kTiles = headDim / 16;
  dTiles = headDim / 8;
  vDTiles = valueHeadDim / 8;
  rowStride = headDim + kRowPad;
  vRowStride = valueHeadDim + kRowPad;
  dsRowStride = blockN + kRowPad;
  withDq = kernel.getKind() == KernelKind::bwd;
  statSlotCount = std::max(blockN, threads());
  // sm_90 and later add four fp32 values with one vector reduction.
  std::optional<::dualkv::Arch> arch =
      ::dualkv::Arch::parse(kernel.getArch()->str());
  vectorRed = arch && arch->number >= 90;
}

int64_t KVMajorEmitter::contractTiles(QKTOp op) const {
  auto kv = op.getKv().getDefiningOp<LoadKVBlockOp>();
  return kv && kv.getOperand() == KVOperand::value ? valueHeadDim / 16 : kTiles;
}

bool KVMajorEmitter::seedsValueGrad(Value acc) {
  for (OpOperand &use : acc.getUses()) {
    Operation *user = use.getOwner();
    if (isa<StoreKVGradsOp>(user))
      return use.getOperandNumber() == 1;
    if (auto accumulate = dyn_cast<AccumulateOp>(user))
      return accumulatesValueGrad(accumulate);
    if (auto loop = dyn_cast<QLoopOp>(user)) {
      unsigned i = use.getOperandNumber();
      if (seedsValueGrad(loop.getRegionIterArgs()[i]) ||
          seedsValueGrad(loop.getResult(i)))
        return true;
    }
  }
  return false;
}

KVProductsHost KVMajorEmitter::productsHost() {
  return {*this,
          *this,
          elemType,
          headDim,
          blockM,
          blockN,
          nTiles,
          withDq,
          splitWarpgroups,
          map,
          ids,
          frags,
          smemTiles,
          copies,
          smem,
          kBuf,
          vBuf,
          dsBuf,
          qCur,
          doCur,
          aG,
          aT,
          qLen,
          dqAccPtr,
          [this](Value tile) { waitFor(tile); },
          [this](Value q) { return dqAccRow(q); }};
}

Value KVMajorEmitter::itemField(int64_t f, bool fresh) {
  Value item = fresh ? opaque(*this, itemIndex) : itemIndex;
  Value v = memref::LoadOp::create(
      b, loc, itemsPtr,
      ValueRange{add(mul(item, idx(::dualkv::kBwdItemFields)), idx(f))});
  return toIndex(v);
}

LogicalResult KVMajorEmitter::emitLoadKVBlock(LoadKVBlockOp op) {
  bool isKey = op.getOperand() == KVOperand::key;
  Value buf = isKey ? kBuf : vBuf;
  Value group =
      (isKey ? smemTiles : vTiles)
          .copyTile(ids.tid, threads(), buf, isKey ? kPtr : vPtr, blockM,
                    idx(0), kRow0, kvEnd, isKey ? kStrideT : vStrideT,
                    mul(kvHead, isKey ? kStrideH : vStrideH),
                    /*predicated=*/true, Value(), /*swizzled=*/swizzledTiles);
  // Loaded once per CTA: wait right away.
  copies.waitAll(group);
  map.map(op.getResult(), buf);
  return success();
}

LogicalResult KVMajorEmitter::emitInitGrad(InitGradOp op) {
  map.map(op.getResult(),
          splat(*this,
                gradMTiles() * gradDTiles(seedsValueGrad(op.getResult())) * 4,
                0.0f));
  return success();
}

LogicalResult KVMajorEmitter::qLoopBounds(QLoopOp op, Value &lb, Value &ub) {
  // Query tiles [0, diagEnd) meet the block's keys (qBegin >= kRow0): they
  // need the causal mask; the rest see every key of the block.
  Value numTiles = ceilDiv(qLen, blockN);
  Value reach = arith::SubIOp::create(b, loc, add(kRow0, idx(blockM)), qBegin);
  reach = select(cmp(arith::CmpIPredicate::sgt, reach, idx(0)), reach, idx(0));
  Value diagEnd = ceilDiv(reach, blockN);
  diagEnd = select(cmp(arith::CmpIPredicate::ult, diagEnd, numTiles), diagEnd,
                   numTiles);
  // With a sliding window W, the tiles from winStart on hold a row past the
  // window of the block's first key (i - kRow0 + d >= W): masked, after the
  // full ones. The runtime ends the item at the last row any key sees.
  Value winStart = numTiles;
  if (window) {
    Value far = arith::SubIOp::create(b, loc, add(kRow0, window),
                                      add(windowShift, qBegin));
    far = select(cmp(arith::CmpIPredicate::sgt, far, idx(0)), far, idx(0));
    winStart = divu(far, blockN);
    winStart = select(cmp(arith::CmpIPredicate::ult, winStart, diagEnd),
                      diagEnd, winStart);
    winStart = select(cmp(arith::CmpIPredicate::ult, winStart, numTiles),
                      winStart, numTiles);
  }
  switch (op.getPart()) {
  case LoopPart::all:
    return op.emitOpError() << "is not tiled: run dualkv-tile-regions first";
  case LoopPart::tail:
  case LoopPart::masked:
    return op.emitOpError()
           << "has no lowering for part " << stringifyLoopPart(op.getPart());
  case LoopPart::diagonal:
    lb = idx(0);
    ub = diagEnd;
    break;
  case LoopPart::full:
    lb = diagEnd;
    ub = winStart;
    break;
  case LoopPart::window:
    lb = winStart;
    ub = numTiles;
    break;
  }
  return success();
}

LogicalResult KVMajorEmitter::emitQLoop(QLoopOp op) {
  Value lb, ub;
  if (failed(qLoopBounds(op, lb, ub)))
    return failure();
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
      beginQIteration(parity);
      copies.clear();
      tileReady = false;
      copies.add(qCur, first[0]);
      copies.add(doCur, first[1]);
      copies.add(lseCur, first[2]);
      Value next = add(i, idx(1));
      for (Value group :
           issueTileCopies(next, arith::SubIOp::create(b, loc, idx(1), parity),
                           cmp(arith::CmpIPredicate::ult, next, ub)))
        copies.add(Value(), group);
      if (failed(emitQIterationOps(op)))
        return failure();
      endQIteration();
      // Every warp must be done with this tile's shared memory before the
      // next iteration's copies overwrite it.
      copies.syncThreads();
      scf::YieldOp::create(b, loc, qIterationYields(op));
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

LogicalResult KVMajorEmitter::emitQIterationOps(QLoopOp op) {
  aLane = opaque(*this, ids.lane);
  aG = divu(aLane, 4);
  aT = remu(aLane, 4);
  for (Operation &inner : op.getBody().front().without_terminator())
    if (failed(emitOp(&inner)))
      return failure();
  return success();
}

SmallVector<Value> KVMajorEmitter::qIterationYields(QLoopOp op) {
  SmallVector<Value> yielded;
  for (Value v : op.getBody().front().getTerminator()->getOperands())
    yielded.push_back(map.lookup(v));
  return yielded;
}

SmallVector<Value, 4> KVMajorEmitter::tileViews(Value parity) {
  auto workgroup =
      gpu::AddressSpaceAttr::get(b.getContext(), gpu::AddressSpace::Workgroup);
  auto tileTypeOf = [&](int64_t stride) {
    return swizzledTiles
               ? MemRefType::get({blockN * stride / 64, 64}, elemType,
                                 MemRefLayoutAttrInterface(), workgroup)
               : MemRefType::get({blockN, stride}, elemType,
                                 MemRefLayoutAttrInterface(), workgroup);
  };
  auto statType = MemRefType::get({statSlots()}, b.getF32Type(),
                                  MemRefLayoutAttrInterface(), workgroup);
  auto view = [&](MemRefType type, int64_t base, int64_t stride) {
    return memref::ViewOp::create(b, loc, type, smem,
                                  add(idx(base), mul(parity, idx(stride))),
                                  ValueRange{})
        .getResult();
  };
  int64_t statBytes = statSlots() * 4;
  return {view(tileTypeOf(rowStride), qOffset(), tileBytes()),
          view(tileTypeOf(vRowStride), doOffset(), vTileBytes()),
          view(statType, statsOffset(), statBytes),
          view(statType, statsOffset() + 2 * statBytes, statBytes)};
}

SmallVector<Value, 3> KVMajorEmitter::issueTileCopies(Value tile, Value parity,
                                                      Value valid) {
  SmallVector<Value, 4> views = tileViews(parity);
  Value first = mul(tile, idx(blockN));
  SmallVector<Value, 3> groups;
  groups.push_back(smemTiles.copyTile(ids.tid, threads(), views[0], qPtr,
                                      blockN, qBegin, first, qLen, qStrideT,
                                      mul(head, qStrideH),
                                      /*predicated=*/true, valid,
                                      /*swizzled=*/swizzledTiles));
  groups.push_back(vTiles.copyTile(ids.tid, threads(), views[1], doPtr, blockN,
                                   qBegin, first, qLen, doStrideT,
                                   mul(head, doStrideH),
                                   /*predicated=*/true, valid,
                                   /*swizzled=*/swizzledTiles));
  groups.push_back(issueStatCopies(first, parity, valid));
  return groups;
}

Value KVMajorEmitter::issueStatCopies(Value first, Value parity, Value valid,
                                      bool infinitePastItem) {
  SmallVector<Value, 4> views = tileViews(parity);
  // LSE and Delta, 4 bytes a query (rows need not be 16-byte aligned).
  // Queries past the item read as 0: their Q and dO rows are zero too, so
  // P = 1 meets dO = 0 and dP - Delta = 0, and they add nothing. With
  // infinitePastItem their LSE is +inf instead: P = 0 whatever Q and dO hold.
  // With more threads than queries, thread j >= BN zero-fills slot j of the
  // arrays' tails (statSlots), a slot of its own: every copy stays
  // unconditional, and no two threads write the same word.
  SmallVector<Value> tokens;
  SmallVector<std::pair<Value, Value>> pastItem; // (slot, in the item)
  for (int64_t j0 = 0; j0 < blockN; j0 += threads()) {
    Value j = add(ids.tid, idx(j0));
    Value col = add(first, j);
    Value ok = arith::AndIOp::create(b, loc, valid,
                                     cmp(arith::CmpIPredicate::ult, col, qLen));
    if (threads() > blockN)
      ok = arith::AndIOp::create(
          b, loc, ok, cmp(arith::CmpIPredicate::ult, j, idx(blockN)));
    Value token = add(qBegin, select(ok, col, idx(0)));
    Value count = select(ok, idx(1), idx(0));
    for (auto [dst, src, strideH] :
         {std::tuple{views[2], lsePtr, lseStrideH},
          std::tuple{views[3], deltaPtr, deltaStrideH}})
      tokens.push_back(nvgpu::DeviceAsyncCopyOp::create(
          b, loc, dst, ValueRange{j}, src,
          ValueRange{add(mul(head, strideH), token)}, b.getIndexAttr(1), count,
          UnitAttr()));
    if (infinitePastItem)
      // The zero-filled LSE slot becomes +inf once its (empty) copy has
      // landed: the store follows the wait in issue order per thread.
      pastItem.push_back({j, ok});
  }
  Value group = nvgpu::DeviceAsyncCreateGroupOp::create(b, loc, tokens);
  if (infinitePastItem) {
    nvgpu::DeviceAsyncWaitOp::create(b, loc, group, b.getI32IntegerAttr(0));
    Value inf = f32c(std::numeric_limits<float>::infinity());
    for (auto [j, ok] : pastItem)
      emitIf(arith::XOrIOp::create(b, loc, ok,
                                   arith::ConstantIntOp::create(b, loc, 1, 1)),
             [&] {
               memref::StoreOp::create(b, loc, inf, views[2], ValueRange{j});
             });
  }
  return group;
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
    for (int64_t mt = 0; mt < scoreMTiles(); ++mt)
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
  Value col0 = queryCol0();
  for (int64_t nt = 0; nt < nTiles; ++nt)
    for (int64_t e = 0; e < 2; ++e) {
      Value v = memref::LoadOp::create(
          b, loc, buf,
          ValueRange{add(col0, add(idx(nt * 8 + e), mul(aT, idx(2))))});
      // LSE moves to the log2 domain of the kernels' exp2.
      if (isLse)
        v = arith::MulFOp::create(b, loc, v, f32c(kLog2e));
      out.push_back(v);
    }
  map.map(op.getResult(), pack(out));
  return success();
}

TileEnv KVMajorEmitter::tileEnv() {
  const int64_t sn = scoreNTiles();
  TileEnv env;
  env.layoutOf = [this, sn](Value tile) {
    Value first = add(qBegin, mul(tile, idx(blockN)));
    ScoreLayout layout;
    layout.key = [this, sn](int64_t i) {
      int64_t mt = i / 4 / sn, nt = i / 4 % sn, c = i % 4;
      return add(kRow0, grid2d ? sKey(nt, c % 2) : keyRow(mt, c / 2));
    };
    layout.query = [this, sn, first](int64_t i) {
      int64_t mt = i / 4 / sn, nt = i / 4 % sn, c = i % 4;
      return add(first, grid2d ? sQuery(mt, c / 2) : queryCol(nt, c % 2));
    };
    return layout;
  };
  env.stat = [this, sn](int64_t i) {
    return statIndex(i / 4 / sn, i / 4 % sn, i % 4);
  };
  env.scaleLog2 = scaleLog2, env.scale = scale;
  env.window = window;
  // Read again where a mask needs it rather than kept in a register through
  // the query loops.
  if (window)
    env.windowShift = itemField(5, /*fresh=*/true);
  if (scoreMod)
    env.siteOf = [this, layoutOf = env.layoutOf](Operation *op) {
      ScoreLayout layout =
          layoutOf(map.lookup(op->getOperand(op->getNumOperands() - 1)));
      // The block's keys are one segment's, consecutive from kRow0, and a
      // score modifier's work items (as a window's) hold queries of one
      // logical shift d (item field 5): lpos(q) - lpos(k) = q - k + d.
      Value kLogical0 = scoreMod->logical(*this, kRow0);
      Value keyBase = arith::SubIOp::create(b, loc, kLogical0, kRow0);
      Value queryBase = add(keyBase, itemField(5, /*fresh=*/true));
      ScoreSite site;
      site.queryLogical = [this, layout, queryBase](int64_t i) {
        return add(queryBase, layout.query(i));
      };
      site.keyLogical = [this, layout, keyBase](int64_t i) {
        return add(keyBase, layout.key(i));
      };
      site.queryPacked = layout.query;
      site.keyPacked = layout.key;
      // A query before the block's segment ends is of that segment; later
      // ones are of its descendants (responses, tree children).
      site.region = [this, layout](int64_t i) {
        return arith::IndexCastOp::create(
            b, loc, b.getIndexType(),
            arith::ExtUIOp::create(
                b, loc, b.getI32Type(),
                cmp(arith::CmpIPredicate::ult, layout.query(i), kvEnd)));
      };
      site.inside = [this, layout](int64_t i) {
        return arith::AndIOp::create(
            b, loc, cmp(arith::CmpIPredicate::ult, layout.key(i), kvEnd),
            cmp(arith::CmpIPredicate::ult, layout.query(i), qEnd));
      };
      site.padShared = true;
      site.head = add(head, scoreMod->head0);
      site.inputs = scoreMod->inputs;
      return site;
    };
  return env;
}

void KVMajorEmitter::reduceDqTile(ArrayRef<Value> acc, int64_t qmTiles,
                                  int64_t cTiles, Value warpRow0,
                                  Value warpCol0, int64_t c0, Value first) {
  {
    // Add to the fp32 dQ of the queries inside the item, [T][Hq][D].
    auto rowBase = [&](Value q) { return add(dqAccRow(q), warpCol0); };
    for (int64_t qm = 0; qm < qmTiles; ++qm) {
      Value row0 = add(first, add(warpRow0, idx(qm * 16)));
      if (!vectorRed) {
        for (int64_t h = 0; h < 2; ++h) {
          Value q = add(row0, add(idx(h * 8), ids.g));
          emitIf(cmp(arith::CmpIPredicate::ult, q, qLen), [&] {
            Value base = add(rowBase(q), mul(ids.t, idx(2)));
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
      Value odd = cmp(arith::CmpIPredicate::eq, remu(ids.t, 2), idx(1));
      Value q = add(row0, add(select(odd, idx(8), idx(0)), ids.g));
      Value col =
          mul(arith::SubIOp::create(b, loc, ids.t, remu(ids.t, 2)), idx(2));
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
  // Inline PTX: MLIR 22's NVVM has no vector reduction (llvm.atomicrmw takes
  // one value), and four scalar ones would be four instructions.
  SmallVector<Value> operands = {ptr};
  operands.append(values.begin(), values.end());
  operands.push_back(arith::ExtUIOp::create(b, loc, b.getI32Type(), enabled));
  inlinePtxF32(b, loc,
               "{ .reg .pred p; setp.ne.b32 p, $5, 0; "
               "@p red.global.add.v4.f32 [$0], {$1, $2, $3, $4}; }",
               "l,f,f,f,f,r", operands, 0);
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
          // dK and dV column tiles interleaved; dV's own columns when
          // its rows are narrower.
          const bool sameCols = valueHeadDim == headDim;
          for (int64_t dt = 0; dt < storedGradDTiles(); ++dt) {
            int64_t i = (mt * gradDTiles() + dt) * 4 + h * 2;
            Value col = gradCol(dt);
            storePair(dkPtr, add(kBase, col), dk[i], dk[i + 1]);
            if (sameCols)
              storePair(dvPtr, add(vBase, col), dv[i], dv[i + 1]);
          }
          for (int64_t dt = 0; !sameCols && dt < storedGradDTiles(true); ++dt) {
            int64_t i = (mt * gradDTiles(true) + dt) * 4 + h * 2;
            storePair(dvPtr, add(vBase, gradCol(dt, true)), dv[i], dv[i + 1]);
          }
        });
      }
  }
  {
    // Several items share these prompt keys: add to the fp32 accumulators,
    // [rows][Hkv][D] (dV: [rows][Hkv][DV]).
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(direct.elseBlock());
    for (int64_t mt = 0; mt < gradMTiles(); ++mt)
      for (int64_t h = 0; h < 2; ++h) {
        Value r = gradRow(mt, h);
        emitIf(cmp(arith::CmpIPredicate::ult, r, kvLen), [&] {
          Value accKey = add(mul(add(accRow, r), idx(numKVHeads)), kvHead);
          Value base = mul(accKey, idx(headDim));
          const bool sameCols = valueHeadDim == headDim;
          for (int64_t dt = 0; dt < storedGradDTiles(); ++dt)
            for (int64_t e = 0; e < 2; ++e) {
              int64_t i = (mt * gradDTiles() + dt) * 4 + h * 2 + e;
              Value at = add(base, add(gradCol(dt), idx(e)));
              atomicAdd(dkAccPtr, at, dk[i]);
              if (sameCols)
                atomicAdd(dvAccPtr, at, dv[i]);
            }
          Value vBase = sameCols ? base : mul(accKey, idx(valueHeadDim));
          for (int64_t dt = 0; !sameCols && dt < storedGradDTiles(true); ++dt)
            for (int64_t e = 0; e < 2; ++e) {
              int64_t i = (mt * gradDTiles(true) + dt) * 4 + h * 2 + e;
              atomicAdd(dvAccPtr, add(vBase, add(gradCol(dt, true), idx(e))),
                        dv[i]);
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
      .Case([&](AccumulateOp o) { return emitAccumulate(o); })
      .Case([&](AccumulateDqOp o) { return emitAccumulateDq(o); })
      .Case([&](StoreKVGradsOp o) { return emitStoreKVGrads(o); })
      .Default([&](Operation *o) -> LogicalResult {
        if (isTileOp(o))
          return emitTileOp(o, *this, tileEnv(), map);
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
  if (grid2d && (blockN % 32 != 0 || blockM % 32 != 0))
    return kernel.emitOpError()
           << "the two-dimensional warp layout needs block_m and block_n "
              "multiples of 32 (2 x 4 warps of whole m16 x n8 blocks of "
              "scores), got "
           << blockM << " and " << blockN;
  fn.create(gpuModule, kernel.getSymName(), kernel.getKind(), threads(),
            abiSchedule(), /*tree=*/false, /*dlse=*/false, /*sinks=*/false,
            hasWindow(kernel), scoreModInputs(kernel));
  if (int inputs = scoreModInputs(kernel); inputs >= 0)
    scoreMod = ScoreModParams::read(fn, inputs);
  qPtr = fn.param("q"), kPtr = fn.param("k"), vPtr = fn.param("v"),
  doPtr = fn.param("dout"), dkPtr = fn.param("dk"), dvPtr = fn.param("dv"),
  lsePtr = fn.param("lse"), deltaPtr = fn.param("delta"),
  dqAccPtr = fn.param("dqacc"), dkAccPtr = fn.param("dkacc"),
  dvAccPtr = fn.param("dvacc"), itemsPtr = fn.param("items");
  qStrideT = fn.indexParam("qStrideT"), qStrideH = fn.indexParam("qStrideH"),
  kStrideT = fn.indexParam("kStrideT"), kStrideH = fn.indexParam("kStrideH"),
  vStrideT = fn.indexParam("vStrideT"), vStrideH = fn.indexParam("vStrideH"),
  doStrideT = fn.indexParam("doStrideT"),
  doStrideH = fn.indexParam("doStrideH"),
  dkStrideT = fn.indexParam("dkStrideT"),
  dkStrideH = fn.indexParam("dkStrideH"),
  dvStrideT = fn.indexParam("dvStrideT"),
  dvStrideH = fn.indexParam("dvStrideH"),
  lseStrideH = fn.indexParam("lseStrideH"),
  deltaStrideH = fn.indexParam("deltaStrideH");
  scale = fn.param("scale");
  scaleLog2 = fn.param("scaleLog2");

  ids = ThreadIds::emit(*this);
  Value item = gpu::BlockIdOp::create(b, loc, gpu::Dimension::x);
  kvHead = gpu::BlockIdOp::create(b, loc, gpu::Dimension::y);
  itemIndex = item;
  kRow0 = itemField(0), kvEnd = itemField(1), qBegin = itemField(2),
  qEnd = itemField(3), accRow = itemField(4);
  qLen = arith::SubIOp::create(b, loc, qEnd, qBegin);
  if (hasWindow(kernel)) {
    window = fn.indexParam("window");
    windowShift = itemField(5);
  }

  auto workgroup =
      gpu::AddressSpaceAttr::get(b.getContext(), gpu::AddressSpace::Workgroup);
  auto bytes = MemRefType::get({ShapedType::kDynamic}, b.getI8Type(),
                               MemRefLayoutAttrInterface(), workgroup);
  smem = gpu::DynamicSharedMemoryOp::create(b, loc, bytes);
  layoutTiles();

  if (failed(emitBody()))
    return failure();
  gpu::ReturnOp::create(b, loc);
  return success();
}

LogicalResult KVMajorEmitter::emitBody() {
  for (Operation &op : kernel.getBody().front())
    if (failed(emitOp(&op)))
      return failure();
  endKernel();
  return success();
}
