// Kernel cache: typed keys, the on-disk store, and loaded modules per context.
#include "Cache.h"

#include "dualkv/Aot.h"
#include "dualkv/Tuning.h"

#include "dualkv/dualkv.h"

#include <fmt/format.h>
#include <llvm/ADT/SmallString.h>
#include <llvm/ADT/StringExtras.h>
#include <llvm/Support/FileSystem.h>
#include <llvm/Support/MemoryBuffer.h>
#include <llvm/Support/Path.h>
#include <llvm/Support/Process.h>
#include <llvm/Support/SHA256.h>
#include <llvm/Support/raw_ostream.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <tuple>

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

std::optional<std::string> readFile(const std::string &path) {
  auto buffer = llvm::MemoryBuffer::getFile(path, /*IsText=*/false,
                                            /*RequiresNullTerminator=*/false);
  if (!buffer)
    return std::nullopt;
  return (*buffer)->getBuffer().str();
}

/// Writes `bytes` to `path` so that no reader ever sees a partial file: a
/// temp file unique to this process and call (pid plus random characters,
/// so threads and ranks never share one) in the same folder, then rename(2),
/// which is atomic within one file system.
bool writeAtomically(const std::string &path, llvm::StringRef bytes,
                     std::string *why) {
  std::string model = fmt::format("{}.tmp.{}.%%%%%%%%%%%%", path,
                                  llvm::sys::Process::getProcessId());
  int fd = -1;
  llvm::SmallString<256> tmp;
  if (std::error_code ec = llvm::sys::fs::createUniqueFile(model, fd, tmp)) {
    if (why)
      *why = fmt::format("cannot create a temp file beside {}: {}", path,
                         ec.message());
    return false;
  }
  {
    llvm::raw_fd_ostream out(fd, /*shouldClose=*/true);
    out << bytes;
    out.close();
    if (out.has_error()) {
      if (why)
        *why = fmt::format("cannot write {}: {}", tmp.str().str(),
                           out.error().message());
      out.clear_error();
      llvm::sys::fs::remove(tmp);
      return false;
    }
  }
  if (std::error_code ec = llvm::sys::fs::rename(tmp, path)) {
    if (why)
      *why = fmt::format("cannot rename {} to {}: {}", tmp.str().str(), path,
                         ec.message());
    llvm::sys::fs::remove(tmp);
    return false;
  }
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
  key.headDim = spec.headDim;
  key.numQHeads = spec.numQHeads;
  key.numKVHeads = spec.numKVHeads;
  key.dtype = spec.dtype;
  key.arch = spec.arch;
  key.tiling = spec.tiling;
  key.schedule = spec.schedule;
  key.compilerFingerprint = compilerFingerprint;
  return key;
}

KernelSpec CacheKey::spec() const {
  KernelSpec spec;
  spec.kind = kind;
  spec.P = P;
  spec.N = N;
  spec.headDim = headDim;
  spec.numQHeads = numQHeads;
  spec.numKVHeads = numKVHeads;
  spec.dtype = dtype;
  spec.arch = arch;
  spec.tiling = tiling;
  spec.schedule = schedule;
  return spec;
}

json CacheKey::toJson() const {
  return json{
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
}

std::string CacheKey::hash() const { return sha256Hex(toJson().dump()); }

std::string CacheKey::describe() const {
  return fmt::format("{} kernel (P={} N={} head_dim={} Hq={} Hkv={} {} {} "
                     "tiling {}x{} warps={} stages={} schedule {})",
                     kindName(kind), P, N, headDim, numQHeads, numKVHeads,
                     dtypeName(dtype), arch, tiling.blockM, tiling.blockN,
                     tiling.warps, tiling.stages, toString(schedule));
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

std::optional<CacheEntry> DiskCache::load(const CacheKey &key) const {
  const std::string dir = entryDir(key);
  const std::string metaPath = joinPath(dir, "meta.json");
  if (!llvm::sys::fs::exists(metaPath))
    return std::nullopt; // an ordinary miss: say nothing

  auto damaged = [&](const std::string &why) -> std::optional<CacheEntry> {
    warnOnce(fmt::format("cache entry {} is unusable ({}): treated as a miss",
                         dir, why));
    return std::nullopt;
  };

  std::optional<std::string> metaText = readFile(metaPath);
  if (!metaText)
    return damaged("meta.json cannot be read");
  json meta = json::parse(*metaText, nullptr, /*allow_exceptions=*/false);
  if (!meta.is_object())
    return damaged("meta.json is not a JSON object");

  CacheEntry entry;
  std::string ptxSum, cubinSum;
  try {
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

  std::optional<std::string> ptx = readFile(joinPath(dir, "kernel.ptx"));
  if (!ptx)
    return damaged("kernel.ptx is missing");
  if (sha256Hex(*ptx) != ptxSum)
    return damaged("kernel.ptx does not match its checksum");
  entry.ptx = std::move(*ptx);

  if (!cubinSum.empty()) {
    std::optional<std::string> cubin = readFile(joinPath(dir, "kernel.cubin"));
    if (!cubin)
      return damaged("kernel.cubin is missing");
    if (sha256Hex(*cubin) != cubinSum)
      return damaged("kernel.cubin does not match its checksum");
    entry.cubin.assign(cubin->begin(), cubin->end());
  }
  return entry;
}

bool DiskCache::store(const CacheKey &key, const CacheEntry &entry,
                      std::string *why) const {
  const std::string dir = entryDir(key);
  if (std::error_code ec = llvm::sys::fs::create_directories(dir)) {
    if (why)
      *why = fmt::format("cannot create {}: {}", dir, ec.message());
    return false;
  }
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
  // meta.json goes last: it is what makes the entry visible to load(), and
  // its checksums catch a reader that interleaves with a writer whose output
  // differs from ours.
  if (!writeAtomically(joinPath(dir, "kernel.ptx"), entry.ptx, why))
    return false;
  if (!cubin.empty() &&
      !writeAtomically(joinPath(dir, "kernel.cubin"), cubin, why))
    return false;
  return writeAtomically(joinPath(dir, "meta.json"), meta.dump(2) + "\n", why);
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

/// The spec as requested (tiling possibly unresolved) in one context, and the
/// heads its tuned tiling is looked up under: the launch path's lookup, which
/// avoids resolving and hashing per launch.
using FastKey = std::tuple<cuda::CUcontext, int, int64_t, int64_t, int, int,
                           int, int, int, int, int, int, int, int>;

FastKey fastKey(cuda::CUcontext ctx, const KernelSpec &s, int tunedQHeads,
                int tunedKVHeads) {
  return FastKey(ctx, static_cast<int>(s.kind), s.P, s.N, s.headDim,
                 s.numQHeads, s.numKVHeads, static_cast<int>(s.dtype),
                 s.tiling.blockM, s.tiling.blockN, s.tiling.warps,
                 s.tiling.stages, tunedQHeads, tunedKVHeads);
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
    std::string error;
    TuningDb loaded = TuningDb::load(TuningDb::defaultPath(), &error);
    if (!error.empty())
      warnOnce(error);
    return loaded;
  }();
  return db;
}

/// Finds, loads or compiles the kernel of `spec` (arch set, tiling maybe open)
/// in the current context; the cache mutex is held.
const LoadedKernel &loadKernel(KernelCache &cache, cuda::CUcontext ctx,
                               const FastKey &fast, KernelSpec spec) {
  spec = resolveSpec(spec);
  CacheKey key = CacheKey::fromSpec(spec, fingerprint());
  std::string hash = key.hash();

  auto loaded = cache.kernels.find({ctx, hash});
  if (loaded != cache.kernels.end()) {
    ++cache.stats.memoryHits;
    cache.byRequest.emplace(fast, loaded->second.get());
    return *loaded->second;
  }

  DiskCache disk(DiskCache::defaultRoot());
  std::optional<CacheEntry> entry = findAot(spec);
  if (entry)
    ++cache.stats.aotHits;
  if (!entry && !disk.root().empty() && !envFlag("DUALKV_ALWAYS_COMPILE")) {
    entry = disk.load(key);
    ++(entry ? cache.stats.diskHits : cache.stats.diskMisses);
  }
  if (!entry) {
    CompileOptions options;
    if (std::optional<std::string> dump = env("DUALKV_DUMP_IR"))
      options.dumpDir = *dump;
    auto start = std::chrono::steady_clock::now();
    CompileResult result = compile(spec, options);
    double ms = std::chrono::duration<double, std::milli>(
                    std::chrono::steady_clock::now() - start)
                    .count();
    ++cache.stats.compiles;
    cache.stats.lastCompileMs = ms;
    cache.stats.totalCompileMs += ms;
    if (!result.ok)
      throw Error(ErrorCode::Compile,
                  fmt::format("compiling the {} failed:\n{}", key.describe(),
                              result.error));
    entry =
        CacheEntry{result.info, std::move(result.ptx), std::move(result.cubin)};
    std::string why;
    if (!disk.root().empty() && !disk.store(key, *entry, &why))
      warnOnce(fmt::format("cannot write the kernel cache: {}", why));
  }
  if (entry->info.name.empty() || entry->info.threads <= 0 ||
      entry->info.blockM <= 0 || entry->info.sharedBytes < 0)
    throw Error(ErrorCode::Internal,
                fmt::format("the {} reports an unusable launch shape (name "
                            "'{}', {} threads, blockM {}, {} shared bytes)",
                            key.describe(), entry->info.name,
                            entry->info.threads, entry->info.blockM,
                            entry->info.sharedBytes));

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
} // namespace

const LoadedKernel &getKernel(const KernelSpec &requested, int tunedQHeads,
                              int tunedKVHeads) {
  cuda::CUcontext ctx = cuda::currentContext();
  KernelCache &cache = kernelCache();
  std::lock_guard<std::mutex> lock(cache.mutex);

  FastKey fast = fastKey(ctx, requested, tunedQHeads, tunedKVHeads);
  if (auto it = cache.byRequest.find(fast); it != cache.byRequest.end()) {
    ++cache.stats.memoryHits;
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
  // (with the heads it was tuned for, if given); a tuned tiling that no
  // longer builds falls back to the default with a warning.
  KernelSpec tunedKey = spec;
  if (tunedKVHeads > 0) {
    tunedKey.numQHeads = tunedQHeads;
    tunedKey.numKVHeads = tunedKVHeads;
  }
  if (spec.tiling == Tiling{})
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

void clearKernelCache() {
  KernelCache &cache = kernelCache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.byRequest.clear();
  cache.kernels.clear();
  cache.archs.clear();
}

CacheStats cacheStats() {
  KernelCache &cache = kernelCache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  return cache.stats;
}

void resetCacheStats() {
  KernelCache &cache = kernelCache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.stats = CacheStats();
}

} // namespace dualkv
