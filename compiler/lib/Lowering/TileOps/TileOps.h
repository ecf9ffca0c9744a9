//===- TileOps.h - the attention math, once, over register fragments ------===//
//
// The tile-op library: one function per elementwise dualkv op on register
// fragments (the masks, the online softmax, the rescale, recomputed
// probabilities, the softmax gradient, the epilogue's row normalisers), for
// every schedule. A skeleton (the cp.async loop of mma.sync, the wgmma loop,
// the warp-specialized ring) issues the products itself and calls the library
// for everything between them; emitTileOp is the one dispatch from a
// template's op to its function, so a new elementwise op is its ODS
// definition, one function here and its use in a template.
//
// Fragments are flat vectors of fp32 scalars. A score-shaped tile's values
// (S, Sᵀ, P, dP, dS) each belong to one query, whose row statistics (running
// max and sum, LSE, Delta) sit at a compile-time slot (StatSlot), and relate
// it to one key; a ScoreLayout builds both positions for the masks.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_COMMON_TILEOPS_H
#define DUALKV_COMPILER_COMMON_TILEOPS_H

#include "Lowering/Support/Builders.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"

#include "mlir/IR/IRMapping.h"

#include <functional>

namespace mlir::dualkv {

/// The slot of value i's row statistics in a fragment of statistics.
using StatSlot = std::function<int64_t(int64_t)>;
/// Where the values of one score-shaped register fragment sit: index values
/// in the frame the masks compare (a bound mask's `bound` is in the key's).
struct ScoreLayout {
  std::function<Value(int64_t)> key;
  std::function<Value(int64_t)> query;
};

/// The C-fragment layout of query-major tiles: each warp holds `mTiles` x
/// `nTiles` m16n8 tiles (mma.sync, or one m16 block of a wgmma m64nN
/// accumulator), value (mt, nt, c) at (mt * nTiles + nt) * 4 + c; with
/// lane = 4g + t it is query row qRow0 + 16 mTiles warp + 16 mt + 8 (c / 2) + g
/// and key keyBase + 8 nt + 2t + c % 2.
ScoreLayout queryMajorLayout(ScalarBuilder &o, int64_t mTiles, int64_t nTiles,
                             Value qRow0, Value keyBase, Value warp, Value g,
                             Value t);
/// Rows (mt, h) of the query-major layout have statistic slot 2 mt + h.
StatSlot queryMajorStats(int64_t nTiles);

/// Where the scores of a tile sit, for a score modifier: value i's query and
/// key positions in the query's logical sequence and in the packed layout,
/// and its region (0: a key of the shared prompt or an ancestor, 1: of the
/// query's own segment), each an index value.
struct ScoreSite {
  std::function<Value(int64_t)> queryLogical, keyLogical, queryPacked,
      keyPacked, region;
  /// Whether value i pairs a query and a key of the sequences (i1; null:
  /// all do). A tile's padding (keys past their segment, queries past a
  /// work item or a segment) has positions of no sequence: its tensor reads
  /// go to element 0, and with `padShared` the modifier leaves its scores as
  /// they are, so they do what the plain kernel's do.
  std::function<Value(int64_t)> inside;
  /// Whether the padding's scores reach the sequences' results: in a
  /// KV-major tile a padding key's dS meets real queries in dQ (a zero key
  /// row times an overflowed dS is NaN). A query-major tile's padding rows
  /// are its own, and dropped.
  bool padShared = false;
  /// The query head (index).
  Value head;
  /// The modifier's tensors: the kernel's score_mod_input parameters.
  SmallVector<Value> inputs;
};

/// What emitTileOp needs of the kernel: its scalars and the layout of its
/// score tiles. A skeleton that emits an op itself (a mask over a pipeline's
/// changing regions) does not pass it to emitTileOp.
struct TileEnv {
  /// The layout of the scores of key/query tile `tile` (a mask's operand).
  std::function<ScoreLayout(Value tile)> layoutOf;
  StatSlot stat;
  /// A bound mask's bound: the shared region's length.
  Value bound;
  /// The kernel's sliding window W (null: none), and the shifts from the
  /// frames' positions to logical ones (tile::mask): windowShift for causal
  /// masks (null: 0), boundShift for bound ones (null: bound; a tree's
  /// ancestor range: the lengths of the ranges walked so far).
  Value window, windowShift, boundShift;
  Value scaleLog2, scale;
  /// Query-major tiles: m16 blocks a warp, key tiles of 8 and accumulator
  /// tiles of 8 columns.
  int64_t mTiles = 0, nTiles = 0, dTiles = 0;
  /// Packs fp32 probabilities (or dS) into the operand the next product
  /// reads: the C-to-A fragment repack of the query-major kernels; none
  /// keeps them as they are.
  std::function<Value(ArrayRef<Value>)> packOperand;
  /// Score modifiers: the site of a score_mod or score_mod_grad op's scores
  /// (null in a kernel without one).
  std::function<ScoreSite(Operation *op)> siteOf;
};

namespace tile {

/// `s` with the keys `kind` excludes at -inf: causal, key > query; bound,
/// key >= `bound`. With a sliding window W (non-null) also the keys at W or
/// more logical positions before the query: query + shift - key >= W, where
/// a null `shift` is `bound` for a bound mask (the query follows the shared
/// region's keys) and 0 for a causal one.
void mask(ScalarBuilder &o, MutableArrayRef<Value> s, MaskKind kind,
          const ScoreLayout &layout, Value bound, Value window = Value(),
          Value shift = Value());
/// `s` times `factor` (dualkv.scale_scores).
void scaleScores(ScalarBuilder &o, MutableArrayRef<Value> s, float factor);
/// The logit softcap c (dualkv.softcap): s becomes (c / scale) tanh(scale s /
/// c), -inf stays -inf; scaleLog2 is the softmax scale times log2(e).
void softcap(ScalarBuilder &o, MutableArrayRef<Value> s, double cap,
             Value scaleLog2);
/// p times 1 - t² with t = scale s / c, the tanh of capped scores `s`
/// (dualkv.softcap_grad); entries with s = -inf give 0.
void softcapGrad(ScalarBuilder &o, MutableArrayRef<Value> p, ArrayRef<Value> s,
                 double cap, Value scaleLog2);
/// The module's score modifier `fn` on `s` in place: x = scale s becomes
/// f(x, ...) / scale, -inf stays -inf; scaleLog2 is the softmax scale times
/// log2(e).
LogicalResult scoreMod(ScalarBuilder &o, MutableArrayRef<Value> s,
                       func::FuncOp fn, const ScoreSite &site, Value scaleLog2);
/// p times df/dx at x = scale s, `s` the scores the modifier took
/// (dualkv.score_mod_grad); entries with s = -inf give 0.
LogicalResult scoreModGrad(ScalarBuilder &o, MutableArrayRef<Value> p,
                           ArrayRef<Value> s, func::FuncOp fn,
                           const ScoreSite &site, Value scaleLog2);
/// One online-softmax step over query-major scores `s` (layout of
/// queryMajorLayout): the new running max `m` (log2 domain of the scaled
/// scores) and per-lane partial sum `l` of each row, the factor `alpha` the
/// accumulator is rescaled by; returns the fp32 probabilities.
SmallVector<Value> onlineSoftmax(ScalarBuilder &o, ArrayRef<Value> s,
                                 MutableArrayRef<Value> m,
                                 MutableArrayRef<Value> l,
                                 MutableArrayRef<Value> alpha, Value scaleLog2,
                                 int64_t mTiles, int64_t nTiles);
/// acc (mTiles x dTiles C fragments) times the factor of each row.
void rescale(ScalarBuilder &o, MutableArrayRef<Value> acc,
             ArrayRef<Value> alpha, int64_t mTiles, int64_t dTiles);
/// P = exp2(S scaleLog2 - LSE) in place, LSE in the log2 domain.
void recomputeProbs(ScalarBuilder &o, MutableArrayRef<Value> s,
                    ArrayRef<Value> lse, const StatSlot &stat, Value scaleLog2);
/// dS = P scale (dP - Delta) in place of P.
void softmaxGrad(ScalarBuilder &o, MutableArrayRef<Value> p, ArrayRef<Value> dp,
                 ArrayRef<Value> delta, const StatSlot &stat, Value scale);
/// The sink logit of query head `head` from the fp32 `sinks` tensor, times
/// log2(e): what addSink takes.
Value sinkLog2(ScalarBuilder &o, Value sinks, Value head);
/// A row's softmax sum with an attention sink: sum + 2^(sinkLog2 - m), m the
/// row's running max and sinkLog2 the sink's logit times log2(e) (the log2
/// domain of the scaled scores).
Value addSink(ScalarBuilder &o, Value sum, Value m, Value sinkLog2);
/// A row's softmax sum from the per-lane partial sums of its quad.
Value rowSum(ScalarBuilder &o, Value partial);
/// LSE (natural log) of a row of running max `m` (log2 domain) and sum.
Value logSumExp(ScalarBuilder &o, Value m, Value sum);

} // namespace tile

/// Emits the elementwise dualkv op `op` (mask, scale_scores, softcap,
/// softcap_grad, score_mod, score_mod_grad, online_softmax, rescale,
/// recompute_probs, softmax_grad) on the values `map` gives its operands and
/// maps its results; fails with a diagnostic on an op the library does not
/// define.
LogicalResult emitTileOp(Operation *op, ScalarBuilder &o, const TileEnv &env,
                         IRMapping &map);
/// Whether emitTileOp defines `op`.
bool isTileOp(Operation *op);

} // namespace mlir::dualkv

#endif
