// Kernel cache: typed keys, the on-disk store, and loaded modules per context.
#include "Cache.h"

#include "Backward.h"
#include "Files.h"

#include "dualkv/Aot.h"
#include "dualkv/Tuning.h"

#include "dualkv/dualkv.h"

#include <fmt/format.h>
#include <llvm/ADT/SmallString.h>
#include <llvm/ADT/StringExtras.h>
#include <llvm/Support/FileSystem.h>
#include <llvm/Support/Path.h>
#include <llvm/Support/Process.h>
#include <llvm/Support/SHA256.h>
#include <llvm/Support/raw_ostream.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <system_error>
#include <thread>
#include <tuple>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace dualkv {

using nlohmann::json;

namespace {

// These spellings are part of the on-disk schema, so they live here rather
// than borrowing the compiler's toString (whose text may change freely).
const char *kindName(KernelKind kind) {
  switch (kind) {
  case KernelKind::Fwd:
    return "fwd";
  case KernelKind::BwdPre:
    return "bwd_pre";
  case KernelKind::Bwd:
    return "bwd";
  case KernelKind::BwdPost:
    return "bwd_post";
  case KernelKind::BwdKV:
    return "bwd_kv";
  case KernelKind::BwdDQ:
    return "bwd_dq";
  }
  return "unknown";
}

const char *dtypeName(DType dtype) {
  switch (dtype) {
  case DType::BF16:
    return "bf16";
  case DType::FP16:
    return "fp16";
  }
  return "unknown";
}

std::string sha256Hex(llvm::StringRef bytes) {
  auto digest = llvm::SHA256::hash(llvm::arrayRefFromStringRef(bytes));
  return llvm::toHex(digest, /*LowerCase=*/true);
}

std::optional<std::string> env(const char *name) {
  std::optional<std::string> value = llvm::sys::Process::GetEnv(name);
  if (value && value->empty())
    return std::nullopt;
  return value;
}

bool envFlag(const char *name) {
  std::optional<std::string> value = env(name);
  return value && *value != "0";
}

/// A damaged entry is worth one line on stderr, not one per launch or per
/// rank; the entry is rewritten after the recompile anyway.
/// Prints each distinct warning once per process.
void warnOnce(const std::string &message) {
  static std::mutex mutex;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lock(mutex);
  if (seen.insert(message).second)
    llvm::errs() << "dualkv: warning: " << message << "\n";
}

/// The most bytes a cache file may have: a kernel's PTX or cubin is well
/// under a megabyte; meta.json is a few hundred bytes.
constexpr size_t kMaxKernelFileBytes = 64u << 20;
constexpr size_t kMaxMetaBytes = 1u << 20;

/// A cache folder opened for use, or why not. `untrusted` marks a folder that
/// is not this user's alone (or not a folder at all): the whole disk cache is
/// then refused, since anything written there could be replaced by others.
struct OpenedDir {
  FileDescriptor fd;
  bool missing = false;
  bool untrusted = false;
  std::string why;
};

/// Opens the folder `name` inside `parent` (a path when `parent` is
/// AT_FDCWD); only the cache root may be reached through a symbolic link (the
/// folder it names is checked). With `create`, a missing folder is made 0700.
OpenedDir openCacheDir(int parent, const std::string &name,
                       const std::string &shown, bool isRoot, bool create) {
  OpenedDir r;
  const int flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC |
                    (isRoot ? 0 : static_cast<int>(O_NOFOLLOW));
  r.fd = FileDescriptor(::openat(parent, name.c_str(), flags));
  std::string createError;
  if (!r.fd && errno == ENOENT && create) {
    if (isRoot) {
      if (std::error_code ec = llvm::sys::fs::create_directories(
              name, /*IgnoreExisting=*/true, llvm::sys::fs::owner_all))
        createError = ec.message();
    } else if (::mkdirat(parent, name.c_str(), 0700) != 0 && errno != EEXIST) {
      createError = std::strerror(errno);
    }
    r.fd = FileDescriptor(::openat(parent, name.c_str(), flags));
  }
  if (!r.fd && !createError.empty()) {
    // A read-only or full file system: an error, not a miss.
    r.why = fmt::format("cannot create {}: {}", shown, createError);
    return r;
  }
  if (!r.fd) {
    int err = errno;
    r.missing = err == ENOENT;
    r.untrusted = err == ELOOP || err == ENOTDIR;
    r.why = r.untrusted
                ? fmt::format("{} is not a folder (a symbolic link or a file)",
                              shown)
                : fmt::format("cannot open {}: {}", shown, std::strerror(err));
    return r;
  }
  struct stat st;
  if (::fstat(r.fd.get(), &st) != 0) {
    r.why = fmt::format("cannot examine {}: {}", shown, std::strerror(errno));
    r.fd = FileDescriptor();
    return r;
  }
  std::string reason = untrustedReason(st.st_uid, st.st_mode);
  if (!reason.empty()) {
    r.untrusted = true;
    r.why = fmt::format("{}: {}", shown, reason);
    r.fd = FileDescriptor();
  }
  return r;
}

/// Writes `bytes` to `name` in the folder `dir` so that no reader ever sees a
/// partial file: a 0600 temp file unique to this process and call (pid plus
/// random characters, so threads and ranks never share one) in the same
/// folder, then renameat(2), which is atomic and replaces whatever `name` was
/// (a damaged file, a link, a FIFO).
bool writeAtomically(int dir, const std::string &shownDir,
                     const std::string &name, llvm::StringRef bytes,
                     std::string *why) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  std::string tmp;
  FileDescriptor fd;
  for (int attempt = 0; attempt < 100 && !fd; ++attempt) {
    tmp = fmt::format("{}.tmp.{}.{:x}", name, ::getpid(),
                      salt ^ (counter++ * 0x9E3779B97F4A7C15ull));
    fd = FileDescriptor(
        ::openat(dir, tmp.c_str(),
                 O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!fd && errno != EEXIST)
      break;
  }
  if (!fd) {
    if (why)
      *why = fmt::format("cannot create a temp file in {}: {}", shownDir,
                         std::strerror(errno));
    return false;
  }
  const char *at = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    ssize_t n = ::write(fd.get(), at, left);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0) {
      if (why)
        *why = fmt::format("cannot write {}/{}: {}", shownDir, tmp,
                           std::strerror(n < 0 ? errno : EIO));
      ::unlinkat(dir, tmp.c_str(), 0);
      return false;
    }
    at += n;
    left -= static_cast<size_t>(n);
  }
  if (::close(fd.release()) != 0 ||
      ::renameat(dir, tmp.c_str(), dir, name.c_str()) != 0) {
    if (why)
      *why = fmt::format("cannot write {}/{}: {}", shownDir, name,
                         std::strerror(errno));
    ::unlinkat(dir, tmp.c_str(), 0);
    return false;
  }
  return true;
}

/// Roots refused in this process: each is reported once, then left alone.
struct RefusedRoots {
  std::mutex mutex;
  std::set<std::string> roots;
};
RefusedRoots &refusedRoots() {
  static RefusedRoots refused;
  return refused;
}

/// The checksum of a meta.json: SHA-256 of its canonical JSON without the
/// checksum field itself, so that it covers the key, the launch geometry and
/// (through their own sums) the PTX and cubin.
std::string entryChecksum(json meta) {
  meta.erase("sha256");
  return sha256Hex(meta.dump());
}

/// True when `name` is a plain C identifier of sane length (a kernel's entry
/// point; also the arch folder's name).
bool isIdentifier(const std::string &name) {
  if (name.empty() || name.size() > 256 ||
      std::isdigit(static_cast<unsigned char>(name[0])))
    return false;
  for (char c : name)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_')
      return false;
  return true;
}

std::string joinPath(llvm::StringRef a, llvm::StringRef b) {
  llvm::SmallString<256> path(a);
  llvm::sys::path::append(path, b);
  return path.str().str();
}

} // namespace

//===----------------------------------------------------------------------===//
// CacheKey
//===----------------------------------------------------------------------===//

CacheKey CacheKey::fromSpec(const KernelSpec &spec,
                            const std::string &compilerFingerprint) {
  CacheKey key;
  key.kind = spec.kind;
  key.P = spec.P;
  key.N = spec.N;
  key.R = spec.R;
  key.headDim = spec.headDim;
  key.numQHeads = spec.numQHeads;
  key.numKVHeads = spec.numKVHeads;
  key.dtype = spec.dtype;
  key.arch = spec.arch;
  key.tiling = spec.tiling;
  key.schedule = spec.schedule;
  key.tree = spec.tree;
  key.compilerFingerprint = compilerFingerprint;
  return key;
}

KernelSpec CacheKey::spec() const {
  KernelSpec spec;
  spec.kind = kind;
  spec.P = P;
  spec.N = N;
  spec.R = R;
  spec.headDim = headDim;
  spec.numQHeads = numQHeads;
  spec.numKVHeads = numKVHeads;
  spec.dtype = dtype;
  spec.arch = arch;
  spec.tiling = tiling;
  spec.schedule = schedule;
  spec.tree = tree;
  return spec;
}

json CacheKey::toJson() const {
  json key{
      {"schema", kSchemaVersion},
      {"kind", kindName(kind)},
      {"P", P},
      {"N", N},
      {"head_dim", headDim},
      {"num_q_heads", numQHeads},
      {"num_kv_heads", numKVHeads},
      {"dtype", dtypeName(dtype)},
      {"arch", arch},
      {"tiling",
       {{"block_m", tiling.blockM},
        {"block_n", tiling.blockN},
        {"warps", tiling.warps},
        {"stages", tiling.stages}}},
      {"schedule", toString(schedule)},
      {"compiler", compilerFingerprint},
  };
  if (tree)
    key["tree"] = true;
  if (R != 0)
    key["R"] = R;
  return key;
}

std::string CacheKey::hash() const { return sha256Hex(toJson().dump()); }

std::string CacheKey::describe() const {
  return fmt::format("{} kernel (P={} N={}{} head_dim={} Hq={} Hkv={} {} {} "
                     "tiling {}x{} warps={} stages={} schedule {}{})",
                     kindName(kind), P, N,
                     R ? fmt::format(" R={}", R) : std::string(), headDim,
                     numQHeads, numKVHeads, dtypeName(dtype), arch,
                     tiling.blockM, tiling.blockN, tiling.warps, tiling.stages,
                     toString(schedule), tree ? ", tree" : "");
}

//===----------------------------------------------------------------------===//
// DiskCache
//===----------------------------------------------------------------------===//

DiskCache::DiskCache(std::string root) : root_(std::move(root)) {}

std::string DiskCache::defaultRoot() {
  if (std::optional<std::string> dir = env("DUALKV_CACHE_DIR"))
    return *dir;
  // $XDG_CACHE_HOME, else ~/.cache: LLVM implements exactly that lookup.
  llvm::SmallString<256> base;
  if (!llvm::sys::path::cache_directory(base))
    return {};
  return joinPath(base, "dualkv");
}

std::string DiskCache::entryDir(const CacheKey &key) const {
  llvm::SmallString<256> path(root_);
  llvm::sys::path::append(path, fmt::format("v{}", CacheKey::kSchemaVersion),
                          key.arch, key.hash());
  return path.str().str();
}

void DiskCache::refuse(const std::string &why) const {
  RefusedRoots &r = refusedRoots();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    r.roots.insert(root_);
  }
  warnOnce(fmt::format("the kernel cache {} is not used: {}; kernels are "
                       "cached in memory only",
                       root_, why));
}

bool DiskCache::usable() const {
  if (root_.empty() || refused())
    return false;
  OpenedDir dir = openCacheDir(AT_FDCWD, root_, root_, /*isRoot=*/true,
                               /*create=*/false);
  if (dir.untrusted)
    refuse(dir.why);
  return !dir.untrusted;
}

bool DiskCache::refused() const {
  RefusedRoots &r = refusedRoots();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.roots.count(root_) != 0;
}

std::optional<DiskCache::EntryFolder>
DiskCache::openEntry(const CacheKey &key, bool create, std::string *why) const {
  if (root_.empty() || refused()) {
    if (why)
      *why = fmt::format("the kernel cache {} is not in use", root_);
    return std::nullopt;
  }
  if (!isIdentifier(key.arch)) {
    if (why)
      *why = fmt::format("arch '{}' cannot name a cache folder", key.arch);
    return std::nullopt;
  }
  OpenedDir dir = openCacheDir(AT_FDCWD, root_, root_, /*isRoot=*/true, create);
  std::string shown = root_;
  for (const std::string &name :
       {fmt::format("v{}", CacheKey::kSchemaVersion), key.arch, key.hash()}) {
    if (!dir.fd)
      break;
    shown = joinPath(shown, name);
    dir = openCacheDir(dir.fd.get(), name, shown, /*isRoot=*/false, create);
  }
  if (dir.untrusted)
    refuse(dir.why);
  if (!dir.fd) {
    if (why)
      *why = dir.missing ? std::string() : dir.why;
    return std::nullopt;
  }
  return EntryFolder{std::move(dir.fd), shown};
}

std::optional<CacheEntry> DiskCache::load(const CacheKey &key) const {
  std::string why;
  std::optional<EntryFolder> folder = openEntry(key, /*create=*/false, &why);
  if (!folder) {
    if (!why.empty() && !refused())
      warnOnce(fmt::format("cannot read the kernel cache: {}", why));
    return std::nullopt; // an ordinary miss says nothing
  }
  const std::string &dir = folder->path;
  const int fd = folder->fd.get();

  auto damaged = [&](const std::string &why) -> std::optional<CacheEntry> {
    warnOnce(fmt::format("cache entry {} is unusable ({}): treated as a miss",
                         dir, why));
    return std::nullopt;
  };
  // Files are read without following links, only when they are this user's
  // regular files of a bounded size; anything else is a damaged entry, which
  // the store after the recompile replaces.
  auto read = [&](const char *name, size_t maxBytes, std::string *error,
                  bool *missing) {
    return readFileChecked(fd, name,
                           FileRules{maxBytes, /*noFollow=*/true,
                                     /*ownedOnly=*/true},
                           error, missing);
  };

  bool missing = false;
  std::optional<std::string> metaText =
      read("meta.json", kMaxMetaBytes, &why, &missing);
  if (!metaText && missing)
    return std::nullopt; // an ordinary miss: say nothing
  if (!metaText)
    return damaged(why);
  if (jsonNestsDeeperThan(*metaText, kMaxJsonDepth))
    return damaged("meta.json nests too deeply");
  json meta = json::parse(*metaText, nullptr, /*allow_exceptions=*/false);
  if (!meta.is_object())
    return damaged("meta.json is not a JSON object");

  CacheEntry entry;
  std::string ptxSum, cubinSum;
  try {
    if (!meta.contains("sha256") || !meta["sha256"].is_string())
      return damaged("meta.json has no entry checksum");
    if (meta["sha256"].get<std::string>() != entryChecksum(meta))
      return damaged("meta.json does not match its checksum");
    if (meta.at("schema").get<int>() != CacheKey::kSchemaVersion)
      return damaged(fmt::format("schema version {} is not {}",
                                 meta.at("schema").dump(),
                                 CacheKey::kSchemaVersion));
    if (meta.at("key") != key.toJson())
      return damaged("meta.json describes another key");
    const json &kernel = meta.at("kernel");
    entry.info.name = kernel.at("name").get<std::string>();
    entry.info.threads = kernel.at("threads").get<int>();
    entry.info.sharedBytes = kernel.at("shared_bytes").get<int>();
    entry.info.blockM = kernel.at("block_m").get<int>();
    ptxSum = meta.at("ptx_sha256").get<std::string>();
    if (!meta.at("cubin_sha256").is_null())
      cubinSum = meta.at("cubin_sha256").get<std::string>();
  } catch (const json::exception &e) {
    return damaged(fmt::format("meta.json is malformed: {}", e.what()));
  }
  if (std::string bad = unusableLaunchShape(entry.info); !bad.empty())
    return damaged(bad);

  std::optional<std::string> ptx =
      read("kernel.ptx", kMaxKernelFileBytes, &why, nullptr);
  if (!ptx)
    return damaged(why);
  if (sha256Hex(*ptx) != ptxSum)
    return damaged("kernel.ptx does not match its checksum");
  entry.ptx = std::move(*ptx);

  if (!cubinSum.empty()) {
    std::optional<std::string> cubin =
        read("kernel.cubin", kMaxKernelFileBytes, &why, nullptr);
    if (!cubin)
      return damaged(why);
    if (sha256Hex(*cubin) != cubinSum)
      return damaged("kernel.cubin does not match its checksum");
    entry.cubin.assign(cubin->begin(), cubin->end());
  }
  return entry;
}

bool DiskCache::store(const CacheKey &key, const CacheEntry &entry,
                      std::string *why) const {
  std::optional<EntryFolder> folder = openEntry(key, /*create=*/true, why);
  if (!folder)
    return false;
  const std::string &dir = folder->path;
  const int fd = folder->fd.get();
  llvm::StringRef cubin(entry.cubin.data(), entry.cubin.size());
  json meta = {
      {"schema", CacheKey::kSchemaVersion},
      {"key", key.toJson()},
      {"kernel",
       {{"name", entry.info.name},
        {"threads", entry.info.threads},
        {"shared_bytes", entry.info.sharedBytes},
        {"block_m", entry.info.blockM}}},
      {"ptx_sha256", sha256Hex(entry.ptx)},
      {"cubin_sha256", cubin.empty() ? json(nullptr) : json(sha256Hex(cubin))},
  };
  meta["sha256"] = entryChecksum(meta);
  // meta.json goes last: it is what makes the entry visible to load(), and
  // its checksums catch a reader that interleaves with a writer whose output
  // differs from ours.
  if (!writeAtomically(fd, dir, "kernel.ptx", entry.ptx, why))
    return false;
  if (!cubin.empty() && !writeAtomically(fd, dir, "kernel.cubin", cubin, why))
    return false;
  return writeAtomically(fd, dir, "meta.json", meta.dump(2) + "\n", why);
}

std::string unusableLaunchShape(const KernelInfo &info) {
  if (!isIdentifier(info.name))
    return fmt::format("entry point '{}' is not an identifier", info.name);
  if (info.threads < 32 || info.threads > 1024 || info.threads % 32 != 0)
    return fmt::format("{} threads is not a whole number of warps up to 1024",
                       info.threads);
  if (info.blockM < 1 || info.blockM > 65536)
    return fmt::format("block_m {} is outside [1, 65536]", info.blockM);
  if (info.sharedBytes < 0 || info.sharedBytes > kMaxSharedBytes)
    return fmt::format("{} bytes of shared memory is outside [0, {}]",
                       info.sharedBytes, kMaxSharedBytes);
  return {};
}

//===----------------------------------------------------------------------===//
// Modules
//===----------------------------------------------------------------------===//

ModuleHandle &ModuleHandle::operator=(ModuleHandle &&o) noexcept {
  if (this != &o) {
    reset();
    driver_ = o.driver_;
    module_ = o.module_;
    o.driver_ = nullptr;
    o.module_ = nullptr;
  }
  return *this;
}

void ModuleHandle::reset() {
  // The result is ignored: unloading runs in destructors, and a context that
  // is already gone has taken its modules with it.
  if (module_ && driver_)
    driver_->moduleUnload(module_);
  module_ = nullptr;
  driver_ = nullptr;
}

ModuleHandle loadModule(cuda::Driver &driver, const CacheEntry &entry,
                        bool *fromPtx) {
  using namespace cuda;
  CUmodule module = nullptr;
  if (!entry.cubin.empty()) {
    CUresult r = driver.moduleLoadData(&module, entry.cubin.data());
    if (r == CUDA_SUCCESS) {
      if (fromPtx)
        *fromPtx = false;
      return ModuleHandle(&driver, module);
    }
    // A cubin for another GPU, or from a ptxas newer than the driver: the
    // PTX still works through the driver's JIT. Anything else is real.
    if (r != CUDA_ERROR_NO_BINARY_FOR_GPU && r != CUDA_ERROR_INVALID_IMAGE)
      check(r, fmt::format("cuModuleLoadData(cubin of {})", entry.info.name)
                   .c_str());
  }
  char log[8192] = {};
  CUjit_option options[] = {CU_JIT_ERROR_LOG_BUFFER,
                            CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void *values[] = {log, reinterpret_cast<void *>(sizeof(log))};
  CUresult r =
      driver.moduleLoadDataEx(&module, entry.ptx.c_str(), 2, options, values);
  if (r != CUDA_SUCCESS)
    throw Error(ErrorCode::Cuda,
                fmt::format("cuModuleLoadDataEx(PTX of {}) failed: {}{}{}",
                            entry.info.name, describe(r), log[0] ? "\n" : "",
                            log));
  if (fromPtx)
    *fromPtx = true;
  return ModuleHandle(&driver, module);
}

//===----------------------------------------------------------------------===//
// In-memory cache
//===----------------------------------------------------------------------===//

namespace {

/// The spec as requested (tiling and schedule possibly unresolved) in one
/// context, and the heads its tuned tiling is looked up under: the launch
/// path's lookup, which avoids resolving and hashing per launch. Every field
/// of the request is in it: a request that differs only in its schedule is
/// another kernel.
using FastKey =
    std::tuple<cuda::CUcontext, int, int64_t, int64_t, int64_t, int, int, int,
               int, int, int, int, int, int, int, bool, int>;

FastKey fastKey(cuda::CUcontext ctx, const KernelSpec &s, int tunedQHeads,
                int tunedKVHeads) {
  return FastKey(ctx, static_cast<int>(s.kind), s.P, s.N, s.R, s.headDim,
                 s.numQHeads, s.numKVHeads, static_cast<int>(s.dtype),
                 s.tiling.blockM, s.tiling.blockN, s.tiling.warps,
                 s.tiling.stages, tunedQHeads, tunedKVHeads, s.tree,
                 static_cast<int>(s.schedule));
}

struct KernelCache {
  // One lock for lookups and for the slow path: a compile of one key must
  // not run twice in one process; other processes are the disk layer's.
  std::mutex mutex;
  std::map<std::pair<cuda::CUcontext, std::string>,
           std::unique_ptr<LoadedKernel>>
      kernels;
  std::map<FastKey, const LoadedKernel *> byRequest;
  std::map<cuda::CUcontext, std::string> archs;
  // The counters have their own lock: compile workers update them while a
  // launch holds `mutex` waiting for those workers.
  std::mutex statsMutex;
  CacheStats stats;
};

KernelCache &kernelCache() {
  // Leaked on purpose: unloading modules during static destruction would
  // race the driver's own teardown.
  static KernelCache *cache = new KernelCache();
  return *cache;
}

const std::string &fingerprint() {
  static const std::string value = compilerFingerprint();
  return value;
}

template <typename F> void updateStats(F &&update) {
  KernelCache &cache = kernelCache();
  std::lock_guard<std::mutex> lock(cache.statsMutex);
  update(cache.stats);
}

/// One compile's outcome, shared by every thread that asked for its key.
struct Compiled {
  bool ok = false;
  CacheEntry entry;
  std::string error;
};
using CompiledPtr = std::shared_ptr<const Compiled>;

/// This process's compiles by key hash, in flight or done: a thread asking
/// for a key another thread is compiling waits for that compile instead of
/// repeating it, and a kernel set compiled together on worker threads is
/// handed to its launches without a disk round trip (nor lost when the disk
/// cache is off). A failed compile is forgotten, so a later request retries
/// and reports its error. clearKernelCache() empties it.
struct CompileTable {
  std::mutex mutex;
  std::map<std::string, std::shared_future<CompiledPtr>> byHash;
};
CompileTable &compileTable() {
  static CompileTable *table = new CompileTable(); // leaked, as kernelCache()
  return *table;
}

bool compileKnown(const std::string &hash) {
  CompileTable &table = compileTable();
  std::lock_guard<std::mutex> lock(table.mutex);
  return table.byHash.count(hash) != 0;
}

/// Keeps `entry` (read from disk for `hash`) in the compile table, so that
/// the launches after a precompile take it without reading the disk again.
void rememberEntry(const std::string &hash, const CacheEntry &entry) {
  auto done = std::make_shared<Compiled>();
  done->ok = true;
  done->entry = entry;
  std::promise<CompiledPtr> ready;
  ready.set_value(std::move(done));
  CompileTable &table = compileTable();
  std::lock_guard<std::mutex> lock(table.mutex);
  table.byHash.emplace(hash, ready.get_future().share());
}

/// The compiled entry of `key` (`spec` resolved): joins a compile of the same
/// key already under way or done in this process, else compiles it here
/// (IR dumped to $DUALKV_DUMP_IR if set) and stores it in `disk` when given.
/// Throws Error (Compile) when the compiler fails. *compiledHere (if given)
/// says whether this call compiled, rather than joined another's compile.
CacheEntry compileOnce(const KernelSpec &spec, const CacheKey &key,
                       const std::string &hash, const DiskCache *disk,
                       bool *compiledHere = nullptr) {
  CompileTable &table = compileTable();
  std::promise<CompiledPtr> promise;
  std::shared_future<CompiledPtr> future;
  bool mine = false;
  {
    std::lock_guard<std::mutex> lock(table.mutex);
    auto it = table.byHash.find(hash);
    if (it != table.byHash.end()) {
      future = it->second;
    } else {
      future = promise.get_future().share();
      table.byHash.emplace(hash, future);
      mine = true;
    }
  }
  if (compiledHere)
    *compiledHere = mine;
  if (mine) {
    auto done = std::make_shared<Compiled>();
    try {
      CompileOptions options;
      if (std::optional<std::string> dump = env("DUALKV_DUMP_IR"))
        options.dumpDir = *dump;
      // A class's kernel is the generic kernel at the class's tiling: the
      // kernels read exact lengths at run time, and the class (P, N, R)
      // only keys its cache entry, so its code is the generic code.
      KernelSpec generic = spec;
      generic.P = generic.N = generic.R = 0;
      auto start = std::chrono::steady_clock::now();
      CompileResult result = compile(generic, options);
      double ms = std::chrono::duration<double, std::milli>(
                      std::chrono::steady_clock::now() - start)
                      .count();
      updateStats([&](CacheStats &stats) {
        ++stats.compiles;
        stats.lastCompileMs = ms;
        stats.totalCompileMs += ms;
      });
      if (!result.ok) {
        done->error = fmt::format("compiling the {} failed:\n{}",
                                  key.describe(), result.error);
      } else {
        done->entry = CacheEntry{result.info, std::move(result.ptx),
                                 std::move(result.cubin)};
        done->ok = true;
        std::string why;
        if (disk && !disk->store(key, done->entry, &why) && !disk->refused())
          warnOnce(fmt::format("cannot write the kernel cache: {}", why));
      }
    } catch (const std::exception &e) {
      done->error =
          fmt::format("compiling the {} failed: {}", key.describe(), e.what());
    } catch (...) {
      done->error =
          fmt::format("compiling the {} failed: unknown error", key.describe());
    }
    if (!done->ok) {
      std::lock_guard<std::mutex> lock(table.mutex);
      table.byHash.erase(hash);
    }
    promise.set_value(done);
  }
  CompiledPtr compiled = future.get();
  if (!compiled->ok)
    throw Error(ErrorCode::Compile, compiled->error);
  return compiled->entry;
}

/// Runs work(i) for every i below n, on up to min(n, cores) threads (the
/// caller's among them). `work` must not throw.
void parallelFor(size_t n, const std::function<void(size_t)> &work) {
  std::atomic<size_t> next{0};
  auto drain = [&] {
    for (size_t i; (i = next++) < n;)
      work(i);
  };
  const size_t width =
      std::min<size_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  for (size_t t = 1; t < width; ++t) {
    try {
      threads.emplace_back(drain);
    } catch (const std::system_error &) {
      break; // no more threads: the ones we have share the rest
    }
  }
  drain();
  for (std::thread &t : threads)
    t.join();
}

} // namespace

namespace {
/// Kernels registered ahead of time, by the hash of their key (fingerprint
/// "aot": an AOT image is trusted for its spec whatever compiler this process
/// has).
struct AotRegistry {
  std::mutex mutex;
  std::map<std::string, AotKernel> kernels;
};
AotRegistry &aotRegistry() {
  static AotRegistry registry;
  return registry;
}
std::string aotHash(const KernelSpec &spec) {
  return CacheKey::fromSpec(resolveSpec(spec), "aot").hash();
}
std::optional<CacheEntry> findAot(const KernelSpec &spec) {
  AotRegistry &r = aotRegistry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.kernels.find(aotHash(spec));
  if (it == r.kernels.end())
    return std::nullopt;
  const AotKernel &k = it->second;
  const char *bytes = static_cast<const char *>(k.image);
  return CacheEntry{k.info, k.ptx ? std::string(k.ptx) : std::string(),
                    std::vector<char>(bytes, bytes + k.imageSize)};
}
} // namespace

void registerAotKernel(const AotKernel &kernel) {
  if (!kernel.image || kernel.imageSize == 0)
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("AOT kernel {} has no image", kernel.info.name));
  AotRegistry &r = aotRegistry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.kernels[aotHash(kernel.spec)] = kernel;
}

size_t aotKernelCount() {
  AotRegistry &r = aotRegistry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.kernels.size();
}

namespace {
/// The tuning database of this process, read once (problems are reported,
/// once).
const TuningDb &tuningDb() {
  static const TuningDb db = [] {
    // The default database lives in the cache root: not read from a root
    // the cache refuses (an explicit $DUALKV_TUNING_DB may be shared).
    if (!env("DUALKV_TUNING_DB")) {
      DiskCache disk(DiskCache::defaultRoot());
      if (!disk.root().empty() && !disk.usable())
        return TuningDb();
    }
    std::string error;
    TuningDb loaded = TuningDb::load(TuningDb::defaultPath(), &error);
    if (!error.empty())
      warnOnce(error);
    return loaded;
  }();
  return db;
}

/// Where an entry came from.
enum class Origin { Aot, Memory, Disk, Compiled };

/// The entry of `spec` (resolved; `key` and `hash` its): the AOT registry,
/// this process's compiles (joining one under way), the disk cache (unless
/// DUALKV_ALWAYS_COMPILE=1), else a compile stored on disk. Counts what it
/// does in the cache stats; throws Error (Compile).
CacheEntry findOrCompile(const KernelSpec &spec, const CacheKey &key,
                         const std::string &hash, Origin *origin = nullptr) {
  auto from = [&](Origin o) {
    if (origin)
      *origin = o;
  };
  if (std::optional<CacheEntry> aot = findAot(spec)) {
    updateStats([](CacheStats &stats) { ++stats.aotHits; });
    from(Origin::Aot);
    return *aot;
  }
  DiskCache disk(DiskCache::defaultRoot());
  const bool useDisk = !disk.root().empty() && !disk.refused();
  const DiskCache *store = useDisk ? &disk : nullptr;
  if (compileKnown(hash)) {
    from(Origin::Memory);
    return compileOnce(spec, key, hash, store);
  }
  if (useDisk && !envFlag("DUALKV_ALWAYS_COMPILE")) {
    std::optional<CacheEntry> entry = disk.load(key);
    updateStats([&](CacheStats &stats) {
      ++(entry ? stats.diskHits : stats.diskMisses);
    });
    if (entry) {
      from(Origin::Disk);
      return std::move(*entry);
    }
  }
  // Memory if another thread started this key's compile meanwhile (decided
  // under the compile table's lock, where the compile is claimed).
  bool compiledHere = false;
  CacheEntry entry = compileOnce(spec, key, hash, store, &compiledHere);
  from(compiledHere ? Origin::Compiled : Origin::Memory);
  return entry;
}

/// `spec` (arch set) with its open tiling replaced by the tuned one when
/// dualkv-tune recorded one (under `tunedQHeads`:`tunedKVHeads` if given),
/// as a launch resolves it.
std::optional<KernelSpec> tunedSpec(const KernelSpec &spec, int tunedQHeads,
                                    int tunedKVHeads) {
  if (!(spec.tiling == Tiling{}))
    return std::nullopt;
  KernelSpec tunedKey = spec;
  if (tunedKVHeads > 0) {
    tunedKey.numQHeads = tunedQHeads;
    tunedKey.numKVHeads = tunedKVHeads;
  }
  std::optional<Tiling> tuned = tuningDb().find(tunedKey);
  if (!tuned)
    return std::nullopt;
  KernelSpec s = spec;
  s.tiling = *tuned;
  return s;
}

/// One kernel of a set, with the heads its tiling is tuned under.
struct SetMember {
  KernelSpec spec;
  int tunedQHeads = 0, tunedKVHeads = 0;
};

/// The kernels a backward of these heads may launch (docs/backward-abi.md):
/// bwd_pre; bwd and bwd_post for every KV head and, with several, for one KV
/// head (long batches); with `deterministic` bwd_kv and bwd_dq instead of the
/// atomics pair. `both` gives both modes' kernels.
std::vector<SetMember> backwardSet(const KernelSpec &base, bool deterministic,
                                   bool both, const Tiling &tiling) {
  auto member = [&](KernelKind kind, int hq, int hkv, const Tiling &t,
                    bool tunedWhole) {
    SetMember m;
    m.spec = base;
    m.spec.kind = kind;
    m.spec.P = 0;
    m.spec.N = 0;
    m.spec.numQHeads = hq;
    m.spec.numKVHeads = hkv;
    m.spec.tiling = t;
    m.spec.schedule = Schedule::Auto;
    if (tunedWhole) {
      m.tunedQHeads = base.numQHeads;
      m.tunedKVHeads = base.numKVHeads;
    }
    return m;
  };
  const int hq = base.numQHeads, hkv = base.numKVHeads;
  std::vector<SetMember> set = {member(KernelKind::BwdPre, hq, hkv, {}, false)};
  if (!deterministic || both) {
    set.push_back(member(KernelKind::Bwd, hq, hkv, tiling, true));
    set.push_back(member(KernelKind::BwdPost, hq, hkv, {}, false));
    if (hkv > 1 && hq % hkv == 0) {
      set.push_back(member(KernelKind::Bwd, hq / hkv, 1, tiling, true));
      set.push_back(member(KernelKind::BwdPost, hq / hkv, 1, {}, false));
    }
  }
  if (deterministic || both) {
    set.push_back(member(KernelKind::BwdKV, hq, hkv, tiling, false));
    set.push_back(member(KernelKind::BwdDQ, hq, hkv, {}, false));
  }
  return set;
}

/// Makes every member's entry available (counted in `report`, if given),
/// compiling the missing ones in parallel on worker threads; a member whose
/// tuned tiling does not build takes the default, as a launch does. Returns
/// the first error (empty when none). `probeOnly` leaves the stats alone for
/// entries the disk or the AOT registry already holds (the launch that
/// needs them reads them, and counts, itself).
std::string ensureSet(const std::vector<SetMember> &set, bool probeOnly,
                      PrecompileReport *report) {
  std::vector<std::string> errors(set.size());
  std::vector<Origin> origins(set.size(), Origin::Compiled);
  parallelFor(set.size(), [&](size_t i) {
    const SetMember &m = set[i];
    try {
      std::vector<KernelSpec> tries;
      if (std::optional<KernelSpec> tuned =
              tunedSpec(m.spec, m.tunedQHeads, m.tunedKVHeads))
        tries.push_back(*tuned);
      tries.push_back(m.spec);
      for (size_t t = 0; t < tries.size(); ++t) {
        KernelSpec spec = resolveSpec(tries[t]);
        if (std::string bad = checkSpec(spec); !bad.empty())
          throw Error(ErrorCode::InvalidArgument, bad);
        CacheKey key = CacheKey::fromSpec(spec, fingerprint());
        std::string hash = key.hash();
        try {
          if (probeOnly && !compileKnown(hash)) {
            if (findAot(spec)) {
              origins[i] = Origin::Aot;
              return;
            }
            DiskCache disk(DiskCache::defaultRoot());
            if (!disk.root().empty() && !disk.refused() &&
                !envFlag("DUALKV_ALWAYS_COMPILE") && disk.load(key)) {
              origins[i] = Origin::Disk;
              return;
            }
            // Nothing to read: compile it now, for the launch to take.
            compileOnce(spec, key, hash,
                        disk.root().empty() || disk.refused() ? nullptr
                                                              : &disk);
            return;
          }
          CacheEntry entry = findOrCompile(spec, key, hash, &origins[i]);
          if (origins[i] == Origin::Disk)
            rememberEntry(hash, entry);
          return;
        } catch (const Error &e) {
          if (e.code() != ErrorCode::Compile || t + 1 == tries.size())
            throw;
          warnOnce(fmt::format("the tuned tiling {},{},{},{} does not build; "
                               "using the default: {}",
                               spec.tiling.blockM, spec.tiling.blockN,
                               spec.tiling.warps, spec.tiling.stages,
                               e.what()));
        }
      }
    } catch (const std::exception &e) {
      errors[i] = e.what();
    } catch (...) {
      errors[i] = "unknown error";
    }
  });
  if (report)
    for (size_t i = 0; i < set.size(); ++i) {
      if (!errors[i].empty())
        continue;
      ++report->kernels;
      switch (origins[i]) {
      case Origin::Aot:
        ++report->aotHits;
        break;
      case Origin::Memory:
        ++report->memoryHits;
        break;
      case Origin::Disk:
        ++report->diskHits;
        break;
      case Origin::Compiled:
        ++report->compiles;
        break;
      }
    }
  for (const std::string &e : errors)
    if (!e.empty())
      return e;
  return {};
}

/// Finds, loads or compiles the kernel of `spec` (arch set, tiling maybe open)
/// in the current context; the cache mutex is held (compile workers never
/// take it).
const LoadedKernel &loadKernel(KernelCache &cache, cuda::CUcontext ctx,
                               const FastKey &fast, KernelSpec spec) {
  spec = resolveSpec(spec);
  CacheKey key = CacheKey::fromSpec(spec, fingerprint());
  std::string hash = key.hash();

  auto loaded = cache.kernels.find({ctx, hash});
  if (loaded != cache.kernels.end()) {
    updateStats([](CacheStats &stats) { ++stats.memoryHits; });
    cache.byRequest.emplace(fast, loaded->second.get());
    return *loaded->second;
  }

  // A backward asks for bwd_pre first: when it is not cached, neither is the
  // rest of its set, so every kernel a backward of these heads may launch by
  // default is compiled now, in parallel (where SplitDQ is the default its
  // set, which the deterministic mode shares; elsewhere both algorithms' and
  // the one-KV-head variants; what the disk holds is left for the launches
  // to read). Errors are left for the launch that needs the kernel, which
  // retries and reports them.
  if (spec.kind == KernelKind::BwdPre && !compileKnown(hash) &&
      !findAot(spec) && !envFlag("DUALKV_NO_PARALLEL_COMPILE")) {
    DiskCache disk(DiskCache::defaultRoot());
    bool onDisk = !disk.root().empty() && !disk.refused() &&
                  !envFlag("DUALKV_ALWAYS_COMPILE") && disk.load(key);
    if (!onDisk)
      ensureSet(splitDQByDefault(spec.arch)
                    ? backwardSet(spec, /*deterministic=*/true, false, {})
                    : backwardSet(spec, false, /*both=*/true, {}),
                /*probeOnly=*/true, nullptr);
  }

  std::optional<CacheEntry> entry = findOrCompile(spec, key, hash);
  // A disk entry was checked on load; this catches a compiler or an AOT image
  // that reports nonsense.
  if (std::string bad = unusableLaunchShape(entry->info); !bad.empty())
    throw Error(ErrorCode::Internal,
                fmt::format("the {} reports an unusable launch shape: {}",
                            key.describe(), bad));

  cuda::Driver &driver = cuda::driver();
  auto kernel = std::make_unique<LoadedKernel>();
  kernel->context = ctx;
  kernel->info = entry->info;
  kernel->spec = spec;
  kernel->hash = hash;
  kernel->module = loadModule(driver, *entry, &kernel->fromPtx);
  cuda::check(
      driver.moduleGetFunction(&kernel->function, kernel->module.get(),
                               kernel->info.name.c_str()),
      fmt::format("cuModuleGetFunction({})", kernel->info.name).c_str());
  // Above 48 KiB of dynamic shared memory a kernel must opt in.
  if (kernel->info.sharedBytes > 48 * 1024)
    cuda::check(driver.funcSetAttribute(
                    kernel->function,
                    cuda::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    kernel->info.sharedBytes),
                "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)");

  const LoadedKernel *result = kernel.get();
  cache.kernels.emplace(std::make_pair(ctx, hash), std::move(kernel));
  cache.byRequest.emplace(fast, result);
  return *result;
}
/// Class kernels (getKernel with a shape class) compiled on background
/// threads, by key hash. The threads only compile (the compiler, ptxas, the
/// disk cache and the compile table): loading a module, which needs the
/// driver and a context, is left to the launch that next asks for the
/// class, so no background thread ever touches a loaded kernel or a module
/// that clearKernelCache() or exit frees. They are joined by
/// waitForBackgroundCompiles(), which clearKernelCache() and an exit handler
/// run. Leaked, like kernelCache().
struct BackgroundCompiles {
  std::mutex mutex;
  std::set<std::string> pending; ///< being compiled
  std::set<std::string> failed;  ///< did not build: the generic serves
  std::vector<std::thread> threads;
  int started = 0;
  bool exitHandler = false;
};
BackgroundCompiles &backgroundCompiles() {
  static BackgroundCompiles *bg = new BackgroundCompiles();
  return *bg;
}

void markClassFailed(const std::string &hash, const std::string &what,
                     const std::string &error) {
  {
    BackgroundCompiles &bg = backgroundCompiles();
    std::lock_guard<std::mutex> lock(bg.mutex);
    bg.failed.insert(hash);
  }
  warnOnce(fmt::format("the {} does not build; the generic kernel serves its "
                       "shape class: {}",
                       what, error));
}

/// Where a class's kernel stands for a launch.
enum class ClassState { Ready, Pending, Failed };

/// Whether the class kernel `spec` (resolved; `key`, `hash` its) can be had
/// now without compiling (the compile table, the AOT registry or the disk,
/// whose entry is then kept in the compile table), is being compiled in the
/// background, or failed. When none of these and background compiles are on,
/// starts its compile on a thread of its own and says Pending; with
/// DUALKV_BACKGROUND_COMPILE=0 says Ready (the launch compiles it).
ClassState classKernelState(const KernelSpec &spec, const CacheKey &key,
                            const std::string &hash) {
  BackgroundCompiles &bg = backgroundCompiles();
  {
    std::lock_guard<std::mutex> lock(bg.mutex);
    if (bg.failed.count(hash))
      return ClassState::Failed;
    if (bg.pending.count(hash))
      return ClassState::Pending;
  }
  if (compileKnown(hash) || findAot(spec))
    return ClassState::Ready;
  DiskCache disk(DiskCache::defaultRoot());
  if (!disk.root().empty() && !disk.refused() &&
      !envFlag("DUALKV_ALWAYS_COMPILE"))
    if (std::optional<CacheEntry> entry = disk.load(key)) {
      updateStats([](CacheStats &stats) { ++stats.diskHits; });
      rememberEntry(hash, *entry);
      return ClassState::Ready;
    }
  if (env("DUALKV_BACKGROUND_COMPILE") == std::optional<std::string>("0"))
    return ClassState::Ready;

  std::lock_guard<std::mutex> lock(bg.mutex);
  if (bg.pending.count(hash)) // another launch thread was quicker
    return ClassState::Pending;
  if (!bg.exitHandler) {
    // Exit waits for the compiles: handlers run in reverse order of
    // registration, so this one runs before the destructors of the statics
    // constructed before it (the library's, LLVM's registries, the
    // fingerprint computed above), which a compile reads.
    std::atexit([] { waitForBackgroundCompiles(); });
    bg.exitHandler = true;
  }
  bg.pending.insert(hash);
  try {
    bg.threads.emplace_back([spec, key, hash] {
      std::string error;
      try {
        Origin origin = Origin::Compiled;
        CacheEntry entry = findOrCompile(spec, key, hash, &origin);
        if (origin == Origin::Disk) // written meanwhile by another process
          rememberEntry(hash, entry);
      } catch (const std::exception &e) {
        error = e.what();
      } catch (...) {
        error = "unknown error";
      }
      if (!error.empty())
        markClassFailed(hash, key.describe(), error);
      BackgroundCompiles &bg = backgroundCompiles();
      std::lock_guard<std::mutex> lock(bg.mutex);
      bg.pending.erase(hash);
    });
    ++bg.started;
  } catch (const std::system_error &) {
    // No thread to be had: the generic kernel serves this launch, and a
    // later one tries again.
    bg.pending.erase(hash);
  }
  return ClassState::Pending;
}

/// The generic kernel of `spec` (arch set; P = N = R = 0): by the request
/// `fast`, else with the tuning database's generic tiling for `tunedKey`
/// (falling back to the default, with a warning, when it does not build),
/// else the default.
const LoadedKernel &loadGeneric(KernelCache &cache, cuda::CUcontext ctx,
                                const FastKey &fast, const KernelSpec &spec,
                                const KernelSpec &tunedKey) {
  if (auto it = cache.byRequest.find(fast); it != cache.byRequest.end()) {
    updateStats([](CacheStats &stats) { ++stats.memoryHits; });
    return *it->second;
  }
  if (spec.tiling == Tiling{} && !spec.tree)
    if (std::optional<Tiling> tuned = tuningDb().find(tunedKey)) {
      KernelSpec tunedSpec = spec;
      tunedSpec.tiling = *tuned;
      try {
        return loadKernel(cache, ctx, fast, tunedSpec);
      } catch (const Error &e) {
        if (e.code() != ErrorCode::Compile)
          throw;
        warnOnce(fmt::format(
            "the tuned tiling {},{},{},{} does not build; using the "
            "default: {}",
            tuned->blockM, tuned->blockN, tuned->warps, tuned->stages,
            e.what()));
      }
    }
  return loadKernel(cache, ctx, fast, spec);
}
} // namespace

const LoadedKernel &getKernel(const KernelSpec &requested, int tunedQHeads,
                              int tunedKVHeads, const ShapeClass &shape) {
  cuda::CUcontext ctx = cuda::currentContext();
  KernelCache &cache = kernelCache();
  std::lock_guard<std::mutex> lock(cache.mutex);

  // Only an open tiling of a tuned kind has a class to look up; the tree
  // kernels (KernelSpec::tree) are not tuned at all.
  const bool classed =
      !shape.any() && requested.tiling == Tiling{} && !requested.tree;
  KernelSpec request = requested;
  if (classed) {
    request.P = shape.P;
    request.N = shape.N;
    request.R = shape.R;
  }
  FastKey fast = fastKey(ctx, request, tunedQHeads, tunedKVHeads);
  if (auto it = cache.byRequest.find(fast); it != cache.byRequest.end()) {
    updateStats([](CacheStats &stats) { ++stats.memoryHits; });
    return *it->second;
  }

  auto archIt = cache.archs.find(ctx);
  if (archIt == cache.archs.end()) {
    std::string arch = cuda::currentDeviceArch();
    std::string why;
    if (!Arch::parse(arch, &why))
      throw Error(ErrorCode::NoGpu,
                  fmt::format("the current GPU ({}) cannot run DualKV "
                              "kernels: {}",
                              arch, why));
    archIt = cache.archs.emplace(ctx, arch).first;
  }
  KernelSpec spec = requested;
  spec.arch = archIt->second;
  // An open tiling takes the tuned one when dualkv-tune measured this spec
  // (with the heads it was tuned for, if given): the class's entry first,
  // then the generic one; a tuned tiling that no longer builds falls back
  // to the generic kernel with a warning.
  KernelSpec tunedKey = spec;
  if (tunedKVHeads > 0) {
    tunedKey.numQHeads = tunedQHeads;
    tunedKey.numKVHeads = tunedKVHeads;
  }
  if (!classed)
    return loadGeneric(cache, ctx, fast, spec, tunedKey);

  const FastKey genericFast =
      fastKey(ctx, requested, tunedQHeads, tunedKVHeads);
  KernelSpec classKey = tunedKey;
  classKey.P = shape.P;
  classKey.N = shape.N;
  classKey.R = shape.R;
  if (std::optional<Tiling> tuned = tuningDb().find(classKey)) {
    KernelSpec classSpec = spec;
    classSpec.P = shape.P;
    classSpec.N = shape.N;
    classSpec.R = shape.R;
    classSpec.tiling = *tuned;
    KernelSpec resolved = resolveSpec(classSpec);
    ClassState state = ClassState::Failed;
    if (checkSpec(resolved).empty()) {
      CacheKey key = CacheKey::fromSpec(resolved, fingerprint());
      std::string hash = key.hash();
      state = cache.kernels.count({ctx, hash})
                  ? ClassState::Ready
                  : classKernelState(resolved, key, hash);
      if (state == ClassState::Ready) {
        try {
          return loadKernel(cache, ctx, fast, classSpec);
        } catch (const Error &e) {
          if (e.code() != ErrorCode::Compile)
            throw;
          markClassFailed(hash, key.describe(), e.what());
          state = ClassState::Failed;
        }
      }
    } else {
      warnOnce(fmt::format("the tuned tiling {},{},{},{} of shape class {} "
                           "cannot be compiled here ({}); the generic kernel "
                           "serves it",
                           tuned->blockM, tuned->blockN, tuned->warps,
                           tuned->stages, shape.name(), checkSpec(resolved)));
    }
    // Being compiled: the generic kernel serves this launch, under its own
    // request only, so that a later launch of the class finds the class's.
    if (state == ClassState::Pending)
      return loadGeneric(cache, ctx, genericFast, spec, tunedKey);
  }
  // No entry for the class, or its kernel does not build: the generic kernel
  // serves the class for good (the database is read once per process).
  const LoadedKernel &kernel =
      loadGeneric(cache, ctx, genericFast, spec, tunedKey);
  cache.byRequest.emplace(fast, &kernel);
  return kernel;
}

void waitForBackgroundCompiles() {
  BackgroundCompiles &bg = backgroundCompiles();
  for (;;) {
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(bg.mutex);
      threads.swap(bg.threads);
    }
    if (threads.empty())
      return;
    for (std::thread &t : threads)
      if (t.joinable())
        t.join();
  }
}

int backgroundCompilesStarted() {
  BackgroundCompiles &bg = backgroundCompiles();
  std::lock_guard<std::mutex> lock(bg.mutex);
  return bg.started;
}

PrecompileReport precompile(const PrecompileArgs &args) {
  auto start = std::chrono::steady_clock::now();
  const int D = args.head_dim, Hq = args.num_q_heads, Hkv = args.num_kv_heads;
  if (D != 64 && D != 128 && D != 256)
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("head_dim ({}) must be 64, 128 or 256", D));
  if (Hq <= 0 || Hkv <= 0 || Hq % Hkv != 0)
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("num_q_heads ({}) must be a positive multiple of "
                            "num_kv_heads ({})",
                            Hq, Hkv));
  if (args.tiling.blockM < 0 || args.tiling.blockN < 0 ||
      args.tiling.warps < 0 || args.tiling.stages < 0)
    throw Error(ErrorCode::InvalidArgument,
                "a tiling field is negative (0 takes the default)");
  std::string arch = args.arch;
  if (arch.empty()) {
    if (!gpuAvailable())
      throw Error(ErrorCode::NoGpu,
                  "nothing to take the arch from: give precompile an arch "
                  "(e.g. sm_90a), which needs no GPU");
    // The current context's device, as a launch takes it (the primary
    // context of device 0 when none is current).
    cuda::currentContext();
    arch = cuda::currentDeviceArch();
    std::string why;
    if (!Arch::parse(arch, &why))
      throw Error(ErrorCode::NoGpu,
                  fmt::format("the current GPU ({}) cannot run DualKV "
                              "kernels: {}",
                              arch, why));
  } else if (std::string why; !Arch::parse(arch, &why)) {
    throw Error(ErrorCode::InvalidArgument, "arch: " + why);
  }
  KernelSpec base;
  base.kind = KernelKind::Fwd;
  base.headDim = D;
  base.numQHeads = Hq;
  base.numKVHeads = Hkv;
  base.dtype = args.dtype;
  base.arch = arch;
  base.tiling = args.tiling;
  std::vector<SetMember> set = {SetMember{base}};
  if (args.backward) {
    // Where SplitDQ is the default (backwardAlgorithmFor), its set alone.
    std::vector<SetMember> bwd = backwardSet(
        base, args.deterministic || splitDQByDefault(arch), false, args.tiling);
    set.insert(set.end(), bwd.begin(), bwd.end());
  }
  PrecompileReport report;
  std::string error = ensureSet(set, /*probeOnly=*/false, &report);
  if (!error.empty())
    throw Error(ErrorCode::Compile, error);
  report.wallMs = std::chrono::duration<double, std::milli>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  return report;
}

void clearKernelCache() {
  // A background compile fills the compile table: finish it first, so the
  // table is empty afterwards. (It never holds a kernel or module freed here.)
  waitForBackgroundCompiles();
  KernelCache &cache = kernelCache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.byRequest.clear();
  cache.kernels.clear();
  cache.archs.clear();
  CompileTable &table = compileTable();
  std::lock_guard<std::mutex> tableLock(table.mutex);
  table.byHash.clear();
}

CacheStats cacheStats() {
  KernelCache &cache = kernelCache();
  std::lock_guard<std::mutex> lock(cache.statsMutex);
  return cache.stats;
}

void resetCacheStats() {
  KernelCache &cache = kernelCache();
  std::lock_guard<std::mutex> lock(cache.statsMutex);
  cache.stats = CacheStats();
}

} // namespace dualkv
