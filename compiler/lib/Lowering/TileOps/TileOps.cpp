//===- TileOps.cpp - the attention math, once, over register fragments ----===//
//
// TileOps.h says what each function computes; the order in which values are
// built here is what the generated code follows.
//
//===----------------------------------------------------------------------===//
#include "Lowering/TileOps/TileOps.h"
#include "ScoreMod/ScoreModIR.h"

#include "llvm/ADT/TypeSwitch.h"

#include <limits>

using namespace mlir;
using namespace mlir::dualkv;

ScoreLayout mlir::dualkv::queryMajorLayout(ScalarBuilder &o, int64_t mTiles,
                                           int64_t nTiles, Value qRow0,
                                           Value keyBase, Value warp, Value g,
                                           Value t) {
  ScoreLayout layout;
  layout.key = [&o, nTiles, keyBase, t](int64_t i) {
    int64_t nt = i / 4 % nTiles, c = i % 4;
    return o.add(keyBase, o.add(o.idx(nt * 8 + (c % 2)), o.mul(t, o.idx(2))));
  };
  layout.query = [&o, mTiles, nTiles, qRow0, warp, g](int64_t i) {
    int64_t mt = i / 4 / nTiles, c = i % 4;
    return o.add(o.add(qRow0, o.mul(warp, o.idx(16 * mTiles))),
                 o.add(o.idx(mt * 16 + (c / 2) * 8), g));
  };
  return layout;
}

StatSlot mlir::dualkv::queryMajorStats(int64_t nTiles) {
  return [nTiles](int64_t i) { return i / 4 / nTiles * 2 + i % 4 / 2; };
}

void tile::mask(ScalarBuilder &o, MutableArrayRef<Value> s, MaskKind kind,
                const ScoreLayout &layout, Value bound, Value window,
                Value shift) {
  Value ninf = o.f32c(-std::numeric_limits<float>::infinity());
  if (!shift && kind == MaskKind::bound)
    shift = bound;
  for (int64_t i = 0, e = s.size(); i < e; ++i) {
    Value key = layout.key(i);
    Value query = layout.query(i);
    Value drop = kind == MaskKind::causal
                     ? o.cmp(arith::CmpIPredicate::ugt, key, query)
                     : o.cmp(arith::CmpIPredicate::uge, key, bound);
    if (window) {
      // Signed: a KV-major item's shift may be negative.
      Value logical = shift ? o.add(query, shift) : query;
      Value distance = arith::SubIOp::create(o.b, o.loc, logical, key);
      drop = arith::OrIOp::create(
          o.b, o.loc, drop, o.cmp(arith::CmpIPredicate::sge, distance, window));
    }
    s[i] = o.select(drop, ninf, s[i]);
  }
}

SmallVector<Value> tile::onlineSoftmax(ScalarBuilder &o, ArrayRef<Value> s,
                                       MutableArrayRef<Value> m,
                                       MutableArrayRef<Value> l,
                                       MutableArrayRef<Value> alpha,
                                       Value scaleLog2, int64_t mTiles,
                                       int64_t nTiles) {
  OpBuilder &b = o.b;
  Location loc = o.loc;
  SmallVector<Value> p(s.size());
  Value ninf = o.f32c(-std::numeric_limits<float>::infinity());
  for (int64_t mt = 0; mt < mTiles; ++mt)
    for (int64_t h = 0; h < 2; ++h) {
      int64_t r = mt * 2 + h;
      auto at = [&](int64_t nt, int64_t e) {
        return s[(mt * nTiles + nt) * 4 + h * 2 + e];
      };
      Value mx = at(0, 0);
      for (int64_t nt = 0; nt < nTiles; ++nt)
        for (int64_t e = 0; e < 2; ++e)
          if (nt || e)
            mx = arith::MaximumFOp::create(b, loc, mx, at(nt, e));
      // The four lanes of a quad hold the same row.
      mx = arith::MaximumFOp::create(b, loc, mx, o.shuffleXor(mx, 1));
      mx = arith::MaximumFOp::create(b, loc, mx, o.shuffleXor(mx, 2));
      Value scaled = arith::MulFOp::create(b, loc, mx, scaleLog2);
      Value mNew = arith::MaximumFOp::create(b, loc, m[r], scaled);
      // A row with no allowed key yet keeps max -inf; subtract 0 so exp2
      // gives 0, not NaN.
      Value isNinf =
          arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OEQ, mNew, ninf);
      Value mUse = o.select(isNinf, o.f32c(0.0f), mNew);
      alpha[r] = o.exp2(arith::SubFOp::create(b, loc, m[r], mUse));
      Value negM = arith::NegFOp::create(b, loc, mUse);
      Value rowSum = o.f32c(0.0f);
      for (int64_t nt = 0; nt < nTiles; ++nt)
        for (int64_t e = 0; e < 2; ++e) {
          Value x = LLVM::FMAOp::create(b, loc, at(nt, e), scaleLog2, negM);
          Value pe = o.exp2(x);
          p[(mt * nTiles + nt) * 4 + h * 2 + e] = pe;
          rowSum = arith::AddFOp::create(b, loc, rowSum, pe);
        }
      // The running sum stays a per-lane partial (rowSum reduces the quad).
      l[r] = LLVM::FMAOp::create(b, loc, l[r], alpha[r], rowSum);
      m[r] = mNew;
    }
  return p;
}

void tile::scaleScores(ScalarBuilder &o, MutableArrayRef<Value> s,
                       float factor) {
  Value c = o.f32c(factor);
  for (Value &v : s)
    v = arith::MulFOp::create(o.b, o.loc, v, c);
}

void tile::softcap(ScalarBuilder &o, MutableArrayRef<Value> s, double cap,
                   Value scaleLog2) {
  OpBuilder &b = o.b;
  Location loc = o.loc;
  // tanh(x) = 1 - 2 / (1 + e^2x) with e^2x = 2^(s 2 scaleLog2 / c): accurate
  // to a few ulps of 1 for every x (tanh.approx.f32 is good to 2^-11 only),
  // saturating to +-1 as e^2x reaches inf or 0. The capped score in the
  // scores' units (before the softmax scale) is t c / scale = t c log2(e) /
  // scaleLog2.
  Value twiceOverCap = arith::MulFOp::create(
      b, loc, scaleLog2, o.f32c(static_cast<float>(2.0 / cap)));
  Value unit = arith::DivFOp::create(
      b, loc, o.f32c(static_cast<float>(cap / kLn2)), scaleLog2);
  Value minusTwoUnit = arith::MulFOp::create(b, loc, unit, o.f32c(-2.0f));
  Value one = o.f32c(1.0f);
  Value ninf = o.f32c(-std::numeric_limits<float>::infinity());
  for (Value &v : s) {
    Value e = o.exp2(arith::MulFOp::create(b, loc, v, twiceOverCap));
    Value r = o.intrinsic("llvm.nvvm.rcp.approx.ftz.f",
                          arith::AddFOp::create(b, loc, e, one));
    Value capped = LLVM::FMAOp::create(b, loc, r, minusTwoUnit, unit);
    Value masked =
        arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OEQ, v, ninf);
    v = o.select(masked, ninf, capped);
  }
}

void tile::softcapGrad(ScalarBuilder &o, MutableArrayRef<Value> p,
                       ArrayRef<Value> s, double cap, Value scaleLog2) {
  OpBuilder &b = o.b;
  Location loc = o.loc;
  // t = s scale / c = s scaleLog2 ln(2) / c; masked s = -inf gives t = -inf,
  // clamped to -1 so that 1 - t² is 0 and P = 0 stays 0 (not NaN).
  Value toTanh = arith::MulFOp::create(b, loc, scaleLog2,
                                       o.f32c(static_cast<float>(kLn2 / cap)));
  Value minusOne = o.f32c(-1.0f);
  Value one = o.f32c(1.0f);
  for (int64_t i = 0, e = p.size(); i < e; ++i) {
    Value t = arith::MaximumFOp::create(
        b, loc, arith::MulFOp::create(b, loc, s[i], toTanh), minusOne);
    Value negT = arith::NegFOp::create(b, loc, t);
    Value slope = LLVM::FMAOp::create(b, loc, negT, t, one);
    p[i] = arith::MulFOp::create(b, loc, p[i], slope);
  }
}

/// Emits `fn` on each score of `s` (raw, before the softmax scale) with
/// `site`'s positions: calls `use(i, masked, inside, value, derivative)`
/// (inside null: every value is).
static LogicalResult
eachScoreMod(ScalarBuilder &o, ArrayRef<Value> s, func::FuncOp fn,
             const ScoreSite &site, Value scaleLog2, bool derivative,
             function_ref<void(int64_t, Value, Value, Value, Value)> use) {
  OpBuilder &b = o.b;
  Location loc = o.loc;
  Value scale = arith::MulFOp::create(b, loc, scaleLog2, o.f32c(kLn2));
  auto i32 = [&](Value v) {
    return arith::IndexCastOp::create(b, loc, b.getI32Type(), v).getResult();
  };
  Value head = i32(site.head);
  Value ninf = o.f32c(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0, e = s.size(); i < e; ++i) {
    Value masked =
        arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OEQ, s[i], ninf);
    Value inside = site.inside ? site.inside(i) : Value();
    // A masked score's or the padding's positions may lie outside the
    // sequences: its tensor reads go to element 0.
    Value skipped = inside
                        ? arith::OrIOp::create(
                              b, loc, masked,
                              arith::XOrIOp::create(
                                  b, loc, inside,
                                  arith::ConstantIntOp::create(b, loc, 1, 1)))
                        : masked;
    SmallVector<Value> inputs;
    SmallVector<Value> scalars{head,
                               i32(site.queryLogical(i)),
                               i32(site.keyLogical(i)),
                               i32(site.queryPacked(i)),
                               i32(site.keyPacked(i)),
                               i32(site.region(i))};
    Value x = arith::MulFOp::create(b, loc, s[i], scale);
    FailureOr<ScoreModValue> v =
        emitScoreMod(o, fn, x, scalars, site.inputs, derivative, skipped);
    if (failed(v))
      return failure();
    use(i, masked, site.padShared ? inside : Value(), v->value, v->derivative);
  }
  return success();
}

LogicalResult tile::scoreMod(ScalarBuilder &o, MutableArrayRef<Value> s,
                             func::FuncOp fn, const ScoreSite &site,
                             Value scaleLog2) {
  // f(x) / scale in the scores' units: f(x) log2(e) / scaleLog2.
  Value unit = arith::DivFOp::create(o.b, o.loc, o.f32c(kLog2e), scaleLog2);
  Value ninf = o.f32c(-std::numeric_limits<float>::infinity());
  return eachScoreMod(
      o, s, fn, site, scaleLog2, /*derivative=*/false,
      [&](int64_t i, Value masked, Value inside, Value y, Value) {
        Value modified = arith::MulFOp::create(o.b, o.loc, y, unit);
        if (inside)
          modified = o.select(inside, modified, s[i]);
        s[i] = o.select(masked, ninf, modified);
      });
}

LogicalResult tile::scoreModGrad(ScalarBuilder &o, MutableArrayRef<Value> p,
                                 ArrayRef<Value> s, func::FuncOp fn,
                                 const ScoreSite &site, Value scaleLog2) {
  Value zero = o.f32c(0.0f);
  return eachScoreMod(
      o, s, fn, site, scaleLog2, /*derivative=*/true,
      [&](int64_t i, Value masked, Value inside, Value, Value dy) {
        if (inside)
          dy = o.select(inside, dy, o.f32c(1.0f));
        p[i] =
            arith::MulFOp::create(o.b, o.loc, p[i], o.select(masked, zero, dy));
      });
}

void tile::rescale(ScalarBuilder &o, MutableArrayRef<Value> acc,
                   ArrayRef<Value> alpha, int64_t mTiles, int64_t dTiles) {
  for (int64_t mt = 0; mt < mTiles; ++mt)
    for (int64_t dt = 0; dt < dTiles; ++dt)
      for (int64_t c = 0; c < 4; ++c) {
        Value &v = acc[(mt * dTiles + dt) * 4 + c];
        v = arith::MulFOp::create(o.b, o.loc, v, alpha[mt * 2 + c / 2]);
      }
}

void tile::recomputeProbs(ScalarBuilder &o, MutableArrayRef<Value> s,
                          ArrayRef<Value> lse, const StatSlot &stat,
                          Value scaleLog2) {
  SmallVector<Value> negLse;
  for (Value v : lse)
    negLse.push_back(arith::NegFOp::create(o.b, o.loc, v));
  for (int64_t i = 0, e = s.size(); i < e; ++i)
    s[i] = o.exp2(
        LLVM::FMAOp::create(o.b, o.loc, s[i], scaleLog2, negLse[stat(i)]));
}

void tile::softmaxGrad(ScalarBuilder &o, MutableArrayRef<Value> p,
                       ArrayRef<Value> dp, ArrayRef<Value> delta,
                       const StatSlot &stat, Value scale) {
  for (int64_t i = 0, e = p.size(); i < e; ++i) {
    Value diff = arith::SubFOp::create(o.b, o.loc, dp[i], delta[stat(i)]);
    Value ps = arith::MulFOp::create(o.b, o.loc, p[i], scale);
    p[i] = arith::MulFOp::create(o.b, o.loc, ps, diff);
  }
}

Value tile::sinkLog2(ScalarBuilder &o, Value sinks, Value head) {
  return arith::MulFOp::create(
      o.b, o.loc, memref::LoadOp::create(o.b, o.loc, sinks, ValueRange{head}),
      o.f32c(kLog2e));
}

Value tile::addSink(ScalarBuilder &o, Value sum, Value m, Value sinkLog2) {
  // The accumulator is relative to m, so the sink joins the sum there too:
  // exact unless exp(sink - max score) overflows fp32 (a sink more than 88
  // above every score of its row).
  Value term = o.exp2(arith::SubFOp::create(o.b, o.loc, sinkLog2, m));
  return arith::AddFOp::create(o.b, o.loc, sum, term);
}

Value tile::rowSum(ScalarBuilder &o, Value partial) {
  Value sum = partial;
  sum = arith::AddFOp::create(o.b, o.loc, sum, o.shuffleXor(sum, 1));
  return arith::AddFOp::create(o.b, o.loc, sum, o.shuffleXor(sum, 2));
}

Value tile::logSumExp(ScalarBuilder &o, Value m, Value sum) {
  // m is kept in the log2 domain of the scaled scores.
  return arith::MulFOp::create(
      o.b, o.loc, arith::AddFOp::create(o.b, o.loc, m, o.log2(sum)),
      o.f32c(kLn2));
}

/// The softcap of `op`'s kernel (#dualkv.problem<..., softcap = c>).
static FailureOr<double> softcapOf(Operation *op) {
  auto kernel = op->getParentOfType<KernelOp>();
  if (kernel && kernel.getProblem())
    if (FloatAttr cap = kernel.getProblem()->getSoftcap())
      return cap.getValueAsDouble();
  return op->emitOpError() << "needs a kernel bound with a softcap";
}

/// The score modifier of `op`'s kernel and the site of its scores.
static FailureOr<std::pair<func::FuncOp, ScoreSite>>
scoreModAt(Operation *op, const TileEnv &env) {
  func::FuncOp fn = scoreModOf(op);
  if (!fn)
    return op->emitOpError() << "needs a module with a score modifier "
                                "(func.func @score_mod)";
  if (!env.siteOf)
    return op->emitOpError()
           << "has no lowering in this schedule: it gives no score positions";
  return std::make_pair(fn, env.siteOf(op));
}

bool mlir::dualkv::isTileOp(Operation *op) {
  return isa<MaskOp, ScaleScoresOp, SoftcapOp, SoftcapGradOp, ScoreModOp,
             ScoreModGradOp, OnlineSoftmaxOp, RescaleOp, RecomputeProbsOp,
             SoftmaxGradOp>(op);
}

LogicalResult mlir::dualkv::emitTileOp(Operation *op, ScalarBuilder &o,
                                       const TileEnv &env, IRMapping &map) {
  auto operand = [&](Value v) { return o.unpack(map.lookup(v)); };
  auto packed = [&](ArrayRef<Value> v) {
    return env.packOperand ? env.packOperand(v) : o.pack(v);
  };
  return llvm::TypeSwitch<Operation *, LogicalResult>(op)
      .Case([&](MaskOp op) {
        SmallVector<Value> s = operand(op.getScores());
        ScoreLayout layout = env.layoutOf(map.lookup(op.getTile()));
        tile::mask(o, s, op.getKind(), layout, env.bound, env.window,
                   op.getKind() == MaskKind::bound ? env.boundShift
                                                   : env.windowShift);
        map.map(op.getResult(), o.pack(s));
        return success();
      })
      .Case([&](ScaleScoresOp op) {
        SmallVector<Value> s = operand(op.getScores());
        tile::scaleScores(o, s, op.getFactor().convertToFloat());
        map.map(op.getResult(), o.pack(s));
        return success();
      })
      .Case([&](SoftcapOp op) -> LogicalResult {
        FailureOr<double> cap = softcapOf(op);
        if (failed(cap))
          return failure();
        SmallVector<Value> s = operand(op.getScores());
        tile::softcap(o, s, *cap, env.scaleLog2);
        map.map(op.getResult(), o.pack(s));
        return success();
      })
      .Case([&](SoftcapGradOp op) -> LogicalResult {
        FailureOr<double> cap = softcapOf(op);
        if (failed(cap))
          return failure();
        SmallVector<Value> p = operand(op.getProbs());
        SmallVector<Value> s = operand(op.getScores());
        tile::softcapGrad(o, p, s, *cap, env.scaleLog2);
        map.map(op.getResult(), o.pack(p));
        return success();
      })
      .Case([&](ScoreModOp op) -> LogicalResult {
        auto at = scoreModAt(op, env);
        if (failed(at))
          return failure();
        SmallVector<Value> s = operand(op.getScores());
        if (failed(tile::scoreMod(o, s, at->first, at->second, env.scaleLog2)))
          return failure();
        map.map(op.getResult(), o.pack(s));
        return success();
      })
      .Case([&](ScoreModGradOp op) -> LogicalResult {
        auto at = scoreModAt(op, env);
        if (failed(at))
          return failure();
        SmallVector<Value> p = operand(op.getProbs());
        SmallVector<Value> s = operand(op.getScores());
        if (failed(tile::scoreModGrad(o, p, s, at->first, at->second,
                                      env.scaleLog2)))
          return failure();
        map.map(op.getResult(), o.pack(p));
        return success();
      })
      .Case([&](OnlineSoftmaxOp op) {
        SmallVector<Value> s = operand(op.getScores());
        SmallVector<Value> m = operand(op.getMax());
        SmallVector<Value> l = operand(op.getSum());
        SmallVector<Value> alpha(m.size());
        SmallVector<Value> p = tile::onlineSoftmax(
            o, s, m, l, alpha, env.scaleLog2, env.mTiles, env.nTiles);
        map.map(op.getProbs(), packed(p));
        map.map(op.getNewMax(), o.pack(m));
        map.map(op.getNewSum(), o.pack(l));
        map.map(op.getAlpha(), o.pack(alpha));
        return success();
      })
      .Case([&](RescaleOp op) {
        SmallVector<Value> acc = operand(op.getAcc());
        SmallVector<Value> alpha = operand(op.getAlpha());
        tile::rescale(o, acc, alpha, env.mTiles, env.dTiles);
        map.map(op.getResult(), o.pack(acc));
        return success();
      })
      .Case([&](RecomputeProbsOp op) {
        SmallVector<Value> s = operand(op.getScores());
        SmallVector<Value> lse = operand(op.getLse());
        tile::recomputeProbs(o, s, lse, env.stat, env.scaleLog2);
        map.map(op.getResult(), o.pack(s));
        return success();
      })
      .Case([&](SoftmaxGradOp op) {
        SmallVector<Value> p = operand(op.getProbs());
        SmallVector<Value> dp = operand(op.getDprobs());
        SmallVector<Value> delta = operand(op.getDelta());
        tile::softmaxGrad(o, p, dp, delta, env.stat, env.scale);
        map.map(op.getResult(), packed(p));
        return success();
      })
      .Default([&](Operation *op) {
        return op->emitOpError() << "is not an elementwise tile op";
      });
}
