// Kernel cache: typed keys, the on-disk store, and loaded modules per context.
#ifndef DUALKV_RUNTIME_CACHE_H
#define DUALKV_RUNTIME_CACHE_H

#include "CudaDriver.h"
#include "Files.h"

#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Export.h"
#include "dualkv/Tuning.h"

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

namespace dualkv {

/// Every input that changes a kernel's code (docs/architecture.md §4). Bump
/// kSchemaVersion whenever a field is added, removed or spelled differently:
/// it names the disk cache's top folder, so old entries are never misread.
/// (`tree` is written only when true and `R` only when non-zero, so neither
/// changes any other key: a generic kernel's key is spelled as before.)
struct DUALKV_API CacheKey {
  static constexpr int kSchemaVersion = 2;

  KernelKind kind = KernelKind::Fwd;
  int64_t P = 0; ///< shape class, 0 = any
  int64_t N = 0; ///< shape class, 0 = any
  int64_t R = 0; ///< shape class, 0 = any; in the JSON only when non-zero
  int headDim = 0;
  int numQHeads = 0;
  int numKVHeads = 0;
  DType dtype = DType::BF16;
  std::string arch;
  Tiling tiling; ///< resolved: the tiling the compiler actually uses
  Schedule schedule = Schedule::Auto; ///< resolved, like the tiling
  /// KernelSpec::tree; in the JSON only when true, so that every other key
  /// is spelled as before it existed.
  bool tree = false;
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

/// What the compiler produced for one key.
struct CacheEntry {
  KernelInfo info;
  std::string ptx;
  std::vector<char> cubin; ///< empty when ptxas was not available
};

/// The most dynamic shared memory any kernel may ask for (the sm_90 limit is
/// 227 KiB).
constexpr int kMaxSharedBytes = 256 * 1024;

/// Why `info` cannot be launched (an entry point that is not an identifier,
/// threads not a whole number of warps up to 1024, block_m or shared memory
/// out of range), or empty when it can.
DUALKV_API std::string unusableLaunchShape(const KernelInfo &info);

/// The on-disk cache: `<root>/v<schema>/<arch>/<hash>/{kernel.ptx,
/// kernel.cubin, meta.json}`. meta.json holds the key, the KernelInfo, SHA-256
/// sums of the PTX and cubin and a SHA-256 of all of that, so no part of an
/// entry can change unnoticed. Every file is written to a uniquely named temp
/// file in the entry's folder and renamed into place, meta.json last, so
/// readers see a complete entry or none even while several processes store the
/// same key.
///
/// The cache trusts only what the user owns: folders are created 0700 and
/// files 0600; the root (which may be reached through a symbolic link) and
/// every folder below it must belong to the current user with no group or
/// other write permission, and no link is followed below the root. A folder
/// that fails this is reported once and the cache at that root is not used
/// again in this process (kernels are then cached in memory only). A file
/// that is a link, not a regular file, not the user's own, larger than the
/// cap or inconsistent with its checksums makes the entry a miss, rewritten
/// after the recompile.
class DUALKV_API DiskCache {
public:
  explicit DiskCache(std::string root);

  /// $DUALKV_CACHE_DIR, else $XDG_CACHE_HOME/dualkv, else ~/.cache/dualkv;
  /// empty when none of them can be formed (the disk cache is then off).
  static std::string defaultRoot();

  const std::string &root() const { return root_; }
  /// The folder of `key`'s entry.
  std::string entryDir(const CacheKey &key) const;

  /// The entry of `key`, or nullopt on a miss. A damaged entry (bad JSON,
  /// another schema or key, a checksum mismatch, a missing file) is a miss
  /// too, reported on stderr once per process.
  std::optional<CacheEntry> load(const CacheKey &key) const;

  /// Writes `entry` for `key`, replacing what was there. Returns false and
  /// sets `*why` when the files cannot be written.
  bool store(const CacheKey &key, const CacheEntry &entry,
             std::string *why = nullptr) const;

  /// Whether this root was refused (not the user's alone) in this process.
  bool refused() const;
  /// False when the root is refused now or was before (reported once); a
  /// root that does not exist yet is usable.
  bool usable() const;

private:
  struct EntryFolder {
    FileDescriptor fd;
    std::string path;
  };
  /// The entry folder of `key`, walked from the root without following links
  /// below it and created (0700) with `create`. nullopt with *why empty on an
  /// ordinary miss; an untrusted folder refuses the root.
  std::optional<EntryFolder> openEntry(const CacheKey &key, bool create,
                                       std::string *why) const;
  /// Reports `why` once and stops using this root in this process.
  void refuse(const std::string &why) const;

  std::string root_;
};

/// A loaded CUmodule, unloaded (through the driver that loaded it) when the
/// handle dies.
class DUALKV_API ModuleHandle {
public:
  ModuleHandle() = default;
  ModuleHandle(cuda::Driver *driver, cuda::CUmodule module)
      : driver_(driver), module_(module) {}
  ModuleHandle(ModuleHandle &&o) noexcept { *this = std::move(o); }
  ModuleHandle &operator=(ModuleHandle &&o) noexcept;
  ModuleHandle(const ModuleHandle &) = delete;
  ModuleHandle &operator=(const ModuleHandle &) = delete;
  ~ModuleHandle() { reset(); }

  cuda::CUmodule get() const { return module_; }
  void reset();

private:
  cuda::Driver *driver_ = nullptr;
  cuda::CUmodule module_ = nullptr;
};

/// A kernel ready to launch in one CUDA context.
struct LoadedKernel {
  cuda::CUcontext context = nullptr;
  ModuleHandle module;
  cuda::CUfunction function = nullptr;
  KernelInfo info;
  KernelSpec spec;      ///< resolved: the tiling and arch it was built for
  std::string hash;     ///< CacheKey::hash()
  bool fromPtx = false; ///< loaded by the driver's JIT, not from the cubin
};

/// The kernel for `spec` in the current CUDA context (spec.arch is replaced
/// by the context's device arch). Looks in memory, then on disk (unless
/// DUALKV_ALWAYS_COMPILE=1), then compiles (IR dumped to $DUALKV_DUMP_IR if
/// set) and stores the result on disk. The reference stays valid until
/// clearKernelCache(). An open tiling takes the one dualkv-tune recorded for
/// the spec, or, with `tunedKVHeads` > 0, for the spec with these heads (a
/// kernel over a slice of a problem's heads takes the whole problem's).
///
/// With a shape class (`shape` not any(); an open tiling; not a tree kernel)
/// the tiling is looked up for that class first, then generically
/// (TuningDb::findForClass). A class entry selects the class's kernel (the
/// spec with P, N, R set to the class: its own cache key, the generic
/// kernel's code at the tuned tiling). Until that kernel is compiled, the
/// launch takes the generic kernel and the class's is compiled on a
/// background thread, for the launches after it; with
/// DUALKV_BACKGROUND_COMPILE=0 the launch compiles and waits for it instead.
/// A class kernel that does not build is warned about once and the generic
/// kernel serves the class from then on.
DUALKV_API const LoadedKernel &getKernel(const KernelSpec &spec,
                                         int tunedQHeads = 0,
                                         int tunedKVHeads = 0,
                                         const ShapeClass &shape = {});

/// Waits until no background compile (getKernel) is running, and joins
/// their threads. Also run at exit, so none outlives the process's statics.
DUALKV_API void waitForBackgroundCompiles();
/// Class kernels compiled in the background so far, failed ones included.
DUALKV_API int backgroundCompilesStarted();

/// Waits for the background compiles, then unloads every cached module
/// (tests; a context about to be destroyed).
DUALKV_API void clearKernelCache();

/// Loads `entry` as a module: the cubin when there is one and it fits the
/// device, else the PTX through the driver's JIT. Sets *fromPtx accordingly.
DUALKV_API ModuleHandle loadModule(cuda::Driver &driver,
                                   const CacheEntry &entry,
                                   bool *fromPtx = nullptr);

} // namespace dualkv

#endif
