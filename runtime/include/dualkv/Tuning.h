// The tuning database: the fastest tiling dualkv-tune measured for an (arch,
// kernel, heads, head shape, dtype, shape class), read by the runtime and by
// dualkv-aot.
#ifndef DUALKV_TUNING_H
#define DUALKV_TUNING_H

#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Export.h"
#include "dualkv/Plan.h"

#include <optional>
#include <string>
#include <vector>

namespace dualkv {

/// A shape class (docs/architecture.md §4): power-of-two buckets of a group's
/// prompt length P, response count N and response length R. All three zero
/// is the generic class ("any shape"); a real class has all three non-zero.
struct DUALKV_API ShapeClass {
  int64_t P = 0, N = 0, R = 0;

  /// Whether this is the generic class (every field 0).
  bool any() const { return P == 0 && N == 0 && R == 0; }
  bool operator==(const ShapeClass &o) const {
    return P == o.P && N == o.N && R == o.R;
  }
  bool operator<(const ShapeClass &o) const {
    return P != o.P ? P < o.P : N != o.N ? N < o.N : R < o.R;
  }
  /// "P1024_N8_R256", or "any".
  std::string name() const;
};

/// The smallest bucket of each dimension: shorter prompts, fewer responses
/// and shorter responses share the floor's class.
constexpr int64_t kShapeClassMinP = 512;
constexpr int64_t kShapeClassMinN = 1;
constexpr int64_t kShapeClassMinR = 64;
/// Lengths above this (2^30) are not bucketed: shapeBucket clamps to it.
constexpr int64_t kShapeClassMax = int64_t(1) << 30;

/// The bucket of `x`: the smallest power of two that is >= x and >= `floor`
/// (a power of two), at most kShapeClassMax. Negative x counts as 0.
DUALKV_API int64_t shapeBucket(int64_t x, int64_t floor);
/// The class of a group of a P-token prompt and N responses of R tokens
/// (R: the mean response length, rounded up): {shapeBucket(P, 512),
/// shapeBucket(N, 1), shapeBucket(R, 64)}.
DUALKV_API ShapeClass shapeClassOf(int64_t P, int64_t N, int64_t R);
/// The class a launch on `plan` looks its tuning up under: that of the
/// plan's largest group (most tokens; the first of equals), with R the mean
/// of its response lengths rounded up. Generic (any()) for a plan that is
/// not groups (a node below a response: chains and trees, whose kernels are
/// not tuned per class).
DUALKV_API ShapeClass shapeClassOf(const Plan &plan);
/// Whether `c` is the generic class or every field is a bucket value
/// (a power of two within [floor, kShapeClassMax]).
DUALKV_API bool isShapeClass(const ShapeClass &c);

/// One measured winner.
struct TunedEntry {
  /// arch, kind, heads, head_dim and value head_dim, dtype, shape class
  /// (P, N, R: all 0 for the generic entry); its tiling
  KernelSpec spec;
  double ms = 0;     ///< median time on the tuning shape
  double tflops = 0; ///< useful TFLOP/s on the tuning shape
  std::string shape; ///< the shape it was timed on, e.g. "P8192_N16_R1024"
};

/// A schema-versioned JSON file of TunedEntry, keyed by everything but the
/// tiling: the kernel kind is part of the key, so the forward (fwd) and the
/// backward's main kernels (bwd, bwd_kv) each have their own entry, and so is
/// the shape class (P, N, R; "R" is written only when non-zero, so a generic
/// entry is spelled as before classes existed, and absent reads as 0), and
/// so is the value head_dim ("v_head_dim", written only when it differs
/// from head_dim, so entries of equal widths are spelled as before it
/// existed; absent reads as head_dim; readers before it refuse an entry of
/// head_dim 192, and with it the file). An entry whose P, N, R are not a
/// shape class (isShapeClass) is malformed, as is one whose integers are
/// not JSON integers within their ranges (head_dim 64, 96, 128, 256 or 512,
/// or 192 with v_head_dim 128; heads within the grid; tiling fields within
/// the compiler's ranges). Version 1 has always stored the kind; readers before
/// the backward reject an entry of a backward kind, and with it the whole file,
/// as they do any malformed entry. Anything wrong with a file (unreadable, not
/// JSON, another schema or version, truncated, fields of the wrong type or
/// range) makes load() report it and return an empty database: a tuning file is
/// never trusted in part. A well-formed entry the compiler's spec check
/// (checkSpec) refuses, such as a forward of 3 stages, is left out alone, with
/// a warning: that kernel takes the default tiling, as a launch does when a
/// tuned tiling does not build.
class DUALKV_API TuningDb {
public:
  /// 2: dtypes spelled by dualkv/Names.h ("fp16", not "f16"); a file of
  /// another version is reported and read as empty.
  static constexpr int kSchemaVersion = 2;

  /// Reads `path`; problems go to *error (empty when the file is fine or
  /// absent). An entry left out because checkSpec refuses it is a line in
  /// *skipped when given, else a warning on stderr (once per process).
  static TuningDb load(const std::string &path, std::string *error,
                       std::vector<std::string> *skipped = nullptr);
  /// $DUALKV_TUNING_DB, else <kernel cache root>/tuning.json.
  static std::string defaultPath();

  /// The tuned tiling for `spec` (its tiling ignored; its kind, shape class
  /// P, N, R, heads, head_dim, value head_dim (vDim()), dtype and arch must
  /// all match), if any.
  std::optional<Tiling> find(const KernelSpec &spec) const;
  /// The runtime's lookup order: the entry of `spec` under shape class `c`,
  /// else its generic entry (P = N = R = 0), else nothing (the compiler's
  /// default). *fromClass (if given) says whether the class's entry answered.
  std::optional<Tiling> findForClass(const KernelSpec &spec,
                                     const ShapeClass &c,
                                     bool *fromClass = nullptr) const;
  /// Adds or replaces the entry with the same key.
  void put(const TunedEntry &entry);
  const std::vector<TunedEntry> &entries() const { return entries_; }

  std::string toJson() const;
  /// Writes atomically (temp file, rename); false with *error on failure.
  bool save(const std::string &path, std::string *error) const;

private:
  std::vector<TunedEntry> entries_;
};

} // namespace dualkv

#endif
