//===- ScoreMod.cpp - score modifiers: check, lower per score, derive -----===//
//
// The math ops lower to the same PTX approximations the kernels' own softmax
// uses (ex2.approx, lg2.approx, rcp.approx); arith ops are cloned as they
// are, but for a division by a constant, which becomes a multiplication by
// its reciprocal. The derivative in the score is forward mode: each f32
// value that depends on the score carries its tangent, null where it is 0.
//
//===----------------------------------------------------------------------===//
#include "dualkv/Compiler/ScoreMod.h"
#include "ScoreMod/ScoreModIR.h"
#include "dualkv/Dialect/DualKVOps.h"

#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/IR/SymbolTable.h"
#include "mlir/Parser/Parser.h"
#include "llvm/ADT/TypeSwitch.h"

#include <cmath>

using namespace mlir;
using namespace mlir::dualkv;

func::FuncOp mlir::dualkv::scoreModOf(Operation *op) {
  return dyn_cast_or_null<func::FuncOp>(SymbolTable::lookupNearestSymbolFrom(
      op, StringAttr::get(op->getContext(), "score_mod")));
}

int mlir::dualkv::scoreModInputs(Operation *kernel) {
  auto op = dyn_cast<KernelOp>(kernel);
  if (!op || !op.getProblem() || !op.getProblem()->getScoreMod())
    return -1;
  func::FuncOp fn = scoreModOf(op);
  if (!fn)
    return -1;
  return static_cast<int>(llvm::count_if(
      fn.getArgumentTypes(), [](Type t) { return isa<MemRefType>(t); }));
}

ScoreModParams ScoreModParams::read(KernelFunction &fn, int inputs) {
  ScoreModParams params;
  params.lpos = fn.param("lpos");
  params.head0 = fn.indexParam("scoreModHead0");
  // The tensors follow lpos and scoreModHead0 in the ABI's table.
  for (int i = 0; i < inputs; ++i)
    params.inputs.push_back(
        fn.param(::dualkv::abi::kScoreModParams[2 + i].name));
  return params;
}

Value ScoreModParams::logical(ScalarBuilder &o, Value token) const {
  return o.toIndex(memref::LoadOp::create(o.b, o.loc, lpos, ValueRange{token}));
}

ScoreSite ScoreModParams::queryMajorSite(
    ScalarBuilder &o, const ScoreLayout &layout, Value segStart, Value segLen,
    Value keyStart, std::function<Value()> region, Value head) const {
  Value qLogical0 = logical(o, segStart);
  Value kLogical0 = logical(o, keyStart);
  ScoreSite site;
  site.queryLogical = [&o, layout, qLogical0](int64_t i) {
    return o.add(qLogical0, layout.query(i));
  };
  site.keyLogical = [&o, layout, kLogical0](int64_t i) {
    return o.add(kLogical0, layout.key(i));
  };
  site.queryPacked = [&o, layout, segStart](int64_t i) {
    return o.add(segStart, layout.query(i));
  };
  site.keyPacked = [&o, layout, keyStart](int64_t i) {
    return o.add(keyStart, layout.key(i));
  };
  site.region = [region](int64_t) { return region(); };
  site.inside = [&o, layout, segLen](int64_t i) {
    return o.cmp(arith::CmpIPredicate::ult, layout.query(i), segLen);
  };
  site.head = o.add(head, head0);
  site.inputs = inputs;
  return site;
}

/// The arith ops a modifier may use, cloned as they are (but divf).
static bool isClonedArith(Operation *op) {
  return isa<arith::ConstantOp, arith::AddFOp, arith::SubFOp, arith::MulFOp,
             arith::DivFOp, arith::NegFOp, arith::MaximumFOp, arith::MinimumFOp,
             arith::CmpFOp, arith::SelectOp, arith::AddIOp, arith::SubIOp,
             arith::MulIOp, arith::DivSIOp, arith::RemSIOp, arith::CmpIOp,
             arith::AndIOp, arith::OrIOp, arith::XOrIOp, arith::SIToFPOp,
             arith::FPToSIOp, arith::IndexCastOp, arith::ExtSIOp,
             arith::TruncIOp>(op);
}

static bool isAllowedMath(Operation *op) {
  return isa<math::ExpOp, math::Exp2Op, math::LogOp, math::Log2Op, math::TanhOp,
             math::SqrtOp, math::RsqrtOp, math::AbsFOp, math::AbsIOp,
             math::SinOp, math::CosOp, math::PowFOp, math::FmaOp>(op);
}

static bool isScalarType(Type t) {
  return t.isF32() || t.isInteger(32) || t.isInteger(1) || t.isIndex();
}

static constexpr const char *kAllowedOps =
    "arith.constant, addf, subf, mulf, divf, negf, maximumf, minimumf, cmpf, "
    "select, addi, subi, muli, divsi, remsi, cmpi, andi, ori, xori, sitofp, "
    "fptosi, index_cast, extsi, trunci; math.exp, exp2, log, log2, tanh, "
    "sqrt, rsqrt, absf, absi, sin, cos, powf, fma; memref.load of a tensor "
    "argument";

LogicalResult mlir::dualkv::verifyScoreMod(func::FuncOp fn) {
  if (fn.isExternal())
    return fn.emitError() << "the score modifier @score_mod has no body";
  FunctionType type = fn.getFunctionType();
  if (type.getNumResults() != 1 || !type.getResult(0).isF32())
    return fn.emitError() << "the score modifier must return one f32 (the "
                             "new logit), got "
                          << type;
  ArrayRef<Type> args = type.getInputs();
  size_t scalars = 0;
  while (scalars < args.size() && !isa<MemRefType>(args[scalars]))
    ++scalars;
  auto signature = [&] {
    return fn.emitError()
           << "the score modifier's arguments must be (f32 score, i32 head, "
              "i32 q_idx, i32 kv_idx[, i32 q_packed, i32 kv_packed, i32 "
              "region][, memref<?xf32> tensors...]), got "
           << type;
  };
  if (scalars != 4 && scalars != 7)
    return signature();
  if (!args[0].isF32())
    return signature();
  for (size_t i = 1; i < scalars; ++i)
    if (!args[i].isInteger(32))
      return signature();
  for (size_t i = scalars; i < args.size(); ++i) {
    auto m = dyn_cast<MemRefType>(args[i]);
    if (!m || m.getRank() != 1 || !m.isDynamicDim(0) ||
        !m.getElementType().isF32() || !m.getLayout().isIdentity() ||
        m.getMemorySpace())
      return signature();
  }
  if (args.size() - scalars > size_t(::dualkv::kMaxScoreModInputs))
    return fn.emitError() << "the score modifier takes "
                          << args.size() - scalars << " tensors; at most "
                          << ::dualkv::kMaxScoreModInputs;
  if (!fn.getBody().hasOneBlock())
    return fn.emitError() << "the score modifier must be one block (no "
                             "control flow: use arith.select)";
  for (Operation &op : fn.getBody().front()) {
    if (isa<func::ReturnOp>(op))
      continue;
    if (auto load = dyn_cast<memref::LoadOp>(op)) {
      auto arg = dyn_cast<BlockArgument>(load.getMemRef());
      if (!arg || arg.getOwner() != &fn.getBody().front() ||
          load.getIndices().size() != 1)
        return op.emitOpError()
               << "in a score modifier must read one of the modifier's "
                  "tensor arguments at one index";
      continue;
    }
    if (!isClonedArith(&op) && !isAllowedMath(&op))
      return op.emitOpError()
             << "is not allowed in a score modifier, which the compiler must "
                "lower per score and differentiate (allowed: "
             << kAllowedOps << ")";
    for (Type t : op.getOperandTypes())
      if (!isScalarType(t))
        return op.emitOpError() << "in a score modifier takes only f32, i32, "
                                   "i1 and index values, not "
                                << t;
    for (Type t : op.getResultTypes())
      if (!isScalarType(t))
        return op.emitOpError() << "in a score modifier makes only f32, i32, "
                                   "i1 and index values, not "
                                << t;
  }
  return success();
}

namespace {
/// Emits one modifier's ops for one score: values in `vals`, tangents (df/dx
/// so far, null for 0) in `tans`.
class Evaluator {
public:
  Evaluator(ScalarBuilder &o, bool derivative)
      : o(o), b(o.b), loc(o.loc), derivative(derivative) {}

  LogicalResult emit(Operation &op);
  IRMapping vals;
  DenseMap<Value, Value> tans;

private:
  Value tan(Value v) { return tans.lookup(v); }
  Value mulf(Value x, Value y) { return arith::MulFOp::create(b, loc, x, y); }
  Value addf(Value x, Value y) { return arith::AddFOp::create(b, loc, x, y); }
  Value subf(Value x, Value y) { return arith::SubFOp::create(b, loc, x, y); }
  Value negf(Value x) { return arith::NegFOp::create(b, loc, x); }
  Value divf(Value x, Value y) { return arith::DivFOp::create(b, loc, x, y); }
  /// Sum of tangent terms, null ones left out.
  Value sum(ArrayRef<Value> terms) {
    Value s;
    for (Value t : terms)
      if (t)
        s = s ? addf(s, t) : t;
    return s;
  }
  /// t * k, null when t is.
  Value scaled(Value t, Value k) { return t ? mulf(t, k) : Value(); }
  Value tanhOf(Value x) {
    // 1 - 2 / (1 + e^2x): saturates to +-1 as e^2x reaches inf or 0.
    Value e = o.exp2(mulf(x, o.f32c(2.0f * kLog2e)));
    Value r = o.intrinsic("llvm.nvvm.rcp.approx.ftz.f", addf(e, o.f32c(1.0f)));
    return LLVM::FMAOp::create(b, loc, r, o.f32c(-2.0f), o.f32c(1.0f));
  }
  Value sinOf(Value x) { return o.intrinsic("llvm.nvvm.sin.approx.ftz.f", x); }
  Value cosOf(Value x) { return o.intrinsic("llvm.nvvm.cos.approx.ftz.f", x); }
  Value logOf(Value x) { return mulf(o.log2(x), o.f32c(kLn2)); }

  ScalarBuilder &o;
  OpBuilder &b;
  Location loc;
  bool derivative;
};
} // namespace

LogicalResult Evaluator::emit(Operation &op) {
  auto in = [&](unsigned i) { return vals.lookup(op.getOperand(i)); };
  auto dIn = [&](unsigned i) { return tan(op.getOperand(i)); };
  Value result;
  Value dResult;
  LogicalResult ok = success();
  llvm::TypeSwitch<Operation *>(&op)
      .Case([&](arith::DivFOp div) {
        // A division by a constant multiplies by its reciprocal.
        FloatAttr c;
        if (matchPattern(div.getRhs(), m_Constant(&c)) &&
            c.getValueAsDouble() != 0.0)
          result = mulf(in(0),
                        o.f32c(static_cast<float>(1.0 / c.getValueAsDouble())));
        else
          result = divf(in(0), in(1));
        if (derivative && (dIn(0) || dIn(1)))
          dResult =
              divf(sum({dIn(0), dIn(1) ? negf(mulf(result, dIn(1))) : Value()}),
                   in(1));
      })
      .Case([&](math::ExpOp) {
        result = o.exp2(mulf(in(0), o.f32c(kLog2e)));
        dResult = scaled(dIn(0), result);
      })
      .Case([&](math::Exp2Op) {
        result = o.exp2(in(0));
        if (dIn(0))
          dResult = mulf(dIn(0), mulf(result, o.f32c(kLn2)));
      })
      .Case([&](math::LogOp) {
        result = logOf(in(0));
        if (dIn(0))
          dResult = divf(dIn(0), in(0));
      })
      .Case([&](math::Log2Op) {
        result = o.log2(in(0));
        if (dIn(0))
          dResult = divf(dIn(0), mulf(in(0), o.f32c(kLn2)));
      })
      .Case([&](math::TanhOp) {
        result = tanhOf(in(0));
        if (dIn(0)) // (1 - y^2) dx
          dResult = mulf(dIn(0), LLVM::FMAOp::create(b, loc, negf(result),
                                                     result, o.f32c(1.0f)));
      })
      .Case([&](math::SqrtOp) {
        result = o.intrinsic("llvm.nvvm.sqrt.approx.ftz.f", in(0));
        if (dIn(0))
          dResult = divf(mulf(dIn(0), o.f32c(0.5f)), result);
      })
      .Case([&](math::RsqrtOp) {
        result = o.intrinsic("llvm.nvvm.rsqrt.approx.ftz.f", in(0));
        if (dIn(0)) // -y^3 / 2 dx
          dResult = mulf(
              dIn(0), mulf(o.f32c(-0.5f), mulf(result, mulf(result, result))));
      })
      .Case([&](math::AbsFOp) {
        result = o.intrinsic("llvm.fabs.f32", in(0));
        if (dIn(0)) {
          Value neg = arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OLT,
                                            in(0), o.f32c(0.0f));
          dResult = o.select(neg, negf(dIn(0)), dIn(0));
        }
      })
      .Case([&](math::AbsIOp) {
        Value x = in(0);
        Value zero =
            arith::ConstantOp::create(b, loc, b.getZeroAttr(x.getType()));
        Value neg =
            arith::CmpIOp::create(b, loc, arith::CmpIPredicate::slt, x, zero);
        result = o.select(neg, arith::SubIOp::create(b, loc, zero, x), x);
      })
      .Case([&](math::SinOp) {
        result = sinOf(in(0));
        dResult = scaled(dIn(0), cosOf(in(0)));
      })
      .Case([&](math::CosOp) {
        result = cosOf(in(0));
        dResult = scaled(dIn(0), negf(sinOf(in(0))));
      })
      .Case([&](math::PowFOp) {
        // a^c = 2^(c log2 a); d = y (dc ln a + c da / a).
        Value a = in(0), c = in(1);
        result = o.exp2(mulf(c, o.log2(a)));
        if (dIn(0) || dIn(1))
          dResult =
              mulf(result, sum({dIn(1) ? mulf(dIn(1), logOf(a)) : Value(),
                                dIn(0) ? divf(mulf(c, dIn(0)), a) : Value()}));
      })
      .Case([&](math::FmaOp) {
        result = LLVM::FMAOp::create(b, loc, in(0), in(1), in(2));
        dResult = sum({scaled(dIn(0), in(1)), scaled(dIn(1), in(0)), dIn(2)});
      })
      .Case([&](memref::LoadOp) {
        ok = failure(); // handled by the caller (its tensor argument)
      })
      .Default([&](Operation *) {
        result = b.clone(op, vals)->getResult(0);
        if (!derivative)
          return;
        llvm::TypeSwitch<Operation *>(&op)
            .Case([&](arith::AddFOp) {
              dResult = sum({dIn(0), dIn(1)});
            })
            .Case([&](arith::SubFOp) {
              dResult = dIn(1) ? (dIn(0) ? subf(dIn(0), dIn(1)) : negf(dIn(1)))
                               : dIn(0);
            })
            .Case([&](arith::MulFOp) {
              dResult = sum({scaled(dIn(0), in(1)), scaled(dIn(1), in(0))});
            })
            .Case([&](arith::NegFOp) {
              dResult = dIn(0) ? negf(dIn(0)) : Value();
            })
            .Case([&](arith::MaximumFOp) {
              if (dIn(0) || dIn(1)) {
                Value first = arith::CmpFOp::create(
                    b, loc, arith::CmpFPredicate::OGE, in(0), in(1));
                dResult = o.select(first, dIn(0) ? dIn(0) : o.f32c(0.0f),
                                   dIn(1) ? dIn(1) : o.f32c(0.0f));
              }
            })
            .Case([&](arith::MinimumFOp) {
              if (dIn(0) || dIn(1)) {
                Value first = arith::CmpFOp::create(
                    b, loc, arith::CmpFPredicate::OLE, in(0), in(1));
                dResult = o.select(first, dIn(0) ? dIn(0) : o.f32c(0.0f),
                                   dIn(1) ? dIn(1) : o.f32c(0.0f));
              }
            })
            .Case([&](arith::SelectOp) {
              if (dIn(1) || dIn(2))
                dResult = o.select(in(0), dIn(1) ? dIn(1) : o.f32c(0.0f),
                                   dIn(2) ? dIn(2) : o.f32c(0.0f));
            })
            .Default([](Operation *) {
              // Constants, integer ops, comparisons and conversions from
              // integers: no tangent in the score.
            });
      });
  if (failed(ok))
    return failure();
  vals.map(op.getResult(0), result);
  if (dResult)
    tans[op.getResult(0)] = dResult;
  return success();
}

FailureOr<ScoreModValue>
mlir::dualkv::emitScoreMod(ScalarBuilder &o, func::FuncOp fn, Value x,
                           ArrayRef<Value> scalars, ArrayRef<Value> inputs,
                           bool derivative, Value masked) {
  Block &body = fn.getBody().front();
  const size_t numScalars = body.getNumArguments() - inputs.size();
  if ((numScalars != 4 && numScalars != 7) || scalars.size() != 6)
    return fn.emitError() << "internal: the score modifier's "
                          << body.getNumArguments()
                          << " arguments do not match the kernel's";
  Evaluator eval(o, derivative);
  eval.vals.map(body.getArgument(0), x);
  if (derivative)
    eval.tans[body.getArgument(0)] = o.f32c(1.0f);
  for (size_t i = 1; i < numScalars; ++i)
    eval.vals.map(body.getArgument(i), scalars[i - 1]);
  // The values that depend on the score or the positions, which a masked
  // score or the padding may hold out of any range: a tensor read at an
  // index among them is guarded. One that depends on the head and constants
  // alone (ALiBi's slope) reads the same element for every score of a row,
  // which the compiler can then keep in a register.
  DenseSet<Value> varying;
  varying.insert(body.getArgument(0));
  for (size_t i = 2; i < numScalars; ++i)
    varying.insert(body.getArgument(i));
  for (Operation &op : body) {
    if (llvm::any_of(op.getOperands(),
                     [&](Value v) { return varying.contains(v); }))
      for (Value r : op.getResults())
        varying.insert(r);
    if (auto ret = dyn_cast<func::ReturnOp>(op)) {
      Value v = ret.getOperand(0);
      ScoreModValue out;
      out.value = eval.vals.lookup(v);
      if (derivative) {
        out.derivative = eval.tans.lookup(v);
        if (!out.derivative)
          out.derivative = o.f32c(0.0f);
      }
      return out;
    }
    if (auto load = dyn_cast<memref::LoadOp>(op)) {
      auto arg = cast<BlockArgument>(load.getMemRef());
      Value tensor = inputs[arg.getArgNumber() - numScalars];
      Value index = eval.vals.lookup(load.getIndices()[0]);
      if (varying.contains(load.getIndices()[0]))
        index = o.select(masked, o.idx(0), index);
      eval.vals.map(
          load.getResult(),
          memref::LoadOp::create(o.b, o.loc, tensor, ValueRange{index}));
      continue;
    }
    if (failed(eval.emit(op)))
      return op.emitOpError() << "has no lowering in a score modifier";
  }
  return fn.emitError() << "the score modifier has no return";
}

namespace dualkv {

ScoreModInfo parseScoreMod(const std::string &text) {
  ScoreModInfo info;
  DialectRegistry registry;
  registry.insert<arith::ArithDialect, func::FuncDialect, math::MathDialect,
                  memref::MemRefDialect>();
  MLIRContext ctx(registry, MLIRContext::Threading::DISABLED);
  ctx.loadAllAvailableDialects();
  std::string diagnostics;
  ScopedDiagnosticHandler handler(&ctx, [&](Diagnostic &diag) {
    llvm::raw_string_ostream os(diagnostics);
    os << diag.getLocation() << ": " << diag << "\n";
    return success();
  });
  OwningOpRef<ModuleOp> module =
      parseSourceString<ModuleOp>(text, &ctx, "score_mod");
  if (!module) {
    info.error = "the score modifier does not parse:\n" + diagnostics;
    return info;
  }
  func::FuncOp fn;
  for (Operation &op : module->getBody()->getOperations()) {
    auto f = dyn_cast<func::FuncOp>(op);
    if (!f || f.getName() != "score_mod") {
      info.error = "a score modifier is one func.func @score_mod and nothing "
                   "else; found '" +
                   op.getName().getStringRef().str() + "'";
      return info;
    }
    fn = f;
  }
  if (!fn) {
    info.error = "the score modifier text has no func.func @score_mod";
    return info;
  }
  if (failed(verifyScoreMod(fn))) {
    info.error = "not a score modifier:\n" + diagnostics;
    return info;
  }
  unsigned memrefs = 0;
  for (Type t : fn.getFunctionType().getInputs())
    memrefs += isa<MemRefType>(t);
  info.inputs = static_cast<int>(memrefs);
  info.packed = fn.getNumArguments() - memrefs == 7;
  llvm::raw_string_ostream os(info.canonical);
  fn->print(os);
  return info;
}

} // namespace dualkv
