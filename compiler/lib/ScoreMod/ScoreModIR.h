//===- ScoreModIR.h - score modifiers in the IR: check, lower, derive -----===//
//
// The compiler's side of dualkv/Compiler/ScoreMod.h: the module's
// `func.func @score_mod` is checked once (verifyScoreMod) and emitted inline
// for each score of a tile (emitScoreMod), with its derivative in the score
// by forward-mode differentiation over the same ops when the backward asks.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_SCOREMOD_SCOREMODIR_H
#define DUALKV_COMPILER_SCOREMOD_SCOREMODIR_H

#include "Lowering/Support/Builders.h"
#include "Lowering/Support/KernelFunction.h"
#include "Lowering/TileOps/TileOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"

namespace mlir::dualkv {

/// The score modifier of `op`'s module (`func.func @score_mod`), or null.
func::FuncOp scoreModOf(Operation *op);

/// The tensors of the score modifier kernel `kernel` (a dualkv.kernel bound
/// with `score_mod = true`) takes, or -1 for a kernel without one: the
/// `scoreModInputs` of its parameter table (dualkv/Compiler/KernelAbi.h).
int scoreModInputs(Operation *kernel);

/// A score-modifier kernel's parameters (kScoreModParams): the plan's
/// logical positions and the modifier's tensors.
struct ScoreModParams {
  /// int32 [T]: each packed token's position in its logical sequence.
  Value lpos;
  /// The launch's first query head among the model's (index).
  Value head0;
  SmallVector<Value> inputs;

  /// Reads them from `fn` (made with `inputs` >= 0 score-modifier tensors).
  static ScoreModParams read(KernelFunction &fn, int inputs);
  /// The logical position of packed token `token` (index): lpos[token].
  Value logical(ScalarBuilder &o, Value token) const;
  /// The site of a query-major tile of `layout`: its rows are those of the
  /// segment of `segLen` tokens from packed `segStart`, its keys those of
  /// the region (the segment itself, its prompt or an ancestor range) from
  /// packed `keyStart`, `region` (index) 0 or 1 for every score; `head` the
  /// launch's query head. Within a segment or a range logical positions are
  /// consecutive from its first token's; rows past the segment are padding.
  ScoreSite queryMajorSite(ScalarBuilder &o, const ScoreLayout &layout,
                           Value segStart, Value segLen, Value keyStart,
                           std::function<Value()> region, Value head) const;
};

/// Whether `fn` is a score modifier the compiler can lower and differentiate
/// (dualkv/Compiler/ScoreMod.h): its signature, its ops (arith, math, and
/// memref.load of its tensor arguments) and their types; a diagnostic on
/// `fn` or the op at fault otherwise.
LogicalResult verifyScoreMod(func::FuncOp fn);

/// What emitScoreMod gives for one score.
struct ScoreModValue {
  /// f(x, ...), and df/dx (null without a derivative).
  Value value, derivative;
};

/// Emits `fn` (verified) at x (f32) with the six i32 `scalars` of the score
/// (head, q_idx, kv_idx, q_packed, kv_packed, region: those `fn` takes are
/// read) and the kernel's tensor parameters `inputs`; with `derivative`,
/// also df/dx. Where `masked` (i1) holds, the tensors are read at index 0
/// when the index depends on the score or the positions: a masked score's
/// positions may lie outside every sequence.
FailureOr<ScoreModValue> emitScoreMod(ScalarBuilder &o, func::FuncOp fn,
                                      Value x, ArrayRef<Value> scalars,
                                      ArrayRef<Value> inputs, bool derivative,
                                      Value masked);

} // namespace mlir::dualkv

#endif
