// Which kernels an operation launches: the one place that knows the sets.
#include "selection/KernelSets.h"

#include "cache/AotRegistry.h"
#include "cache/CompileTable.h"
#include "driver/CudaDriver.h"
#include "driver/Launch.h"
#include "dualkv/HeadDims.h"
#include "selection/Tuned.h"
#include "support/Env.h"
#include "support/Parallel.h"
#include "support/Status.h"

#include "dualkv/Bounded.h"
#include "dualkv/Compiler/ScoreMod.h"
#include "dualkv/Device.h"

#include <fmt/format.h>

#include <chrono>
#include <optional>

namespace dualkv {

bool splitDQByDefault(const std::string &arch) {
  std::optional<Arch> a = Arch::parse(arch);
  return a && a->hasWgmma();
}

llvm::Error checkHeadsFitGrid(int numQHeads, int numKVHeads, bool backward) {
  if (numQHeads > kMaxGridYZ)
    return invalidArgument(fmt::format(
        "num_q_heads ({}) exceeds the grid limit ({})", numQHeads, kMaxGridYZ));
  // bwd_post launches a CTA row per query head and per KV head of a slice,
  // and a slice may hold every KV head.
  if (backward && int64_t(numQHeads) + numKVHeads > kMaxGridYZ)
    return invalidArgument(
        fmt::format("num_q_heads + num_kv_heads ({} + {}) exceeds the grid "
                    "limit ({})",
                    numQHeads, numKVHeads, kMaxGridYZ));
  return llvm::Error::success();
}

llvm::Error checkTilingFields(const std::string &name, const Tiling &t,
                              bool zeroTakesDefault) {
  auto powerOfTwo = [](int x) { return x > 0 && (x & (x - 1)) == 0; };
  struct Field {
    const char *name;
    int value;
    bool ok;
    const char *rule;
  };
  const Field fields[] = {
      {"blockM", t.blockM,
       powerOfTwo(t.blockM) && t.blockM >= 16 && t.blockM <= 256,
       "a power of two in [16, 256]"},
      {"blockN", t.blockN,
       powerOfTwo(t.blockN) && t.blockN >= 16 && t.blockN <= 256,
       "a power of two in [16, 256]"},
      {"warps", t.warps, powerOfTwo(t.warps) && t.warps <= 16,
       "a power of two up to 16"},
      {"stages", t.stages, t.stages >= 1 && t.stages <= 4, "1 to 4"}};
  for (const Field &f : fields) {
    if (f.value < 0)
      return invalidArgument(
          fmt::format("{}.{} ({}) is negative", name, f.name, f.value));
    if (f.ok || (zeroTakesDefault && f.value == 0))
      continue;
    return invalidArgument(
        fmt::format("{}.{} ({}) must be {}{}", name, f.name, f.value, f.rule,
                    zeroTakesDefault ? " (0 takes the default)" : ""));
  }
  return llvm::Error::success();
}

namespace {

/// The most characters of an arch a message quotes (supported ones have at
/// most 6).
constexpr size_t kMaxArchQuoted = 64;

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
    // Each member keeps only the variants of its kind.
    m.spec = withVariantsOfKind(m.spec);
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
    if (std::string bad = checkSpec(spec); !bad.empty()) {
      if (t + 1 == tries.size())
        return invalidArgument(bad);
      // A tuned tiling the compiler refuses (the loader leaves such entries
      // out, so a compiler newer than the database): the default's turn.
      warnOnce(fmt::format("the tuned tiling {},{},{},{} does not build; "
                           "using the default: {}",
                           spec.tiling.blockM, spec.tiling.blockN,
                           spec.tiling.warps, spec.tiling.stages, bad));
      continue;
    }
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
  const int Dv = args.v_head_dim ? args.v_head_dim : D;
  if (args.v_head_dim < 0)
    return invalidArgument(fmt::format(
        "v_head_dim ({}) must be >= 0 (0: head_dim)", args.v_head_dim));
  if (!isSupportedHeadShape(D, Dv)) {
    if (args.v_head_dim == 0 && !isQueryKeyHeadDim(D))
      return invalidArgument(
          fmt::format("head_dim ({}) must be {}", D, headShapeChoices()));
    return invalidArgument(fmt::format(
        "head_dim ({}) with v_head_dim ({}{}) must be {}", D, args.v_head_dim,
        args.v_head_dim == 0 ? ": head_dim" : "", headShapeChoices()));
  }
  if (Hq <= 0 || Hkv <= 0 || Hq % Hkv != 0)
    return invalidArgument(
        fmt::format("num_q_heads ({}) must be a positive multiple of "
                    "num_kv_heads ({})",
                    Hq, Hkv));
  // Kernels every launch of these heads would refuse are not compiled.
  if (llvm::Error e = checkHeadsFitGrid(Hq, Hkv, args.backward))
    return e;
  if (llvm::Error e = checkTilingFields("tiling", args.tiling,
                                        /*zeroTakesDefault=*/true))
    return e;
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
  } else if (!Arch::parse(arch)) {
    // The arch is the caller's text: quoted within bounds.
    return invalidArgument(
        fmt::format("arch: arch '{}' is not supported; supported: {}",
                    clipForMessage(arch, kMaxArchQuoted), supportedArchs()));
  }
  if (std::string why = checkSoftcap(args.softcap); !why.empty())
    return invalidArgument(why);
  if (args.window && args.backward && args.deterministic)
    return invalidArgument(
        "the deterministic backward does not yet support a sliding window: "
        "precompile the window's set without deterministic (the atomic "
        "algorithm's kernels)");
  // The tensors are the launches'; the text alone picks the kernels.
  std::string scoreMod;
  if (args.score_mod && *args.score_mod) {
    ScoreModInfo info = parseScoreMod(args.score_mod);
    if (!info.error.empty())
      return invalidArgument("score_mod: " + info.error);
    scoreMod = info.canonical;
  }
  if (!scoreMod.empty() && args.backward && args.deterministic)
    return invalidArgument(
        "the deterministic backward does not yet support a score modifier: "
        "precompile the modifier's set without deterministic (the atomic "
        "algorithm's kernels)");
  KernelSpec base;
  base.kind = KernelKind::Fwd;
  base.headDim = D;
  base.valueHeadDim = Dv == D ? 0 : Dv;
  base.numQHeads = Hq;
  base.numKVHeads = Hkv;
  base.dtype = args.dtype;
  base.arch = arch;
  base.tiling = args.tiling;
  base.softcap = args.softcap;
  base.dlse = args.dlse;
  base.sinks = args.sinks;
  base.window = args.window;
  base.scoreMod = scoreMod;
  std::vector<SetMember> set = {SetMember{withVariantsOfKind(base)}};
  if (args.backward) {
    // Where SplitDQ is the default (backwardAlgorithmFor), its set alone; a
    // window's or a score modifier's backward is the atomic algorithm on
    // every arch.
    bool splitDq = !args.window && scoreMod.empty() &&
                   (args.deterministic || splitDQByDefault(arch));
    std::vector<SetMember> bwd = backwardSet(base, splitDq, false, args.tiling);
    set.insert(set.end(), bwd.begin(), bwd.end());
  }
  // A pinned tiling the compiler cannot use for one of the set's kernels is
  // the caller's mistake: refused before anything compiles.
  if (!(args.tiling == Tiling{}))
    for (const SetMember &m : set) {
      if (!(m.spec.tiling == args.tiling))
        continue;
      if (std::string why = checkSpec(m.spec); !why.empty())
        return invalidArgument(fmt::format(
            "tiling ({}, {}, {}, {}) cannot build the {} kernel: {}",
            args.tiling.blockM, args.tiling.blockN, args.tiling.warps,
            args.tiling.stages, toString(m.spec.kind), why));
    }
  PrecompileReport report;
  // Errors keep their code: Compile for a kernel that does not build.
  if (llvm::Error e = ensureSet(set, /*probeOnly=*/false, &report))
    return e;
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
