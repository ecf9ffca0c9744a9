//===- WarpSpecializedQueryMajor.cpp - the sm_90a forward and dQ kernels --===//
//
// A CTA of three warpgroups computes block_m = 128 query rows of one head of
// one segment:
//   warpgroup 2, the producer (setmaxnreg down to 24 registers): one thread
//     loads Q once and then K and V tile after tile by TMA
//     (cp.async.bulk.tensor) into a ring of `stages` slots, each slot with a
//     "full" mbarrier (expect_tx: the TMA bytes) and an "empty" one;
//   warpgroups 0 and 1, the consumers (setmaxnreg up to 240): 64 query rows
//     each, S = Q Kᵀ and O += P V by wgmma; the scores of tile i + 1 are
//     issued before P V of tile i, so the softmax of tile i + 1 runs while
//     the tensor cores still multiply tile i (FlashAttention-3's
//     intra-warpgroup overlap); the two warpgroups take turns to issue their
//     GEMMs (QueryMajorBarrier::Turn0, Turn1), so one's softmax runs under the
//     other's GEMMs (ping-pong); at the end each stages its O through its rows
//     of the Q tile and stores whole rows (QueryMajorBarrier::Epilogue0,
//     Epilogue1).
// Every tile of the kernel's kv_loops (the shared prompt's full tiles and its
// masked tail, the response's full tiles and its causal diagonal) is one
// iteration of a single software pipeline, in the loops' order; the masks of
// the IR's edge loops are applied only to the iterations of those loops.
// The consumers walk the template: the pipeline issues the loop body's
// products (its qk ops and its pv) and emits every other op of the body
// through the tile-op library (Lowering/TileOps/TileOps.h) as soon as the
// values it reads are there, so a change to the template's math reaches this
// schedule as it reaches the others. The tiles sit in the 128-byte swizzle that
// both TMA (CU_TENSOR_MAP_SWIZZLE_ 128B, boxes of 64 columns) and wgmma read: D
// / 64 atoms of rows x 128 bytes. The runtime passes one CUtensorMap each for
// Q, K and V (3-D: head_dim, heads, tokens) as 128-byte grid-constant
// parameters after the forward's ABI, then the plan's forward work order
// (Plan::forwardTable): CTA x computes item x, the longest KV walks first.
//
// Prefix trees (KernelSpec::tree; the default on sm_90a, the dQ kernel's
// too): a segment's keys are its ancestor ranges,
// walked from the plan's chain table as the dualkv.chain_loop of the IR says
// (each range's full tiles, then its tail masked past the range's end), then
// its own region as above. The pipeline iterates over the ranges' tiles first:
// producer and consumers carry the walk's state (the row, the tile in it, and
// what is left) from one iteration to the next, reading a chain row only when a
// range begins.
//
// The dQ kernel (bwd_dq; the split-dQ backward's, sm_90a's default and the
// deterministic mode) is the same pipeline with three
// products a tile. The producer loads dO beside Q (one barrier for both);
// each consumer warpgroup holds its 64 rows' LSE and Delta in registers and,
// for tile i, issues S = Q Kᵀ and dP = dO Vᵀ, then dQ += dS K of tile i - 1
// behind them: P = exp2(S - LSE) is computed while dP and the previous dQ
// product still run, dS = P (dP - Delta) scale while the dQ product runs.
// K therefore stays in its slot until tile i + 1's products are issued, so
// the dQ kernel's ring is deeper (kDqWarpSpecializedStages). dQ leaves as
// the forward's O does, through the warpgroup's rows of the Q tile.
//
// The emitter's state is explicit: what emit reads and computes at entry
// (KernelArgs, SegmentCoords, RingTiles, the Pipeline of KVLoops and Chain)
// is made by one function each and passed to the functions that read it; the
// loop-carried values (Walk, Carried) convert to and from an scf loop's flat
// values in one place each.
//
//===----------------------------------------------------------------------===//
#include "WarpSpecialized.h"

#include "Lowering/Support/HopperSync.h"
#include "Lowering/Support/KernelFunction.h"
#include "Lowering/Support/MmaFragments.h"
#include "Lowering/Support/Segments.h"
#include "Lowering/Support/SharedTiles.h"
#include "Lowering/Support/WgmmaBuilder.h"
#include "Lowering/TileOps/TileOps.h"
#include "ScoreMod/ScoreModIR.h"
#include "dualkv/Compiler/Schedule.h"

#include <limits>
#include <optional>
#include <tuple>

using namespace mlir;
using namespace mlir::dualkv;

namespace {

/// Threads of a warpgroup; the producer warpgroup follows the consumers.
constexpr int64_t kWarpgroupThreads = 128;
/// Registers a thread after setmaxnreg: 128 x 24 + 256 x 240 = 384 x 168.
constexpr int32_t kProducerRegs = 24;
constexpr int32_t kConsumerRegs = 240;
constexpr int32_t kEntryRegs = 168;

/// The kernel parameters the emitter reads (KernelAbi.h), read once at entry
/// (WarpSpecializedQueryMajor::readArgs).
struct KernelArgs {
  /// The rows' LSE (the forward writes it, the dQ kernel reads it), the
  /// plan's segment table, LSE's head stride.
  Value lse, segs, lseStrideH;
  /// The output, the forward's O or the dQ kernel's dQ, and its token and
  /// head strides.
  Value out, outStrideT, outStrideH;
  /// The dQ kernel's: Delta, its head stride, the softmax scale, dO's TMA map.
  Value delta, deltaStrideH, scale, doMap;
  /// scale · log2 e; the TMA maps of Q, K and V.
  Value scaleLog2, qMap, kMap, vMap;
  /// The plan's forward work order; tree kernels: the chain table.
  Value order, chain;
  /// A forward with attention sinks: one logit per query head.
  Value sinks;
};

/// What the CTA computes: a query tile of one head of one segment, read off
/// the work order and the segment table at entry
/// (WarpSpecializedQueryMajor::locate).
struct SegmentCoords {
  /// The segment's row of the segment table (and of a tree's chain table).
  Value segRow;
  /// The tile's first query row within the segment.
  Value qRow0;
  /// The query head (block z) and the K/V head it reads.
  Value head, kvHead;
  /// The first of the CTA's block of output (and V) columns; null: one
  /// block (outputColumnBlocks).
  Value column0;
  /// The segment's first token and length; its shared prompt's.
  Value segStart, segLen, sharedStart, sharedLen;
};

/// The ring in dynamic shared memory, at RingLayout's offsets from `base`
/// (WarpSpecializedQueryMajor::placeRing); the barriers and slot tiles are
/// addresses computed from it (barrier, kFull, kAddrOf, ...).
struct RingTiles {
  /// The swizzle-aligned base address (index), where the Q tile starts.
  Value base;
  /// The Q tile as a memref: the epilogues stage their rows through it.
  Value qTile;
};

/// One kv_loop of the tiled IR: its tiles [lb, ub) of `region`, the mask its
/// scores pass through (if any), and its first iteration of the pipeline.
struct Loop {
  KVRegion region;
  std::optional<MaskKind> mask;
  Value lb, ub, count, offset;
};

/// The kernel's kv_loops in order, and numIters, the tiles of all of them
/// (WarpSpecializedQueryMajor::collectLoops).
struct KVLoops {
  SmallVector<Loop> loops;
  Value numIters;
};

/// Tree kernels: the chain table, the segment's row of it, and `tiles`, the
/// tiles of every ancestor range of the segment (countChainTiles): the
/// pipeline's first iterations.
struct Chain {
  Value table, segRow, tiles;
  /// The query tile's first row (a sliding window's bounds need it).
  Value qRow0;
};

/// The pipeline's iterations, fixed before the roles split
/// (WarpSpecializedQueryMajor::pipeline): the chain's tiles first (tree
/// kernels), then every kv_loop's, numIters in all.
struct Pipeline {
  KVLoops kv;
  std::optional<Chain> chain;
  Value numIters;
};

/// The tree walk's state at one iteration, carried from iteration to
/// iteration: the chain row, the tile in its range, the range's tiles, its
/// start and length, and the ranges left after it.
struct Walk {
  Value row, tile, tiles, start, len, left;
  /// With a sliding window: how many logical positions the range starts
  /// before the segment (the lengths of the ranges walked so far, its own
  /// included); null without one.
  Value shift;

  /// As an scf loop's values, in the order of the fields.
  SmallVector<Value> values() const {
    SmallVector<Value> v = {row, tile, tiles, start, len, left};
    if (shift)
      v.push_back(shift);
    return v;
  }
  /// From an scf loop's values (values()' order).
  static Walk from(ValueRange v) {
    assert((v.size() == 6 || v.size() == 7) && "not a walk state");
    return {v[0], v[1], v[2], v[3], v[4], v[5], v.size() == 7 ? v[6] : Value()};
  }
};

/// What a consumer's main loop carries from iteration i - 1 to i: the
/// accumulator (up to tile i - 2's product), the body's other iter_args
/// (the forward's statistics; none in the dQ kernel), the operand of tile
/// i - 1's product (P, or dS), and the tree walk (tree kernels).
struct Carried {
  SmallVector<Value> acc;
  SmallVector<SmallVector<Value>> state;
  SmallVector<Value> operand;
  std::optional<Walk> walk;

  /// As an scf loop's values: acc, the state's in order, operand, walk.
  SmallVector<Value> flat() const {
    SmallVector<Value> out(acc);
    for (const SmallVector<Value> &s : state)
      out.append(s);
    out.append(operand);
    if (walk)
      out.append(walk->values());
    return out;
  }
  /// From an scf loop's `values`, laid out as flat() lays out `shape`.
  static Carried like(const Carried &shape, ValueRange values) {
    Carried c;
    size_t at = 0;
    auto take = [&](size_t n) {
      SmallVector<Value> part(values.begin() + at, values.begin() + at + n);
      at += n;
      return part;
    };
    c.acc = take(shape.acc.size());
    for (const SmallVector<Value> &s : shape.state)
      c.state.push_back(take(s.size()));
    c.operand = take(shape.operand.size());
    if (shape.walk)
      c.walk = Walk::from(take(shape.walk->values().size()));
    assert(at == values.size() && "values not laid out as the shape's");
    return c;
  }
};

/// The template's tile program, read off the kernel before anything is
/// emitted (WarpSpecializedQueryMajor::collectTileProgram): the tile loop
/// (the first kv_loop, a tree's chain_loop's included), whose body every
/// kv_loop's repeats but for its masks; the products in it that the pipeline
/// issues itself (the scores Q Kᵀ, the dQ kernel's dP = dO Vᵀ, the
/// accumulating P V or dS K); and the iter_arg the product accumulates into.
/// Op handles: passed by value.
struct TileProgram {
  KVLoopOp loop;
  QKOp scores, dp;
  PVOp product;
  unsigned accArg = 0;
};

/// One tile's pass through the template's loop body: the values bound to
/// the body's values so far, and the body's ops already emitted.
struct TileStep {
  IRMapping map;
  DenseSet<Operation *> done;
};

/// Emits the warp-specialized query-major kernels: the forward and the dQ
/// kernel (bwd_dq).
class WarpSpecializedQueryMajor : public ScalarBuilder {
public:
  WarpSpecializedQueryMajor(KernelOp kernel, OpBuilder &b)
      : ScalarBuilder(b, kernel.getLoc()), kernel(kernel),
        elemType(kernel.getProblem()->getDtype()),
        headDim(kernel.getProblem()->getHeadDim()),
        tileDim(::dualkv::swizzledTileDim(headDim)),
        columnBlocks(kernel.getKind() == KernelKind::fwd
                         ? ::dualkv::outputColumnBlocks(
                               ::dualkv::KernelKind::Fwd, headDim,
                               kernel.getProblem()->getValueHeadDim())
                         : 1),
        valueHeadDim(kernel.getProblem()->getValueHeadDim() / columnBlocks),
        vTileDim(::dualkv::swizzledTileDim(valueHeadDim)),
        warps(kernel.getTiling()->getWarps()),
        blockM(kernel.getTiling()->getBlockM()),
        blockN(kernel.getTiling()->getBlockN()),
        stages(kernel.getTiling()->getStages()),
        groupSize(kernel.getProblem()->getNumQHeads() /
                  kernel.getProblem()->getNumKvHeads()),
        nTiles(blockN / 8), isDq(kernel.getKind() == KernelKind::bwd_dq),
        dTiles((isDq ? tileDim : vTileDim) / 8),
        outDim(isDq ? headDim : valueHeadDim), isTree(kernel.walksChain()),
        ring(::dualkv::RingLayout::of(
            {int(blockM), int(blockN), int(warps), int(stages)}, int(headDim),
            isDq ? ::dualkv::KernelKind::BwdDQ : ::dualkv::KernelKind::Fwd,
            int(valueHeadDim))),
        fn(*this, elemType), frags(*this, elemType),
        smemTiles(*this, elemType, headDim),
        mma(b, kernel.getLoc(), kernel.getProblem()->getDtype(),
            isDq ? tileDim : vTileDim, headDim) {
    smemTiles.setSwizzledTileCols(tileDim);
  }

  LogicalResult emit(gpu::GPUModuleOp gpuModule);

  /// [Q][dO (bwd_dq)][K x stages][V x stages][mbarriers], 1 KB spare for
  /// the alignment: the schedule record's RingLayout.
  int64_t sharedBytes() const { return ring.total; }

private:
  // ---- fixed at construction ----------------------------------------------
  KernelOp kernel;
  /// The element type, head_dim, the columns of its swizzled tiles
  /// (swizzledTileDim: 128 at head_dim 96, whose last 32 the TMA zero-fills;
  /// the accumulators of O and dQ keep them, zero, and the stores leave them
  /// out), the value head_dim and its tiles' columns (V; the forward only
  /// takes one apart from head_dim), and the consumer warps a CTA.
  const Type elemType;
  /// columnBlocks: the forward's blocks of output columns
  /// (outputColumnBlocks: 2 at head_dim 512), one CTA each; valueHeadDim
  /// the CTA's block of value columns.
  const int64_t headDim, tileDim, columnBlocks, valueHeadDim, vTileDim, warps;
  const int64_t blockM, blockN, stages, groupSize, nTiles;
  const bool isDq;
  /// The accumulator's n8 tiles (O: vTileDim's, dQ: tileDim's) and the
  /// columns the epilogue stores (the value head_dim's, or head_dim's).
  const int64_t dTiles, outDim;
  const bool isTree;
  /// The sliding window W (the `window` parameter, read at entry; null:
  /// none).
  Value window;
  /// A score modifier's parameters (scoreModInputs(kernel) >= 0).
  std::optional<ScoreModParams> scoreMod;
  /// A forward with attention sinks (#dualkv.problem<..., sinks = true>).
  bool hasSinks() {
    return !isDq && kernel.getProblem() && kernel.getProblem()->getSinks();
  }
  /// Where the tiles and barriers sit: the layout the record counts.
  const ::dualkv::RingLayout ring;
  int64_t threads() const { return warps * 32; }
  KernelFunction fn;
  /// The A fragments of P (or dS) for wgmma's register operand.
  MmaFragments frags;
  /// The swizzled tiles the TMA fills and the epilogue stages through.
  SharedTiles smemTiles;
  WgmmaBuilder mma;
  /// The calling thread's ids: emitted at entry, before anything reads them.
  ThreadIds ids;

  // ---- entry: what the roles read ------------------------------------------
  /// The kernel parameters, in the order of their index casts.
  KernelArgs readArgs();
  /// Block x's work item of the plan's forward order, block z's head.
  SegmentCoords locate(const KernelArgs &args);
  /// The ring's base address and Q tile in dynamic shared memory.
  RingTiles placeRing();
  FailureOr<KVLoops> collectLoops(const SegmentCoords &coords);
  /// The pipeline of `kv`'s iterations, after a tree's chain.
  Pipeline pipeline(KVLoops kv, const KernelArgs &args,
                    const SegmentCoords &coords);

  // ---- the roles -----------------------------------------------------------
  void emitProducer(const KernelArgs &args, const SegmentCoords &coords,
                    const RingTiles &tiles, const Pipeline &pipe);
  LogicalResult emitConsumer(const KernelArgs &args,
                             const SegmentCoords &coords,
                             const RingTiles &tiles, const Pipeline &pipe,
                             TileProgram prog);
  LogicalResult emitDqConsumer(const KernelArgs &args,
                               const SegmentCoords &coords,
                               const RingTiles &tiles, const Pipeline &pipe,
                               TileProgram prog);

  // ---- the ring's addresses ------------------------------------------------
  // Barrier indices: Q full, then per slot K full, V full, K empty, V empty.
  Value barrier(const RingTiles &t, int64_t index) {
    return sharedPtr(*this, add(t.base, idx(ring.barriers + 8 * index)));
  }
  Value barrierAt(const RingTiles &t, int64_t first, Value slot) {
    return sharedPtr(*this, add(t.base, add(idx(ring.barriers + 8 * first),
                                            mul(slot, idx(8 * 4)))));
  }
  /// Shared addresses of ring slot `slot`'s K and V tiles.
  Value kAddrOf(const RingTiles &t, Value slot) {
    return add(t.base, add(idx(ring.kRing), mul(slot, idx(ring.slotBytes))));
  }
  Value vAddrOf(const RingTiles &t, Value slot) {
    return add(t.base, add(idx(ring.vRing), mul(slot, idx(ring.vSlotBytes))));
  }
  Value kFull(const RingTiles &t, Value s) { return barrierAt(t, 1, s); }
  Value vFull(const RingTiles &t, Value s) { return barrierAt(t, 2, s); }
  Value kEmpty(const RingTiles &t, Value s) { return barrierAt(t, 3, s); }
  Value vEmpty(const RingTiles &t, Value s) { return barrierAt(t, 4, s); }

  /// Ping-pong of the two consumer warpgroups (FlashAttention-3): a warpgroup
  /// issues its GEMMs only in its turn (QueryMajorBarrier::Turn0 + w, both
  /// warpgroups' 256 threads), then hands the turn to the other, so one's
  /// softmax runs under the other's GEMMs. Warpgroup 1 hands warpgroup 0 the
  /// first turn; each warpgroup takes as many turns as the other, and warpgroup
  /// 1 passes none on after its last, so both barriers end balanced. `wg`: the
  /// calling consumer's warpgroup.
  void turnBegin(Value wg) {
    namedBarrier(
        *this, i32Of(*this, add(idx(barrierId(QueryMajorBarrier::Turn0)), wg)),
        threads());
  }
  void turnEnd(Value wg) {
    NVVM::BarrierArriveOp::create(
        b, loc,
        i32Of(*this, arith::SubIOp::create(
                         b, loc, idx(barrierId(QueryMajorBarrier::Turn1)), wg)),
        i32c(int32_t(threads())));
  }
  /// turnEnd for warpgroup `w` only.
  void turnEndIf(Value wg, int64_t w) {
    auto only =
        scf::IfOp::create(b, loc, cmp(arith::CmpIPredicate::eq, wg, idx(w)),
                          /*withElseRegion=*/false);
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(only.thenBlock());
    turnEnd(wg);
  }

  /// Slot and phase parity of pipeline iteration `i`.
  RingSlot slotOf(Value i) { return ringSlot(*this, i, stages); }
  /// The region start (a token) and tile index of iteration `i` of the
  /// kv_loops.
  std::pair<Value, Value> tileOf(const KVLoops &kv, const SegmentCoords &coords,
                                 Value i);

  SmallVector<Value> scores(const RingTiles &tiles, Value kAddr);
  SmallVector<Value> mask(const SegmentCoords &coords, ArrayRef<Value> s,
                          MaskKind kind, Value tile);
  /// Applies the mask of every masked loop whose iterations include `i`.
  SmallVector<Value> maskEdges(const KVLoops &kv, const SegmentCoords &coords,
                               SmallVector<Value> s, Value i);
  /// O and LSE of the consumer's rows inside the segment (through shared
  /// memory).
  void storeOutput(const KernelArgs &args, const SegmentCoords &coords,
                   const RingTiles &tiles, Value wg, ArrayRef<Value> acc,
                   ArrayRef<Value> m, ArrayRef<Value> l);
  /// The consumer's rows of `acc` (C fragments), times `rowScale[h]` if
  /// given, through its warpgroup `wg`'s rows of the Q tile to `out`
  /// (strides `strideT`, `strideH`), rows inside the segment only.
  void storeRows(const SegmentCoords &coords, const RingTiles &tiles, Value wg,
                 ArrayRef<Value> acc, ArrayRef<Value> rowScale, Value out,
                 Value strideT, Value strideH);
  /// The P V (dQ: dS K) product of `p` and the tile at `vAddr` into `acc`.
  void accumulate(MutableArrayRef<Value> acc, ArrayRef<Value> p, Value vAddr);
  /// bwd_dq: the scores (or dP) of this warpgroup's rows of the tile at
  /// `aOffset` (Q or dO) against the key tile at `kAddr` (K or V).
  SmallVector<Value> rowProducts(const RingTiles &tiles, int64_t aOffset,
                                 Value kAddr);

  // ---- the template's tile program ---------------------------------------
  // The pipeline issues the body's products itself (the scores Q Kᵀ, the dQ
  // kernel's dP = dO Vᵀ, the accumulating P V or dS K) and emits the rest of
  // the body, op by op through the tile-op library, as soon as the values an
  // op reads are there: the scores' ops once the scores have landed, the
  // accumulator's (the forward's rescale) once the previous tile's product
  // has retired. Every kv_loop's body must be the first one's but for its
  // masks, which maskAt applies where the body masks the scores.
  /// The kernel's tile program, or a diagnostic on what the pipeline cannot
  /// place.
  FailureOr<TileProgram> collectTileProgram();
  /// A step for one tile of `prog`: `kernelValues`, and `state` bound to the
  /// body's iter_args other than the accumulator, in order (as packed
  /// vectors).
  TileStep beginTile(TileProgram prog, const IRMapping &kernelValues,
                     ArrayRef<SmallVector<Value>> state);
  /// Binds the result of the product `op` (a qk) to the fragment `values`;
  /// the scores pass through this iteration's masks (`masked`) first.
  void bindProduct(TileStep &step, Operation *op, ArrayRef<Value> values);
  /// Emits, once each, the body's library ops whose operands `step` holds.
  LogicalResult emitReady(TileProgram prog, TileStep &step, const TileEnv &env);
  /// Binds the scores `s` of pipeline iteration `i` (walk state `w`), masked,
  /// and emits the library ops that become ready on them.
  LogicalResult emitScores(TileProgram prog, TileStep &step,
                           const Pipeline &pipe, const SegmentCoords &coords,
                           SmallVector<Value> s, Value i,
                           const std::optional<Walk> &w, const TileEnv &env) {
    bindProduct(step, prog.scores, maskAt(pipe, coords, std::move(s), i, w));
    if (!scoreMod)
      return emitReady(prog, step, env);
    // The score modifier's ops read the tile index and the positions of
    // this iteration's tile.
    auto [start, tile] = tileAt(pipe, coords, i, w);
    step.map.map(prog.loop.getTileIndex(), tile);
    TileEnv here = env;
    here.siteOf = [this, coords, start = start, tile = tile](Operation *) {
      return siteAt(coords, start, tile);
    };
    return emitReady(prog, step, here);
  }
  /// The positions of the scores of key tile `tile` of the region starting
  /// at packed token `start` (the segment's own, or its prompt's or an
  /// ancestor range's).
  ScoreSite siteAt(const SegmentCoords &coords, Value start, Value tile) {
    ScoreLayout layout =
        queryMajorLayout(*this, 1, nTiles, coords.qRow0, mul(tile, idx(blockN)),
                         ids.warp, ids.g, ids.t);
    // The key's region: the segment's own, or its prompt or an ancestor's.
    Value own = arith::IndexCastOp::create(
        b, loc, b.getIndexType(),
        arith::ExtUIOp::create(
            b, loc, b.getI32Type(),
            cmp(arith::CmpIPredicate::eq, start, coords.segStart)));
    return scoreMod->queryMajorSite(
        *this, layout, coords.segStart, coords.segLen, start,
        [own] { return own; }, coords.head);
  }
  /// The values `map` gives the body's values `v` (a fragment each).
  SmallVector<Value> lookup(const IRMapping &map, Value v) {
    return unpack(map.lookup(v));
  }
  /// The iter_args that are not the accumulator: the values the body's
  /// yield gives them after one tile.
  SmallVector<SmallVector<Value>> nextState(TileProgram prog,
                                            const TileStep &step);
  /// What the tile-op library reads of the kernel: its scales.
  TileEnv tileEnv(const KernelArgs &args);
  /// The first value of the iter_arg whose first loop's init is `v`
  /// (init_stats, init_acc).
  SmallVector<Value> initialValue(Value v);
  /// `v`, or through chain_loop iter_args the value it starts from.
  static Value origin(Value v);
  KVLoopOp lastKVLoop() {
    KVLoopOp last;
    for (Operation &op : kernel.getBody().front())
      if (auto loop = dyn_cast<KVLoopOp>(op))
        last = loop;
    return last;
  }
  /// What iteration 1 reads of iteration `first` (0), whose tile `step`
  /// went through with the walk state `walk`; the accumulator's first value.
  Carried afterFirstTile(TileProgram prog, const TileStep &step,
                         const Pipeline &pipe, Value first,
                         const std::optional<Walk> &walk);
  /// Iteration `i`'s products, issued after waiting for its slot `slot`
  /// (and the previous one's, `prev`), with the previous tile's product
  /// accumulated into `in.acc` behind them; and the ops on them.
  using IssueTile = function_ref<FailureOr<TileStep>(
      Value i, RingSlot slot, RingSlot prev, Carried &in)>;
  /// A consumer's iterations 1..n-1 (an scf.for from `init`): `issue`, then
  /// the previous product retired and its slot freed, the ops on the
  /// accumulator, and the carried values of the next. Returns the loop's
  /// results.
  FailureOr<Carried> emitMainLoop(TileProgram prog, const Pipeline &pipe,
                                  const RingTiles &tiles, const TileEnv &env,
                                  const Carried &init, IssueTile issue);

  // ---- prefix trees: the walk over the segment's ancestor ranges ---------
  /// Field `f` of row `row` of the chain table `table`: {start, length,
  /// next, ranges}.
  Value chainField(Value table, Value row, int64_t f) {
    return toIndex(memref::LoadOp::create(
        b, loc, table, ValueRange{add(mul(row, idx(4)), idx(f))}));
  }
  /// The state at the walk's first tile (the tree's first non-empty range).
  Walk walkBegin(const Chain &chain);
  /// The state after `w`'s tile: the next tile of the range, else the first
  /// of the next non-empty range.
  Walk walkStep(const Chain &chain, Walk w, bool advance);
  /// The tiles of every ancestor range of segment row `segRow`.
  Value countChainTiles(const Chain &chain);
  /// The first tile of an ancestor range of `len` keys `shift` positions
  /// before the segment that a sliding window reaches (0 without a window;
  /// the range's tile count when it reaches none).
  Value rangeFirstTile(const Chain &chain, Value shift, Value len);
  /// The region start and tile of pipeline iteration `i`, whose walk state
  /// is `w` (tree kernels).
  std::pair<Value, Value> tileAt(const Pipeline &pipe,
                                 const SegmentCoords &coords, Value i,
                                 const std::optional<Walk> &w);
  /// The masks of iteration `i` on its scores `s`.
  SmallVector<Value> maskAt(const Pipeline &pipe, const SegmentCoords &coords,
                            SmallVector<Value> s, Value i,
                            const std::optional<Walk> &w);
  /// The walk state of iteration i + 1 (none without a tree).
  std::optional<Walk> walkAfter(const Pipeline &pipe, Value i,
                                const std::optional<Walk> &w);
};

KernelArgs WarpSpecializedQueryMajor::readArgs() {
  KernelArgs args;
  args.lse = fn.param("lse"), args.segs = fn.param("segs");
  args.lseStrideH = fn.indexParam("lseStrideH");
  if (hasSinks())
    args.sinks = fn.param("sinks");
  if (isDq) {
    // dq takes the output's place.
    args.out = fn.param("dq"), args.outStrideT = fn.indexParam("dqStrideT"),
    args.outStrideH = fn.indexParam("dqStrideH");
    args.delta = fn.param("delta"),
    args.deltaStrideH = fn.indexParam("deltaStrideH");
    args.scale = fn.param("scale");
    args.doMap = fn.param("doMap");
  } else {
    args.out = fn.param("o"), args.outStrideT = fn.indexParam("oStrideT"),
    args.outStrideH = fn.indexParam("oStrideH");
  }
  args.scaleLog2 = fn.param("scaleLog2");
  args.qMap = fn.param("qMap"), args.kMap = fn.param("kMap"),
  args.vMap = fn.param("vMap");
  args.order = fn.param("order");
  if (isTree)
    args.chain = fn.param("chain");
  return args;
}

SegmentCoords WarpSpecializedQueryMajor::locate(const KernelArgs &args) {
  // Block x takes work item x of the plan's forward order ({segment, query
  // tile}, heaviest first), block z is the head.
  Value item = gpu::BlockIdOp::create(b, loc, gpu::Dimension::x);
  auto workField = [&](int64_t f) {
    return toIndex(memref::LoadOp::create(
        b, loc, args.order, ValueRange{add(mul(item, idx(2)), idx(f))}));
  };
  SegmentCoords coords;
  Value seg = workField(0);
  coords.segRow = seg;
  coords.qRow0 = mul(workField(1), idx(blockM));
  coords.head = gpu::BlockIdOp::create(b, loc, gpu::Dimension::z);
  if (columnBlocks > 1) {
    // z = head * blocks + the block of output columns.
    Value z = coords.head;
    coords.head = divu(z, columnBlocks);
    coords.column0 = mul(remu(z, columnBlocks), idx(outDim));
  }
  coords.kvHead = divu(coords.head, groupSize);
  SegmentFields fields = segmentFields(*this, args.segs, seg);
  coords.segStart = fields.start, coords.segLen = fields.length,
  coords.sharedStart = fields.sharedStart, coords.sharedLen = fields.sharedLen;
  return coords;
}

RingTiles WarpSpecializedQueryMajor::placeRing() {
  auto workgroup =
      gpu::AddressSpaceAttr::get(b.getContext(), gpu::AddressSpace::Workgroup);
  auto bytes = MemRefType::get({ShapedType::kDynamic}, b.getI8Type(),
                               MemRefLayoutAttrInterface(), workgroup);
  Value smem = gpu::DynamicSharedMemoryOp::create(b, loc, bytes);
  RingTiles tiles;
  tiles.base = smemTiles.alignToSwizzle(smem, sharedBytes());
  tiles.qTile = smemTiles.swizzledTile(smem, 0, blockM);
  return tiles;
}

FailureOr<KVLoops>
WarpSpecializedQueryMajor::collectLoops(const SegmentCoords &coords) {
  KVLoops kv;
  Value offset = idx(0);
  for (Operation &op : kernel.getBody().front()) {
    auto loop = dyn_cast<KVLoopOp>(op);
    if (!loop)
      continue;
    Loop l;
    l.region = loop.getRegion();
    loop.getBody().walk([&](MaskOp m) { l.mask = m.getKind(); });
    auto bounds =
        kvLoopTiles(*this, loop.getPart(), l.region, coords.qRow0,
                    coords.segLen, coords.sharedLen, blockM, blockN, window);
    if (!bounds)
      return loop.emitOpError()
             << "is not tiled: run dualkv-tile-regions first";
    l.lb = bounds->lb, l.ub = bounds->ub;
    l.count = arith::SubIOp::create(b, loc, l.ub, l.lb);
    l.offset = offset;
    offset = add(offset, l.count);
    kv.loops.push_back(l);
  }
  if (kv.loops.empty())
    return kernel.emitOpError() << "has no kv_loop to schedule";
  kv.numIters = offset;
  return kv;
}

Pipeline WarpSpecializedQueryMajor::pipeline(KVLoops kv, const KernelArgs &args,
                                             const SegmentCoords &coords) {
  Pipeline pipe;
  pipe.numIters = kv.numIters;
  if (isTree) {
    // The ancestor ranges' tiles come first.
    Chain chain{args.chain, coords.segRow, Value(), coords.qRow0};
    chain.tiles = countChainTiles(chain);
    pipe.numIters = add(chain.tiles, kv.numIters);
    pipe.chain = chain;
  }
  pipe.kv = std::move(kv);
  return pipe;
}

std::pair<Value, Value>
WarpSpecializedQueryMajor::tileOf(const KVLoops &kv,
                                  const SegmentCoords &coords, Value i) {
  Value start, tile;
  for (const Loop &l : kv.loops) {
    Value s =
        l.region == KVRegion::shared ? coords.sharedStart : coords.segStart;
    Value j = add(l.lb, arith::SubIOp::create(b, loc, i, l.offset));
    if (!start) {
      start = s, tile = j;
      continue;
    }
    // Later loops start at or after earlier ones: the last that has begun owns
    // iteration i.
    Value begun = cmp(arith::CmpIPredicate::uge, i, l.offset);
    start = select(begun, s, start);
    tile = select(begun, j, tile);
  }
  return {start, tile};
}

Value WarpSpecializedQueryMajor::rangeFirstTile(const Chain &chain, Value shift,
                                                Value len) {
  if (!window)
    return idx(0);
  // kvLoopTiles' rule for a shared region of `len` keys `shift` positions
  // before the segment: the first of its tiles the window reaches (`tiles`
  // when none).
  return kvLoopTiles(*this, LoopPart::masked, KVRegion::shared, chain.qRow0,
                     /*segLen: the shared region's bounds do not read it*/ len,
                     len, blockM, blockN, window, shift)
      ->lb;
}

Walk WarpSpecializedQueryMajor::walkBegin(const Chain &chain) {
  Walk w;
  Value count = chainField(chain.table, chain.segRow, 3);
  w.row = chain.segRow;
  w.start = chainField(chain.table, chain.segRow, 0);
  w.len = chainField(chain.table, chain.segRow, 1);
  w.tiles = ceilDiv(w.len, blockN);
  if (window)
    w.shift = w.len;
  w.tile = rangeFirstTile(chain, w.shift, w.len);
  // A root segment's row has no range (count 0): no tiles, nothing left.
  w.left = select(cmp(arith::CmpIPredicate::ugt, count, idx(0)),
                  arith::SubIOp::create(b, loc, count, idx(1)), idx(0));
  // Skip empty ranges, as walkStep does.
  return walkStep(chain, w, /*advance=*/false);
}

Walk WarpSpecializedQueryMajor::walkStep(const Chain &chain, Walk w,
                                         bool advance) {
  if (advance)
    w.tile = add(w.tile, idx(1));
  // While the range is done and another follows: the next row's range.
  SmallVector<Type> types(w.values().size(), b.getIndexType());
  auto loop = scf::WhileOp::create(
      b, loc, types, w.values(),
      [&](OpBuilder &, Location, ValueRange args) {
        Walk a = Walk::from(args);
        Value more = arith::AndIOp::create(
            b, loc, cmp(arith::CmpIPredicate::uge, a.tile, a.tiles),
            cmp(arith::CmpIPredicate::ugt, a.left, idx(0)));
        scf::ConditionOp::create(b, loc, more, args);
      },
      [&](OpBuilder &, Location, ValueRange args) {
        Walk a = Walk::from(args), n;
        n.row = chainField(chain.table, a.row, 2);
        n.start = chainField(chain.table, n.row, 0);
        n.len = chainField(chain.table, n.row, 1);
        n.tiles = ceilDiv(n.len, blockN);
        if (window)
          n.shift = add(a.shift, n.len);
        n.tile = rangeFirstTile(chain, n.shift, n.len);
        n.left = arith::SubIOp::create(b, loc, a.left, idx(1));
        scf::YieldOp::create(b, loc, n.values());
      });
  return Walk::from(loop.getResults());
}

Value WarpSpecializedQueryMajor::countChainTiles(const Chain &chain) {
  Value count = chainField(chain.table, chain.segRow, 3);
  SmallVector<Value> inits = {chain.segRow, idx(0)};
  if (window)
    inits.push_back(idx(0));
  auto loop = scf::ForOp::create(b, loc, idx(0), count, idx(1), inits);
  {
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(loop.getBody());
    auto args = loop.getRegionIterArgs();
    Value row = args[0];
    Value len = chainField(chain.table, row, 1);
    Value tiles = ceilDiv(len, blockN);
    SmallVector<Value> yielded = {chainField(chain.table, row, 2)};
    if (window) {
      // Only the tiles from the range's first the window reaches.
      Value shift = add(args[2], len);
      Value first = rangeFirstTile(chain, shift, len);
      yielded.push_back(
          add(args[1], arith::SubIOp::create(b, loc, tiles, first)));
      yielded.push_back(shift);
    } else {
      yielded.push_back(add(args[1], tiles));
    }
    scf::YieldOp::create(b, loc, yielded);
  }
  return loop.getResult(1);
}

std::pair<Value, Value>
WarpSpecializedQueryMajor::tileAt(const Pipeline &pipe,
                                  const SegmentCoords &coords, Value i,
                                  const std::optional<Walk> &w) {
  if (!isTree)
    return tileOf(pipe.kv, coords, i);
  Value chainTiles = pipe.chain->tiles;
  Value inChain = cmp(arith::CmpIPredicate::ult, i, chainTiles);
  Value own =
      select(inChain, idx(0), arith::SubIOp::create(b, loc, i, chainTiles));
  auto [start, tile] = tileOf(pipe.kv, coords, own);
  return {select(inChain, w->start, start), select(inChain, w->tile, tile)};
}

SmallVector<Value> WarpSpecializedQueryMajor::maskAt(
    const Pipeline &pipe, const SegmentCoords &coords, SmallVector<Value> s,
    Value i, const std::optional<Walk> &w) {
  if (!isTree)
    return maskEdges(pipe.kv, coords, std::move(s), i);
  Value chainTiles = pipe.chain->tiles;
  Value inChain = cmp(arith::CmpIPredicate::ult, i, chainTiles);
  Value vec = pack(s);
  auto branch = scf::IfOp::create(b, loc, TypeRange{vec.getType()}, inChain,
                                  /*withElseRegion=*/true);
  {
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(branch.thenBlock());
    // The tile's keys past the range's end and, with a sliding window,
    // outside the window.
    auto rangeMasked = [&] {
      SmallVector<Value> masked(s);
      tile::mask(*this, masked, MaskKind::bound,
                 queryMajorLayout(*this, 1, nTiles, coords.qRow0,
                                  mul(w->tile, idx(blockN)), ids.warp, ids.g,
                                  ids.t),
                 w->len, window, w->shift);
      return pack(masked);
    };
    // With a sliding window every tile of a range is masked (its window edge
    // and its tail); without, a range's last tile, if partial.
    Value rangeScores;
    if (window) {
      rangeScores = rangeMasked();
    } else {
      Value last =
          cmp(arith::CmpIPredicate::eq, add(w->tile, idx(1)), w->tiles);
      Value partial =
          cmp(arith::CmpIPredicate::ne, remu(w->len, blockN), idx(0));
      auto tail =
          scf::IfOp::create(b, loc, TypeRange{vec.getType()},
                            arith::AndIOp::create(b, loc, last, partial),
                            /*withElseRegion=*/true);
      OpBuilder::InsertionGuard inner(b);
      b.setInsertionPointToStart(tail.thenBlock());
      scf::YieldOp::create(b, loc, rangeMasked());
      b.setInsertionPointToStart(tail.elseBlock());
      scf::YieldOp::create(b, loc, vec);
      rangeScores = tail.getResult(0);
    }
    scf::YieldOp::create(b, loc, rangeScores);
    b.setInsertionPointToStart(branch.elseBlock());
    Value own = arith::SubIOp::create(b, loc, i, chainTiles);
    scf::YieldOp::create(b, loc, pack(maskEdges(pipe.kv, coords, s, own)));
  }
  return unpack(branch.getResult(0));
}

std::optional<Walk>
WarpSpecializedQueryMajor::walkAfter(const Pipeline &pipe, Value i,
                                     const std::optional<Walk> &w) {
  if (!isTree)
    return std::nullopt;
  Value inChain = cmp(arith::CmpIPredicate::ult, i, pipe.chain->tiles);
  SmallVector<Type> types(w->values().size(), b.getIndexType());
  auto branch = scf::IfOp::create(b, loc, types, inChain,
                                  /*withElseRegion=*/true);
  {
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(branch.thenBlock());
    scf::YieldOp::create(b, loc,
                         walkStep(*pipe.chain, *w, /*advance=*/true).values());
    b.setInsertionPointToStart(branch.elseBlock());
    scf::YieldOp::create(b, loc, w->values());
  }
  return Walk::from(branch.getResults());
}

void WarpSpecializedQueryMajor::emitProducer(const KernelArgs &args,
                                             const SegmentCoords &coords,
                                             const RingTiles &tiles,
                                             const Pipeline &pipe) {
  NVVM::SetMaxRegisterOp::create(b, loc, kProducerRegs,
                                 NVVM::SetMaxRegisterAction::decrease);
  // One thread issues every load.
  Value leader = cmp(arith::CmpIPredicate::eq, ids.tid, idx(threads()));
  auto one = scf::IfOp::create(b, loc, leader, /*withElseRegion=*/false);
  OpBuilder::InsertionGuard guard(b);
  b.setInsertionPointToStart(one.thenBlock());
  Value qBar = barrier(tiles, 0);
  // Q (and dO) fill the bytes before the K ring.
  NVVM::MBarrierArriveExpectTxOp::create(
      b, loc, Type(), qBar, i32c(int32_t(ring.kRing)), NVVM::MemScopeKind::CTA,
      false, Value());
  tmaLoadTile(*this, args.qMap, tiles.base, blockM, tileDim,
              add(coords.segStart, coords.qRow0), coords.head, qBar);
  if (isDq)
    tmaLoadTile(*this, args.doMap, add(tiles.base, idx(ring.dO)), blockM,
                tileDim, add(coords.segStart, coords.qRow0), coords.head, qBar);

  SmallVector<Value> walkInit;
  if (isTree)
    walkInit = walkBegin(*pipe.chain).values();
  auto loop =
      scf::ForOp::create(b, loc, idx(0), pipe.numIters, idx(1), walkInit);
  b.setInsertionPointToStart(loop.getBody());
  Value i = loop.getInductionVar();
  std::optional<Walk> w;
  if (isTree)
    w = Walk::from(loop.getRegionIterArgs());
  auto [slot, parity] = slotOf(i);
  // A fresh barrier completes phase "1" at once: the first pass over the ring
  // does not wait.
  Value free = arith::XOrIOp::create(b, loc, parity, idx(1));
  auto [start, tile] = tileAt(pipe, coords, i, w);
  Value row = add(start, mul(tile, idx(blockN)));
  Value slotBytes = mul(slot, idx(ring.slotBytes));
  Value vSlotBytes = ring.vSlotBytes == ring.slotBytes
                         ? slotBytes
                         : mul(slot, idx(ring.vSlotBytes));
  waitParity(*this, kEmpty(tiles, slot), free);
  NVVM::MBarrierArriveExpectTxOp::create(
      b, loc, Type(), kFull(tiles, slot), i32c(int32_t(ring.slotBytes)),
      NVVM::MemScopeKind::CTA, false, Value());
  tmaLoadTile(*this, args.kMap,
              add(tiles.base, add(idx(ring.kRing), slotBytes)), blockN, tileDim,
              row, coords.kvHead, kFull(tiles, slot));
  waitParity(*this, vEmpty(tiles, slot), free);
  NVVM::MBarrierArriveExpectTxOp::create(
      b, loc, Type(), vFull(tiles, slot), i32c(int32_t(ring.vSlotBytes)),
      NVVM::MemScopeKind::CTA, false, Value());
  tmaLoadTile(*this, args.vMap,
              add(tiles.base, add(idx(ring.vRing), vSlotBytes)), blockN,
              vTileDim, row, coords.kvHead, vFull(tiles, slot), coords.column0);
  if (isTree)
    scf::YieldOp::create(b, loc, walkAfter(pipe, i, w)->values());
}

SmallVector<Value> WarpSpecializedQueryMajor::scores(const RingTiles &tiles,
                                                     Value kAddr) {
  // Warpgroup w owns query rows 64w..64w+63; both operands K-major. The Q
  // address is made opaque per use so LLVM rebuilds its descriptors instead
  // of keeping all of them live across the loop.
  Value qAddr =
      add(opaque(*this, tiles.base), mul(divu(ids.warp, 4), idx(64 * 128)));
  Value aDesc = mma.desc(qAddr, 16, 1024);
  Value bDesc = mma.desc(kAddr, 16, 1024);
  return mma.overHeadDim({}, blockN, aDesc, blockM, bDesc, blockN);
}

void WarpSpecializedQueryMajor::accumulate(MutableArrayRef<Value> acc,
                                           ArrayRef<Value> p, Value vAddr) {
  // Its own fence: the P V group is issued behind the scores' group, and
  // ptxas serialises a group whose inputs (descriptors, P) were defined after
  // the last fence.
  Value desc = mma.desc(vAddr, blockN * 128, 1024);
  mma.fence();
  SmallVector<Value> out = mma.regsA(SmallVector<Value>(acc), p, desc);
  std::copy(out.begin(), out.end(), acc.begin());
}

SmallVector<Value> WarpSpecializedQueryMajor::mask(const SegmentCoords &coords,
                                                   ArrayRef<Value> sIn,
                                                   MaskKind kind, Value tile) {
  SmallVector<Value> s(sIn);
  tile::mask(*this, s, kind,
             queryMajorLayout(*this, 1, nTiles, coords.qRow0,
                              mul(tile, idx(blockN)), ids.warp, ids.g, ids.t),
             coords.sharedLen, window);
  return s;
}

SmallVector<Value>
WarpSpecializedQueryMajor::maskEdges(const KVLoops &kv,
                                     const SegmentCoords &coords,
                                     SmallVector<Value> s, Value i) {
  for (const Loop &l : kv.loops) {
    if (!l.mask)
      continue;
    Value in = arith::AndIOp::create(
        b, loc, cmp(arith::CmpIPredicate::uge, i, l.offset),
        cmp(arith::CmpIPredicate::ult, i, add(l.offset, l.count)));
    Value vec = pack(s);
    auto edge = scf::IfOp::create(b, loc, TypeRange{vec.getType()}, in,
                                  /*withElseRegion=*/true);
    {
      OpBuilder::InsertionGuard guard(b);
      b.setInsertionPointToStart(edge.thenBlock());
      Value j = add(l.lb, arith::SubIOp::create(b, loc, i, l.offset));
      scf::YieldOp::create(b, loc, pack(mask(coords, s, *l.mask, j)));
      b.setInsertionPointToStart(edge.elseBlock());
      scf::YieldOp::create(b, loc, vec);
    }
    s = unpack(edge.getResult(0));
  }
  return s;
}

FailureOr<TileProgram> WarpSpecializedQueryMajor::collectTileProgram() {
  TileProgram prog;
  // A loop's ops, masks aside: what every loop of the pipeline must share.
  auto signature = [](KVLoopOp loop) {
    SmallVector<std::pair<StringRef, DictionaryAttr>> ops;
    for (Operation &op : loop.getBody().front())
      if (!isa<MaskOp>(op))
        ops.push_back({op.getName().getStringRef(), op.getAttrDictionary()});
    return ops;
  };
  auto readsQ = [](Value v) {
    return isa_and_nonnull<LoadQOp>(v.getDefiningOp());
  };
  // Every kv_loop, a tree's chain_loop's included, in pipeline order.
  SmallVector<KVLoopOp> all;
  kernel.getBody().walk<WalkOrder::PreOrder>(
      [&](KVLoopOp loop) { all.push_back(loop); });
  for (KVLoopOp loop : all) {
    if (!prog.loop)
      prog.loop = loop;
    else if (signature(loop) != signature(prog.loop))
      return loop.emitOpError()
             << "differs from the first kv_loop in more than its masks: the "
                "warp-specialized schedule runs every loop's tiles through "
                "one pipeline";
    WalkResult masks = loop.getBody().walk([&](MaskOp mask) {
      auto qk = mask.getScores().getDefiningOp<QKOp>();
      if (qk && readsQ(qk.getQ()))
        return WalkResult::advance();
      mask.emitOpError() << "masks values other than the scores Q Kᵀ, which "
                            "is where the warp-specialized pipeline masks";
      return WalkResult::interrupt();
    });
    if (masks.wasInterrupted())
      return failure();
  }
  if (!prog.loop)
    return kernel.emitOpError() << "has no kv_loop to schedule";
  Block &body = prog.loop.getBody().front();
  for (Operation &op : body.without_terminator()) {
    if (auto qk = dyn_cast<QKOp>(op)) {
      bool fromQ = readsQ(qk.getQ());
      bool fromDout = isa_and_nonnull<LoadDoutOp>(qk.getQ().getDefiningOp());
      QKOp &slot = fromQ ? prog.scores : prog.dp;
      if ((!fromQ && !fromDout) || slot)
        return qk.emitOpError() << "is not a product the warp-specialized "
                                   "pipeline issues (one Q Kᵀ, and dO Vᵀ in "
                                   "the dQ kernel)";
      slot = qk;
    } else if (auto pv = dyn_cast<PVOp>(op)) {
      if (prog.product)
        return pv.emitOpError() << "is a second accumulating product; the "
                                   "warp-specialized pipeline issues one";
      prog.product = pv;
    } else if (!isa<LoadKVOp, MaskOp>(op) && !isTileOp(&op)) {
      return op.emitOpError()
             << "has no place in the warp-specialized pipeline (neither a "
                "load, a product nor an op of the tile-op library)";
    }
  }
  if (!prog.scores || !prog.product || (isDq != bool(prog.dp)))
    return prog.loop.emitOpError()
           << "does not compute what the warp-specialized "
           << (isDq ? "dQ kernel" : "forward") << " pipelines: Q Kᵀ, "
           << (isDq ? "dO Vᵀ, " : "") << "and one accumulating product";
  Operation *yield = body.getTerminator();
  auto acc = llvm::find(yield->getOperands(), prog.product.getResult());
  if (acc == yield->operand_end())
    return prog.loop.emitOpError()
           << "does not carry its product's accumulator to the next tile";
  prog.accArg = acc - yield->operand_begin();
  for (auto [j, init] : llvm::enumerate(prog.loop.getInits())) {
    Operation *def = origin(init).getDefiningOp();
    if (j == prog.accArg ? !isa_and_nonnull<InitAccOp>(def)
                         : !isa_and_nonnull<InitStatsOp>(def))
      return prog.loop.emitOpError()
             << "starts iter_arg " << j << " from a value the warp-specialized "
             << "pipeline does not build (init_acc for the accumulator, "
                "init_stats for the rest)";
  }
  return prog;
}

TileStep
WarpSpecializedQueryMajor::beginTile(TileProgram prog,
                                     const IRMapping &kernelValues,
                                     ArrayRef<SmallVector<Value>> state) {
  TileStep step{kernelValues, {}};
  Block &body = prog.loop.getBody().front();
  size_t next = 0;
  for (unsigned j = 0, e = body.getNumArguments() - 1; j < e; ++j)
    if (j != prog.accArg)
      step.map.map(body.getArgument(1 + j), pack(state[next++]));
  return step;
}

void WarpSpecializedQueryMajor::bindProduct(TileStep &step, Operation *op,
                                            ArrayRef<Value> values) {
  step.map.map(op->getResult(0), pack(values));
}

LogicalResult WarpSpecializedQueryMajor::emitReady(TileProgram prog,
                                                   TileStep &step,
                                                   const TileEnv &env) {
  IRMapping &map = step.map;
  for (Operation &op : prog.loop.getBody().front().without_terminator()) {
    if (step.done.contains(&op))
      continue;
    // The skeleton bound the scores masked (maskAt): a mask passes them on.
    if (auto mask = dyn_cast<MaskOp>(op)) {
      if (!map.contains(mask.getScores()))
        continue;
      map.map(mask.getResult(), map.lookup(mask.getScores()));
    } else {
      if (!isTileOp(&op) || !llvm::all_of(op.getOperands(), [&](Value v) {
            return map.contains(v);
          }))
        continue;
      if (failed(emitTileOp(&op, *this, env, map)))
        return failure();
    }
    step.done.insert(&op);
  }
  return success();
}

SmallVector<SmallVector<Value>>
WarpSpecializedQueryMajor::nextState(TileProgram prog, const TileStep &step) {
  SmallVector<SmallVector<Value>> state;
  Operation *yield = prog.loop.getBody().front().getTerminator();
  for (auto [j, v] : llvm::enumerate(yield->getOperands()))
    if (j != prog.accArg)
      state.push_back(lookup(step.map, v));
  return state;
}

TileEnv WarpSpecializedQueryMajor::tileEnv(const KernelArgs &args) {
  TileEnv env;
  env.stat = queryMajorStats(nTiles);
  env.scaleLog2 = args.scaleLog2, env.scale = args.scale;
  env.mTiles = 1, env.nTiles = nTiles, env.dTiles = dTiles;
  env.packOperand = [this](ArrayRef<Value> p) {
    return pack(frags.packAFragments(p, 1, nTiles));
  };
  return env;
}

Value WarpSpecializedQueryMajor::origin(Value v) {
  // Through a chain_loop's iter_args to the values it starts from.
  while (auto arg = dyn_cast<BlockArgument>(v)) {
    auto chain = dyn_cast<ChainLoopOp>(arg.getOwner()->getParentOp());
    if (!chain)
      break;
    v = chain.getInits()[llvm::find(chain.getRegionIterArgs(), arg) -
                         chain.getRegionIterArgs().begin()];
  }
  return v;
}

SmallVector<Value> WarpSpecializedQueryMajor::initialValue(Value init) {
  Value v = origin(init);
  if (auto stats = v.getDefiningOp<InitStatsOp>())
    return unpack(splat(
        *this, 2,
        v == stats.getMax() ? -std::numeric_limits<float>::infinity() : 0.0f));
  return unpack(splat(*this, dTiles * 4, 0.0f));
}

Carried WarpSpecializedQueryMajor::afterFirstTile(
    TileProgram prog, const TileStep &step, const Pipeline &pipe, Value first,
    const std::optional<Walk> &walk) {
  Carried c;
  c.operand = lookup(step.map, prog.product.getProbs());
  c.state = nextState(prog, step);
  // Iteration 0's product accumulates into init_acc's zeros.
  c.acc = initialValue(prog.loop.getInits()[prog.accArg]);
  c.walk = walkAfter(pipe, first, walk);
  return c;
}

FailureOr<Carried> WarpSpecializedQueryMajor::emitMainLoop(
    TileProgram prog, const Pipeline &pipe, const RingTiles &tiles,
    const TileEnv &env, const Carried &init, IssueTile issue) {
  auto loop =
      scf::ForOp::create(b, loc, idx(1), pipe.numIters, idx(1), init.flat());
  {
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(loop.getBody());
    Value i = loop.getInductionVar();
    Carried in = Carried::like(init, loop.getRegionIterArgs());
    RingSlot slot = slotOf(i);
    RingSlot prev = slotOf(arith::SubIOp::create(b, loc, i, idx(1)));
    FailureOr<TileStep> step = issue(i, slot, prev, in);
    if (failed(step))
      return failure();
    SmallVector<Value> operandNext = lookup(step->map, prog.product.getProbs());
    // The operand passes through the wait too: the previous product reads
    // its registers until it retires, and LLVM would otherwise give them to
    // the next tile's. The product frees the slot of its B operand: V (the
    // forward's P V), K (the dQ kernel's dS K).
    mma.waitKeeping(0, in.acc, in.operand);
    arrive(*this, isDq ? kEmpty(tiles, prev.slot) : vEmpty(tiles, prev.slot));
    step->map.map(prog.loop.getBody().front().getArgument(1 + prog.accArg),
                  pack(in.acc));
    if (failed(emitReady(prog, *step, env)))
      return failure();
    Carried out;
    out.acc = lookup(step->map, prog.product.getAcc());
    out.state = nextState(prog, *step);
    out.operand = operandNext;
    out.walk = walkAfter(pipe, i, in.walk);
    scf::YieldOp::create(b, loc, out.flat());
  }
  return Carried::like(init, loop.getResults());
}

LogicalResult WarpSpecializedQueryMajor::emitConsumer(
    const KernelArgs &args, const SegmentCoords &coords, const RingTiles &tiles,
    const Pipeline &pipe, TileProgram prog) {
  NVVM::SetMaxRegisterOp::create(b, loc, kConsumerRegs,
                                 NVVM::SetMaxRegisterAction::increase);
  waitParity(*this, barrier(tiles, 0), idx(0));
  TileEnv env = tileEnv(args);
  // The forward's tiles read no kernel values.
  IRMapping kernelValues;

  // The iter_args' first values: the first loop's inits.
  SmallVector<SmallVector<Value>> state;
  for (auto [j, init] : llvm::enumerate(prog.loop.getInits()))
    if (j != prog.accArg)
      state.push_back(initialValue(init));
  Value wg = divu(ids.warp, 4);
  // Iteration 0: its scores and the ops on them. Its product accumulates
  // into init_acc's zeros, so the ops on the accumulator (the rescale) have
  // nothing to do.
  turnEndIf(wg, 1);
  Value first = idx(0);
  waitParity(*this, kFull(tiles, first), idx(0));
  turnBegin(wg);
  mma.fence();
  SmallVector<Value> s = scores(tiles, kAddrOf(tiles, first));
  mma.commit();
  turnEnd(wg);
  mma.wait(0, s);
  arrive(*this, kEmpty(tiles, first));
  std::optional<Walk> walk;
  if (isTree)
    walk = walkBegin(*pipe.chain);
  TileStep step = beginTile(prog, kernelValues, state);
  if (failed(emitScores(prog, step, pipe, coords, s, first, walk, env)))
    return failure();
  Carried carried = afterFirstTile(prog, step, pipe, first, walk);

  // Iterations 1..n-1: scores of i, then the product (P V) of i - 1 behind
  // them.
  FailureOr<Carried> last = emitMainLoop(
      prog, pipe, tiles, env, carried,
      [&](Value i, RingSlot slot, RingSlot prev,
          Carried &in) -> FailureOr<TileStep> {
        waitParity(*this, kFull(tiles, slot.slot), slot.parity);
        waitParity(*this, vFull(tiles, prev.slot), prev.parity);
        turnBegin(wg);
        mma.fence();
        SmallVector<Value> s = scores(tiles, kAddrOf(tiles, slot.slot));
        mma.commit();
        accumulate(in.acc, in.operand, vAddrOf(tiles, prev.slot));
        mma.commit();
        turnEnd(wg);
        mma.wait(1, s);
        arrive(*this, kEmpty(tiles, slot.slot));
        TileStep step = beginTile(prog, kernelValues, in.state);
        if (failed(emitScores(prog, step, pipe, coords, s, i, in.walk, env)))
          return failure();
        return step;
      });
  if (failed(last))
    return failure();
  SmallVector<Value> acc = last->acc, p = last->operand;

  // The last tile's product.
  auto [lastSlot, lastParity] =
      slotOf(arith::SubIOp::create(b, loc, pipe.numIters, idx(1)));
  waitParity(*this, vFull(tiles, lastSlot), lastParity);
  turnBegin(wg);
  accumulate(acc, p, vAddrOf(tiles, lastSlot));
  mma.commit();
  turnEndIf(wg, 0);
  mma.wait(0, acc);
  arrive(*this, vEmpty(tiles, lastSlot));
  // The epilogue reads the last loop's results.
  IRMapping results = kernelValues;
  KVLoopOp lastLoop = lastKVLoop();
  size_t next = 0;
  for (auto [j, r] : llvm::enumerate(lastLoop.getResults()))
    results.map(r, pack(j == prog.accArg ? acc : last->state[next++]));
  kernel.getBody().walk([&](StoreOutputOp store) {
    storeOutput(args, coords, tiles, wg, lookup(results, store.getAcc()),
                lookup(results, store.getMax()),
                lookup(results, store.getSum()));
  });
  return success();
}

void WarpSpecializedQueryMajor::storeOutput(
    const KernelArgs &args, const SegmentCoords &coords, const RingTiles &tiles,
    Value wg, ArrayRef<Value> acc, ArrayRef<Value> m, ArrayRef<Value> l) {
  SmallVector<Value> inv;
  // With attention sinks, the head's sink logit in the log2 domain.
  Value sinkLog2;
  if (args.sinks)
    sinkLog2 = tile::sinkLog2(*this, args.sinks, coords.head);
  for (int64_t h = 0; h < 2; ++h) {
    Value sum = tile::rowSum(*this, l[h]);
    if (sinkLog2)
      sum = tile::addSink(*this, sum, m[h], sinkLog2);
    inv.push_back(arith::DivFOp::create(b, loc, f32c(1.0f), sum));
    Value row =
        add(coords.qRow0, add(mul(ids.warp, idx(16)), add(idx(h * 8), ids.g)));
    Value lead = arith::AndIOp::create(
        b, loc, cmp(arith::CmpIPredicate::eq, ids.t, idx(0)),
        cmp(arith::CmpIPredicate::ult, row, coords.segLen));
    // One CTA of a query tile's column blocks stores its LSE (each computes
    // the same).
    if (coords.column0)
      lead = arith::AndIOp::create(
          b, loc, lead, cmp(arith::CmpIPredicate::eq, coords.column0, idx(0)));
    auto lseIf = scf::IfOp::create(b, loc, lead, /*withElseRegion=*/false);
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(lseIf.thenBlock());
    Value lse = tile::logSumExp(*this, m[h], sum);
    memref::StoreOp::create(b, loc, lse, args.lse,
                            ValueRange{add(mul(coords.head, args.lseStrideH),
                                           add(coords.segStart, row))});
  }
  storeRows(coords, tiles, wg, acc, inv, args.out, args.outStrideT,
            args.outStrideH);
}

void WarpSpecializedQueryMajor::storeRows(const SegmentCoords &coords,
                                          const RingTiles &tiles, Value wg,
                                          ArrayRef<Value> acc,
                                          ArrayRef<Value> rowScale, Value out,
                                          Value strideT, Value strideH) {
  // The rows go through this warpgroup's 64 rows of the Q tile (its last
  // scores are done, so Q is free), in the same swizzle, then out as 16-byte
  // row chunks: every warp of the group writes whole rows, coalesced. Only
  // outDim's columns (a tile of 128 at head_dim 96 holds 32 zero ones; O of
  // MLA's 192/128 fills 128 of Q's 192).
  proxyFence(*this);
  for (int64_t h = 0; h < 2; ++h) {
    Value r =
        add(mul(ids.warp, idx(16)), add(idx(h * 8), ids.g)); // row in the tile
    for (int64_t dt = 0; dt < outDim / 8; ++dt) {
      Value lo = acc[dt * 4 + h * 2], hi = acc[dt * 4 + h * 2 + 1];
      if (!rowScale.empty()) {
        lo = arith::MulFOp::create(b, loc, lo, rowScale[h]);
        hi = arith::MulFOp::create(b, loc, hi, rowScale[h]);
      }
      Value narrow = arith::TruncFOp::create(
          b, loc, VectorType::get({2}, elemType), pack({lo, hi}));
      SmallVector<Value, 2> at =
          smemTiles.swizzledIndex(r, idx(dt * 8), blockM);
      vector::StoreOp::create(
          b, loc, narrow, tiles.qTile,
          ValueRange{at[0], add(at[1], mul(ids.t, idx(2)))});
    }
  }
  // The warpgroup's 128 threads see each other's rows.
  namedBarrier(
      *this,
      i32Of(*this, add(idx(barrierId(QueryMajorBarrier::Epilogue0)), wg)),
      kWarpgroupThreads);
  // A row's 16-byte chunks in power-of-two column parts (copyParts: one
  // part but at head_dim 96, whose 12 are 8 + 4), each part's chunks dealt
  // to the threads as one column of rows apiece.
  Value lt = remu(ids.tid, kWarpgroupThreads);
  auto vec8 = VectorType::get({8}, elemType);
  for (auto [chunk0, chunks] : ::dualkv::copyParts(outDim / 8)) {
    int64_t rowsPerPass = kWarpgroupThreads / chunks;
    Value c = mul(remu(lt, chunks), idx(8));
    if (chunk0)
      c = add(c, idx(chunk0 * 8));
    for (int64_t pass = 0; pass * rowsPerPass < 64; ++pass) {
      Value r =
          add(mul(wg, idx(64)), add(idx(pass * rowsPerPass), divu(lt, chunks)));
      SmallVector<Value, 2> at = smemTiles.swizzledIndex(r, c, blockM);
      Value chunk = vector::LoadOp::create(b, loc, vec8, tiles.qTile,
                                           ValueRange{at[0], at[1]});
      Value row = add(coords.qRow0, r);
      auto inRange = scf::IfOp::create(
          b, loc, cmp(arith::CmpIPredicate::ult, row, coords.segLen),
          /*withElseRegion=*/false);
      OpBuilder::InsertionGuard guard(b);
      b.setInsertionPointToStart(inRange.thenBlock());
      Value token = add(coords.segStart, row);
      Value offset =
          add(add(mul(token, strideT), mul(coords.head, strideH)), c);
      if (coords.column0)
        offset = add(offset, coords.column0);
      vector::StoreOp::create(b, loc, chunk, out, ValueRange{offset});
    }
  }
}

SmallVector<Value>
WarpSpecializedQueryMajor::rowProducts(const RingTiles &tiles, int64_t aOffset,
                                       Value kAddr) {
  // As scores(): warpgroup w's rows 64w..64w+63 of Q (or dO), both operands
  // K-major, the A address opaque per use.
  Value aAddr = add(opaque(*this, tiles.base),
                    add(idx(aOffset), mul(divu(ids.warp, 4), idx(64 * 128))));
  Value aDesc = mma.desc(aAddr, 16, 1024);
  Value bDesc = mma.desc(kAddr, 16, 1024);
  return mma.overHeadDim({}, blockN, aDesc, blockM, bDesc, blockN);
}

LogicalResult WarpSpecializedQueryMajor::emitDqConsumer(
    const KernelArgs &args, const SegmentCoords &coords, const RingTiles &tiles,
    const Pipeline &pipe, TileProgram prog) {
  NVVM::SetMaxRegisterOp::create(b, loc, kConsumerRegs,
                                 NVVM::SetMaxRegisterAction::increase);
  Value wg = divu(ids.warp, 4);
  TileEnv env = tileEnv(args);
  // The rows' LSE (in the log2 domain of the kernels' exp2) and Delta; rows
  // past the segment: LSE +inf (P = 0), Delta 0.
  SmallVector<Value> lse, delta;
  for (int64_t h = 0; h < 2; ++h) {
    Value row =
        add(coords.qRow0, add(mul(ids.warp, idx(16)), add(idx(h * 8), ids.g)));
    Value valid = cmp(arith::CmpIPredicate::ult, row, coords.segLen);
    Value token = add(coords.segStart, select(valid, row, idx(0)));
    Value l = memref::LoadOp::create(
        b, loc, args.lse,
        ValueRange{add(mul(coords.head, args.lseStrideH), token)});
    l = arith::MulFOp::create(b, loc, l, f32c(kLog2e));
    lse.push_back(
        select(valid, l, f32c(std::numeric_limits<float>::infinity())));
    Value d = memref::LoadOp::create(
        b, loc, args.delta,
        ValueRange{add(mul(coords.head, args.deltaStrideH), token)});
    delta.push_back(select(valid, d, f32c(0.0f)));
  }
  // The kernel's values the tiles read: the rows' LSE and Delta.
  IRMapping kernelValues;
  kernel.getBody().walk([&](LoadRowStatsOp op) {
    kernelValues.map(op.getResult(),
                     pack(op.getStat() == StatKind::lse ? lse : delta));
  });
  waitParity(*this, barrier(tiles, 0), idx(0));

  // Iteration 0: S and dP, then the ops on them (P, dS).
  turnEndIf(wg, 1);
  Value first = idx(0);
  waitParity(*this, kFull(tiles, first), idx(0));
  waitParity(*this, vFull(tiles, first), idx(0));
  turnBegin(wg);
  mma.fence();
  SmallVector<Value> s = rowProducts(tiles, 0, kAddrOf(tiles, first));
  mma.commit();
  SmallVector<Value> dp = rowProducts(tiles, ring.dO, vAddrOf(tiles, first));
  mma.commit();
  turnEnd(wg);
  mma.wait(1, s);
  // Prefix trees: the walk over the ancestor ranges, as the forward's.
  std::optional<Walk> walk;
  if (isTree)
    walk = walkBegin(*pipe.chain);
  TileStep step = beginTile(prog, kernelValues, {});
  if (failed(emitScores(prog, step, pipe, coords, s, first, walk, env)))
    return failure();
  mma.wait(0, dp);
  arrive(*this, vEmpty(tiles, first));
  bindProduct(step, prog.dp, dp);
  if (failed(emitReady(prog, step, env)))
    return failure();
  Carried carried = afterFirstTile(prog, step, pipe, first, walk);

  // Iterations 1..n-1: S and dP of i, then the product (dQ += dS K) of i - 1
  // behind them.
  FailureOr<Carried> last = emitMainLoop(
      prog, pipe, tiles, env, carried,
      [&](Value i, RingSlot slot, RingSlot prev,
          Carried &in) -> FailureOr<TileStep> {
        // K of i - 1 has landed: its scores were computed.
        waitParity(*this, kFull(tiles, slot.slot), slot.parity);
        waitParity(*this, vFull(tiles, slot.slot), slot.parity);
        turnBegin(wg);
        mma.fence();
        SmallVector<Value> s = rowProducts(tiles, 0, kAddrOf(tiles, slot.slot));
        mma.commit();
        SmallVector<Value> dp =
            rowProducts(tiles, ring.dO, vAddrOf(tiles, slot.slot));
        mma.commit();
        accumulate(in.acc, in.operand, kAddrOf(tiles, prev.slot));
        mma.commit();
        turnEnd(wg);
        mma.wait(2, s);
        TileStep step = beginTile(prog, kernelValues, {});
        if (failed(emitScores(prog, step, pipe, coords, s, i, in.walk, env)))
          return failure();
        mma.wait(1, dp);
        arrive(*this, vEmpty(tiles, slot.slot));
        bindProduct(step, prog.dp, dp);
        if (failed(emitReady(prog, step, env)))
          return failure();
        return step;
      });
  if (failed(last))
    return failure();
  SmallVector<Value> acc = last->acc, ds = last->operand;

  // The last tile's dQ product.
  RingSlot lastSlot =
      slotOf(arith::SubIOp::create(b, loc, pipe.numIters, idx(1)));
  turnBegin(wg);
  accumulate(acc, ds, kAddrOf(tiles, lastSlot.slot));
  mma.commit();
  turnEndIf(wg, 0);
  mma.waitKeeping(0, acc, ds);
  arrive(*this, kEmpty(tiles, lastSlot.slot));
  // The epilogue stores the last loop's accumulator.
  IRMapping results = kernelValues;
  results.map(lastKVLoop().getResult(prog.accArg), pack(acc));
  kernel.getBody().walk([&](StoreDqOp store) {
    storeRows(coords, tiles, wg, lookup(results, store.getAcc()), {}, args.out,
              args.outStrideT, args.outStrideH);
  });
  return success();
}

LogicalResult WarpSpecializedQueryMajor::emit(gpu::GPUModuleOp gpuModule) {
  // The spec was checked against the schedule's record (checkSpec, in the
  // dualkv.kernel verifier and again by dualkv-lower-to-nvgpu): the kind,
  // tiling, head_dim and shared memory fit this emitter.
  Block &entry =
      fn.create(gpuModule, kernel.getSymName(), kernel.getKind(), threads(),
                ::dualkv::Schedule::WarpSpecialized, isTree, /*dlse=*/false,
                hasSinks(), hasWindow(kernel), scoreModInputs(kernel));
  auto func = cast<gpu::GPUFuncOp>(entry.getParentOp());
  int64_t total = threads() + kWarpgroupThreads;
  func.setKnownBlockSizeAttr(b.getDenseI32ArrayAttr({int32_t(total), 1, 1}));
  func->setAttr("nvvm.maxnreg", b.getI32IntegerAttr(kEntryRegs));
  KernelArgs args = readArgs();
  if (hasWindow(kernel))
    window = fn.indexParam("window");
  if (int inputs = scoreModInputs(kernel); inputs >= 0)
    scoreMod = ScoreModParams::read(fn, inputs);
  ids = ThreadIds::emit(*this);
  SegmentCoords coords = locate(args);
  RingTiles tiles = placeRing();
  FailureOr<KVLoops> kv = collectLoops(coords);
  if (failed(kv))
    return failure();
  FailureOr<TileProgram> prog = collectTileProgram();
  if (failed(prog))
    return failure();
  Pipeline pipe = pipeline(std::move(*kv), args, coords);

  // Thread 0 initialises the barriers: Q and every "full" barrier complete on
  // the producer's arrival plus the TMA bytes, every "empty" one when all 256
  // consumer threads are done with the slot.
  {
    auto init = scf::IfOp::create(
        b, loc, cmp(arith::CmpIPredicate::eq, ids.tid, idx(0)),
        /*withElseRegion=*/false);
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(init.thenBlock());
    NVVM::MBarrierInitOp::create(b, loc, barrier(tiles, 0), i32c(1), Value());
    for (int64_t s = 0; s < stages; ++s) {
      Value slot = idx(s);
      NVVM::MBarrierInitOp::create(b, loc, kFull(tiles, slot), i32c(1),
                                   Value());
      NVVM::MBarrierInitOp::create(b, loc, vFull(tiles, slot), i32c(1),
                                   Value());
      NVVM::MBarrierInitOp::create(b, loc, kEmpty(tiles, slot),
                                   i32c(int32_t(threads())), Value());
      NVVM::MBarrierInitOp::create(b, loc, vEmpty(tiles, slot),
                                   i32c(int32_t(threads())), Value());
    }
  }
  gpu::BarrierOp::create(b, loc);

  auto role = scf::IfOp::create(
      b, loc, cmp(arith::CmpIPredicate::uge, ids.tid, idx(threads())),
      /*withElseRegion=*/true);
  {
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(role.thenBlock());
    emitProducer(args, coords, tiles, pipe);
    b.setInsertionPointToStart(role.elseBlock());
    if (failed(isDq ? emitDqConsumer(args, coords, tiles, pipe, *prog)
                    : emitConsumer(args, coords, tiles, pipe, *prog)))
      return failure();
  }

  b.setInsertionPointToEnd(&entry);
  gpu::ReturnOp::create(b, loc);
  return success();
}

} // namespace

LogicalResult
mlir::dualkv::emitWarpSpecializedQueryMajor(KernelOp kernel, OpBuilder &b,
                                            gpu::GPUModuleOp gpuModule,
                                            int64_t *sharedBytes) {
  WarpSpecializedQueryMajor emitter(kernel, b);
  if (failed(emitter.emit(gpuModule)))
    return failure();
  *sharedBytes = emitter.sharedBytes();
  return success();
}
