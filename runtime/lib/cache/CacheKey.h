// The kernel cache's key: every input that changes a kernel's code.
#ifndef DUALKV_RUNTIME_CACHE_CACHEKEY_H
#define DUALKV_RUNTIME_CACHE_CACHEKEY_H

#include "dualkv/Compiler/Compiler.h"

#include <nlohmann/json.hpp>

#include <string>

#include <llvm/ADT/StringRef.h>

namespace dualkv {

/// Every input that changes a kernel's code (docs/architecture.md §4). Bump
/// kSchemaVersion whenever a field is added, removed or spelled differently:
/// it names the disk cache's top folder, so old entries are never misread.
/// (`tree` is written only when true, and `R` and `valueHeadDim` only when
/// non-zero, so none changes any other key: a generic kernel's key is
/// spelled as before.)
struct CacheKey {
  /// 3: kinds, dtypes and schedules spelled by dualkv/Names.h.
  static constexpr int kSchemaVersion = 3;

  KernelKind kind = KernelKind::Fwd;
  int64_t P = 0; ///< shape class, 0 = any
  int64_t N = 0; ///< shape class, 0 = any
  int64_t R = 0; ///< shape class, 0 = any; in the JSON only when non-zero
  int headDim = 0;
  /// KernelSpec::vDim() when it differs from headDim, else 0; in the JSON
  /// only when non-zero, like `R`.
  int valueHeadDim = 0;
  int numQHeads = 0;
  int numKVHeads = 0;
  DType dtype = DType::BF16;
  std::string arch;
  Tiling tiling; ///< resolved: the tiling the compiler actually uses
  Schedule schedule = Schedule::Auto; ///< resolved, like the tiling
  /// KernelSpec::tree; in the JSON only when true, so that every other key
  /// is spelled as before it existed.
  bool tree = false;
  /// KernelSpec::softcap; in the JSON only when set, like `tree`.
  float softcap = 0;
  /// KernelSpec::dlse; in the JSON only when set.
  bool dlse = false;
  /// KernelSpec::sinks; in the JSON only when set.
  bool sinks = false;
  /// KernelSpec::window (W itself is a kernel parameter); in the JSON only
  /// when set.
  bool window = false;
  /// KernelSpec::scoreMod (canonical text; empty: none).
  std::string scoreMod;
  std::string compilerFingerprint;

  /// The key of `spec`, whose tiling and schedule should already be resolved
  /// (resolveSpec) so that "default" and its explicit spelling share a key.
  static CacheKey fromSpec(const KernelSpec &spec,
                           const std::string &compilerFingerprint);
  /// The spec this key describes.
  KernelSpec spec() const;

  /// Canonical JSON: every field plus the schema version. nlohmann's objects
  /// keep keys sorted, so equal keys serialise to equal bytes.
  nlohmann::json toJson() const;
  /// Lower-case hex SHA-256 of toJson().dump().
  std::string hash() const;
  /// A short human-readable form for messages.
  std::string describe() const;

  bool operator==(const CacheKey &o) const { return toJson() == o.toJson(); }
};

/// Lower-case hex SHA-256 of `bytes`.
std::string sha256Hex(llvm::StringRef bytes);

} // namespace dualkv

#endif
