//===- ScoreMod.h - score modifiers written by users ----------------------===//
//
// A score modifier is one MLIR function applied to every logit before the
// softmax (docs/score-modifiers.md):
//
//   func.func @score_mod(%score: f32, %head: i32, %q_idx: i32, %kv_idx: i32
//                        [, %q_packed: i32, %kv_packed: i32, %region: i32]
//                        [, %t0: memref<?xf32>, ...]) -> f32
//
// built from arith and math ops (and memref.load of its tensor arguments),
// which the compiler lowers per score and differentiates for the backward.
// Needs no MLIR to include.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_SCOREMOD_H
#define DUALKV_COMPILER_SCOREMOD_H

#include "dualkv/Export.h"

#include <string>

namespace dualkv {

/// The most tensors (memref arguments) a score modifier may take.
inline constexpr int kMaxScoreModInputs = 8;

/// A score modifier as the compiler reads it.
struct ScoreModInfo {
  /// The function as MLIR prints it (SSA names and spacing canonical): what
  /// KernelSpec::scoreMod holds and the kernel cache's key covers. Empty on
  /// error.
  std::string canonical;
  /// Its memref<?xf32> arguments: kernel parameters, in order.
  int inputs = 0;
  /// Whether it takes the packed positions and the region (7 scalar
  /// arguments, not 4).
  bool packed = false;
  /// Why `text` is no score modifier (empty: it is one).
  std::string error;
};

/// Parses and checks the score modifier `text` (MLIR holding one
/// `func.func @score_mod`). Without the compiler (libdualkv_runtime) every
/// text is an error saying so.
DUALKV_API ScoreModInfo parseScoreMod(const std::string &text);

} // namespace dualkv

#endif
