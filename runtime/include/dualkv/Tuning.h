// The tuning database: the fastest tiling dualkv-tune measured for an (arch,
// kernel, heads, head_dim, dtype, shape class), read by the runtime and by
// dualkv-aot.
#ifndef DUALKV_TUNING_H
#define DUALKV_TUNING_H

#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Export.h"

#include <optional>
#include <string>
#include <vector>

namespace dualkv {

/// One measured winner.
struct TunedEntry {
  KernelSpec
      spec; ///< arch, kind, heads, head_dim, dtype, shape class; its tiling
  double ms = 0;     ///< median time on the tuning shape
  double tflops = 0; ///< useful TFLOP/s on the tuning shape
  std::string shape; ///< the shape it was timed on, e.g. "P8192_N16_R1024"
};

/// A schema-versioned JSON file of TunedEntry, keyed by everything but the
/// tiling: the kernel kind is part of the key, so the forward (fwd) and the
/// backward's main kernels (bwd, bwd_kv) each have their own entry. Version 1
/// has always stored the kind; readers before the backward reject an entry of
/// a backward kind, and with it the whole file, as they do any malformed
/// entry. Anything wrong with a file (unreadable, not JSON, another schema or
/// version, truncated, fields of the wrong type) makes load() report it and
/// return an empty database: a tuning file is never trusted in part.
class DUALKV_API TuningDb {
public:
  static constexpr int kSchemaVersion = 1;

  /// Reads `path`; problems go to *error (empty when the file is fine or
  /// absent).
  static TuningDb load(const std::string &path, std::string *error);
  /// $DUALKV_TUNING_DB, else <kernel cache root>/tuning.json.
  static std::string defaultPath();

  /// The tuned tiling for `spec` (its tiling ignored; its kind, shape class,
  /// heads, head_dim, dtype and arch must all match), if any.
  std::optional<Tiling> find(const KernelSpec &spec) const;
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
