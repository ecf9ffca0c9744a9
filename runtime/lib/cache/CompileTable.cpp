// This process's compiles, shared by every thread that asks for a key, and
// the lookup order of a kernel's image: AOT, this process, disk, compiler.
#include "cache/CompileTable.h"

#include "cache/AotRegistry.h"
#include "cache/Stats.h"
#include "dualkv/HeadDims.h"
#include "support/Env.h"
#include "support/Status.h"

#include <fmt/format.h>

#include <cctype>
#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <mutex>

namespace dualkv {

namespace {

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

/// The folder of `spec`'s IR dump under $DUALKV_DUMP_IR: one a kernel, so
/// that the kernels of a process do not overwrite each other's files, named
/// as dualkv-aot names its kernels (schedule included). Only letters, digits
/// and '_' are kept: the name is one folder, whatever the arch string holds.
std::string dumpFolderName(const KernelSpec &s) {
  std::string name = fmt::format(
      "dualkv_{}{}{}{}{}{}{}_{}_h{}x{}_{}_{}_m{}n{}w{}s{}_{}", toString(s.kind),
      s.tree ? "_tree" : "", s.dlse ? "_dlse" : "", s.sinks ? "_sinks" : "",
      s.softcap > 0 ? fmt::format("_softcap{}", s.softcap) : std::string(),
      s.window ? "_window" : "",
      s.scoreMod.empty() ? std::string()
                         : "_scoremod" + sha256Hex(s.scoreMod).substr(0, 8),
      headShapeName(s.headDim, s.vDim()), s.numQHeads, s.numKVHeads,
      toString(s.dtype), s.arch, s.tiling.blockM, s.tiling.blockN,
      s.tiling.warps, s.tiling.stages, toString(s.schedule));
  for (char &c : name)
    if (!std::isalnum(static_cast<unsigned char>(c)))
      c = '_';
  return name;
}

} // namespace

const std::string &fingerprint() {
  static const std::string value = compilerFingerprint();
  return value;
}

bool compileKnown(const std::string &hash) {
  CompileTable &table = compileTable();
  std::lock_guard<std::mutex> lock(table.mutex);
  return table.byHash.count(hash) != 0;
}

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

llvm::Expected<CacheEntry> compileOnce(const KernelSpec &spec,
                                       const CacheKey &key,
                                       const std::string &hash,
                                       const DiskCache *disk,
                                       bool *compiledHere) {
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
        options.dumpDir = *dump + "/" + dumpFolderName(spec);
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
        if (disk)
          if (llvm::Error stored = disk->store(key, done->entry)) {
            std::string why = llvm::toString(std::move(stored));
            if (!disk->refused())
              warnOnce(fmt::format("cannot write the kernel cache: {}", why));
          }
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
    return makeError(ErrorCode::Compile, compiled->error);
  return compiled->entry;
}

llvm::Expected<CacheEntry> findOrCompile(const KernelSpec &spec,
                                         const CacheKey &key,
                                         const std::string &hash,
                                         Origin *origin) {
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
  llvm::Expected<CacheEntry> entry =
      compileOnce(spec, key, hash, store, &compiledHere);
  if (entry)
    from(compiledHere ? Origin::Compiled : Origin::Memory);
  return entry;
}

void forgetCompiles() {
  CompileTable &table = compileTable();
  std::lock_guard<std::mutex> lock(table.mutex);
  table.byHash.clear();
}

} // namespace dualkv
