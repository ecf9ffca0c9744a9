//===- dualkv-aot.cpp - compile DualKV kernels ahead of time
//---------------===//
//
// Writes PTX and cubins for kernel specs given on the command line; needs no
// GPU.
//
//===----------------------------------------------------------------------===//
#include "cache/CacheKey.h"
#include "cache/DiskCache.h"
#include "cache/Files.h"
#include "common/CommandLine.h"
#include "common/OutputFiles.h"
#include "dualkv/Bounded.h"
#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Compiler/Schedule.h"
#include "dualkv/Compiler/ScoreMod.h"
#include "dualkv/HeadDims.h"
#include "dualkv/Tuning.h"

#include "llvm/Support/CommandLine.h"
#include "llvm/Support/MemoryBuffer.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <fcntl.h>

namespace {

namespace cl = llvm::cl;
using dualkv::tools::badValue;
using dualkv::tools::flag;
using dualkv::tools::usageError;

//===----------------------------------------------------------------------===//
// The command line
//===----------------------------------------------------------------------===//

constexpr const char *kOverview =
    R"(compile DualKV attention kernels ahead of time; no GPU is needed

  dualkv-aot [options] --out DIR
  dualkv-aot [options] --into-cache [DIR]

For each kernel, DIR receives <name>.ptx, <name>.cubin (when ptxas is
available) and <name>.json (the spec, launch geometry, schedule and ptxas
register/spill report), where <name> is
dualkv_<kind>_d<D>_h<Hq>x<Hkv>_<dtype>_<arch>_m<M>n<N>w<W>s<S> (d<D>v<Dv>
when --v-head-dim differs from --head-dim: d192v128), plus _<schedule> when
--schedule names another than the compiler's choice. A spec asked for several
archs with one tiling (launch geometry) for all of them also gets
<name>.fatbin holding every arch's cubin and the PTX (default tilings can
differ by arch: the forward's on sm_90a is the warp-specialized schedule's).

Head shapes (--head-dim, --v-head-dim): 64, 96, 128, 256 or 512 with value
rows as wide, or MLA's query/key 192 with value 128 (DeepSeek-V3): a
warp-specialized forward on sm_90a, every other kernel of it with the mma_sync
schedule. At head_dim 512 the forward and bwd_dq compute O and dQ in two CTAs
of 256 columns each, and the KV-major backward (bwd, bwd_kv) needs 204 KB of
shared memory a CTA: sm_90, sm_90a, sm_100, sm_103 and sm_110 (227 KB), not
sm_80 or sm_87 (163 KB) nor the 99 KB archs.
)";

cl::OptionCategory kernelOptions("What to compile");
cl::OptionCategory outputOptions("Where it goes");
constexpr const char *kExitStatus =
    "\nexit status: 0 success, 1 a compile error or an output that cannot be\n"
    "written, 2 bad arguments.\n";

/// "--P value '-1' is out of range (0 to 2^31 - 1)" and the like.
std::string expectsCount(llvm::StringRef flag, llvm::StringRef text,
                         std::optional<int64_t> value, int64_t lo, int64_t) {
  if (!value)
    return fmt::format("{} expects an integer, got '{}'", flag.str(),
                       text.str());
  if (*value >= 0 && *value < lo)
    return fmt::format("{} needs at least {}, got '{}'", flag.str(), lo,
                       text.str());
  return fmt::format("{} value '{}' is out of range (0 to 2^31 - 1)",
                     flag.str(), text.str());
}

constexpr int64_t kMaxCount = std::numeric_limits<int32_t>::max();
/// A count: an integer in [0, 2^31 - 1].
using Count = dualkv::tools::IntegerParser<0, kMaxCount, expectsCount>;
template <typename T>
using Names =
    dualkv::tools::NameParser<T, dualkv::tools::NameComplaint::NotOneOf>;

/// A C identifier, for the registration's file and function names.
class IdentifierParser : public cl::parser<std::string> {
public:
  using cl::parser<std::string>::parser;
  bool parse(cl::Option &, llvm::StringRef name, llvm::StringRef text,
             std::string &value) {
    bool ident =
        !text.empty() && !std::isdigit(static_cast<unsigned char>(text[0]));
    for (char ch : text)
      ident =
          ident && (std::isalnum(static_cast<unsigned char>(ch)) || ch == '_');
    if (!ident)
      return badValue(flag(name) + " needs a C identifier, got '" + text + "'");
    value = text.str();
    return false;
  }
};

// What to compile. Each is also the default of a --spec-file field.
// KernelKind::Bwd stands for the whole backward set: the fused kernel alone
// has no --kind of its own.
cl::opt<dualkv::KernelKind, false, Names<dualkv::KernelKind>> kindOption(
    "kind",
    cl::desc("the kernels (default fwd); tiling flags apply\n"
             "to the main kernels (fwd, bwd, bwd_kv, bwd_dq):\n"
             "bwd_pre and bwd_post always take their defaults"),
    cl::init(dualkv::KernelKind::Fwd),
    cl::values(clEnumValN(dualkv::KernelKind::Fwd, "fwd", "the forward"),
               clEnumValN(dualkv::KernelKind::Bwd, "bwd",
                          "the whole backward set: bwd_pre, bwd,\n"
                          "bwd_post (with several KV heads also bwd and\n"
                          "bwd_post for one KV head) and the\n"
                          "deterministic bwd_kv, bwd_dq"),
               clEnumValN(dualkv::KernelKind::BwdPre, "bwd_pre",
                          "the backward's Delta kernel"),
               clEnumValN(dualkv::KernelKind::BwdPost, "bwd_post",
                          "the backward's last kernel: fp32 accumulators\n"
                          "to the element type"),
               clEnumValN(dualkv::KernelKind::BwdKV, "bwd_kv",
                          "the deterministic backward's dK/dV kernel"),
               clEnumValN(dualkv::KernelKind::BwdDQ, "bwd_dq",
                          "the deterministic backward's dQ kernel")),
    cl::cat(kernelOptions));
cl::opt<int, false, Count>
    promptClass("P", cl::value_desc("N"),
                cl::desc("prompt-length class the kernel is tuned for;\n"
                         "0 = any (default 0)"),
                cl::cat(kernelOptions));
cl::opt<int, false, Count>
    responseClass("N", cl::value_desc("N"),
                  cl::desc("response-count class; 0 = any (default 0)"),
                  cl::cat(kernelOptions));
/// --head-dim's help: dualkv/HeadDims.h's head dims.
const std::string kHeadDimHelp =
    "query/key head size: " + dualkv::headDimChoices() +
    "\n(default 128), or 192 with --v-head-dim 128";
cl::opt<int, false, dualkv::tools::HeadDimParser>
    headDim("head-dim", cl::value_desc("D"), cl::desc(kHeadDimHelp),
            cl::init(128), cl::cat(kernelOptions));
cl::opt<int, false, dualkv::tools::ValueHeadDimParser>
    valueHeadDim("v-head-dim", cl::value_desc("DV"),
                 cl::desc("value head size (V, O, dO, dV; default: the\n"
                          "--head-dim's); apart from it only 128 with\n"
                          "--head-dim 192 (MLA: DeepSeek-V3); sm_90a's\n"
                          "forward of it is warp-specialized, the rest\n"
                          "mma_sync"),
                 cl::init(0), cl::cat(kernelOptions));
cl::opt<dualkv::tools::Heads, false, dualkv::tools::HeadsParser<Count>>
    heads("heads",
          cl::desc("HQ:HKV, query and key/value heads (default\n"
                   "32:8): HQ a multiple of HKV, at most 65535\n"
                   "(the launch grid's limit; HQ + HKV for the\n"
                   "backward)"),
          cl::cat(kernelOptions));
cl::opt<dualkv::DType, false, dualkv::tools::DTypeParser>
    dtype("dtype", cl::desc("element type (default bf16)"),
          cl::init(dualkv::DType::BF16), cl::cat(kernelOptions));
cl::list<std::string, bool, dualkv::tools::ArchParser>
    archs("arch", cl::value_desc("A"), cl::CommaSeparated,
          cl::desc("target: sm_80, sm_86, sm_87, sm_89, sm_90,\n"
                   "sm_90a, sm_100, sm_103, sm_110, sm_120 or\n"
                   "sm_121 (from sm_100 on the mma_sync schedule,\n"
                   "compile-tested only); repeat or comma-separate\n"
                   "for several (default sm_90a)"),
          cl::cat(kernelOptions));
cl::opt<dualkv::Schedule, false, Names<dualkv::Schedule>>
    schedule("schedule",
             cl::desc("how each kernel is computed (default auto); one\n"
                      "that a spec cannot use is an error; bwd_pre and\n"
                      "bwd_post always take mma_sync"),
             cl::init(dualkv::Schedule::Auto),
             cl::values(clEnumValN(dualkv::Schedule::Auto, "auto",
                                   "the compiler's choice for each spec")),
             cl::cat(kernelOptions));
cl::opt<bool> tree("tree",
                   cl::desc("the tree variants of the query-major kernels\n"
                            "(fwd, bwd_dq) that branching prefix trees launch\n"
                            "(with the chain table, docs/forward-abi.md);\n"
                            "other kinds as usual"),
                   cl::cat(kernelOptions));
cl::opt<float> softcap("softcap", cl::value_desc("C"),
                       cl::desc("logit softcap c > 0 of the kernels that\n"
                                "compute scores (fwd, bwd, bwd_kv, bwd_dq):\n"
                                "c tanh(logit / c); 0 (default): none"),
                       cl::init(0.0f), cl::cat(kernelOptions));
cl::opt<bool>
    window("window",
           cl::desc("the sliding-window variants of the kernels\n"
                    "that compute scores (fwd, bwd, bwd_kv, bwd_dq):\n"
                    "W is their launch parameter, so one kernel\n"
                    "serves every window; other kinds as usual"),
           cl::cat(kernelOptions));
cl::opt<std::string>
    scoreModFile("score-mod", cl::value_desc("FILE"),
                 cl::desc("a score modifier (MLIR text of one func.func\n"
                          "@score_mod, docs/score-modifiers.md) that the\n"
                          "kernels computing scores (fwd, bwd, bwd_kv,\n"
                          "bwd_dq) apply to every logit; other kinds as\n"
                          "usual"),
                 cl::cat(kernelOptions));
cl::opt<bool> dlse("dlse",
                   cl::desc("bwd_pre for a caller that differentiates the\n"
                            "LSE (Delta - dLSE, docs/backward-abi.md); other\n"
                            "kinds as usual"),
                   cl::cat(kernelOptions));
cl::opt<bool> sinks("sinks",
                    cl::desc("attention sinks: the forward that counts them\n"
                             "in the denominator and the bwd_pre that writes\n"
                             "their gradient; other kinds as usual"),
                    cl::cat(kernelOptions));
cl::opt<int, false, Count>
    blockM("block-m", cl::value_desc("M"),
           cl::desc("query rows per CTA (default: the compiler's\nchoice)"),
           cl::cat(kernelOptions));
cl::opt<int, false, Count>
    blockN("block-n", cl::value_desc("N"),
           cl::desc("keys per KV tile (default: the compiler's\nchoice)"),
           cl::cat(kernelOptions));
cl::opt<int, false, Count>
    warps("warps", cl::value_desc("W"),
          cl::desc("warps per CTA (default: the compiler's choice)"),
          cl::cat(kernelOptions));
cl::opt<int, false, Count>
    stages("stages", cl::value_desc("S"),
           cl::desc("shared-memory pipeline stages (default: the\n"
                    "compiler's choice)"),
           cl::cat(kernelOptions));
cl::opt<bool> tuned("tuned",
                    cl::desc("take the tiling from the tuning database\n"
                             "(dualkv-tune) for each arch; a spec file says\n"
                             "\"tiling\": \"tuned\""),
                    cl::cat(kernelOptions));
cl::opt<std::string>
    tuningDb("tuning-db", cl::value_desc("F"),
             cl::desc("the tuning database (default: $DUALKV_TUNING_DB,\n"
                      "else <kernel cache>/tuning.json, which is not\n"
                      "read from a cache folder others may write)"),
             cl::cat(kernelOptions));
cl::opt<std::string>
    specFile("spec-file", cl::value_desc("F"),
             cl::desc("compile every spec of the JSON file F: an array\n"
                      "of objects {\"kind\", \"P\", \"N\", \"head_dim\",\n"
                      "\"v_head_dim\", \"heads\": \"HQ:HKV\", \"dtype\",\n"
                      "\"arch\": \"sm_90a\" or [\"sm_80\", \"sm_90a\"],\n"
                      "\"tiling\": \"default\",\n"
                      "\"tuned\" or {\"block_m\", \"block_n\", \"warps\",\n"
                      "\"stages\"}, \"schedule\"}; flags then give the\n"
                      "defaults of missing fields"),
             cl::cat(kernelOptions));

// Where it goes.
cl::opt<std::string>
    outDir("out", cl::value_desc("DIR"),
           cl::desc("output directory (created if missing); required\n"
                    "unless --into-cache is given"),
           cl::cat(outputOptions));
cl::opt<std::string, false, dualkv::tools::OptionalValueParser>
    intoCache("into-cache", cl::value_desc("DIR"), cl::ValueOptional,
              cl::desc("also write every kernel into the runtime's\n"
                       "kernel cache at DIR (default: $DUALKV_CACHE_DIR,\n"
                       "else $XDG_CACHE_HOME/dualkv, else\n"
                       "~/.cache/dualkv) under the key a launch asks\n"
                       "for, so a later process (a container built from\n"
                       "this image) finds it on disk. The runtime asks\n"
                       "for shape-generic kernels (--P 0 --N 0) with the\n"
                       "default tiling, or the tuned one when the tuning\n"
                       "database has one (then pass --tuned)"),
              cl::cat(outputOptions));
/// Arguments that are no option: only the DIR of "--into-cache DIR" (llvm::cl
/// takes an optional value only as "--into-cache=DIR").
cl::list<std::string> operands(cl::Positional, cl::ReallyHidden,
                               cl::cat(outputOptions));
cl::opt<std::string, false, IdentifierParser>
    registration("emit-registration", cl::value_desc("NAME"),
                 cl::desc("also write DIR/NAME.h and DIR/NAME.cpp: the\n"
                          "kernels embedded and a function NAME_register()\n"
                          "that registers them with the runtime\n"
                          "(dualkv/Aot.h), for libdualkv_runtime.so\n"
                          "programs"),
                 cl::cat(outputOptions));
cl::opt<bool> noCubin("no-cubin", cl::desc("write PTX only, do not run ptxas"),
                      cl::cat(outputOptions));
cl::opt<std::string>
    dumpIR("dump-ir", cl::value_desc("DIR"),
           cl::desc("also write every stage's IR into DIR/<name>/"),
           cl::cat(outputOptions));
cl::opt<int, false, dualkv::tools::IntegerParser<1, kMaxCount, expectsCount>>
    jobsParallel("jobs", cl::value_desc("N"),
                 cl::desc("kernels compiled in parallel (default: the CPU\n"
                          "count)"),
                 cl::cat(outputOptions));
cl::alias jobsShort("j", cl::desc("Alias for --jobs"), cl::NotHidden,
                    cl::aliasopt(jobsParallel));

/// One spec to compile for one or more archs.
struct Job {
  dualkv::KernelSpec spec;
  std::vector<std::string> archs;
  bool tuned = false; ///< take each arch's tiling from the tuning database
  /// A slice kernel of the backward takes the tiling tuned for the whole
  /// problem: these heads (0: the spec's own).
  int tunedQHeads = 0, tunedKVHeads = 0;
};

/// The kernels `kind` names: one kind, or for Bwd every kernel of the
/// backward (docs/backward-abi.md).
std::vector<dualkv::KernelKind> kindsOf(dualkv::KernelKind kind) {
  using K = dualkv::KernelKind;
  if (kind == K::Bwd)
    return {K::BwdPre, K::Bwd, K::BwdPost, K::BwdKV, K::BwdDQ};
  return {kind};
}

/// The kernels a spec file's "kind" names: as --kind.
std::optional<std::vector<dualkv::KernelKind>>
kindsNamed(const std::string &v) {
  using K = dualkv::KernelKind;
  for (K k : {K::Fwd, K::Bwd, K::BwdPre, K::BwdPost, K::BwdKV, K::BwdDQ})
    if (v == dualkv::toString(k))
      return kindsOf(k);
  return std::nullopt;
}
/// Whether `kinds` holds a kernel of the backward.
bool hasBackward(const std::vector<dualkv::KernelKind> &kinds) {
  return std::any_of(kinds.begin(), kinds.end(), [](dualkv::KernelKind k) {
    return k != dualkv::KernelKind::Fwd;
  });
}

constexpr const char *kKindChoices =
    "fwd, bwd, bwd_pre, bwd_post, bwd_kv, bwd_dq";

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
    // --softcap, --dlse, --sinks, --window: the kinds that take them.
    j.spec = dualkv::withVariantsOfKind(j.spec);
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

//===----------------------------------------------------------------------===//
// The runtime's internals (cache/Files.h, cache/DiskCache.h): this file uses
// them here only.
//===----------------------------------------------------------------------===//

/// The most bytes a spec file may have (a spec is about a hundred).
constexpr size_t kMaxSpecFileBytes = 16u << 20;

/// The text of the spec file `path`: a regular file of sane size (not a
/// folder, FIFO or device), nesting no deeper than a spec file can (parsing
/// and printing recurse per level). Otherwise nothing, and *error says why.
std::optional<std::string> readSpecText(const std::string &path,
                                        std::string *error) {
  llvm::Expected<std::string> text = dualkv::readFileChecked(
      AT_FDCWD, path, dualkv::FileRules{kMaxSpecFileBytes});
  if (!text)
    *error = fmt::format("cannot read --spec-file: {}",
                         llvm::toString(text.takeError()));
  else if (dualkv::jsonNestsDeeperThan(*text, dualkv::kMaxJsonDepth))
    *error = fmt::format("--spec-file '{}' nests deeper than {} levels", path,
                         dualkv::kMaxJsonDepth);
  else
    return std::move(*text);
  return std::nullopt;
}

/// The runtime's kernel cache in a folder, written as a launch reads it.
class KernelCache {
public:
  /// The folder a process uses when given none; empty when none can be
  /// formed.
  static std::string defaultFolder() {
    return dualkv::DiskCache::defaultRoot();
  }

  explicit KernelCache(std::string folder) : disk_(std::move(folder)) {}

  /// False when the folder is not the user's alone (the cache has said why).
  bool usable() const { return disk_.usable(); }

  /// Stores the kernel `spec` compiled to under the key a launch builds: the
  /// resolved spec under this library's compiler fingerprint (the same
  /// libdualkv a later process loads). Returns the entry's folder, or
  /// nothing with *why saying what failed.
  std::optional<std::string> store(const dualkv::KernelSpec &spec,
                                   const dualkv::CompileResult &kernel,
                                   std::string *why) const {
    dualkv::CacheKey key =
        dualkv::CacheKey::fromSpec(spec, dualkv::compilerFingerprint());
    if (llvm::Error e =
            disk_.store(key, {kernel.info, kernel.ptx, kernel.cubin})) {
      *why = llvm::toString(std::move(e));
      return std::nullopt;
    }
    return disk_.entryDir(key);
  }

private:
  dualkv::DiskCache disk_;
};

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
  std::vector<dualkv::KernelKind> kinds = {dualkv::KernelKind::Fwd};
};

Args parseArgs(int argc, char **argv) {
  // The schedules after auto, as their records name and describe them.
  for (const dualkv::ScheduleRecord *r : dualkv::scheduleRecords())
    schedule.getParser().addLiteralOption(r->name, r->schedule, r->summary);
  dualkv::tools::parseCommandLine(argc, argv, "dualkv-aot",
                                  {&kernelOptions, &outputOptions}, kOverview,
                                  kExitStatus);
  Args a;
  a.kinds = kindsOf(kindOption.getValue());
  a.spec.P = promptClass;
  a.spec.N = responseClass;
  a.spec.headDim = headDim;
  if (std::string problem =
          dualkv::tools::headShapeProblem(headDim, valueHeadDim);
      !problem.empty())
    usageError(problem);
  a.spec.valueHeadDim = valueHeadDim == headDim ? 0 : valueHeadDim;
  a.spec.numQHeads = heads.query;
  a.spec.numKVHeads = heads.kv;
  a.spec.dtype = dtype;
  a.spec.schedule = schedule;
  a.spec.tree = tree;
  a.spec.softcap = softcap;
  a.spec.dlse = dlse;
  a.spec.sinks = sinks;
  a.spec.window = window;
  if (!scoreModFile.empty()) {
    auto text = llvm::MemoryBuffer::getFile(scoreModFile);
    if (!text) {
      llvm::errs() << "dualkv-aot: --score-mod " << scoreModFile << ": "
                   << text.getError().message() << "\n";
      std::exit(2);
    }
    dualkv::ScoreModInfo info =
        dualkv::parseScoreMod((*text)->getBuffer().str());
    if (!info.error.empty()) {
      llvm::errs() << "dualkv-aot: --score-mod " << scoreModFile << ": "
                   << info.error << "\n";
      std::exit(2);
    }
    a.spec.scoreMod = info.canonical;
  }
  a.spec.tiling = {blockM, blockN, warps, stages};
  a.archs.assign(archs.begin(), archs.end());
  if (a.archs.empty())
    a.archs.push_back("sm_90a");
  a.specFile = specFile;
  a.tuningDb = tuningDb;
  a.tuned = tuned;
  a.registration = registration;
  a.out = outDir;
  a.dumpIR = dumpIR;
  a.cubin = !noCubin;
  a.jobsParallel = jobsParallel;
  a.intoCache = intoCache.getNumOccurrences() > 0;
  a.cacheDir = intoCache;
  for (unsigned i = 0; i < operands.size(); ++i) {
    if (!a.intoCache || !a.cacheDir.empty() ||
        operands.getPosition(i) != intoCache.getPosition() + 1)
      usageError(fmt::format("unexpected argument '{}'", operands[i]));
    if (operands[i].empty())
      usageError("--into-cache DIR is empty");
    a.cacheDir = operands[i];
  }
  if (a.out.empty() && !a.intoCache)
    usageError("--out DIR is required (or --into-cache [DIR])");
  if (a.intoCache && a.cacheDir.empty()) {
    a.cacheDir = KernelCache::defaultFolder();
    if (a.cacheDir.empty())
      usageError("--into-cache: no kernel cache folder: set DUALKV_CACHE_DIR "
                 "or HOME, or give DIR");
  }
  if (a.intoCache && !a.registration.empty() && a.out.empty())
    usageError("--emit-registration needs --out DIR");
  // The parser checked the heads for every kernel; the backward's take one
  // more grid row each (a spec file's kinds are checked as it is read).
  if (a.specFile.empty() && hasBackward(a.kinds)) {
    std::string problem = dualkv::tools::headsProblem(
        a.spec.numQHeads, a.spec.numKVHeads, /*backward=*/true);
    if (!problem.empty())
      usageError(fmt::format("--heads {}:{}: {}", a.spec.numQHeads,
                             a.spec.numKVHeads, problem));
  }
  return a;
}

/// `v` as JSON for a message, cut short when long.
std::string brief(const nlohmann::json &v) {
  std::string text =
      v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return text.size() <= 80 ? text : text.substr(0, 77) + "...";
}

/// `v` as an integer when it is a JSON integer that int64 holds: never a
/// bool, a float (64.0 included) or an unsigned number beyond 2^63 - 1 (which
/// get<int64_t>() would wrap).
std::optional<int64_t> jsonInteger(const nlohmann::json &v) {
  if (v.is_number_unsigned()) {
    auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer())
    return v.get<int64_t>();
  return std::nullopt;
}

[[noreturn]] void specError(const std::string &msg) {
  fmt::print(stderr, "dualkv-aot: {}\n", msg);
  std::exit(2);
}

/// Reads --spec-file: every field is checked and a bad one named with its
/// value.
std::vector<Job> readSpecFile(const Args &a) {
  std::string error;
  std::optional<std::string> text = readSpecText(a.specFile, &error);
  if (!text)
    specError(error);
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
      std::optional<int64_t> n = jsonInteger(v);
      if (!n || *n < lo || *n > hi)
        specError(fmt::format("{} must be an integer in [{}, {}], got {}",
                              where(field), lo, hi, brief(v)));
      return *n;
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
          key != "v_head_dim" && key != "heads" && key != "dtype" &&
          key != "arch" && key != "tiling" && key != "schedule")
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
    // A spec's "head_dim" without "v_head_dim" has value rows as wide;
    // with neither, the flags' shape holds.
    if (o.contains("head_dim")) {
      std::optional<int64_t> d = jsonInteger(o["head_dim"]);
      if (!d || !dualkv::isQueryKeyHeadDim(*d))
        specError(fmt::format(
            "{} must be {}, or 192 with \"v_head_dim\": 128, got {}",
            where("head_dim"), dualkv::headDimChoices(), brief(o["head_dim"])));
      job.spec.headDim = static_cast<int>(*d);
      job.spec.valueHeadDim = 0;
    }
    if (o.contains("v_head_dim")) {
      std::optional<int64_t> dv = jsonInteger(o["v_head_dim"]);
      if (!dv || !dualkv::isSupportedHeadDim(*dv))
        specError(fmt::format("{} must be {}, got {}", where("v_head_dim"),
                              dualkv::headDimChoices(),
                              brief(o["v_head_dim"])));
      job.spec.valueHeadDim =
          *dv == job.spec.headDim ? 0 : static_cast<int>(*dv);
    }
    if (!dualkv::isSupportedHeadShape(job.spec.headDim, job.spec.vDim())) {
      // A split shape's query/key head_dim given alone names what it lacks.
      for (dualkv::HeadShape shape : dualkv::kSplitHeadShapes)
        if (job.spec.vDim() == job.spec.headDim && shape.qk == job.spec.headDim)
          specError(fmt::format("spec[{}]: head_dim {} needs \"v_head_dim\": "
                                "{} ({})",
                                i, shape.qk, shape.v,
                                dualkv::headShapeChoices()));
      specError(fmt::format("spec[{}]: head_dim {} with v_head_dim {} is no "
                            "head shape a kernel takes ({})",
                            i, job.spec.headDim, job.spec.vDim(),
                            dualkv::headShapeChoices()));
    }
    if (o.contains("heads")) {
      // Each count all digits and within int64 (no sscanf: "%d" wraps
      // 4294967300 to 4), then the heads every launch takes.
      const nlohmann::json &v = o["heads"];
      std::string spelled = v.is_string() ? v.get<std::string>() : "";
      llvm::StringRef q, kv;
      std::tie(q, kv) = llvm::StringRef(spelled).split(':');
      std::optional<int64_t> hq = dualkv::tools::readInteger(q),
                             hkv = dualkv::tools::readInteger(kv);
      if (!v.is_string() || q.size() == spelled.size() || !hq || !hkv)
        specError(fmt::format("{} must be \"HQ:HKV\" (two integers), got {}",
                              where("heads"), brief(v)));
      std::string problem =
          dualkv::tools::headsProblem(*hq, *hkv, hasBackward(kinds));
      if (!problem.empty())
        specError(fmt::format("{} {}: {}", where("heads"), brief(v), problem));
      job.spec.numQHeads = static_cast<int>(*hq);
      job.spec.numKVHeads = static_cast<int>(*hkv);
    } else if (hasBackward(kinds)) {
      // The heads from --heads (checked for the forward) and a backward kind
      // from the spec.
      std::string problem = dualkv::tools::headsProblem(
          job.spec.numQHeads, job.spec.numKVHeads, /*backward=*/true);
      if (!problem.empty())
        specError(fmt::format("spec[{}]: heads {}:{}: {}", i,
                              job.spec.numQHeads, job.spec.numKVHeads,
                              problem));
    }
    if (auto dtype = text("dtype")) {
      if (std::optional<dualkv::DType> d = dualkv::parseDType(*dtype))
        job.spec.dtype = *d;
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
          std::optional<int64_t> n = jsonInteger(value);
          if (!n || *n < 0 || *n > 4096)
            specError(
                fmt::format("{}.{} must be an integer in [0, 4096], got {}",
                            where("tiling"), key, brief(value)));
          *field = static_cast<int>(*n);
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
      "dualkv_{}{}{}{}{}{}{}_{}_h{}x{}_{}{}_m{}n{}w{}s{}{}",
      dualkv::toString(s.kind), s.tree ? "_tree" : "", s.dlse ? "_dlse" : "",
      s.sinks ? "_sinks" : "",
      s.softcap > 0 ? fmt::format("_softcap{}", s.softcap) : std::string(),
      s.window ? "_window" : "",
      s.scoreMod.empty()
          ? std::string()
          : "_scoremod" + dualkv::sha256Hex(s.scoreMod).substr(0, 8),
      dualkv::headShapeName(s.headDim, s.vDim()), s.numQHeads, s.numKVHeads,
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
};

/// How long fatbinary may take: it packs a few megabytes at most, in well
/// under a second.
constexpr int kFatbinaryTimeoutSeconds = 120;
/// The most bytes of a fatbin or of fatbinary's log read back.
constexpr size_t kMaxFatbinBytes = 256u << 20;
constexpr size_t kMaxLogBytes = 16u << 20;

/// `name` of the private folder `scratch` (a file fatbinary wrote), read as
/// the runtime reads a cache file: a regular file of this user, no link.
llvm::Expected<std::string>
readScratchFile(const dualkv::tools::ScratchFolder &scratch,
                const std::string &name, size_t maxBytes) {
  return dualkv::readFileChecked(
      scratch.fd(), name,
      dualkv::FileRules{maxBytes, /*noFollow=*/true, /*ownedOnly=*/true});
}

/// Writes DIR/NAME.fatbin (`name`): every arch's cubin plus the lowest arch's
/// PTX, packed by `fatbinary` (beside ptxas). fatbinary takes each input as
/// "--image3=kind=elf,sm=80,file=PATH", a list that a ',' or '"' in PATH
/// would break, and has no escaping: so it runs in a private scratch folder
/// on copies named there (0.cubin, ..., kernel.ptx), never on a path of the
/// user's, and the fatbin it writes there is copied to DIR. Empty, or why
/// not.
std::string writeFatbin(const std::vector<Built> &builds,
                        const std::string &dir, const std::string &name) {
  std::string ptxas = dualkv::ptxasPath({});
  if (ptxas.empty())
    return "no ptxas, and so no fatbinary beside it";
  std::string why;
  std::optional<dualkv::tools::ScratchFolder> scratch =
      dualkv::tools::ScratchFolder::create("dualkv-aot", &why);
  if (!scratch)
    return why;
  std::filesystem::path tool =
      std::filesystem::path(ptxas).parent_path() / "fatbinary";
  std::vector<std::string> argv = {tool.string(), "-64",
                                   "--create=kernel.fatbin"};
  for (size_t i = 0; i < builds.size(); ++i) {
    const Built &b = builds[i];
    if (b.cubin.empty())
      continue;
    std::string file = fmt::format("{}.cubin", i);
    why = scratch->write(file, {b.cubin.data(), b.cubin.size()});
    if (!why.empty())
      return why;
    argv.push_back(fmt::format("--image3=kind=elf,sm={},file={}",
                               b.spec.arch.substr(3), file));
  }
  why = scratch->write("kernel.ptx", builds.front().ptx);
  if (!why.empty())
    return why;
  argv.push_back(fmt::format("--image3=kind=ptx,sm={},file=kernel.ptx",
                             builds.front().spec.arch.substr(3)));
  why = dualkv::tools::runInFolder(argv, *scratch, "fatbinary.log",
                                   kFatbinaryTimeoutSeconds);
  if (!why.empty()) {
    llvm::Expected<std::string> log =
        readScratchFile(*scratch, "fatbinary.log", kMaxLogBytes);
    std::string said =
        log ? *log : llvm::toString(log.takeError()); // what it said, or why
    while (!said.empty() && std::isspace(static_cast<unsigned char>(
                                said.back()))) // one message, no blank line
      said.pop_back();
    return fmt::format("{} failed ({}){}{}", tool.string(), why,
                       said.empty() ? "" : ": ", dualkv::clipForMessage(said));
  }
  llvm::Expected<std::string> fatbin =
      readScratchFile(*scratch, "kernel.fatbin", kMaxFatbinBytes);
  if (!fatbin)
    return fmt::format("{} wrote no fatbin: {}", tool.string(),
                       llvm::toString(fatbin.takeError()));
  if (fatbin->empty())
    return fmt::format("{} wrote an empty fatbin", tool.string());
  return dualkv::tools::writeFileAtomically(dir, name, *fatbin);
}

void writeBytes(std::string &out, const std::string &name, const char *data,
                size_t size, bool terminate) {
  out.reserve(out.size() + 4 * size + 6 * (size / 20) + name.size() + 64);
  out += "alignas(64) const unsigned char " + name + "[] = {";
  for (size_t i = 0; i < size; ++i)
    fmt::format_to(std::back_inserter(out), "{}{},", i % 20 ? "" : "\n    ",
                   static_cast<unsigned>(static_cast<unsigned char>(data[i])));
  if (terminate)
    out += "0";
  out += "};\n";
}

/// The text of NAME.h and of NAME.cpp: every kernel embedded (cubin, PTX)
/// and registered.
std::pair<std::string, std::string>
registrationSource(const std::vector<Built> &builds, const std::string &name) {
  std::string h = fmt::format(
      "// Generated by dualkv-aot; do not edit.\n#pragma once\n\n"
      "/// Registers this file's {} DualKV kernels with the runtime "
      "(dualkv/Aot.h).\nvoid {}_register();\n",
      builds.size(), name);
  std::string c = fmt::format(
      "// Generated by dualkv-aot; do not edit.\n#include \"{}.h\"\n\n"
      "#include \"dualkv/Aot.h\"\n\nnamespace {{\n",
      name);
  for (size_t i = 0; i < builds.size(); ++i) {
    const Built &b = builds[i];
    const std::vector<char> &image = b.cubin;
    if (!image.empty())
      writeBytes(c, fmt::format("kImage{}", i), image.data(), image.size(),
                 false);
    writeBytes(c, fmt::format("kPtx{}", i), b.ptx.data(), b.ptx.size(), true);
  }
  c += "} // namespace\n\nvoid " + name + "_register() {\n";
  for (size_t i = 0; i < builds.size(); ++i) {
    const Built &b = builds[i];
    const dualkv::KernelSpec &s = b.spec;
    c += "  {\n    dualkv::AotKernel k;\n";
    c += fmt::format(
        "    k.spec.kind = dualkv::KernelKind::{};\n    k.spec.P = {};\n "
        "   "
        "k.spec.N = {};\n    k.spec.headDim = {};\n    k.spec.numQHeads = "
        "{};\n    "
        "k.spec.numKVHeads = {};\n    k.spec.dtype = dualkv::DType::{};\n "
        "   "
        "k.spec.arch = \"{}\";\n    k.spec.tiling = {{{}, {}, {}, {}}};\n"
        "    k.spec.schedule = dualkv::Schedule::{};\n"
        "    k.spec.tree = {};\n    k.spec.softcap = "
        "static_cast<float>({:.9g});\n    k.spec.dlse = {};\n"
        "    k.spec.sinks = {};\n    k.spec.window = {};\n",
        dualkv::enumeratorOf(s.kind), s.P, s.N, s.headDim, s.numQHeads,
        s.numKVHeads, dualkv::enumeratorOf(s.dtype), s.arch, s.tiling.blockM,
        s.tiling.blockN, s.tiling.warps, s.tiling.stages,
        dualkv::enumeratorOf(s.schedule), s.tree ? "true" : "false", s.softcap,
        s.dlse ? "true" : "false", s.sinks ? "true" : "false",
        s.window ? "true" : "false");
    if (!s.scoreMod.empty())
      c += fmt::format("    k.spec.scoreMod = R\"dualkv({})dualkv\";\n",
                       s.scoreMod);
    if (s.vDim() != s.headDim)
      c += fmt::format("    k.spec.valueHeadDim = {};\n", s.vDim());
    c += fmt::format("    k.info.name = \"{}\";\n    k.info.threads = {};\n    "
                     "k.info.sharedBytes = {};\n    k.info.blockM = {};\n",
                     b.info.name, b.info.threads, b.info.sharedBytes,
                     b.info.blockM);
    if (!b.cubin.empty())
      c += fmt::format(
          "    k.image = kImage{};\n    k.imageSize = sizeof(kImage{});\n", i,
          i);
    else
      c += fmt::format(
          "    k.image = kPtx{};\n    k.imageSize = sizeof(kPtx{});\n", i, i);
    c += fmt::format("    k.ptx = reinterpret_cast<const char *>(kPtx{});\n",
                     i) +
         "    dualkv::registerAotKernel(k);\n  }\n";
  }
  c += "}\n";
  return {std::move(h), std::move(c)};
}

/// Writes DIR/NAME.h and DIR/NAME.cpp, both or neither. Empty, or why not.
std::string writeRegistration(const std::vector<Built> &builds,
                              const std::string &dir, const std::string &name) {
  auto [h, c] = registrationSource(builds, name);
  std::string why = dualkv::tools::writeFileAtomically(dir, name + ".h", h);
  if (why.empty()) {
    why = dualkv::tools::writeFileAtomically(dir, name + ".cpp", c);
    if (!why.empty())
      dualkv::tools::removeFile(dir, name + ".h");
  }
  return why;
}

/// The JSON report of one kernel (DIR/<name>.json).
std::string kernelReport(const dualkv::KernelSpec &spec,
                         const dualkv::CompileResult &r) {
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
  // The variants, only when set (as in the kernel cache's keys).
  if (spec.tree)
    meta["tree"] = true;
  if (spec.softcap > 0)
    meta["softcap"] = spec.softcap;
  if (spec.dlse)
    meta["dlse"] = true;
  if (spec.sinks)
    meta["sinks"] = true;
  if (spec.window)
    meta["window"] = true;
  if (!spec.scoreMod.empty())
    meta["score_mod"] = spec.scoreMod;
  // Value rows apart from the query/key ones (as in the kernel cache's key).
  if (spec.vDim() != spec.headDim)
    meta["v_head_dim"] = spec.vDim();
  // ptxas's log is outside text: a byte that is no UTF-8 is replaced, not
  // thrown over.
  return meta.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) +
         "\n";
}

/// Writes DIR/<name>.ptx, .cubin (when there is one) and .json: all of them,
/// or none (those written first are removed again). Empty, or why not.
std::string writeKernelFiles(const std::string &dir, const std::string &name,
                             const dualkv::KernelSpec &spec,
                             const dualkv::CompileResult &r) {
  std::vector<std::pair<std::string, std::string_view>> files;
  files.push_back({name + ".ptx", r.ptx});
  if (!r.cubin.empty())
    files.push_back({name + ".cubin", {r.cubin.data(), r.cubin.size()}});
  std::string report = kernelReport(spec, r);
  files.push_back({name + ".json", report});
  for (size_t i = 0; i < files.size(); ++i) {
    std::string why = dualkv::tools::writeFileAtomically(dir, files[i].first,
                                                         files[i].second);
    if (!why.empty()) {
      for (size_t j = 0; j < i; ++j)
        dualkv::tools::removeFile(dir, files[j].first);
      return why;
    }
  }
  return {};
}

/// The tuning database that --tuned and the --into-cache note read, loaded
/// once: --tuning-db, else $DUALKV_TUNING_DB, else <kernel cache>/tuning.json.
/// That last one is read only from a cache root the cache itself would use,
/// as the runtime's own lookup does (processTuningDb): a root that others may
/// write (0777, or another user's) could hold anybody's tiling. Refused, it
/// reads as empty, said once; --tuned then builds the default tiling, which
/// is also what launches take from such a root.
class TuningSource {
public:
  explicit TuningSource(const std::string &explicitPath)
      : explicit_(!explicitPath.empty() ||
                  dualkv::envValue("DUALKV_TUNING_DB").has_value()),
        path_(explicitPath.empty() ? dualkv::TuningDb::defaultPath()
                                   : explicitPath) {}

  const std::string &path() const { return path_; }
  /// True when the cache root holding the database was refused.
  bool refused() {
    get();
    return refused_;
  }

  const dualkv::TuningDb &get() {
    if (db_)
      return *db_;
    db_.emplace();
    std::string root = KernelCache::defaultFolder();
    if (!explicit_ && !root.empty() && !KernelCache(root).usable()) {
      fmt::print(stderr,
                 "dualkv-aot: the tuning database '{}' is not read: the "
                 "kernel cache at '{}' is not usable (see the warning "
                 "above), and launches do not read it either; the default "
                 "tiling is built\n",
                 path_, root);
      refused_ = true;
      return *db_;
    }
    std::string error;
    *db_ = dualkv::TuningDb::load(path_, &error);
    if (!error.empty())
      fmt::print(stderr, "dualkv-aot: {}\n", error);
    return *db_;
  }

private:
  bool explicit_;
  std::string path_;
  std::optional<dualkv::TuningDb> db_;
  bool refused_ = false;
};

} // namespace

int main(int argc, char **argv) {
  Args args = parseArgs(argc, argv);
  std::vector<Job> jobs;
  if (args.specFile.empty())
    expandKinds({args.spec, args.archs, args.tuned}, args.kinds, jobs);
  else
    jobs = readSpecFile(args);
  TuningSource tuning(args.tuningDb);
  // Files go to --out only. With --into-cache alone the kernels go to the
  // cache and nowhere else: no folder of its own, predictable or not.
  const std::string &outDir = args.out;
  if (!outDir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(outDir, ec);
    if (ec) {
      fmt::print(stderr, "dualkv-aot: cannot create --out '{}': {}\n", outDir,
                 ec.message());
      return 2;
    }
  }
  std::optional<KernelCache> cache;
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
      dualkv::KernelSpec key = spec;
      if (job.tunedKVHeads) {
        key.numQHeads = job.tunedQHeads;
        key.numKVHeads = job.tunedKVHeads;
      }
      if (job.tuned && !tuning.refused()) {
        std::optional<dualkv::Tiling> tuned = tuning.get().find(key);
        if (!tuned) {
          fmt::print(stderr,
                     "dualkv-aot: no tuned tiling for {} head_dim {}{} heads "
                     "{}:{} {} {} in "
                     "'{}': run dualkv-tune there first\n",
                     dualkv::toString(key.kind), key.headDim,
                     key.vDim() == key.headDim
                         ? std::string()
                         : fmt::format(" v_head_dim {}", key.vDim()),
                     key.numQHeads, key.numKVHeads, dualkv::toString(key.dtype),
                     key.arch, tuning.path());
          ++failures;
          continue;
        }
        spec.tiling = *tuned;
      }
      if (args.intoCache && !job.tuned && spec.tiling == dualkv::Tiling{}) {
        // A launch with an open tiling takes the tuned one when the database
        // has it: the default's entry would then never be read.
        if (std::optional<dualkv::Tiling> tuned = tuning.get().find(key))
          fmt::print(stderr,
                     "dualkv-aot: note: '{}' has the tiling {},{},{},{} for "
                     "{} {}, which launches take: add --tuned to cache that "
                     "one\n",
                     tuning.path(), tuned->blockM, tuned->blockN, tuned->warps,
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
      bool written = true;
      if (!outDir.empty()) {
        std::string why = writeKernelFiles(outDir, name, spec, r);
        if (!why.empty()) {
          fmt::print(stderr, "dualkv-aot: {}\n", why);
          ++failures;
          written = false;
        }
      }
      std::string base = outDir.empty() ? name : outDir + "/" + name;
      if (written) {
        fmt::print(
            "{}\n  entry {}  threads {}  shared {} B  PTX {} B  cubin {} B  "
            "compile {:.0f} ms (MLIR {:.0f} + LLVM {:.0f}) + ptxas {:.0f} ms\n",
            base, r.info.name, r.info.threads, r.info.sharedBytes, r.ptx.size(),
            r.cubin.size(), r.compileMs, r.mlirMs, r.llvmMs, r.ptxasMs);
        if (!r.ptxasLog.empty())
          fmt::print("{}", r.ptxasLog);
      }
      if (cache) {
        std::string why;
        std::optional<std::string> entry;
        if (spec.P != 0 || spec.N != 0) {
          fmt::print(stderr,
                     "dualkv-aot: {}: --into-cache takes shape-generic "
                     "kernels (P = N = 0), which are what the runtime asks "
                     "for\n",
                     name);
          ++failures;
        } else if (!(entry = cache->store(spec, r, &why))) {
          fmt::print(stderr,
                     "dualkv-aot: {}: cannot write the kernel cache: "
                     "{}\n",
                     name, why);
          ++failures;
        } else {
          fmt::print("  cached {}\n", *entry);
        }
      }
      if (written)
        builds.push_back({spec, r.info, std::move(r.ptx), std::move(r.cubin)});
    }
    // A fatbin holds one kernel for every arch: one launch geometry and one
    // entry point, so one tiling and one schedule. It goes to --out only.
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
    const bool fatbin = builds.size() > 1 && args.cubin && !outDir.empty();
    if (fatbin && !oneTiling) {
      fmt::print("  no fatbin: the archs' tilings differ ({}), and so do "
                 "their launch geometries\n",
                 tilings);
    } else if (fatbin && !oneEntry) {
      fmt::print("  no fatbin: the archs' schedules differ ({}), and so do "
                 "their entry points\n",
                 schedules);
    } else if (fatbin) {
      std::string name = kernelFileName(builds.front().spec, false) + ".fatbin";
      std::string why = writeFatbin(builds, outDir, name);
      if (why.empty()) {
        fmt::print("{}/{}\n  fatbin of {} archs + PTX\n", outDir, name,
                   builds.size());
      } else {
        fmt::print(stderr, "dualkv-aot: no fatbin {}/{}: {}\n", outDir, name,
                   why);
        ++failures;
      }
    }
    all.insert(all.end(), builds.begin(), builds.end());
  }
  if (!args.registration.empty() && !failures) {
    std::string why = writeRegistration(all, args.out, args.registration);
    if (why.empty()) {
      fmt::print("{}/{}.h, .cpp\n  registration of {} kernels: {}_register()\n",
                 args.out, args.registration, all.size(), args.registration);
    } else {
      fmt::print(stderr, "dualkv-aot: --emit-registration: {}\n", why);
      ++failures;
    }
  }
  // The report is an output too: a full disk or a closed pipe behind stdout
  // is no success.
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    fmt::print(stderr, "dualkv-aot: cannot write the report to stdout: {}\n",
               std::strerror(errno));
    return 1;
  }
  return failures ? 1 : 0;
}
