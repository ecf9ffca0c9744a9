// Which kernels an operation launches: the one place that knows the sets.
#include "selection/KernelSets.h"

#include "cache/AotRegistry.h"
#include "cache/CompileTable.h"
#include "driver/CudaDriver.h"
#include "selection/Tuned.h"
#include "support/Env.h"
#include "support/Parallel.h"
#include "support/Status.h"

#include "dualkv/Device.h"

#include <fmt/format.h>

#include <chrono>
#include <optional>

namespace dualkv {

bool splitDQByDefault(const std::string &arch) {
  std::optional<Arch> a = Arch::parse(arch);
  return a && a->hasWgmma();
}

namespace {

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

/// Makes `m`'s entry available, recording where it came from in `origin`:
/// its tuned tiling first, then (when that does not build, with a warning,
/// as a launch does) the default. `probeOnly` as for ensureSet.
llvm::Error ensureMember(const SetMember &m, bool probeOnly, Origin &origin) {
  std::vector<KernelSpec> tries;
  if (std::optional<KernelSpec> tuned =
          tunedSpec(m.spec, m.tunedQHeads, m.tunedKVHeads))
    tries.push_back(*tuned);
  tries.push_back(m.spec);
  for (size_t t = 0; t < tries.size(); ++t) {
    KernelSpec spec = resolveSpec(tries[t]);
    if (std::string bad = checkSpec(spec); !bad.empty())
      return invalidArgument(bad);
    CacheKey key = CacheKey::fromSpec(spec, fingerprint());
    std::string hash = key.hash();
    auto attempt = [&]() -> llvm::Error {
      if (probeOnly && !compileKnown(hash)) {
        if (findAot(spec)) {
          origin = Origin::Aot;
          return llvm::Error::success();
        }
        DiskCache disk(DiskCache::defaultRoot());
        if (!disk.root().empty() && !disk.refused() &&
            !envFlag("DUALKV_ALWAYS_COMPILE") && disk.load(key)) {
          origin = Origin::Disk;
          return llvm::Error::success();
        }
        // Nothing to read: compile it now, for the launch to take.
        return compileOnce(spec, key, hash,
                           disk.root().empty() || disk.refused() ? nullptr
                                                                 : &disk)
            .takeError();
      }
      llvm::Expected<CacheEntry> entry =
          findOrCompile(spec, key, hash, &origin);
      if (entry && origin == Origin::Disk)
        rememberEntry(hash, *entry);
      return entry.takeError();
    };
    llvm::Error error = attempt();
    if (!error || t + 1 == tries.size())
      return error;
    // The tuned tiling does not build: the default's turn.
    if (llvm::Error other = handleCode(
            std::move(error), ErrorCode::Compile, [&](const RuntimeError &e) {
              warnOnce(fmt::format("the tuned tiling {},{},{},{} does not "
                                   "build; using the default: {}",
                                   spec.tiling.blockM, spec.tiling.blockN,
                                   spec.tiling.warps, spec.tiling.stages,
                                   e.message()));
            }))
      return other;
  }
  return llvm::Error::success();
}

/// Makes every member's entry available (counted in `report`, if given),
/// compiling the missing ones in parallel on worker threads (ensureMember).
/// Returns the first member's error. `probeOnly` leaves the stats alone for
/// entries the disk or the AOT registry already holds (the launch that needs
/// them reads them, and counts, itself).
llvm::Error ensureSet(const std::vector<SetMember> &set, bool probeOnly,
                      PrecompileReport *report) {
  // Messages, not llvm::Errors: each worker consumes its own error.
  std::vector<std::optional<ErrorParts>> errors(set.size());
  std::vector<Origin> origins(set.size(), Origin::Compiled);
  parallelFor(set.size(), [&](size_t i) {
    try {
      if (llvm::Error e = ensureMember(set[i], probeOnly, origins[i]))
        errors[i] = takeErrorParts(std::move(e));
    } catch (const std::exception &e) { // out of memory, say
      errors[i] = ErrorParts{ErrorCode::Internal, e.what(), {}};
    } catch (...) {
      errors[i] = ErrorParts{ErrorCode::Internal, "unknown error", {}};
    }
  });
  if (report)
    for (size_t i = 0; i < set.size(); ++i) {
      if (errors[i])
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
  for (const std::optional<ErrorParts> &e : errors)
    if (e)
      return makeError(e->code, e->message, e->cause);
  return llvm::Error::success();
}

} // namespace

void prefetchBackwardSet(const KernelSpec &spec, const CacheKey &key,
                         const std::string &hash) {
  // When bwd_pre is not cached, neither is the rest of its set: every
  // kernel a backward of these heads may launch by default is compiled now,
  // in parallel (where SplitDQ is the default its set, which the
  // deterministic mode shares; elsewhere both algorithms' and the
  // one-KV-head variants; what the disk holds is left for the launches to
  // read).
  if (spec.kind != KernelKind::BwdPre || compileKnown(hash) || findAot(spec) ||
      envFlag("DUALKV_NO_PARALLEL_COMPILE"))
    return;
  DiskCache disk(DiskCache::defaultRoot());
  bool onDisk = !disk.root().empty() && !disk.refused() &&
                !envFlag("DUALKV_ALWAYS_COMPILE") && disk.load(key);
  // Errors are left for the launch that needs the kernel.
  if (!onDisk)
    llvm::consumeError(
        ensureSet(splitDQByDefault(spec.arch)
                      ? backwardSet(spec, /*deterministic=*/true, false, {})
                      : backwardSet(spec, false, /*both=*/true, {}),
                  /*probeOnly=*/true, nullptr));
}

namespace {

llvm::Expected<PrecompileReport> precompileSet(const PrecompileArgs &args) {
  auto start = std::chrono::steady_clock::now();
  const int D = args.head_dim, Hq = args.num_q_heads, Hkv = args.num_kv_heads;
  if (D != 64 && D != 128 && D != 256)
    return invalidArgument(
        fmt::format("head_dim ({}) must be 64, 128 or 256", D));
  if (Hq <= 0 || Hkv <= 0 || Hq % Hkv != 0)
    return invalidArgument(
        fmt::format("num_q_heads ({}) must be a positive multiple of "
                    "num_kv_heads ({})",
                    Hq, Hkv));
  if (args.tiling.blockM < 0 || args.tiling.blockN < 0 ||
      args.tiling.warps < 0 || args.tiling.stages < 0)
    return invalidArgument("a tiling field is negative (0 takes the default)");
  std::string arch = args.arch;
  if (arch.empty()) {
    if (!gpuAvailable())
      return makeError(ErrorCode::NoGpu,
                       "nothing to take the arch from: give precompile an "
                       "arch (e.g. sm_90a), which needs no GPU");
    // The current context's device, as a launch takes it (the primary
    // context of device 0 when none is current).
    if (llvm::Error e = cuda::currentContext().takeError())
      return e;
    if (llvm::Error e = cuda::currentDeviceArch().moveInto(arch))
      return e;
    std::string why;
    if (!Arch::parse(arch, &why))
      return makeError(ErrorCode::NoGpu,
                       fmt::format("the current GPU ({}) cannot run DualKV "
                                   "kernels: {}",
                                   arch, why));
  } else if (std::string why; !Arch::parse(arch, &why)) {
    return invalidArgument("arch: " + why);
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
  // Any member that cannot be made ready is a kernel that does not build.
  if (llvm::Error e = ensureSet(set, /*probeOnly=*/false, &report))
    return makeError(ErrorCode::Compile, takeErrorParts(std::move(e)).message);
  report.wallMs = std::chrono::duration<double, std::milli>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  return report;
}

} // namespace

PrecompileReport precompile(const PrecompileArgs &args) {
  return valueOrThrow(precompileSet(args));
}

} // namespace dualkv
