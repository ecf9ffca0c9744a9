// Which kernels an operation launches: the one place that knows the sets.
#include "selection/KernelSets.h"

#include "cache/AotRegistry.h"
#include "cache/CompileTable.h"
#include "driver/CudaDriver.h"
#include "selection/Tuned.h"
#include "support/Env.h"
#include "support/Parallel.h"

#include "dualkv/Device.h"
#include "dualkv/Error.h"

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
  if (!onDisk)
    ensureSet(splitDQByDefault(spec.arch)
                  ? backwardSet(spec, /*deterministic=*/true, false, {})
                  : backwardSet(spec, false, /*both=*/true, {}),
              /*probeOnly=*/true, nullptr);
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

} // namespace dualkv
