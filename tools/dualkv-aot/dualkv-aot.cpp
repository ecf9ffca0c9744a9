//===- dualkv-aot.cpp - compile DualKV kernels ahead of time
//---------------===//
//
// Writes PTX and cubins for kernel specs given on the command line; needs no
// GPU.
//
//===----------------------------------------------------------------------===//
#include "cache/DiskCache.h"
#include "cache/Files.h"
#include "common/CommandLine.h"
#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Tuning.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

constexpr const char *kUsage = R"(usage: dualkv-aot [options] --out DIR
       dualkv-aot [options] --into-cache [DIR]

Compile DualKV attention kernels ahead of time. For each kernel, DIR receives
(<name>: dualkv_<kind>_d<D>_h<Hq>x<Hkv>_<dtype>_<arch>_m<M>n<N>w<W>s<S>, plus
_<schedule> when --schedule names another than the compiler's choice)
<name>.ptx, <name>.cubin (when ptxas is available) and <name>.json (the spec,
launch geometry, schedule and ptxas register/spill report); a spec asked for several
archs with one tiling (launch geometry) for all of them also gets <name>.fatbin
holding every arch's cubin and the PTX (default tilings can differ by arch: the
forward's on sm_90a is the warp-specialized schedule's). No GPU is
needed.

options:
  --kind K         fwd, or bwd for the whole backward set (bwd_pre, bwd,
                   bwd_post, with several KV heads also bwd and bwd_post for
                   one KV head, and the deterministic bwd_kv, bwd_dq), or one
                   of those (default: fwd). Tiling flags apply to the main
                   kernels (fwd, bwd, bwd_kv, bwd_dq); bwd_pre and bwd_post
                   always take their defaults
  --P N            prompt-length class the kernel is tuned for; 0 = any (default 0)
  --N N            response-count class; 0 = any (default 0)
  --head-dim D     64, 128 or 256 (default 128)
  --heads HQ:HKV   query and key/value heads (default 32:8)
  --dtype T        bf16 or fp16 (default bf16)
  --arch A         target: sm_80, sm_86, sm_87, sm_89, sm_90, sm_90a, sm_100,
                   sm_103, sm_110, sm_120 or sm_121 (from sm_100 on the
                   mma_sync schedule, compile-tested only); repeat or
                   comma-separate for several (default sm_90a)
  --schedule S     auto (default: the compiler's choice for each spec),
                   mma_sync, wgmma or warp_specialized (sm_90a: the forward,
                   bwd and bwd_kv at head_dim 64 and 128);
                   one that a spec cannot use is an error. bwd_pre and
                   bwd_post always take mma_sync
  --tree           the tree variants of the query-major kernels (fwd,
                   bwd_dq) that branching prefix trees launch (with the
                   chain table, docs/forward-abi.md); other kinds as usual
  --block-m M      query rows per CTA (default: the compiler's choice)
  --block-n N      keys per KV tile (default: the compiler's choice)
  --warps W        warps per CTA (default: the compiler's choice)
  --stages S       shared-memory pipeline stages (default: the compiler's choice)
  --spec-file F    compile every spec of the JSON file F (an array of objects
                   {"kind", "P", "N", "head_dim", "heads": "HQ:HKV", "dtype",
                   "arch": "sm_90a" or ["sm_80", "sm_90a"], "tiling": "default"
                   or {"block_m", "block_n", "warps", "stages"}, "schedule"});
                   flags then give the defaults of missing fields
  --emit-registration NAME
                   also write DIR/NAME.h and DIR/NAME.cpp: the kernels embedded
                   and a function NAME_register() that registers them with the
                   runtime (dualkv/Aot.h), for libdualkv_runtime.so programs
  --tuned          take the tiling from the tuning database (dualkv-tune) for
                   each arch; a spec file says "tiling": "tuned"
  --tuning-db F    the tuning database (default: $DUALKV_TUNING_DB, else
                   <kernel cache>/tuning.json)
  --no-cubin       write PTX only, do not run ptxas
  --dump-ir DIR    also write every stage's IR into DIR/<name>/
  --out DIR        output directory (created if missing); required unless
                   --into-cache is given
  --into-cache [DIR]
                   also write every kernel into the runtime's kernel cache at
                   DIR (default: $DUALKV_CACHE_DIR, else $XDG_CACHE_HOME/dualkv,
                   else ~/.cache/dualkv) under the key a launch asks for, so
                   a later process (a container built from this image) finds
                   it on disk. The runtime asks for shape-generic kernels
                   (--P 0 --N 0) with the default tiling, or the tuned one when
                   the tuning database has one (then pass --tuned)
  -j, --jobs N     kernels compiled in parallel (default: the CPU count)
  -h, --help       show this help

exit status: 0 success, 1 compile error, 2 bad arguments.
)";

/// One spec to compile for one or more archs.
struct Job {
  dualkv::KernelSpec spec;
  std::vector<std::string> archs;
  bool tuned = false; ///< take each arch's tiling from the tuning database
  /// A slice kernel of the backward takes the tiling tuned for the whole
  /// problem: these heads (0: the spec's own).
  int tunedQHeads = 0, tunedKVHeads = 0;
};

/// The kernels a --kind value names: one kind, or "bwd" for every kernel of
/// the backward (docs/backward-abi.md).
std::optional<std::vector<dualkv::KernelKind>>
kindsNamed(const std::string &v) {
  using K = dualkv::KernelKind;
  if (v == "bwd")
    return std::vector<K>{K::BwdPre, K::Bwd, K::BwdPost, K::BwdKV, K::BwdDQ};
  for (K k : {K::Fwd, K::BwdPre, K::BwdPost, K::BwdKV, K::BwdDQ})
    if (v == dualkv::toString(k))
      return std::vector<K>{k};
  return std::nullopt;
}
constexpr const char *kKindChoices =
    "fwd, bwd, bwd_pre, bwd_post, bwd_kv, bwd_dq";

/// The C++ spelling of `kind`, for generated registration code.
const char *kindEnumerator(dualkv::KernelKind kind) {
  switch (kind) {
  case dualkv::KernelKind::Fwd:
    return "Fwd";
  case dualkv::KernelKind::BwdPre:
    return "BwdPre";
  case dualkv::KernelKind::Bwd:
    return "Bwd";
  case dualkv::KernelKind::BwdPost:
    return "BwdPost";
  case dualkv::KernelKind::BwdKV:
    return "BwdKV";
  case dualkv::KernelKind::BwdDQ:
    return "BwdDQ";
  }
  return "Fwd";
}

/// The C++ spelling of `schedule`, for generated registration code.
const char *scheduleEnumerator(dualkv::Schedule schedule) {
  switch (schedule) {
  case dualkv::Schedule::Auto:
    return "Auto";
  case dualkv::Schedule::MmaSync:
    return "MmaSync";
  case dualkv::Schedule::Wgmma:
    return "Wgmma";
  case dualkv::Schedule::WarpSpecialized:
    return "WarpSpecialized";
  }
  return "Auto";
}
constexpr const char *kScheduleChoices =
    "auto, mma_sync, wgmma, warp_specialized";

/// One job per kernel of `kinds`; the elementwise backward kernels drop any
/// tiling and schedule (theirs are fixed). The whole backward set ("bwd") with
/// several KV heads also gets bwd and bwd_post for one KV head and its query
/// heads: the runtime launches those on long batches, one KV head at a time
/// (backwardKVHeadsPerLaunch).
void expandKinds(const Job &job, const std::vector<dualkv::KernelKind> &kinds,
                 std::vector<Job> &out) {
  auto jobFor = [&](dualkv::KernelKind kind) {
    Job j = job;
    j.spec.kind = kind;
    // --tree: the query-major kernels' tree variants; the KV-major ones
    // have none (they take trees as they are).
    j.spec.tree = job.spec.tree && (kind == dualkv::KernelKind::Fwd ||
                                    kind == dualkv::KernelKind::BwdDQ);
    if (kind == dualkv::KernelKind::BwdPre ||
        kind == dualkv::KernelKind::BwdPost) {
      j.spec.tiling = {};
      j.spec.schedule = dualkv::Schedule::Auto;
      j.tuned = false;
    }
    return j;
  };
  const bool wholeSet = kinds.size() > 1;
  for (dualkv::KernelKind kind : kinds) {
    out.push_back(jobFor(kind));
    if (wholeSet && kind == dualkv::KernelKind::BwdPost &&
        job.spec.numKVHeads > 1 &&
        job.spec.numQHeads % job.spec.numKVHeads == 0) {
      for (dualkv::KernelKind sliced :
           {dualkv::KernelKind::Bwd, dualkv::KernelKind::BwdPost}) {
        Job s = jobFor(sliced);
        s.spec.numQHeads = job.spec.numQHeads / job.spec.numKVHeads;
        s.spec.numKVHeads = 1;
        s.tunedQHeads = job.spec.numQHeads;
        s.tunedKVHeads = job.spec.numKVHeads;
        out.push_back(s);
      }
    }
  }
}

struct Args {
  dualkv::KernelSpec spec;
  std::vector<std::string> archs;
  std::string specFile;
  std::string tuningDb;
  bool tuned = false;
  std::string registration;
  std::string out;
  std::string dumpIR;
  bool cubin = true;
  bool intoCache = false;
  std::string cacheDir; ///< --into-cache's DIR; empty: the runtime's default
  int jobsParallel = 0; ///< 0: the CPU count
  std::vector<Job> jobs;
  std::vector<dualkv::KernelKind> kinds = {dualkv::KernelKind::Fwd};
};

[[noreturn]] void usageError(const std::string &msg) {
  fmt::print(stderr, "dualkv-aot: {}\nrun 'dualkv-aot --help' for usage\n",
             msg);
  std::exit(2);
}

int64_t parseInt(const std::string &flag, const std::string &value) {
  std::optional<int64_t> v = dualkv::tools::parseInteger(value);
  if (!v)
    usageError(fmt::format("{} expects an integer, got '{}'", flag, value));
  if (*v < 0 || *v > std::numeric_limits<int32_t>::max())
    usageError(fmt::format("{} value '{}' is out of range (0 to 2^31 - 1)",
                           flag, value));
  return *v;
}

dualkv::Schedule parseScheduleOrDie(const std::string &flag,
                                    const std::string &value) {
  std::optional<dualkv::Schedule> s = dualkv::parseSchedule(value);
  if (!s)
    usageError(
        fmt::format("{} '{}' is not one of {}", flag, value, kScheduleChoices));
  return *s;
}

Args parseArgs(int argc, char **argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      fmt::print("{}", kUsage);
      std::exit(0);
    }
    if (flag == "--no-cubin") {
      a.cubin = false;
      continue;
    }
    if (flag == "--tuned") {
      a.tuned = true;
      continue;
    }
    if (flag == "--tree") {
      a.spec.tree = true;
      continue;
    }
    if (flag == "--into-cache") {
      a.intoCache = true;
      // DIR is optional: the next argument, unless it is another option.
      if (i + 1 < argc && argv[i + 1][0] != '-') {
        a.cacheDir = argv[++i];
        if (a.cacheDir.empty())
          usageError("--into-cache DIR is empty");
      }
      continue;
    }
    if (i + 1 >= argc)
      usageError(fmt::format("{} needs a value", flag));
    std::string v = argv[++i];
    if (flag == "--kind") {
      auto kinds = kindsNamed(v);
      if (!kinds)
        usageError(
            fmt::format("--kind '{}' is not one of {}", v, kKindChoices));
      a.kinds = *kinds;
    } else if (flag == "--P") {
      a.spec.P = parseInt(flag, v);
    } else if (flag == "--N") {
      a.spec.N = parseInt(flag, v);
    } else if (flag == "--head-dim") {
      a.spec.headDim = static_cast<int>(parseInt(flag, v));
    } else if (flag == "--heads") {
      auto colon = v.find(':');
      if (colon == std::string::npos)
        usageError(fmt::format("--heads expects HQ:HKV, got '{}'", v));
      a.spec.numQHeads = static_cast<int>(parseInt(flag, v.substr(0, colon)));
      a.spec.numKVHeads = static_cast<int>(parseInt(flag, v.substr(colon + 1)));
    } else if (flag == "--dtype") {
      if (v == "bf16")
        a.spec.dtype = dualkv::DType::BF16;
      else if (v == "fp16" || v == "f16")
        a.spec.dtype = dualkv::DType::FP16;
      else
        usageError(fmt::format("--dtype must be bf16 or fp16, got '{}'", v));
    } else if (flag == "--arch") {
      size_t pos = 0;
      while (pos <= v.size()) {
        size_t comma = v.find(',', pos);
        std::string one = v.substr(
            pos, comma == std::string::npos ? std::string::npos : comma - pos);
        std::string why;
        if (!dualkv::Arch::parse(one, &why))
          usageError("--arch: " + why);
        a.archs.push_back(one);
        if (comma == std::string::npos)
          break;
        pos = comma + 1;
      }
    } else if (flag == "--schedule") {
      a.spec.schedule = parseScheduleOrDie(flag, v);
    } else if (flag == "--block-m") {
      a.spec.tiling.blockM = static_cast<int>(parseInt(flag, v));
    } else if (flag == "--block-n") {
      a.spec.tiling.blockN = static_cast<int>(parseInt(flag, v));
    } else if (flag == "--warps") {
      a.spec.tiling.warps = static_cast<int>(parseInt(flag, v));
    } else if (flag == "--stages") {
      a.spec.tiling.stages = static_cast<int>(parseInt(flag, v));
    } else if (flag == "--tuning-db") {
      a.tuningDb = v;
    } else if (flag == "--spec-file") {
      a.specFile = v;
    } else if (flag == "--emit-registration") {
      bool ident =
          !v.empty() && !std::isdigit(static_cast<unsigned char>(v[0]));
      for (char ch : v)
        ident = ident &&
                (std::isalnum(static_cast<unsigned char>(ch)) || ch == '_');
      if (!ident)
        usageError(fmt::format(
            "--emit-registration needs a C identifier, got '{}'", v));
      a.registration = v;
    } else if (flag == "--out") {
      a.out = v;
    } else if (flag == "--dump-ir") {
      a.dumpIR = v;
    } else if (flag == "-j" || flag == "--jobs") {
      a.jobsParallel = static_cast<int>(parseInt(flag, v));
      if (a.jobsParallel < 1)
        usageError(fmt::format("{} needs at least 1, got '{}'", flag, v));
    } else {
      usageError(fmt::format("unknown option '{}'", flag));
    }
  }
  if (a.out.empty() && !a.intoCache)
    usageError("--out DIR is required (or --into-cache [DIR])");
  if (a.intoCache && a.cacheDir.empty()) {
    a.cacheDir = dualkv::DiskCache::defaultRoot();
    if (a.cacheDir.empty())
      usageError("--into-cache: no kernel cache folder: set DUALKV_CACHE_DIR "
                 "or HOME, or give DIR");
  }
  if (a.intoCache && !a.registration.empty() && a.out.empty())
    usageError("--emit-registration needs --out DIR");
  if (a.archs.empty())
    a.archs.push_back("sm_90a");
  return a;
}

/// The most bytes a spec file may have (a spec is about a hundred).
constexpr size_t kMaxSpecFileBytes = 16u << 20;

/// `v` as JSON for a message, cut short when long.
std::string brief(const nlohmann::json &v) {
  std::string text =
      v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return text.size() <= 80 ? text : text.substr(0, 77) + "...";
}

[[noreturn]] void specError(const std::string &msg) {
  fmt::print(stderr, "dualkv-aot: {}\n", msg);
  std::exit(2);
}

/// Reads --spec-file: every field is checked and a bad one named with its
/// value.
std::vector<Job> readSpecFile(const Args &a) {
  // A regular file of sane size (not a folder, FIFO or device), and no deeper
  // than a spec file can be: parsing and printing recurse per level.
  std::string why;
  std::optional<std::string> text = dualkv::readFileChecked(
      AT_FDCWD, a.specFile, dualkv::FileRules{kMaxSpecFileBytes}, &why);
  if (!text)
    specError(fmt::format("cannot read --spec-file: {}", why));
  if (dualkv::jsonNestsDeeperThan(*text, dualkv::kMaxJsonDepth))
    specError(fmt::format("--spec-file '{}' nests deeper than {} levels",
                          a.specFile, dualkv::kMaxJsonDepth));
  nlohmann::json doc =
      nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded())
    specError(fmt::format("--spec-file '{}' is not valid JSON", a.specFile));
  if (!doc.is_array())
    specError(fmt::format("--spec-file '{}' must hold a JSON array of specs",
                          a.specFile));
  std::vector<Job> jobs;
  for (size_t i = 0; i < doc.size(); ++i) {
    const nlohmann::json &o = doc[i];
    auto where = [&](const char *field) {
      return fmt::format("spec[{}].{}", i, field);
    };
    if (!o.is_object())
      specError(fmt::format("spec[{}] must be an object, got {}", i, brief(o)));
    Job job{a.spec, a.archs, a.tuned};
    auto integer = [&](const char *field, int64_t lo, int64_t hi,
                       int64_t dflt) {
      if (!o.contains(field))
        return dflt;
      const auto &v = o[field];
      if (!v.is_number_integer() || v.get<int64_t>() < lo ||
          v.get<int64_t>() > hi)
        specError(fmt::format("{} must be an integer in [{}, {}], got {}",
                              where(field), lo, hi, brief(v)));
      return v.get<int64_t>();
    };
    auto text = [&](const char *field) -> std::optional<std::string> {
      if (!o.contains(field))
        return std::nullopt;
      if (!o[field].is_string())
        specError(fmt::format("{} must be a string, got {}", where(field),
                              brief(o[field])));
      return o[field].get<std::string>();
    };
    for (auto &[key, value] : o.items())
      if (key != "kind" && key != "P" && key != "N" && key != "head_dim" &&
          key != "heads" && key != "dtype" && key != "arch" &&
          key != "tiling" && key != "schedule")
        specError(fmt::format("spec[{}] has an unknown field '{}'", i, key));
    std::vector<dualkv::KernelKind> kinds = a.kinds;
    if (auto kind = text("kind")) {
      auto named = kindsNamed(*kind);
      if (!named)
        specError(fmt::format("{} '{}' is not one of {}", where("kind"), *kind,
                              kKindChoices));
      kinds = *named;
    }
    const int64_t maxInt = std::numeric_limits<int32_t>::max();
    job.spec.P = integer("P", 0, maxInt, job.spec.P);
    job.spec.N = integer("N", 0, maxInt, job.spec.N);
    job.spec.headDim =
        static_cast<int>(integer("head_dim", 1, maxInt, job.spec.headDim));
    if (auto heads = text("heads")) {
      int hq = 0, hkv = 0;
      char extra = 0;
      if (std::sscanf(heads->c_str(), "%d:%d%c", &hq, &hkv, &extra) != 2 ||
          hq <= 0 || hkv <= 0)
        specError(fmt::format("{} must be \"HQ:HKV\", got '{}'", where("heads"),
                              *heads));
      job.spec.numQHeads = hq;
      job.spec.numKVHeads = hkv;
    }
    if (auto dtype = text("dtype")) {
      if (*dtype == "bf16")
        job.spec.dtype = dualkv::DType::BF16;
      else if (*dtype == "fp16" || *dtype == "f16")
        job.spec.dtype = dualkv::DType::FP16;
      else
        specError(fmt::format("{} must be bf16 or fp16, got '{}'",
                              where("dtype"), *dtype));
    }
    if (o.contains("arch")) {
      nlohmann::json archs = o["arch"].is_string()
                                 ? nlohmann::json::array({o["arch"]})
                                 : o["arch"];
      if (!archs.is_array() || archs.empty())
        specError(fmt::format("{} must be an arch or a list of archs, got {}",
                              where("arch"), brief(o["arch"])));
      job.archs.clear();
      for (const auto &arch : archs) {
        std::string why = "it is not a string";
        if (!arch.is_string() ||
            !dualkv::Arch::parse(arch.get<std::string>(), &why))
          specError(
              fmt::format("{} entry {}: {}", where("arch"), brief(arch), why));
        job.archs.push_back(arch.get<std::string>());
      }
    }
    if (auto schedule = text("schedule")) {
      std::optional<dualkv::Schedule> named = dualkv::parseSchedule(*schedule);
      if (!named)
        specError(fmt::format("{} '{}' is not one of {}", where("schedule"),
                              *schedule, kScheduleChoices));
      job.spec.schedule = *named;
    }
    if (o.contains("tiling")) {
      const auto &t = o["tiling"];
      if (t.is_string() && t.get<std::string>() == "tuned") {
        // As --tuned: each arch's tiling from --tuning-db (or the default
        // database) when the kernels are built.
        job.spec.tiling = {};
        job.tuned = true;
      } else if (t.is_string() && t.get<std::string>() == "default") {
        job.spec.tiling = {};
        job.tuned = false;
      } else if (t.is_object()) {
        for (auto &[key, value] : t.items()) {
          int *field = key == "block_m"   ? &job.spec.tiling.blockM
                       : key == "block_n" ? &job.spec.tiling.blockN
                       : key == "warps"   ? &job.spec.tiling.warps
                       : key == "stages"  ? &job.spec.tiling.stages
                                          : nullptr;
          if (!field)
            specError(fmt::format("{} has an unknown field '{}'",
                                  where("tiling"), key));
          if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
              value.get<int64_t>() > 4096)
            specError(
                fmt::format("{}.{} must be an integer in [0, 4096], got {}",
                            where("tiling"), key, brief(value)));
          *field = static_cast<int>(value.get<int64_t>());
        }
      } else {
        specError(fmt::format(
            "{} must be \"default\", \"tuned\" or an object, got {}",
            where("tiling"), brief(t)));
      }
    }
    expandKinds(job, kinds, jobs);
  }
  return jobs;
}

/// "dualkv_fwd_d128_h32x8_bf16_sm_90a_m128n32w4s2"; without an arch for
/// fatbins. A schedule other than the one the compiler picks for the spec
/// is appended ("..._m128n128w8s2_wgmma"), so that two schedules of one
/// tiling never write the same files.
std::string kernelFileName(const dualkv::KernelSpec &s, bool withArch = true) {
  dualkv::KernelSpec automatic = s;
  automatic.schedule = dualkv::Schedule::Auto;
  bool chosen = s.schedule == dualkv::Schedule::Auto ||
                s.schedule == dualkv::resolveSpec(automatic).schedule;
  return fmt::format(
      "dualkv_{}{}_d{}_h{}x{}_{}{}_m{}n{}w{}s{}{}", dualkv::toString(s.kind),
      s.tree ? "_tree" : "", s.headDim, s.numQHeads, s.numKVHeads,
      dualkv::toString(s.dtype), withArch ? "_" + s.arch : std::string(),
      s.tiling.blockM, s.tiling.blockN, s.tiling.warps, s.tiling.stages,
      chosen ? std::string() : "_" + std::string(dualkv::toString(s.schedule)));
}

/// One compiled kernel, for the fatbin and the registration source.
struct Built {
  dualkv::KernelSpec spec;
  dualkv::KernelInfo info;
  std::string ptx;
  std::vector<char> cubin;
  std::string base; ///< DIR/<name>
};

/// Runs `argv` (argv[0] a path) without a shell and waits for it: no
/// argument is ever interpreted, whatever characters it holds.
bool runProgram(const std::vector<std::string> &argv) {
  std::vector<char *> args;
  for (const std::string &a : argv)
    args.push_back(const_cast<char *>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawn(&pid, args[0], nullptr, nullptr, args.data(), environ) != 0)
    return false;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR)
      return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/// Runs `fatbinary` (beside ptxas) over every arch's cubin plus the lowest
/// arch's PTX.
bool writeFatbin(const std::vector<Built> &builds, const std::string &path) {
  std::string ptxas = dualkv::ptxasPath({});
  if (ptxas.empty())
    return false;
  std::filesystem::path tool =
      std::filesystem::path(ptxas).parent_path() / "fatbinary";
  std::vector<std::string> argv = {tool.string(), "-64", "--create=" + path};
  for (const Built &b : builds) {
    std::string sm = b.spec.arch.substr(3);
    if (!b.cubin.empty())
      argv.push_back(
          fmt::format("--image3=kind=elf,sm={},file={}.cubin", sm, b.base));
  }
  argv.push_back(fmt::format("--image3=kind=ptx,sm={},file={}.ptx",
                             builds.front().spec.arch.substr(3),
                             builds.front().base));
  return runProgram(argv);
}

void writeBytes(std::ofstream &os, const std::string &name, const char *data,
                size_t size, bool terminate) {
  os << "alignas(64) const unsigned char " << name << "[] = {";
  for (size_t i = 0; i < size; ++i)
    os << (i % 20 ? "" : "\n    ")
       << static_cast<unsigned>(static_cast<unsigned char>(data[i])) << ",";
  if (terminate)
    os << "0";
  os << "};\n";
}

/// DIR/NAME.h and DIR/NAME.cpp: every kernel embedded (cubin, PTX) and
/// registered.
void writeRegistration(const std::vector<Built> &builds, const std::string &dir,
                       const std::string &name) {
  std::ofstream h(dir + "/" + name + ".h");
  h << "// Generated by dualkv-aot; do not edit.\n#pragma once\n\n"
    << "/// Registers this file's " << builds.size()
    << " DualKV kernels with the runtime (dualkv/Aot.h).\nvoid " << name
    << "_register();\n";
  std::ofstream c(dir + "/" + name + ".cpp");
  c << "// Generated by dualkv-aot; do not edit.\n#include \"" << name
    << ".h\"\n\n#include \"dualkv/Aot.h\"\n\nnamespace {\n";
  for (size_t i = 0; i < builds.size(); ++i) {
    const Built &b = builds[i];
    const std::vector<char> &image = b.cubin;
    if (!image.empty())
      writeBytes(c, fmt::format("kImage{}", i), image.data(), image.size(),
                 false);
    writeBytes(c, fmt::format("kPtx{}", i), b.ptx.data(), b.ptx.size(), true);
  }
  c << "} // namespace\n\nvoid " << name << "_register() {\n";
  for (size_t i = 0; i < builds.size(); ++i) {
    const Built &b = builds[i];
    const dualkv::KernelSpec &s = b.spec;
    c << "  {\n    dualkv::AotKernel k;\n"
      << fmt::format(
             "    k.spec.kind = dualkv::KernelKind::{};\n    k.spec.P = {};\n "
             "   "
             "k.spec.N = {};\n    k.spec.headDim = {};\n    k.spec.numQHeads = "
             "{};\n    "
             "k.spec.numKVHeads = {};\n    k.spec.dtype = dualkv::DType::{};\n "
             "   "
             "k.spec.arch = \"{}\";\n    k.spec.tiling = {{{}, {}, {}, {}}};\n"
             "    k.spec.schedule = dualkv::Schedule::{};\n"
             "    k.spec.tree = {};\n",
             kindEnumerator(s.kind), s.P, s.N, s.headDim, s.numQHeads,
             s.numKVHeads, s.dtype == dualkv::DType::BF16 ? "BF16" : "FP16",
             s.arch, s.tiling.blockM, s.tiling.blockN, s.tiling.warps,
             s.tiling.stages, scheduleEnumerator(s.schedule),
             s.tree ? "true" : "false")
      << fmt::format("    k.info.name = \"{}\";\n    k.info.threads = {};\n    "
                     "k.info.sharedBytes = {};\n    k.info.blockM = {};\n",
                     b.info.name, b.info.threads, b.info.sharedBytes,
                     b.info.blockM);
    if (!b.cubin.empty())
      c << fmt::format(
          "    k.image = kImage{};\n    k.imageSize = sizeof(kImage{});\n", i,
          i);
    else
      c << fmt::format(
          "    k.image = kPtx{};\n    k.imageSize = sizeof(kPtx{});\n", i, i);
    c << fmt::format("    k.ptx = reinterpret_cast<const char *>(kPtx{});\n", i)
      << "    dualkv::registerAotKernel(k);\n  }\n";
  }
  c << "}\n";
}

} // namespace

int main(int argc, char **argv) {
  Args args = parseArgs(argc, argv);
  std::vector<Job> jobs;
  if (args.specFile.empty())
    expandKinds({args.spec, args.archs, args.tuned}, args.kinds, jobs);
  else
    jobs = readSpecFile(args);
  std::string dbPath =
      args.tuningDb.empty() ? dualkv::TuningDb::defaultPath() : args.tuningDb;
  std::optional<dualkv::TuningDb> db;
  // --out may be absent with --into-cache: the kernels then go to the cache
  // only (the files are written to a temporary folder, for the fatbin).
  std::string outDir = args.out;
  std::filesystem::path scratch;
  if (outDir.empty()) {
    scratch = std::filesystem::temp_directory_path() /
              fmt::format("dualkv-aot.{}", ::getpid());
    outDir = scratch.string();
  }
  std::error_code ec;
  std::filesystem::create_directories(outDir, ec);
  if (ec) {
    fmt::print(stderr, "dualkv-aot: cannot create --out '{}': {}\n", outDir,
               ec.message());
    return 2;
  }
  std::optional<dualkv::DiskCache> cache;
  if (args.intoCache) {
    cache.emplace(args.cacheDir);
    if (!cache->usable()) {
      fmt::print(stderr,
                 "dualkv-aot: --into-cache: the kernel cache at '{}' is not "
                 "usable (see the warning above)\n",
                 args.cacheDir);
      return 1;
    }
  }
  int failures = 0;

  // Every (spec, arch) to compile, in output order; the compiles run in
  // parallel (each has its own MLIR and LLVM contexts), the files and the
  // report are written in order afterwards.
  struct Task {
    size_t job;
    dualkv::KernelSpec spec;
    std::string name;
    dualkv::CompileOptions options;
    dualkv::CompileResult result;
  };
  std::vector<Task> tasks;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Job &job = jobs[j];
    for (const std::string &arch : job.archs) {
      dualkv::KernelSpec spec = job.spec;
      spec.arch = arch;
      if (job.tuned) {
        if (!db) {
          std::string error;
          db = dualkv::TuningDb::load(dbPath, &error);
          if (!error.empty())
            fmt::print(stderr, "dualkv-aot: {}\n", error);
        }
        dualkv::KernelSpec key = spec;
        if (job.tunedKVHeads) {
          key.numQHeads = job.tunedQHeads;
          key.numKVHeads = job.tunedKVHeads;
        }
        std::optional<dualkv::Tiling> tuned = db->find(key);
        if (!tuned) {
          fmt::print(stderr,
                     "dualkv-aot: no tuned tiling for {} head_dim {} heads "
                     "{}:{} {} {} in "
                     "'{}': run dualkv-tune there first\n",
                     dualkv::toString(key.kind), key.headDim, key.numQHeads,
                     key.numKVHeads, dualkv::toString(key.dtype), key.arch,
                     dbPath);
          ++failures;
          continue;
        }
        spec.tiling = *tuned;
      }
      if (args.intoCache && !job.tuned && spec.tiling == dualkv::Tiling{}) {
        // A launch with an open tiling takes the tuned one when the database
        // has it: the default's entry would then never be read.
        if (!db) {
          std::string error;
          db = dualkv::TuningDb::load(dbPath, &error);
        }
        dualkv::KernelSpec key = spec;
        if (job.tunedKVHeads) {
          key.numQHeads = job.tunedQHeads;
          key.numKVHeads = job.tunedKVHeads;
        }
        if (std::optional<dualkv::Tiling> tuned = db->find(key))
          fmt::print(stderr,
                     "dualkv-aot: note: '{}' has the tiling {},{},{},{} for "
                     "{} {}, which launches take: add --tuned to cache that "
                     "one\n",
                     dbPath, tuned->blockM, tuned->blockN, tuned->warps,
                     tuned->stages, dualkv::toString(key.kind), key.arch);
      }
      spec = dualkv::resolveSpec(spec);
      Task t{j, spec, kernelFileName(spec), {}, {}};
      t.options.emitCubin = args.cubin;
      if (!args.dumpIR.empty())
        t.options.dumpDir = args.dumpIR + "/" + t.name;
      tasks.push_back(std::move(t));
    }
  }
  {
    unsigned width = args.jobsParallel > 0
                         ? static_cast<unsigned>(args.jobsParallel)
                         : std::max(1u, std::thread::hardware_concurrency());
    width = std::min<unsigned>(width, static_cast<unsigned>(tasks.size()));
    std::atomic<size_t> next{0};
    auto drain = [&] {
      for (size_t i; (i = next++) < tasks.size();)
        tasks[i].result = dualkv::compile(tasks[i].spec, tasks[i].options);
    };
    std::vector<std::thread> threads;
    for (unsigned t = 1; t < width; ++t)
      threads.emplace_back(drain);
    drain();
    for (std::thread &t : threads)
      t.join();
  }

  std::vector<Built> all;
  size_t nextTask = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    std::vector<Built> builds;
    for (; nextTask < tasks.size() && tasks[nextTask].job == j; ++nextTask) {
      Task &task = tasks[nextTask];
      const dualkv::KernelSpec &spec = task.spec;
      const std::string &name = task.name;
      dualkv::CompileResult &r = task.result;
      if (!r.ok) {
        fmt::print(stderr, "dualkv-aot: {}: {}\n", name, r.error);
        ++failures;
        continue;
      }
      std::string base = outDir + "/" + name;
      std::ofstream(base + ".ptx") << r.ptx;
      if (!r.cubin.empty())
        std::ofstream(base + ".cubin", std::ios::binary)
            .write(r.cubin.data(),
                   static_cast<std::streamsize>(r.cubin.size()));
      nlohmann::json meta = {
          {"kind", dualkv::toString(spec.kind)},
          {"P", spec.P},
          {"N", spec.N},
          {"head_dim", spec.headDim},
          {"num_q_heads", spec.numQHeads},
          {"num_kv_heads", spec.numKVHeads},
          {"dtype", dualkv::toString(spec.dtype)},
          {"arch", spec.arch},
          {"tiling",
           {{"block_m", spec.tiling.blockM},
            {"block_n", spec.tiling.blockN},
            {"warps", spec.tiling.warps},
            {"stages", spec.tiling.stages}}},
          {"schedule", dualkv::toString(spec.schedule)},
          {"entry", r.info.name},
          {"threads", r.info.threads},
          {"shared_bytes", r.info.sharedBytes},
          {"compiler", dualkv::compilerFingerprint()},
          {"compile_ms", r.compileMs},
          {"mlir_ms", r.mlirMs},
          {"llvm_ms", r.llvmMs},
          {"ptxas_ms", r.ptxasMs},
          {"ptxas_log", r.ptxasLog},
      };
      std::ofstream(base + ".json") << meta.dump(2) << "\n";
      fmt::print(
          "{}\n  entry {}  threads {}  shared {} B  PTX {} B  cubin {} B  "
          "compile {:.0f} ms (MLIR {:.0f} + LLVM {:.0f}) + ptxas {:.0f} ms\n",
          base, r.info.name, r.info.threads, r.info.sharedBytes, r.ptx.size(),
          r.cubin.size(), r.compileMs, r.mlirMs, r.llvmMs, r.ptxasMs);
      if (!r.ptxasLog.empty())
        fmt::print("{}", r.ptxasLog);
      if (cache) {
        // The key a launch builds: the resolved spec under this library's
        // compiler fingerprint (the same libdualkv a later process loads).
        dualkv::CacheKey key =
            dualkv::CacheKey::fromSpec(spec, dualkv::compilerFingerprint());
        std::string why;
        if (spec.P != 0 || spec.N != 0) {
          fmt::print(stderr,
                     "dualkv-aot: {}: --into-cache takes shape-generic "
                     "kernels (P = N = 0), which are what the runtime asks "
                     "for\n",
                     name);
          ++failures;
        } else if (!cache->store(key, {r.info, r.ptx, r.cubin}, &why)) {
          fmt::print(stderr,
                     "dualkv-aot: {}: cannot write the kernel cache: "
                     "{}\n",
                     name, why);
          ++failures;
        } else {
          fmt::print("  cached {}\n", cache->entryDir(key));
        }
      }
      builds.push_back(
          {spec, r.info, std::move(r.ptx), std::move(r.cubin), base});
    }
    // A fatbin holds one kernel for every arch: one launch geometry and one
    // entry point, so one tiling and one schedule.
    bool oneTiling = true, oneEntry = true;
    std::string tilings, schedules;
    for (const Built &b : builds) {
      oneTiling = oneTiling && b.spec.tiling == builds.front().spec.tiling;
      oneEntry = oneEntry && b.info.name == builds.front().info.name;
      tilings +=
          fmt::format("{}{} {},{},{},{}", tilings.empty() ? "" : ", ",
                      b.spec.arch, b.spec.tiling.blockM, b.spec.tiling.blockN,
                      b.spec.tiling.warps, b.spec.tiling.stages);
      schedules += fmt::format("{}{} {}", schedules.empty() ? "" : ", ",
                               b.spec.arch, dualkv::toString(b.spec.schedule));
    }
    if (builds.size() > 1 && args.cubin && !oneTiling) {
      fmt::print("  no fatbin: the archs' tilings differ ({}), and so do "
                 "their launch geometries\n",
                 tilings);
    } else if (builds.size() > 1 && args.cubin && !oneEntry) {
      fmt::print("  no fatbin: the archs' schedules differ ({}), and so do "
                 "their entry points\n",
                 schedules);
    } else if (builds.size() > 1 && args.cubin) {
      std::string fatbin =
          outDir + "/" + kernelFileName(builds.front().spec, false) + ".fatbin";
      if (writeFatbin(builds, fatbin)) {
        fmt::print("{}\n  fatbin of {} archs + PTX\n", fatbin, builds.size());
      } else {
        fmt::print(stderr, "dualkv-aot: fatbinary failed for {}\n", fatbin);
        ++failures;
      }
    }
    all.insert(all.end(), builds.begin(), builds.end());
  }
  if (!args.registration.empty() && !failures) {
    writeRegistration(all, args.out, args.registration);
    fmt::print("{}/{}.h, .cpp\n  registration of {} kernels: {}_register()\n",
               args.out, args.registration, all.size(), args.registration);
  }
  if (!scratch.empty())
    std::filesystem::remove_all(scratch, ec);
  return failures ? 1 : 0;
}
