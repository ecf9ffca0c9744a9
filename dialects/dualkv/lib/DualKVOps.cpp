//===- DualKVOps.cpp - verifiers and custom syntax of dualkv ops
//-----------===//
#include "dualkv/Dialect/DualKVOps.h"

#include <cmath>

#include "mlir/IR/Builders.h"
#include "mlir/IR/OpImplementation.h"
#include "mlir/Interfaces/FunctionImplementation.h"
#include "llvm/ADT/STLExtras.h"

#include <limits>

using namespace mlir;
using namespace mlir::dualkv;

//===----------------------------------------------------------------------===//
// Attributes
//===----------------------------------------------------------------------===//

LogicalResult ProblemAttr::verify(function_ref<InFlightDiagnostic()> emitError,
                                  int64_t P, int64_t N, int64_t numQHeads,
                                  int64_t numKVHeads, int64_t headDim,
                                  Type dtype, FloatAttr scale, bool causal,
                                  bool tree, FloatAttr softcap, bool dlse,
                                  bool sinks, bool window, bool scoreMod,
                                  int64_t vHeadDim) {
  if (P < 0)
    return emitError() << "P must be >= 0 (0 means any prompt length), got "
                       << P;
  if (N < 0)
    return emitError() << "N must be >= 0, got " << N;
  // The spec's rules (compiler/lib/Spec/KernelSpec.cpp), which the runtime
  // checks too.
  if (vHeadDim < 0)
    return emitError() << "v_head_dim must be >= 0 (0 means head_dim), got "
                       << vHeadDim;
  if (std::string why = ::dualkv::checkProblem(
          headDim, vHeadDim ? vHeadDim : headDim, numQHeads, numKVHeads);
      !why.empty())
    return emitError() << why;
  if (!dtype || !(dtype.isBF16() || dtype.isF16()))
    return emitError() << "dtype must be bf16 or f16, got " << dtype;
  if (!scale || !(scale.getValueAsDouble() > 0.0))
    return emitError() << "scale must be a positive float";
  if (!causal)
    return emitError() << "DualKV attention is causal: causal must be true";
  if (softcap) {
    if (std::string why = ::dualkv::checkSoftcap(softcap.getValueAsDouble());
        !why.empty())
      return emitError() << why;
    if (!(softcap.getValueAsDouble() > 0.0))
      return emitError() << "softcap must be positive when given (leave it "
                            "out for none)";
  }
  // Which kinds read dLSE, sinks or a window is the kernel's check
  // (checkSpec).
  (void)window;
  (void)scoreMod;
  (void)dlse;
  (void)sinks;
  return success();
}

LogicalResult TilingAttr::verify(function_ref<InFlightDiagnostic()> emitError,
                                 int64_t blockM, int64_t blockN, int64_t warps,
                                 int64_t stages) {
  if (std::string why = ::dualkv::checkTiling(blockM, blockN, warps, stages);
      !why.empty())
    return emitError() << why;
  return success();
}

//===----------------------------------------------------------------------===//
// Problem-level ops
//===----------------------------------------------------------------------===//

/// Checks that `type` is a rank-3 THD tensor with `heads` heads of the
/// problem's element type, rows of the problem's head_dim (`value`: its
/// value head_dim).
static LogicalResult verifyTHD(Operation *op, StringRef name, Type type,
                               int64_t heads, ProblemAttr problem,
                               bool value = false) {
  int64_t width = value ? problem.getValueHeadDim() : problem.getHeadDim();
  auto t = cast<RankedTensorType>(type);
  if (t.getRank() != 3)
    return op->emitOpError()
           << name << " must be [T, heads, head_dim], got rank " << t.getRank();
  if (!ShapedType::isDynamic(t.getDimSize(1)) && t.getDimSize(1) != heads)
    return op->emitOpError() << name << " has " << t.getDimSize(1)
                             << " heads, the problem says " << heads;
  if (!ShapedType::isDynamic(t.getDimSize(2)) && t.getDimSize(2) != width)
    return op->emitOpError() << name << " has head_dim " << t.getDimSize(2)
                             << ", the problem says " << width;
  if (t.getElementType() != problem.getDtype())
    return op->emitOpError()
           << name << " has element type " << t.getElementType()
           << ", the problem says " << problem.getDtype();
  return success();
}

/// Checks that q, k, v, o and lse agree with each other and with the problem.
static LogicalResult verifyAttentionTensors(Operation *op, ProblemAttr problem,
                                            Type q, Type k, Type v, Type o,
                                            Type lse) {
  int64_t hq = problem.getNumQHeads(), hkv = problem.getNumKvHeads();
  if (failed(verifyTHD(op, "q", q, hq, problem)) ||
      failed(verifyTHD(op, "k", k, hkv, problem)) ||
      failed(verifyTHD(op, "v", v, hkv, problem, /*value=*/true)) ||
      failed(verifyTHD(op, "o", o, hq, problem, /*value=*/true)))
    return failure();
  int64_t tokens = cast<RankedTensorType>(q).getDimSize(0);
  for (auto [name, type] :
       {std::pair<StringRef, Type>{"k", k}, {"v", v}, {"o", o}}) {
    int64_t t = cast<RankedTensorType>(type).getDimSize(0);
    if (!ShapedType::isDynamic(tokens) && !ShapedType::isDynamic(t) &&
        t != tokens)
      return op->emitOpError()
             << name << " has " << t << " tokens, q has " << tokens;
  }
  auto lseType = cast<RankedTensorType>(lse);
  if (lseType.getRank() != 2 || !lseType.getElementType().isF32())
    return op->emitOpError()
           << "lse must be [num_q_heads, T] of f32, got " << lse;
  if (!ShapedType::isDynamic(lseType.getDimSize(0)) &&
      lseType.getDimSize(0) != hq)
    return op->emitOpError() << "lse has " << lseType.getDimSize(0)
                             << " heads, the problem says " << hq;
  if (!ShapedType::isDynamic(tokens) &&
      !ShapedType::isDynamic(lseType.getDimSize(1)) &&
      lseType.getDimSize(1) != tokens)
    return op->emitOpError() << "lse has " << lseType.getDimSize(1)
                             << " tokens, q has " << tokens;
  if (problem.getP() > 0 && !ShapedType::isDynamic(tokens) &&
      tokens < problem.getP())
    return op->emitOpError()
           << "T = " << tokens
           << " is shorter than the prompt, P = " << problem.getP();
  return success();
}

LogicalResult AttentionFwdOp::verify() {
  return verifyAttentionTensors(*this, getProblem(), getQ().getType(),
                                getK().getType(), getV().getType(),
                                getO().getType(), getLse().getType());
}

LogicalResult AttentionBwdOp::verify() {
  if (failed(verifyAttentionTensors(*this, getProblem(), getQ().getType(),
                                    getK().getType(), getV().getType(),
                                    getO().getType(), getLse().getType())))
    return failure();
  if (getDout().getType() != getO().getType())
    return emitOpError() << "dout type " << getDout().getType()
                         << " must equal the output type " << getO().getType();
  if (getDq().getType() != getQ().getType() ||
      getDk().getType() != getK().getType() ||
      getDv().getType() != getV().getType())
    return emitOpError() << "gradients must have the types of q, k and v";
  return success();
}

//===----------------------------------------------------------------------===//
// KernelOp
//===----------------------------------------------------------------------===//

// The spec's enumerations list their values in the dialect's order (the
// schedules after Auto), so a bound kernel converts to a KernelSpec by casts.
static_assert(static_cast<int>(::dualkv::KernelKind::BwdDQ) ==
              static_cast<int>(KernelKind::bwd_dq));
static_assert(static_cast<int>(::dualkv::Schedule::WarpSpecialized) ==
              static_cast<int>(Schedule::warp_specialized) + 1);

bool KernelOp::walksChain() {
  bool found = false;
  walk([&](ChainLoopOp) { found = true; });
  return found;
}

FailureOr<::dualkv::KernelSpec> KernelOp::checkedSpec() {
  ProblemAttr problem = *getProblem();
  TilingAttr tiling = *getTiling();
  // The attributes' own verifiers bound head_dim and the tiling; head counts
  // are only positive there, and the spec holds ints.
  for (auto [name, value] :
       {std::pair<const char *, int64_t>{"num_q_heads", problem.getNumQHeads()},
        {"num_kv_heads", problem.getNumKvHeads()}})
    if (value > std::numeric_limits<int32_t>::max())
      return emitOpError() << name << " = " << value << " is out of range";
  if (std::string why =
          ::dualkv::checkTiling(tiling.getBlockM(), tiling.getBlockN(),
                                tiling.getWarps(), tiling.getStages());
      !why.empty())
    return emitOpError() << why;
  ::dualkv::KernelSpec spec;
  spec.kind = static_cast<::dualkv::KernelKind>(getKind());
  spec.P = problem.getP();
  spec.N = problem.getN();
  spec.headDim = static_cast<int>(problem.getHeadDim());
  spec.valueHeadDim = static_cast<int>(problem.getVHeadDim());
  spec.numQHeads = static_cast<int>(problem.getNumQHeads());
  spec.numKVHeads = static_cast<int>(problem.getNumKvHeads());
  spec.dtype = problem.getDtype() && problem.getDtype().isF16()
                   ? ::dualkv::DType::FP16
                   : ::dualkv::DType::BF16;
  spec.arch = getArch()->str();
  spec.tiling = {static_cast<int>(tiling.getBlockM()),
                 static_cast<int>(tiling.getBlockN()),
                 static_cast<int>(tiling.getWarps()),
                 static_cast<int>(tiling.getStages())};
  spec.schedule =
      static_cast<::dualkv::Schedule>(static_cast<int>(*getSchedule()) + 1);
  spec.tree = problem.getTree();
  spec.dlse = problem.getDlse();
  spec.sinks = problem.getSinks();
  spec.window = problem.getWindow();
  // The modifier's text is the module's function, which the checks do not
  // read (printing it here would verify the module again): they need to
  // know there is one.
  if (problem.getScoreMod())
    spec.scoreMod = "func.func @score_mod";
  if (FloatAttr cap = problem.getSoftcap())
    spec.softcap = static_cast<float>(cap.getValueAsDouble());
  if (std::string why = ::dualkv::checkSpec(spec); !why.empty())
    return emitOpError() << why;
  return spec;
}

LogicalResult KernelOp::verify() {
  bool anyBound = getProblem() || getTiling() || getArch() || getSchedule();
  if (anyBound && !isBound())
    return emitOpError()
           << "problem, tiling, arch and schedule are bound together: either "
              "all four or none";
  if (!isBound())
    return success();
  // The spec check of dualkv-bind-spec and the runtime, so that no pass
  // lowers a spec that cannot run (a schedule its arch lacks, a tiling its
  // schedule cannot compute, a launch beyond CUDA's limits).
  return success(succeeded(checkedSpec()));
}

LogicalResult KernelOp::verifyRegions() {
  // The regions a kernel walks must be disjoint: each (region, part) at most
  // once, and `all` and `masked` (every tile of the region) exclude every
  // other part of the same region.
  SmallVector<KVLoopOp> loops;
  getBody().walk([&](KVLoopOp loop) { loops.push_back(loop); });
  for (auto [i, a] : llvm::enumerate(loops)) {
    for (KVLoopOp b : ArrayRef<KVLoopOp>(loops).drop_front(i + 1)) {
      if (a.getRegion() != b.getRegion())
        continue;
      auto whole = [](LoopPart p) {
        return p == LoopPart::all || p == LoopPart::masked;
      };
      if (a.getPart() == b.getPart() || whole(a.getPart()) ||
          whole(b.getPart()))
        return b.emitOpError()
               << "overlaps an earlier loop over the "
               << stringifyKVRegion(a.getRegion()) << " region (parts "
               << stringifyLoopPart(a.getPart()) << " and "
               << stringifyLoopPart(b.getPart())
               << "): every KV tile must be visited once";
    }
  }
  auto needs = [&](bool present, StringRef what,
                   StringRef op) -> LogicalResult {
    if (present)
      return success();
    return emitOpError() << stringifyKernelKind(getKind()) << " kernel " << what
                         << " (dualkv." << op << ")";
  };
  auto has = [&](auto tag) {
    return !getBody().getOps<decltype(tag)>().empty();
  };
  switch (getKind()) {
  case KernelKind::bwd:
  case KernelKind::bwd_kv:
    if (failed(needs(has(LoadKVBlockOp()), "loads no key/value block",
                     "load_kv_block")) ||
        failed(needs(has(QLoopOp()), "walks no query tiles", "q_loop")) ||
        failed(
            needs(has(StoreKVGradsOp()), "stores no dK/dV", "store_kv_grads")))
      return failure();
    break;
  case KernelKind::bwd_pre:
    return needs(has(ComputeDeltaOp()), "computes no Delta", "compute_delta");
  case KernelKind::bwd_post:
    return needs(has(ConvertGradsOp()), "converts nothing", "convert_grads");
  case KernelKind::bwd_dq:
    if (failed(needs(has(LoadQOp()), "loads no query tile", "load_q")) ||
        failed(needs(has(StoreDqOp()), "stores no dQ", "store_dq")))
      return failure();
    break;
  case KernelKind::fwd:
    break;
  }
  if (getKind() == KernelKind::fwd) {
    if (getBody().getOps<LoadQOp>().empty())
      return emitOpError()
             << "forward kernel loads no query tile (dualkv.load_q)";
    if (getBody().getOps<StoreOutputOp>().empty())
      return emitOpError()
             << "forward kernel stores no output (dualkv.store_output)";
  }
  return success();
}

//===----------------------------------------------------------------------===//
// Tile-level ops
//===----------------------------------------------------------------------===//

LogicalResult LoadQOp::verify() {
  auto kernel = (*this)->getParentOfType<KernelOp>();
  if (!kernel)
    return emitOpError() << "must be inside a dualkv.kernel";
  if (kernel.getKind() != KernelKind::fwd &&
      kernel.getKind() != KernelKind::bwd_dq)
    return emitOpError()
           << "only query-major kernels (fwd, bwd_dq) load query tiles";
  return success();
}

/// Prints `[iter_args(%a = %x, ...) : types] [attr-dict] body`, shared by
/// kv_loop and q_loop.
template <typename LoopOp>
static void printLoopTail(OpAsmPrinter &p, LoopOp op,
                          ArrayRef<StringRef> elided) {
  if (!op.getInits().empty()) {
    p << " iter_args(";
    llvm::interleaveComma(
        llvm::zip(op.getRegionIterArgs(), op.getInits()), p, [&](auto pair) {
          p << std::get<0>(pair) << " = " << std::get<1>(pair);
        });
    p << ") : " << op.getInits().getTypes();
  }
  p.printOptionalAttrDictWithKeyword(op->getAttrs(), elided);
  p << " ";
  p.printRegion(op.getBody(), /*printEntryBlockArgs=*/true,
                /*printBlockTerminators=*/!op.getInits().empty());
}

/// Parses what printLoopTail prints.
template <typename LoopOp>
static ParseResult parseLoopTail(OpAsmParser &parser, OperationState &result) {
  SmallVector<OpAsmParser::UnresolvedOperand> inits;
  // The names before '=' repeat the entry block's arguments, which name them.
  SmallVector<OpAsmParser::Argument> iterArgs;
  SmallVector<Type> types;
  if (succeeded(parser.parseOptionalKeyword("iter_args"))) {
    if (parser.parseAssignmentList(iterArgs, inits) || parser.parseColon() ||
        parser.parseTypeList(types))
      return failure();
    if (types.size() != inits.size())
      return parser.emitError(parser.getCurrentLocation())
             << "iter_args has " << inits.size() << " values but "
             << types.size() << " types";
    if (parser.resolveOperands(inits, types, parser.getCurrentLocation(),
                               result.operands))
      return failure();
    result.addTypes(types);
  }
  if (parser.parseOptionalAttrDictWithKeyword(result.attributes))
    return failure();
  // The body's arguments are written in its entry block: ^bb0(%j: index, ...).
  Region *body = result.addRegion();
  if (parser.parseRegion(*body, /*arguments=*/{}))
    return failure();
  if (body->empty()) {
    return parser.emitError(parser.getCurrentLocation())
           << result.name.getStringRef() << " needs a body";
  }
  if (types.empty())
    LoopOp::ensureTerminator(*body, parser.getBuilder(), result.location);
  return success();
}

/// Adds the body block (tile index, then one argument per carried value).
static void buildLoopBody(OpBuilder &builder, OperationState &state,
                          ValueRange inits) {
  state.addOperands(inits);
  state.addTypes(inits.getTypes());
  Region *body = state.addRegion();
  Block *block = new Block();
  body->push_back(block);
  block->addArgument(builder.getIndexType(), state.location);
  for (Value v : inits)
    block->addArgument(v.getType(), state.location);
}

/// The region checks kv_loop and q_loop share.
template <typename LoopOp>
static LogicalResult verifyLoopRegion(LoopOp op, StringRef what) {
  Block &block = op.getBody().front();
  if (block.getNumArguments() != op.getInits().size() + 1)
    return op.emitOpError() << "body must take the tile index and "
                            << op.getInits().size() << " carried values, got "
                            << block.getNumArguments() << " arguments";
  if (!block.getArgument(0).getType().isIndex())
    return op.emitOpError()
           << "first body argument must be the index of the " << what;
  for (auto [i, arg, init] :
       llvm::enumerate(op.getRegionIterArgs(), op.getInits()))
    if (arg.getType() != init.getType())
      return op.emitOpError()
             << "carried value #" << i << " has type " << init.getType()
             << " but the body takes " << arg.getType();
  auto yield = cast<YieldOp>(block.getTerminator());
  if (yield.getValues().getTypes() != op.getResultTypes())
    return op.emitOpError()
           << "yields " << yield.getValues().size()
           << " values whose types differ from the loop's results";
  return success();
}

void KVLoopOp::build(OpBuilder &builder, OperationState &state, KVRegion region,
                     LoopPart part, ValueRange inits) {
  state.addAttribute(getRegionAttrName(state.name),
                     KVRegionAttr::get(builder.getContext(), region));
  state.addAttribute(getPartAttrName(state.name),
                     LoopPartAttr::get(builder.getContext(), part));
  buildLoopBody(builder, state, inits);
}

// Syntax: dualkv.kv_loop <region> part <part> [iter_args(%a = %x, ...) :
// types] body
void KVLoopOp::print(OpAsmPrinter &p) {
  p << " ";
  p.printStrippedAttrOrType(getRegionAttr());
  p << " part ";
  p.printStrippedAttrOrType(getPartAttr());
  printLoopTail(p, *this, {getRegionAttrName(), getPartAttrName()});
}

ParseResult KVLoopOp::parse(OpAsmParser &parser, OperationState &result) {
  KVRegionAttr region;
  LoopPartAttr part;
  if (parser.parseCustomAttributeWithFallback(region) ||
      parser.parseKeyword("part") ||
      parser.parseCustomAttributeWithFallback(part))
    return failure();
  result.addAttribute("region", region);
  result.addAttribute("part", part);
  return parseLoopTail<KVLoopOp>(parser, result);
}

LogicalResult KVLoopOp::verify() {
  KVRegion region = getRegion();
  LoopPart part = getPart();
  if (region == KVRegion::shared && part == LoopPart::diagonal)
    return emitOpError()
           << "the shared region has no causal diagonal: every prompt key "
              "precedes every response query";
  if (region == KVRegion::response && part == LoopPart::tail)
    return emitOpError()
           << "the response region has no tail part: its last tiles are "
              "the diagonal ones";
  return success();
}

LogicalResult KVLoopOp::verifyRegions() {
  if (failed(verifyLoopRegion(*this, "KV tile")))
    return failure();
  if (!getBody().getOps<KVLoopOp>().empty())
    return emitOpError() << "KV loops do not nest";
  return success();
}

void ChainLoopOp::build(OpBuilder &builder, OperationState &state,
                        ValueRange inits) {
  state.addOperands(inits);
  state.addTypes(inits.getTypes());
  Region *body = state.addRegion();
  Block *block = new Block();
  body->push_back(block);
  for (Value v : inits)
    block->addArgument(v.getType(), state.location);
}

// Syntax: dualkv.chain_loop [iter_args(%a = %x, ...) : types] body
void ChainLoopOp::print(OpAsmPrinter &p) { printLoopTail(p, *this, {}); }

ParseResult ChainLoopOp::parse(OpAsmParser &parser, OperationState &result) {
  return parseLoopTail<ChainLoopOp>(parser, result);
}

LogicalResult ChainLoopOp::verifyRegions() {
  Block &block = getBody().front();
  if (block.getNumArguments() != getInits().size())
    return emitOpError() << "body must take the " << getInits().size()
                         << " carried values, got " << block.getNumArguments()
                         << " arguments";
  for (auto [i, arg, init] : llvm::enumerate(block.getArguments(), getInits()))
    if (arg.getType() != init.getType())
      return emitOpError() << "carried value #" << i << " has type "
                           << init.getType() << " but the body takes "
                           << arg.getType();
  auto yield = cast<YieldOp>(block.getTerminator());
  if (yield.getValues().getTypes() != getResultTypes())
    return emitOpError() << "yields " << yield.getValues().size()
                         << " values whose types differ from the loop's "
                            "results";
  for (Operation &op : block.without_terminator()) {
    auto loop = dyn_cast<KVLoopOp>(op);
    if (!loop || loop.getRegion() != KVRegion::shared)
      return op.emitOpError()
             << "cannot be in a dualkv.chain_loop, whose body walks the "
                "shared region's loops (dualkv.kv_loop <shared>) only";
  }
  auto kernel = (*this)->getParentOfType<KernelOp>();
  if (kernel.getKind() != KernelKind::fwd &&
      kernel.getKind() != KernelKind::bwd_dq)
    return emitOpError() << "belongs to the query-major kernels (fwd, "
                            "bwd_dq) only";
  if (auto problem = kernel.getProblem(); problem && !problem->getTree())
    return emitOpError() << "walks ancestor chains, which only tree kernels "
                            "(#dualkv.problem<..., tree = true>) have";
  return success();
}

LogicalResult ScaleScoresOp::verify() {
  float factor = getFactor().convertToFloat();
  if (!std::isfinite(factor) || factor <= 0.0f)
    return emitOpError() << "factor must be positive and finite, got "
                         << factor;
  return success();
}

/// A softcap op's kernel, bound, must have a softcap: dualkv-bind-spec erases
/// them from kernels bound without one.
static LogicalResult verifySoftcapKernel(Operation *op) {
  auto kernel = op->getParentOfType<KernelOp>();
  if (!kernel || !kernel.getProblem() || kernel.getProblem()->getSoftcap())
    return success();
  return op->emitOpError()
         << "is in a kernel bound without a softcap "
            "(#dualkv.problem<..., softcap = c>): nothing to cap";
}

LogicalResult SoftcapOp::verify() { return verifySoftcapKernel(*this); }

LogicalResult SoftcapGradOp::verify() { return verifySoftcapKernel(*this); }

/// A score_mod op's kernel, bound, must have a score modifier:
/// dualkv-bind-spec erases them from kernels bound without one.
static LogicalResult verifyScoreModKernel(Operation *op) {
  auto kernel = op->getParentOfType<KernelOp>();
  if (!kernel || !kernel.getProblem() || kernel.getProblem()->getScoreMod())
    return success();
  return op->emitOpError()
         << "is in a kernel bound without a score modifier "
            "(#dualkv.problem<..., score_mod = true>): nothing to apply";
}

LogicalResult ScoreModOp::verify() { return verifyScoreModKernel(*this); }

LogicalResult ScoreModGradOp::verify() { return verifyScoreModKernel(*this); }

LogicalResult MaskOp::verify() {
  // AllTypesMatch<scores, result> has checked the result type.
  if (auto qloop = (*this)->getParentOfType<QLoopOp>()) {
    if (!isa<ScoresTType>(getScores().getType()))
      return emitOpError()
             << "a q_loop masks transposed scores (!dualkv.scores_t)";
    if (qloop.getBody().front().getNumArguments() == 0 ||
        getTile() != qloop.getTileIndex())
      return emitOpError() << "must mask the tile of its own loop iteration";
    if (getKind() != MaskKind::causal)
      return emitOpError()
             << "a backward query tile needs only the causal mask";
    if (qloop.getPart() == LoopPart::full)
      return emitOpError() << "a full tile needs no mask";
    return success();
  }
  auto loop = (*this)->getParentOfType<KVLoopOp>();
  if (!loop)
    return emitOpError() << "must be inside a dualkv.kv_loop or dualkv.q_loop";
  if (!isa<ScoresType>(getScores().getType()))
    return emitOpError() << "a kv_loop masks !dualkv.scores";
  // Child verifiers run before the loop's region verifier: the body may lack
  // its tile-index argument here.
  if (loop.getBody().front().getNumArguments() == 0 ||
      getTile() != loop.getTileIndex())
    return emitOpError() << "must mask the tile of its own loop iteration";
  switch (getKind()) {
  case MaskKind::none:
    return emitOpError() << "a mask of kind none is no mask: drop the op";
  case MaskKind::causal:
    if (loop.getRegion() != KVRegion::response)
      return emitOpError() << "causal masks belong to the response region only";
    if (loop.getPart() == LoopPart::full)
      return emitOpError() << "a full tile needs no mask";
    break;
  case MaskKind::bound:
    if (loop.getRegion() != KVRegion::shared)
      return emitOpError() << "bound masks belong to the shared region only";
    if (loop.getPart() == LoopPart::full)
      return emitOpError() << "a full tile needs no mask";
    break;
  }
  return success();
}

//===----------------------------------------------------------------------===//
// Backward ops
//===----------------------------------------------------------------------===//

void QLoopOp::build(OpBuilder &builder, OperationState &state, LoopPart part,
                    ValueRange inits) {
  state.addAttribute(getPartAttrName(state.name),
                     LoopPartAttr::get(builder.getContext(), part));
  buildLoopBody(builder, state, inits);
}

// Syntax: dualkv.q_loop part <part> [iter_args(%a = %x, ...) : types] body
void QLoopOp::print(OpAsmPrinter &p) {
  p << " part ";
  p.printStrippedAttrOrType(getPartAttr());
  printLoopTail(p, *this, {getPartAttrName()});
}

ParseResult QLoopOp::parse(OpAsmParser &parser, OperationState &result) {
  LoopPartAttr part;
  if (parser.parseKeyword("part") ||
      parser.parseCustomAttributeWithFallback(part))
    return failure();
  result.addAttribute("part", part);
  return parseLoopTail<QLoopOp>(parser, result);
}

LogicalResult QLoopOp::verify() {
  if (getPart() == LoopPart::tail)
    return emitOpError() << "a query loop has no tail part: the last query "
                            "tile's extra rows read as zero";
  if (getPart() == LoopPart::masked)
    return emitOpError() << "a query loop has no masked part: its tiles split "
                            "into the diagonal and the full ones";
  auto kernel = (*this)->getParentOfType<KernelOp>();
  if (kernel && kernel.getKind() != KernelKind::bwd &&
      kernel.getKind() != KernelKind::bwd_kv)
    return emitOpError() << "query loops belong to KV-major backward kernels "
                            "(bwd, bwd_kv)";
  return success();
}

LogicalResult QLoopOp::verifyRegions() {
  // Nesting needs no check: both loops must sit directly in a dualkv.kernel.
  return verifyLoopRegion(*this, "query tile");
}

/// scores pair with row statistics, transposed scores with column statistics.
static LogicalResult verifyOrientation(Operation *op, Type scores, Type stats) {
  bool rows = isa<ScoresType>(scores);
  if (rows != isa<RowStatsType>(stats))
    return op->emitOpError()
           << (rows ? "!dualkv.scores pairs with !dualkv.row_stats"
                    : "!dualkv.scores_t pairs with !dualkv.col_stats")
           << ", got " << stats;
  return success();
}

LogicalResult RecomputeProbsOp::verify() {
  return verifyOrientation(*this, getScores().getType(), getLse().getType());
}

LogicalResult SoftmaxGradOp::verify() {
  // AllTypesMatch<probs, dprobs> has checked that P and dP share a type.
  Type p = getProbs().getType();
  if (failed(verifyOrientation(*this, p, getDelta().getType())))
    return failure();
  Type r = getResult().getType();
  if (isa<ScoresType>(p) != isa<ProbsType>(r))
    return emitOpError() << "dS of " << p << " is "
                         << (isa<ScoresType>(p) ? "!dualkv.probs"
                                                : "!dualkv.scores_t")
                         << ", got " << r;
  return success();
}

#define GET_OP_CLASSES
#include "dualkv/Dialect/DualKVOps.cpp.inc"

//===----------------------------------------------------------------------===//
// Warpgroup machine ops
//===----------------------------------------------------------------------===//

LogicalResult WgmmaOp::verify() {
  int64_t n = getN();
  if (n < 8 || n > 256 || n % 8)
    return emitOpError() << "n must be a multiple of 8 in [8, 256], got " << n;
  if (int64_t(getResult().size()) != n / 2)
    return emitOpError() << "has " << getResult().size() << " results; an m64n"
                         << n << " step gives " << n / 2 << " a thread";
  if (!getAcc().empty() && getAcc().size() != getResult().size())
    return emitOpError() << "takes " << getAcc().size()
                         << " accumulators; it needs none or " << n / 2;
  bool regs = !getARegs().empty();
  if (regs == bool(getADesc()))
    return emitOpError() << "takes A either as a_desc or as four a_regs";
  if (regs && getARegs().size() != 4)
    return emitOpError() << "takes four a_regs, got " << getARegs().size();
  if (regs && getTransA())
    return emitOpError() << "trans_a applies to a_desc only";
  Type e = getElemType();
  if (!e.isBF16() && !e.isF16())
    return emitOpError() << "elem_type must be bf16 or f16";
  return success();
}
