//===- dualkv-tune.cpp - find the fastest tiling and record it ------------===//
//
// Enumerates the legal tilings of the forward kernel or of the backward's main
// kernel, drops those that fail ptxas, spill, or disagree with the fp64
// reference, times the rest on the GPU and writes the winner into the tuning
// database that the runtime and dualkv-aot read.
//
//===----------------------------------------------------------------------===//
#include "cache/Files.h"
#include "common/CommandLine.h"
#include "common/DeviceProblem.h"
#include "dualkv/Bounded.h"
#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Compiler/ScoreMod.h"
#include "dualkv/Reference.h"
#include "dualkv/Tuning.h"
#include "dualkv/dualkv.h"

#include "llvm/Support/CommandLine.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace dualkv;
using dualkv::tools::cudaCheck;
using dualkv::tools::DeviceArray;
using dualkv::tools::DeviceProblem;
using dualkv::tools::fromElement;
using dualkv::tools::toElement;

namespace {

/// `a` with the algorithm that runs `kind` (bwd: the atomic one, bwd_kv and
/// bwd_dq: the split-dQ one), whatever the device's default, and `tiling` as
/// that kernel's: BackwardArgs::dq_tiling for bwd_dq, else ::tiling.
BackwardArgs withAlgorithm(BackwardArgs a, KernelKind kind,
                           const Tiling &tiling) {
  a.algorithm = kind == KernelKind::Bwd ? BackwardAlgorithm::Atomic
                                        : BackwardAlgorithm::SplitDQ;
  a.tiling = kind == KernelKind::BwdDQ ? Tiling{} : tiling;
  a.dq_tiling = kind == KernelKind::BwdDQ ? tiling : Tiling{};
  return a;
}

namespace cl = llvm::cl;
using dualkv::tools::IntegerParser;
using dualkv::tools::usageError;

constexpr const char *kOverview =
    R"(find the fastest tiling of a DualKV kernel on this GPU and record it

The kernel is tuned for one head configuration and recorded in the tuning
database under its kind:
  fwd     the forward (candidates block_m 64/128, block_n 16/32/64/128, warps
          4/8, stages 1/2); timed: one forward call
  bwd     the atomic algorithm's fused main kernel (dQ by fp32 atomics;
          block_m = keys a CTA 64/128, block_n = queries a tile 16/32/64, warps
          4/8, stages 1: the backward does not pipeline); timed: the whole
          atomic backward call (bwd_pre, bwd, bwd_post), the candidate as
          BackwardArgs::tiling
  bwd_kv  the split-dQ algorithm's dK/dV kernel (same candidates, and block_n
          128 at head_dim 64); timed: the whole split-dQ backward call
          (bwd_pre, bwd_kv, bwd_dq). On sm_90a that algorithm is the default
          one (and the deterministic one everywhere): tune bwd_kv and bwd_dq
          there
  bwd_dq  the split-dQ algorithm's dQ kernel (block_m 64/128, block_n
          16/32/64, and 128 at head_dim 64, warps 4/8, stages 1 to 4: more
          than 2 only in the warp-specialized schedule); timed: the whole
          split-dQ backward call, the candidate as BackwardArgs::dq_tiling,
          bwd_kv at its own tiling
At head_dim 512 every kind also tries block_m 32 (bwd and bwd_kv hold 32 keys
there).
Candidates that the verifier rejects, that ptxas fails or that spill are dropped
(listed with the reason); the rest are checked against the fp64 reference on a
small problem with every edge (the GPU tests' tolerances), then timed (CUDA
events, median of --reps after two warm-ups, three input sets in rotation so the
L2 cache does not flatter) on a packed group of --P, --N, --R. Without --shapes
the winner is the generic entry (shape class "any"): it serves every shape of
the head configuration that has no entry of its own.

With --shapes FILE (e.g. an RL trace of (P, N, R)), the kernel is tuned once
per distinct shape class of the file's shapes instead: power-of-two buckets
P' = max(512, 2^ceil(log2 P)), N' = max(1, 2^ceil(log2 N)), R' = max(64,
2^ceil(log2 R)) (docs/architecture.md, section 4). Each class is timed on one
group of P' prompt tokens and N' responses of R' tokens (the class's upper
corner) and recorded under the class; the runtime takes a class's tiling for
batches whose largest group falls in it, else the generic entry, else the
compiler's default. The candidates are compiled and checked against the
reference once, then timed per class. FILE is text, one shape a line as
"P N R" (spaces or commas; '#' starts a comment), or JSON: an array of
[P, N, R] or of {"P": .., "N": .., "R": ..}, or an object whose "shapes" is
such an array. R is the (mean) response length.

With --score-mod FILE, the candidates are compiled with that score modifier
and checked and timed with it (--kind fwd or bwd: the split-dQ backward takes
no modifier), each of its tensors a device buffer of the fp32 elements that
--score-mod-input-sizes gives, uniform random in [-0.1, 0.1]. The fp64 reference knows no
modifier, so each candidate is checked against the kernel at the default
tiling instead, at twice the reference's tolerances (each within them of the
exact result). Nothing is written to the tuning database: the runtime never
looks a score modifier's kernels up there (it runs the compiler's default
tiling unless ForwardArgs or BackwardArgs::tiling names one), so --db is
refused. The ranking is printed, and --report written, for you to pass the
winner as that tiling (or to dualkv-aot --block-m, --block-n, --warps,
--stages).
)";

cl::OptionCategory kernelOptions("Kernel to tune");
cl::OptionCategory runOptions("Tuning run");
constexpr const char *kExitStatus =
    "\nexit status: 0 success, 1 no candidate survived (for any class) or a\n"
    "GPU/database error, 2 bad arguments (a --shapes file that cannot be read "
    "or\nparsed, or a --score-mod file that is no score modifier, "
    "included).\n";

constexpr int64_t kMaxTokens = 1 << 20;

cl::opt<
    KernelKind, false,
    dualkv::tools::NameParser<KernelKind, dualkv::tools::NameComplaint::MustBe>>
    kindOption("kind",
               cl::desc("the kernel to tune (default fwd), timed as above"),
               cl::init(KernelKind::Fwd),
               cl::values(clEnumValN(KernelKind::Fwd, "fwd", "the forward"),
                          clEnumValN(KernelKind::Bwd, "bwd",
                                     "the atomic backward's main kernel"),
                          clEnumValN(KernelKind::BwdKV, "bwd_kv",
                                     "the split-dQ backward's dK/dV kernel"),
                          clEnumValN(KernelKind::BwdDQ, "bwd_dq",
                                     "the split-dQ backward's dQ kernel")),
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
                 cl::desc("value head size (default: the --head-dim's);\n"
                          "apart from it only 128 with --head-dim 192\n"
                          "(MLA), whose candidates are the mma_sync\n"
                          "schedule's tilings on every arch"),
                 cl::init(0), cl::cat(kernelOptions));
cl::opt<dualkv::tools::Heads, false,
        dualkv::tools::HeadsParser<IntegerParser<1, 65535>>>
    heads("heads", cl::desc("HQ:HKV, query and key/value heads (default 32:8)"),
          cl::cat(kernelOptions));
cl::opt<DType, false, dualkv::tools::DTypeParser>
    dtype("dtype", cl::desc("element type (default bf16)"),
          cl::init(DType::BF16), cl::cat(kernelOptions));
cl::opt<std::string, false, dualkv::tools::ArchParser>
    archOption("arch", cl::value_desc("A"),
               cl::desc("target for --dry-run: sm_80 ... sm_121 (default\n"
                        "sm_90a; with a GPU, the GPU's)"),
               cl::init("sm_90a"), cl::cat(kernelOptions));
cl::opt<std::string>
    scoreModFile("score-mod", cl::value_desc("FILE"),
                 cl::desc("a score modifier (MLIR text of one func.func\n"
                          "@score_mod, docs/score-modifiers.md) that the\n"
                          "candidates and the timed kernels apply to every\n"
                          "logit; --kind fwd or bwd only. Checked against\n"
                          "the default tiling, never recorded (above)"),
                 cl::cat(kernelOptions));

cl::opt<int, false, IntegerParser<1, kMaxTokens>>
    promptTokens("P", cl::value_desc("P"),
                 cl::desc("prompt tokens of the timed group (default 8192)"),
                 cl::init(8192), cl::cat(runOptions));
cl::opt<int, false, IntegerParser<0, 1024>>
    responses("N", cl::value_desc("N"),
              cl::desc("responses of the timed group (default 16)"),
              cl::init(16), cl::cat(runOptions));
cl::opt<int, false, IntegerParser<0, kMaxTokens>>
    responseTokens("R", cl::value_desc("R"),
                   cl::desc("tokens of each timed response (default 1024)"),
                   cl::init(1024), cl::cat(runOptions));
cl::opt<std::string>
    shapesFile("shapes", cl::value_desc("FILE"),
               cl::desc("tune every shape class of FILE's shapes (above) "
                        "instead\nof the generic entry; --P/--N/--R are then "
                        "not used"),
               cl::cat(runOptions));
cl::opt<bool> listClasses(
    "list-classes",
    cl::desc("with --shapes: print each class and its shapes' count,\n"
             "and stop (no GPU, no compile)"),
    cl::cat(runOptions));
cl::opt<std::string>
    scoreModSizes("score-mod-input-sizes", cl::value_desc("N[,N...]"),
                  cl::desc("with --score-mod: fp32 elements of each of its\n"
                           "tensors (memref arguments, in order), as many\n"
                           "sizes as it takes; each must cover every index\n"
                           "it reads for the timed shapes and the check's\n"
                           "(logical positions below 1000, packed below\n"
                           "1196). Needed to check and time, not for\n"
                           "--dry-run or --list-classes"),
                  cl::cat(runOptions));
cl::opt<int, false, IntegerParser<10, 100000>>
    reps("reps", cl::value_desc("K"),
         cl::desc("timed runs per candidate, at least 10 (default 10)"),
         cl::init(10), cl::cat(runOptions));
cl::opt<std::string>
    dbFile("db", cl::value_desc("FILE"),
           cl::desc("tuning database to update (default: $DUALKV_TUNING_DB,\n"
                    "else <kernel cache>/tuning.json); not with\n"
                    "--score-mod"),
           cl::cat(runOptions));
cl::opt<std::string>
    reportFile("report", cl::value_desc("FILE"),
               cl::desc("also write every candidate (status, registers, "
                        "spills,\nms) as JSON"),
               cl::cat(runOptions));
cl::opt<bool>
    dryRun("dry-run",
           cl::desc("no GPU needed: list the candidates with their ptxas\n"
                    "registers, shared memory and spills, and stop"),
           cl::cat(runOptions));

bool isBackward(KernelKind k) { return k != KernelKind::Fwd; }

dualkv::tools::HeadShape headShape(const KernelSpec &s) {
  return {s.numQHeads, s.numKVHeads, s.headDim, s.dtype, s.valueHeadDim};
}

/// One shape of a --shapes file.
struct Shape {
  int64_t P = 0, N = 0, R = 0;
};

/// The most bytes a --shapes file may have: a million shapes of text or
/// JSON, parsed in well under a second and a few hundred MB.
constexpr size_t kMaxShapesFileBytes = 16u << 20;
/// The most bytes of a value (a JSON entry, a word) a --shapes message
/// quotes; the count of the rest is said.
constexpr size_t kMaxEchoBytes = 80;

/// Refuses the --shapes file: one line "dualkv-tune: <message>", exit 2.
[[noreturn]] void shapesError(const std::string &message) {
  dualkv::tools::badValue(message);
  std::exit(2);
}

/// A --shapes file's shapes; shapesError() naming the line or index at fault.
/// The file is read only when it is a regular file of at most
/// kMaxShapesFileBytes (a FIFO, device or folder is refused before any read)
/// and, as JSON, parsed only when it nests no deeper than kMaxJsonDepth.
std::vector<Shape> readShapes(const std::string &path) {
  const std::string shownPath = clipForMessage(path);
  llvm::Expected<std::string> read =
      readFileChecked(AT_FDCWD, path, FileRules{kMaxShapesFileBytes});
  if (!read)
    shapesError("cannot read --shapes: " +
                clipForMessage(llvm::toString(read.takeError())));
  const std::string text = std::move(*read);
  auto bad = [&](const std::string &where, const std::string &why) {
    shapesError(where.empty() ? fmt::format("--shapes {}: {}", shownPath, why)
                              : fmt::format("--shapes {}: {}: {}", shownPath,
                                            where, why));
  };
  // P >= 1, N and R >= 0; at most 1024 responses and 2^20 tokens, as --P,
  // --N and --R.
  struct Field {
    const char *name;
    int64_t lo, hi;
  };
  const Field fields[3] = {
      {"P", 1, kMaxTokens}, {"N", 0, 1024}, {"R", 0, kMaxTokens}};
  auto outOfRange = [&](const std::string &where, const Field &f,
                        const std::string &value) {
    bad(where, fmt::format("{} = {} is not in [{}, {}]", f.name,
                           clipForMessage(value, kMaxEchoBytes), f.lo, f.hi));
  };
  std::vector<Shape> shapes;
  size_t first = text.find_first_not_of(" \t\r\n");
  if (first != std::string::npos &&
      (text[first] == '[' || text[first] == '{')) {
    // Parsing, printing and destroying a document recurse once per level.
    if (jsonNestsDeeperThan(text, kMaxJsonDepth))
      bad("JSON", fmt::format("nests deeper than {} levels", kMaxJsonDepth));
    nlohmann::json doc =
        nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (doc.is_discarded())
      bad("JSON", "not valid JSON");
    if (doc.is_object()) {
      if (!doc.contains("shapes"))
        bad("JSON", "an object needs a \"shapes\" array");
      nlohmann::json inner = std::move(doc["shapes"]);
      doc = std::move(inner);
    }
    if (!doc.is_array())
      bad("JSON", "expected an array of shapes");
    auto echo = [](const nlohmann::json &v) {
      return clipForMessage(
          v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
          kMaxEchoBytes);
    };
    for (size_t i = 0; i < doc.size(); ++i) {
      const nlohmann::json &e = doc[i];
      std::string where = fmt::format("shapes[{}]", i);
      // An integer as nlohmann holds it: unsigned when it is positive (read
      // as int64 it would wrap: 2^64 - 1 is -1), signed when negative.
      auto field = [&](const nlohmann::json &v, const Field &f) -> int64_t {
        if (v.is_number_unsigned()) {
          uint64_t u = v.get<uint64_t>();
          if (u > static_cast<uint64_t>(f.hi))
            outOfRange(where, f, std::to_string(u));
          return static_cast<int64_t>(u);
        }
        if (!v.is_number_integer())
          bad(where, fmt::format("{} is not an integer: {}", f.name, echo(v)));
        int64_t x = v.get<int64_t>();
        if (x < f.lo || x > f.hi)
          outOfRange(where, f, std::to_string(x));
        return x;
      };
      if (e.is_array() && e.size() == 3) {
        shapes.push_back({field(e[0], fields[0]), field(e[1], fields[1]),
                          field(e[2], fields[2])});
      } else if (e.is_object() && e.contains("P") && e.contains("N") &&
                 e.contains("R")) {
        shapes.push_back({field(e["P"], fields[0]), field(e["N"], fields[1]),
                          field(e["R"], fields[2])});
      } else {
        bad(where,
            "expected [P, N, R] or {\"P\", \"N\", \"R\"}, got " + echo(e));
      }
    }
  } else {
    std::istringstream lines(text);
    std::string line;
    for (int64_t number = 1; std::getline(lines, line); ++number) {
      std::string where = fmt::format("line {}", number);
      line = line.substr(0, line.find('#'));
      std::replace(line.begin(), line.end(), ',', ' ');
      std::istringstream words(line);
      std::vector<std::string> w;
      for (std::string word; words >> word;)
        w.push_back(word);
      if (w.empty())
        continue;
      if (w.size() != 3)
        bad(where, fmt::format("expected three integers P N R, got {} fields",
                               w.size()));
      int64_t v[3];
      for (size_t k = 0; k < 3; ++k) {
        const Field &f = fields[k];
        std::optional<int64_t> x = dualkv::tools::readInteger(w[k]);
        // All digits but beyond int64: a number, out of range.
        bool digits =
            w[k].find_first_not_of("0123456789", w[k][0] == '-' ? 1 : 0) ==
                std::string::npos &&
            w[k] != "-";
        if (!x && !digits)
          bad(where, fmt::format("{} '{}' is not an integer", f.name,
                                 clipForMessage(w[k], kMaxEchoBytes)));
        if (!x || *x < f.lo || *x > f.hi)
          outOfRange(where, f, w[k]);
        v[k] = *x;
      }
      shapes.push_back({v[0], v[1], v[2]});
    }
  }
  if (shapes.empty())
    bad("", "no shapes");
  return shapes;
}

/// One tuning: the timing shape and the class it is recorded under (any()
/// for the generic entry).
struct Job {
  Shape shape;
  ShapeClass cls;
  size_t count = 0; ///< --shapes shapes in this class
};

/// Every distinct class of `shapes`, in ascending order, each timed at its
/// upper corner.
std::vector<Job> classJobs(const std::vector<Shape> &shapes) {
  std::map<ShapeClass, size_t> counts;
  for (const Shape &s : shapes)
    ++counts[shapeClassOf(s.P, s.N, s.R)];
  std::vector<Job> jobs;
  for (const auto &[cls, count] : counts)
    jobs.push_back({{cls.P, cls.N, cls.R}, cls, count});
  return jobs;
}

struct Args {
  KernelSpec spec; ///< spec.kind: Fwd, Bwd, BwdKV or BwdDQ
  int64_t P = 8192, N = 16, R = 1024;
  int reps = 10;
  std::string db, report, shapes;
  std::string arch = "sm_90a";
  bool dryRun = false, listClasses = false;
  /// --score-mod: the file (spec.scoreMod holds its canonical text), its
  /// tensors' count and their --score-mod-input-sizes (empty: not given).
  std::string scoreModFile;
  int scoreModInputs = 0;
  std::vector<int64_t> scoreModSizes;
};

/// The most fp32 elements of one score-modifier tensor (4 GiB).
constexpr int64_t kMaxScoreModElements = int64_t(1) << 30;
/// The most bytes of a --score-mod file.
constexpr size_t kMaxScoreModFileBytes = 1u << 20;

/// "1 tensor (memref argument)", "2 tensors (memref arguments)".
std::string tensorsName(int n) {
  return fmt::format("{} tensor{} (memref argument{})", n, n == 1 ? "" : "s",
                     n == 1 ? "" : "s");
}

/// --score-mod FILE read into a.spec.scoreMod (its canonical text) and
/// a.scoreModInputs, and --score-mod-input-sizes into a.scoreModSizes; a file
/// that is no score modifier, sizes that are no list of integers in [1,
/// kMaxScoreModElements] or not one for each tensor, are refused (exit 2).
void readScoreMod(Args &a, const std::string &file, const std::string &sizes,
                  bool sizesGiven) {
  if (file.empty()) {
    if (sizesGiven)
      usageError("--score-mod-input-sizes needs --score-mod FILE");
    return;
  }
  const std::string shown = clipForMessage(file);
  llvm::Expected<std::string> text =
      readFileChecked(AT_FDCWD, file, FileRules{kMaxScoreModFileBytes});
  if (!text) {
    dualkv::tools::badValue("cannot read --score-mod: " +
                            clipForMessage(llvm::toString(text.takeError())));
    std::exit(2);
  }
  ScoreModInfo info = parseScoreMod(*text);
  if (!info.error.empty()) {
    dualkv::tools::badValue(
        fmt::format("--score-mod {}: {}", shown, info.error));
    std::exit(2);
  }
  a.scoreModFile = file;
  a.spec.scoreMod = info.canonical;
  a.scoreModInputs = info.inputs;
  if (a.spec.kind == KernelKind::BwdKV || a.spec.kind == KernelKind::BwdDQ)
    usageError(fmt::format("--score-mod with --kind {}: the split-dQ backward "
                           "takes no score modifier; tune --kind bwd (the "
                           "atomic backward, which a modifier's backward runs)",
                           toString(a.spec.kind)));
  if (sizesGiven) {
    llvm::SmallVector<llvm::StringRef> words;
    llvm::StringRef(sizes).split(words, ',');
    for (llvm::StringRef w : words) {
      std::optional<int64_t> n = dualkv::tools::readInteger(w.trim());
      if (!n || *n < 1 || *n > kMaxScoreModElements)
        usageError(fmt::format(
            "--score-mod-input-sizes expects N[,N...], each an integer in "
            "[1, {}], got '{}'",
            kMaxScoreModElements, clipForMessage(sizes, kMaxEchoBytes)));
      a.scoreModSizes.push_back(*n);
    }
  }
  const int given = static_cast<int>(a.scoreModSizes.size());
  if (!a.scoreModSizes.empty() && given != info.inputs)
    usageError(fmt::format(
        "--score-mod-input-sizes gives {} size{}, but the score modifier {} "
        "takes {}",
        given, given == 1 ? "" : "s", shown, tensorsName(info.inputs)));
  if (a.scoreModSizes.empty() && info.inputs > 0 && !a.dryRun && !a.listClasses)
    usageError(fmt::format(
        "the score modifier {} takes {}: give {} in fp32 elements with "
        "--score-mod-input-sizes",
        shown, tensorsName(info.inputs),
        info.inputs == 1 ? "its size" : "their sizes"));
}

Args parseArgs(int argc, char **argv) {
  dualkv::tools::parseCommandLine(argc, argv, "dualkv-tune",
                                  {&kernelOptions, &runOptions}, kOverview,
                                  kExitStatus);
  Args a;
  a.spec.kind = kindOption;
  a.spec.headDim = headDim;
  if (std::string problem =
          dualkv::tools::headShapeProblem(headDim, valueHeadDim);
      !problem.empty())
    usageError(problem);
  a.spec.valueHeadDim = valueHeadDim == headDim ? 0 : valueHeadDim;
  a.spec.numQHeads = heads.query;
  a.spec.numKVHeads = heads.kv;
  a.spec.dtype = dtype;
  a.P = promptTokens;
  a.N = responses;
  a.R = responseTokens;
  a.reps = reps;
  a.db = dbFile;
  a.report = reportFile;
  a.shapes = shapesFile;
  a.arch = archOption;
  a.dryRun = dryRun;
  a.listClasses = listClasses;
  if (a.listClasses && a.shapes.empty())
    usageError("--list-classes needs --shapes FILE");
  if (a.spec.numQHeads % a.spec.numKVHeads != 0)
    usageError(fmt::format("--heads {}:{}: HQ must be a multiple of HKV",
                           a.spec.numQHeads, a.spec.numKVHeads));
  readScoreMod(a, scoreModFile, scoreModSizes,
               scoreModSizes.getNumOccurrences() > 0);
  if (!a.spec.scoreMod.empty() && !a.db.empty())
    usageError("--db with --score-mod: a score modifier's tiling is never "
               "recorded (the runtime does not look score-modifier kernels up "
               "in the tuning database)");
  return a;
}

struct Candidate {
  Tiling tiling;
  std::string status = "ok"; ///< why it was dropped, or "ok"
  int registers = 0;
  int sharedBytes = 0;
  int spillStores = 0, spillLoads = 0; ///< bytes, from ptxas
  bool timed = false; ///< passed the reference check and was timed
  double ms = 0, tflops = 0;
};

/// The integer that ends just before `marker` in a ptxas log ("Used 96
/// registers", "8 bytes spill stores"), or -1 when the marker is absent.
int numberBefore(const std::string &log, const std::string &marker) {
  size_t at = log.find(marker);
  if (at == std::string::npos)
    return -1;
  size_t begin = at;
  while (begin > 0 && std::isdigit(static_cast<unsigned char>(log[begin - 1])))
    --begin;
  return begin == at ? -1 : std::atoi(log.c_str() + begin);
}

std::string tilingName(const Tiling &t) {
  return fmt::format("{},{},{},{}", t.blockM, t.blockN, t.warps, t.stages);
}

/// Compiles every candidate tiling; those the verifier, ptxas or spills rule
/// out get a status saying why. The KV-major backward's emitters do not
/// pipeline, so their candidates have one stage only; the dQ kernel's
/// warp-specialized schedule rings 2 to 4 stages.
std::vector<Candidate> enumerate(const KernelSpec &base) {
  std::vector<int> stages = {1, 2};
  if (base.kind == KernelKind::BwdDQ)
    stages = {1, 2, 3, 4};
  else if (isBackward(base.kind))
    stages = {1};
  std::vector<Candidate> all;
  bool warnedNoPtxas = false;
  // The forward also tries 128-key tiles (its sm_90a default at head_dim
  // 128), bwd_kv 128-query tiles (its sm_90a default at head_dim 64) and the
  // dQ kernel 128-key tiles (sm_90a, head_dim 64).
  std::vector<int> blockNs = {16, 32, 64};
  if (!isBackward(base.kind) ||
      (base.headDim == 64 &&
       (base.kind == KernelKind::BwdKV || base.kind == KernelKind::BwdDQ)))
    blockNs.push_back(128);
  // Head_dim 512 also 32 rows: bwd and bwd_kv hold 32 keys (64 need 256
  // accumulator registers a thread), and the query-major kernels take 32
  // rows where less shared memory is.
  std::vector<int> blockMs = {64, 128};
  if (base.headDim == 512)
    blockMs.insert(blockMs.begin(), 32);
  for (int m : blockMs)
    for (int n : blockNs)
      for (int w : {4, 8})
        for (int s : stages) {
          Candidate c;
          c.tiling = {m, n, w, s};
          KernelSpec spec = base;
          spec.tiling = c.tiling;
          CompileResult r = compile(spec);
          if (!r.ok) {
            // The verifier's message follows the location: "loc(...):
            // <message>".
            size_t at = r.error.find("): ");
            std::string msg =
                at == std::string::npos ? r.error : r.error.substr(at + 3);
            c.status = "illegal: " + msg.substr(0, msg.find('\n'));
          } else if (r.ptxasLog.empty()) {
            // No ptxas: PTX only, nothing known about registers or spills.
            if (!warnedNoPtxas)
              fmt::print(stderr, "dualkv-tune: no ptxas found: registers and "
                                 "spills are not checked\n");
            warnedNoPtxas = true;
            c.sharedBytes = r.info.sharedBytes;
          } else {
            c.registers = std::max(0, numberBefore(r.ptxasLog, " registers"));
            c.sharedBytes = r.info.sharedBytes;
            c.spillStores = numberBefore(r.ptxasLog, " bytes spill stores");
            c.spillLoads = numberBefore(r.ptxasLog, " bytes spill loads");
            if (c.spillStores != 0 || c.spillLoads != 0)
              c.status = fmt::format("spills ({} B stored, {} B loaded)",
                                     c.spillStores, c.spillLoads);
          }
          all.push_back(c);
        }
  return all;
}

std::string arch() {
  cudaDeviceProp p;
  cudaCheck(cudaGetDeviceProperties(&p, 0), "cudaGetDeviceProperties");
  return Arch::forComputeCapability(p.major, p.minor).str();
}

/// The --score-mod modifier as the runtime takes it: its text and one device
/// buffer per tensor (--score-mod-input-sizes fp32 elements, uniform random
/// in [-0.1, 0.1]). Without a modifier, nothing.
class ScoreModTensors {
public:
  explicit ScoreModTensors(const Args &args) : text_(args.spec.scoreMod) {
    if (text_.empty())
      return;
    std::mt19937_64 rng(11);
    std::uniform_real_distribution<float> uniform(-0.1f, 0.1f);
    for (int64_t n : args.scoreModSizes) {
      std::vector<float> host(static_cast<size_t>(n));
      for (float &x : host)
        x = uniform(rng);
      buffers_.push_back(
          std::make_unique<DeviceArray<float>>(static_cast<size_t>(n)));
      buffers_.back()->write(host);
      pointers_.push_back(buffers_.back()->data());
    }
  }

  /// `a` (ForwardArgs or BackwardArgs) carrying the modifier.
  template <typename A> A apply(A a) const {
    if (text_.empty())
      return a;
    a.score_mod = text_.c_str();
    a.score_mod_inputs = pointers_.data();
    a.num_score_mod_inputs = static_cast<int>(pointers_.size());
    return a;
  }

  bool active() const { return !text_.empty(); }

private:
  std::string text_;
  std::vector<std::unique_ptr<DeviceArray<float>>> buffers_;
  std::vector<const float *> pointers_;
};

/// Whether `x` and `ref` are the same value that is not finite (both NaN, or
/// one infinity): the default tiling's result, which a score modifier's
/// candidates are checked against, may hold them where a modifier masks.
bool sameNonFinite(double x, double ref) {
  return (std::isnan(x) && std::isnan(ref)) || (std::isinf(x) && x == ref);
}

//===----------------------------------------------------------------------===//
// The fp64 reference, one thread per KV head
//===----------------------------------------------------------------------===//

/// Heads [h0, h0 + n) of x [T][H][D], as [T][n][D].
std::vector<double> sliceHeads(const std::vector<double> &x, int64_t t, int h,
                               int d, int h0, int n) {
  std::vector<double> out(size_t(t) * n * d);
  for (int64_t i = 0; i < t; ++i)
    std::copy_n(x.begin() + (i * h + h0) * d, size_t(n) * d,
                out.begin() + i * n * d);
  return out;
}

/// The inverse of sliceHeads: writes `part` [T][n][D] into heads [h0, h0 + n)
/// of x [T][H][D].
void scatterHeads(const std::vector<double> &part, std::vector<double> &x,
                  int64_t t, int h, int d, int h0, int n) {
  for (int64_t i = 0; i < t; ++i)
    std::copy_n(part.begin() + i * n * d, size_t(n) * d,
                x.begin() + (i * h + h0) * d);
}

/// Runs fn(kvHead) on one thread per KV head: a KV head and its query heads
/// are an independent problem, so the reference takes seconds, not minutes.
template <typename F> void forEachKvHead(int hkv, F &&fn) {
  std::vector<std::thread> pool;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(hkv));
  for (int h = 0; h < hkv; ++h)
    pool.emplace_back([&, h] {
      try {
        fn(h);
      } catch (...) {
        errors[size_t(h)] = std::current_exception();
      }
    });
  for (auto &t : pool)
    t.join();
  for (auto &e : errors)
    if (e)
      std::rethrow_exception(e);
}

/// max |x - ref| / max |ref| and ||x - ref|| / ||ref||, as the GPU tests
/// measure gradients; infinite when a value is not finite.
struct Errors {
  double maxAbsRel = 0, relL2 = 0;
};

Errors compare(const std::vector<float> &x, const std::vector<double> &ref) {
  double maxAbs = 0, maxRef = 0, num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (sameNonFinite(x[i], ref[i]))
      continue;
    if (!std::isfinite(x[i]) || !std::isfinite(ref[i]))
      return {INFINITY, INFINITY};
    double d = std::abs(double(x[i]) - ref[i]);
    maxAbs = std::max(maxAbs, d);
    maxRef = std::max(maxRef, std::abs(ref[i]));
    num += d * d;
    den += ref[i] * ref[i];
  }
  return {maxRef > 0 ? maxAbs / maxRef : maxAbs,
          den > 0 ? std::sqrt(num / den) : std::sqrt(num)};
}

/// A small problem with every edge (partial tiles, an empty response, a group
/// longer than one backward query chunk so that prompt dK/dV are summed over
/// chunks) and its fp64 reference, computed once; check() runs one candidate
/// on it. With a score modifier, which the fp64 reference cannot evaluate,
/// the reference is the kernel at the default tiling `dflt` instead, at twice
/// the tolerances (each within them of the exact result).
class Checker {
public:
  Checker(const KernelSpec &s, const ScoreModTensors &scoreMod,
          const Tiling &dflt)
      : spec_(s), scoreMod_(scoreMod), dflt_(dflt),
        tolScale_(scoreMod.active() ? 2.0 : 1.0),
        groups_({{600, {400, 0, 113, 1}}, {65, {17}}}), plan_(groups_),
        tokens_(plan_.numTokens()), rng_(5), in_(plan_, headShape(s), rng_),
        dout_(in_.o.size()), dq_(in_.hostQ.size()), dk_(in_.hostK.size()),
        dv_(in_.hostV.size()) {
    for (auto &g : groups_)
      problem_.groups.push_back({g.prompt_len, g.response_lens});
    problem_.num_q_heads = s.numQHeads;
    problem_.num_kv_heads = s.numKVHeads;
    problem_.head_dim = s.headDim;
    problem_.v_head_dim = s.vDim();
    problem_.scale = 1.0 / std::sqrt(double(s.headDim));
    if (isBackward(s.kind))
      prepareBackward();
    else
      prepareForward();
  }

  /// Why `tiling` is wrong, or nothing when it agrees with the reference.
  std::optional<std::string> check(const Tiling &tiling) {
    if (!baselineError_.empty())
      return baselineError_;
    return isBackward(spec_.kind) ? checkBackward(tiling)
                                  : checkForward(tiling);
  }

private:
  std::vector<double> widen(const std::vector<uint16_t> &x) const {
    std::vector<double> w(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      w[i] = fromElement(x[i], spec_.dtype);
    return w;
  }
  std::vector<float> widenF(const std::vector<uint16_t> &x) const {
    std::vector<float> w(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      w[i] = fromElement(x[i], spec_.dtype);
    return w;
  }
  reference::Problem perKvHead() const {
    reference::Problem p = problem_;
    p.num_q_heads = spec_.numQHeads / spec_.numKVHeads;
    p.num_kv_heads = 1;
    return p;
  }

  void prepareForward() {
    if (scoreMod_.active()) {
      // The default tiling's O and LSE (tolScale_ widens the tolerances).
      in_.o.poison();
      in_.lse.poison();
      if (!runBaseline("the default tiling " + tilingName(dflt_),
                       [&] { forward(forwardArgs(dflt_)); }))
        return;
      oRef_ = widen(in_.o.read());
      auto lse = in_.lse.read();
      lseRef_.assign(lse.begin(), lse.end());
      return;
    }
    const int hq = spec_.numQHeads, hkv = spec_.numKVHeads, d = spec_.headDim,
              dv = spec_.vDim(), g = hq / hkv;
    auto q = widen(in_.hostQ), k = widen(in_.hostK), v = widen(in_.hostV);
    oRef_.assign(in_.o.size(), 0);
    lseRef_.assign(size_t(tokens_) * hq, 0);
    forEachKvHead(hkv, [&](int h) {
      auto qh = sliceHeads(q, tokens_, hq, d, h * g, g);
      auto kh = sliceHeads(k, tokens_, hkv, d, h, 1);
      auto vh = sliceHeads(v, tokens_, hkv, dv, h, 1);
      std::vector<double> oh(size_t(tokens_) * g * dv), lh(size_t(tokens_) * g);
      reference::forward(perKvHead(), qh.data(), kh.data(), vh.data(),
                         oh.data(), lh.data());
      scatterHeads(oh, oRef_, tokens_, hq, dv, h * g, g);
      std::copy(lh.begin(), lh.end(), lseRef_.begin() + h * g * tokens_);
    });
  }

  std::optional<std::string> checkForward(const Tiling &tiling) {
    in_.o.poison();
    in_.lse.poison();
    forward(forwardArgs(tiling));
    cudaCheck(cudaDeviceSynchronize(), "check run");
    auto oh = in_.o.read();
    auto lh = in_.lse.read();
    double maxO = 0, maxLse = 0;
    for (size_t i = 0; i < oh.size(); ++i) {
      double x = fromElement(oh[i], spec_.dtype);
      if (sameNonFinite(x, oRef_[i]))
        continue;
      double e = std::abs(x - oRef_[i]);
      maxO = std::isfinite(e) ? std::max(maxO, e) : INFINITY;
    }
    for (size_t i = 0; i < lh.size(); ++i) {
      if (sameNonFinite(lh[i], lseRef_[i]))
        continue;
      double e = std::abs(lh[i] - lseRef_[i]);
      maxLse = std::isfinite(e) ? std::max(maxLse, e) : INFINITY;
    }
    double tolO = tolScale_ * (spec_.dtype == DType::BF16 ? 2e-2 : 4e-3);
    if (maxO <= tolO && maxLse <= tolScale_ * 1e-4)
      return std::nullopt;
    return fmt::format("wrong: max|dO| {:.3g}, max|dLSE| {:.3g}", maxO, maxLse);
  }

  /// The reference gets exactly the kernel's inputs, as in the GPU tests: q,
  /// k, v and dO in the element type, and the forward kernel's own O and LSE
  /// (the forward at its default tiling; it does not change between
  /// candidates).
  void prepareBackward() {
    const int hq = spec_.numQHeads, hkv = spec_.numKVHeads, d = spec_.headDim,
              dv = spec_.vDim(), g = hq / hkv;
    std::normal_distribution<float> normal;
    dout16_.resize(in_.o.size());
    for (auto &e : dout16_)
      e = toElement(normal(rng_), spec_.dtype);
    dout_.write(dout16_);
    KernelSpec fwdSpec = spec_;
    fwdSpec.kind = KernelKind::Fwd;
    const Tiling fwdTiling = defaultTiling(fwdSpec);
    if (!runBaseline("the forward at " + tilingName(fwdTiling),
                     [&] { forward(forwardArgs(fwdTiling)); }))
      return;
    if (scoreMod_.active()) {
      // The default tiling's gradients (tolScale_ widens the tolerances).
      for (DeviceArray<uint16_t> *b : {&dq_, &dk_, &dv_})
        b->poison();
      if (!runBaseline("the default tiling " + tilingName(dflt_),
                       [&] { backward(backwardArgs(dflt_)); }))
        return;
      dqRef_ = widen(dq_.read());
      dkRef_ = widen(dk_.read());
      dvRef_ = widen(dv_.read());
      return;
    }
    auto o = widen(in_.o.read());
    auto lse32 = in_.lse.read();
    std::vector<double> lse(lse32.begin(), lse32.end());
    auto q = widen(in_.hostQ), k = widen(in_.hostK), v = widen(in_.hostV),
         dout = widen(dout16_);
    dqRef_.assign(q.size(), 0);
    dkRef_.assign(k.size(), 0);
    dvRef_.assign(v.size(), 0);
    forEachKvHead(hkv, [&](int h) {
      auto qh = sliceHeads(q, tokens_, hq, d, h * g, g);
      auto oh = sliceHeads(o, tokens_, hq, dv, h * g, g);
      auto douth = sliceHeads(dout, tokens_, hq, dv, h * g, g);
      auto kh = sliceHeads(k, tokens_, hkv, d, h, 1);
      auto vh = sliceHeads(v, tokens_, hkv, dv, h, 1);
      std::vector<double> lh(lse.begin() + h * g * tokens_,
                             lse.begin() + (h + 1) * g * tokens_);
      std::vector<double> dqh(qh.size()), dkh(kh.size()), dvh(vh.size());
      reference::backward(perKvHead(), qh.data(), kh.data(), vh.data(),
                          oh.data(), lh.data(), douth.data(), dqh.data(),
                          dkh.data(), dvh.data());
      scatterHeads(dqh, dqRef_, tokens_, hq, d, h * g, g);
      scatterHeads(dkh, dkRef_, tokens_, hkv, d, h, 1);
      scatterHeads(dvh, dvRef_, tokens_, hkv, dv, h, 1);
    });
  }

  std::optional<std::string> checkBackward(const Tiling &tiling) {
    for (DeviceArray<uint16_t> *b : {&dq_, &dk_, &dv_})
      b->poison();
    backward(backwardArgs(tiling));
    cudaCheck(cudaDeviceSynchronize(), "check run");
    Errors e[3] = {compare(widenF(dq_.read()), dqRef_),
                   compare(widenF(dk_.read()), dkRef_),
                   compare(widenF(dv_.read()), dvRef_)};
    // tests/gpu/BackwardGpuTest.cpp, toleranceFor: bf16 4e-2 / 1.5e-2, fp16
    // 6e-3 / 2.5e-3 (max|err| / max|ref|, rel-L2).
    const bool bf16 = spec_.dtype == DType::BF16;
    const double tolMax = tolScale_ * (bf16 ? 4e-2 : 6e-3),
                 tolL2 = tolScale_ * (bf16 ? 1.5e-2 : 2.5e-3);
    bool ok = true;
    for (const Errors &x : e)
      ok = ok && x.maxAbsRel <= tolMax && x.relL2 <= tolL2;
    if (ok)
      return std::nullopt;
    return fmt::format("wrong: max|err|/max|ref| dq {:.3g} dk {:.3g} dv "
                       "{:.3g}, rel-L2 dq {:.3g} dk {:.3g} dv {:.3g}",
                       e[0].maxAbsRel, e[1].maxAbsRel, e[2].maxAbsRel,
                       e[0].relL2, e[1].relL2, e[2].relL2);
  }

  ForwardArgs forwardArgs(const Tiling &tiling) {
    return scoreMod_.apply(in_.forwardArgs(tiling));
  }
  BackwardArgs backwardArgs(const Tiling &tiling) {
    return scoreMod_.apply(withAlgorithm(
        in_.backwardArgs(dout_.data(), dq_.data(), dk_.data(), dv_.data()),
        spec_.kind, tiling));
  }

  /// Runs `what`, a kernel call the check's reference needs (the forward a
  /// backward is checked over; with a score modifier, the default tiling).
  /// With a modifier, a call the runtime refuses leaves every candidate
  /// unchecked (baselineError_) and returns false; without one, it ends the
  /// run, as does a CUDA error.
  template <typename F> bool runBaseline(const std::string &what, F &&run) {
    try {
      run();
    } catch (const Error &e) {
      if (!scoreMod_.active())
        throw;
      baselineError_ = fmt::format(
          "unchecked: {}, the check's reference with --score-mod, failed: {}",
          what, e.what());
      return false;
    }
    cudaCheck(cudaDeviceSynchronize(), "the check's reference run");
    return true;
  }

  KernelSpec spec_;
  const ScoreModTensors &scoreMod_;
  Tiling dflt_;
  double tolScale_;
  std::string baselineError_;
  std::vector<PlanGroup> groups_;
  Plan plan_;
  int64_t tokens_;
  std::mt19937_64 rng_;
  DeviceProblem in_;
  std::vector<uint16_t> dout16_;
  DeviceArray<uint16_t> dout_, dq_, dk_, dv_;
  reference::Problem problem_;
  std::vector<double> oRef_, lseRef_, dqRef_, dkRef_, dvRef_;
};

//===----------------------------------------------------------------------===//
// Timing
//===----------------------------------------------------------------------===//

/// The timing problem: three input sets in rotation, and for the backward the
/// forward's O and LSE of each and shared gradient outputs. The upstream
/// gradient of set i is the next set's q: random, never zero, and no host
/// work for another hundred million values.
class Timer {
public:
  Timer(const Args &args, const KernelSpec &base,
        const ScoreModTensors &scoreMod)
      : spec_(base), scoreMod_(scoreMod),
        plan_({PlanGroup{args.P, std::vector<int64_t>(args.N, args.R)}}) {
    std::mt19937_64 rng(7);
    for (int i = 0; i < 3; ++i)
      inputs_.push_back(
          std::make_unique<DeviceProblem>(plan_, headShape(base), rng));
    if (!isBackward(base.kind))
      return;
    size_t qSize = inputs_[0]->hostQ.size(), kSize = inputs_[0]->hostK.size(),
           vSize = inputs_[0]->hostV.size();
    dq_ = std::make_unique<DeviceArray<uint16_t>>(qSize);
    dk_ = std::make_unique<DeviceArray<uint16_t>>(kSize);
    dv_ = std::make_unique<DeviceArray<uint16_t>>(vSize);
    for (auto &in : inputs_)
      forward(scoreMod_.apply(in->forwardArgs()));
    cudaCheck(cudaDeviceSynchronize(), "forward of the timing inputs");
  }

  /// One call of what is tuned on input set i.
  void run(int i, const Tiling &tiling) {
    DeviceProblem &in = *inputs_[size_t(i) % 3];
    if (!isBackward(spec_.kind)) {
      forward(scoreMod_.apply(in.forwardArgs(tiling)));
      return;
    }
    // dO: another input set's Q (random; O's shape or larger: every head
    // shape has Dv <= D), read with O's strides.
    backward(scoreMod_.apply(
        withAlgorithm(in.backwardArgs(inputs_[size_t(i + 1) % 3]->q.data(),
                                      dq_->data(), dk_->data(), dv_->data()),
                      spec_.kind, tiling)));
  }

private:
  KernelSpec spec_;
  const ScoreModTensors &scoreMod_;
  Plan plan_;
  std::vector<std::unique_ptr<DeviceProblem>> inputs_;
  std::unique_ptr<DeviceArray<uint16_t>> dq_, dk_, dv_;
};

nlohmann::json toJson(const Candidate &c, const Tiling &dflt) {
  return {{"tiling",
           {{"block_m", c.tiling.blockM},
            {"block_n", c.tiling.blockN},
            {"warps", c.tiling.warps},
            {"stages", c.tiling.stages}}},
          {"status", c.status},
          {"default", c.tiling == dflt},
          {"timed", c.timed},
          {"registers", c.registers},
          {"shared_bytes", c.sharedBytes},
          {"spill_store_bytes", c.spillStores},
          {"spill_load_bytes", c.spillLoads},
          {"ms", c.ms},
          {"tflops", c.tflops}};
}

/// One tuning's report: every candidate (status, registers, spills, ms).
nlohmann::json reportJson(const KernelSpec &base, const std::string &shape,
                          const ShapeClass &cls, double flops,
                          const std::vector<Candidate> &cands,
                          const Tiling &dflt,
                          const std::optional<Tiling> &best) {
  nlohmann::json doc = {{"kind", toString(base.kind)},
                        {"head_dim", base.headDim},
                        {"num_q_heads", base.numQHeads},
                        {"num_kv_heads", base.numKVHeads},
                        {"dtype", toString(base.dtype)},
                        {"arch", base.arch},
                        {"shape", shape},
                        {"shape_class", cls.name()},
                        {"useful_flops", flops},
                        {"candidates", nlohmann::json::array()}};
  if (!base.scoreMod.empty())
    doc["score_mod"] = base.scoreMod; // checked against the default tiling
  if (base.vDim() != base.headDim)
    doc["v_head_dim"] = base.vDim();
  for (const Candidate &c : cands)
    doc["candidates"].push_back(toJson(c, dflt));
  doc["default"] = tilingName(dflt);
  doc["best"] = best ? nlohmann::json(tilingName(*best)) : nlohmann::json();
  return doc;
}

/// Writes the --report file; false (and a message) when it cannot.
bool writeReport(const std::string &path, const nlohmann::json &doc) {
  std::ofstream out(path);
  out << doc.dump(2) << "\n";
  if (!out) {
    fmt::print(stderr, "dualkv-tune: cannot write --report '{}'\n", path);
    return false;
  }
  return true;
}

/// Useful FLOPs of one group (benchmarks/README.md): the forward 4 * D * Hq
/// * pairs (2 * (D + Dv) with a value head_dim Dv apart: Q K^T and P V), the
/// backward 2.5 times that.
double usefulFlops(const KernelSpec &base, const Shape &s) {
  double pairs =
      s.P * (s.P + 1) / 2.0 + s.N * (s.R * double(s.P) + s.R * (s.R + 1) / 2.0);
  return (isBackward(base.kind) ? 2.5 : 1.0) * 2.0 *
         (base.headDim + base.vDim()) * base.numQHeads * pairs;
}

std::string shapeName(const Shape &s) {
  return fmt::format("P{}_N{}_R{}", s.P, s.N, s.R);
}

const char *describe(KernelKind k) {
  switch (k) {
  case KernelKind::Bwd:
    return "backward (bwd, dQ by atomics)";
  case KernelKind::BwdKV:
    return "backward (bwd_kv, deterministic)";
  case KernelKind::BwdDQ:
    return "backward (bwd_dq, deterministic)";
  default:
    return "forward";
  }
}

} // namespace

int main(int argc, char **argv) {
  Args args = parseArgs(argc, argv);
  // Without --shapes: one job, the generic entry timed on --P/--N/--R.
  std::vector<Job> jobs;
  if (!args.shapes.empty()) {
    jobs = classJobs(readShapes(args.shapes));
    if (args.listClasses) {
      fmt::print("{} shape classes in {}:\n", jobs.size(), args.shapes);
      for (const Job &j : jobs)
        fmt::print("  {} ({} shape{})\n", j.cls.name(), j.count,
                   j.count == 1 ? "" : "s");
      return 0;
    }
  } else {
    jobs.push_back({{args.P, args.N, args.R}, ShapeClass{}, 0});
  }
  bool gpu = !args.dryRun && dualkv::tools::gpuPresent();
  if (!args.dryRun && !gpu) {
    fmt::print(stderr,
               "dualkv-tune: no GPU; use --dry-run to list candidates\n");
    return 1;
  }
  try {
    KernelSpec base = args.spec;
    base.arch = gpu ? arch() : args.arch;
    const bool bwd = isBackward(base.kind);
    fmt::print("dualkv-tune: {}, head_dim {}{}, heads {}:{}, {}, {}{}\n",
               describe(base.kind), base.headDim,
               base.vDim() == base.headDim
                   ? std::string()
                   : fmt::format(" v_head_dim {}", base.vDim()),
               base.numQHeads, base.numKVHeads, toString(base.dtype), base.arch,
               base.scoreMod.empty()
                   ? std::string()
                   : fmt::format(", score modifier {} ({} tensor{})",
                                 args.scoreModFile, args.scoreModInputs,
                                 args.scoreModInputs == 1 ? "" : "s"));
    if (!args.shapes.empty()) {
      fmt::print("{} shape classes in {}:", jobs.size(), args.shapes);
      for (const Job &j : jobs)
        fmt::print(" {}", j.cls.name());
      fmt::print("\n");
    }
    std::vector<Candidate> cands = enumerate(base);
    Tiling dflt = defaultTiling(base);
    if (args.dryRun) {
      fmt::print("{:>7} {:>7} {:>5} {:>6} {:>9} {:>13}  {}\n", "block_m",
                 "block_n", "warps", "stages", "registers", "shared bytes",
                 "status");
      for (const Candidate &c : cands)
        fmt::print("{:>7} {:>7} {:>5} {:>6} {:>9} {:>13}  {}{}\n",
                   c.tiling.blockM, c.tiling.blockN, c.tiling.warps,
                   c.tiling.stages, c.registers, c.sharedBytes, c.status,
                   c.tiling == dflt ? " (default)" : "");
      const Job &j = jobs.front();
      if (!args.report.empty() &&
          !writeReport(args.report,
                       reportJson(base, shapeName(j.shape), j.cls,
                                  usefulFlops(base, j.shape), cands, dflt, {})))
        return 1;
      return 0;
    }

    // Spilling candidates are dropped like illegal ones, except the default:
    // it is what the runtime runs without a tuning, so it is always timed (a
    // baseline the winner must beat, and a winner if nothing does).
    auto eligible = [&](const Candidate &c) {
      return c.status == "ok" ||
             (c.tiling == dflt && c.status.rfind("spills", 0) == 0);
    };
    size_t todo = std::count_if(cands.begin(), cands.end(), eligible);
    fmt::print("{} candidates, {} dropped before timing:\n", cands.size(),
               cands.size() - todo);
    for (const Candidate &c : cands)
      if (c.status != "ok")
        fmt::print("  {}: {}{}\n", tilingName(c.tiling), c.status,
                   eligible(c) ? " (the default: timed all the same)" : "");

    // Correctness on a small problem (its reference computed once), once per
    // candidate whatever the number of classes.
    auto start = std::chrono::steady_clock::now();
    const ScoreModTensors scoreMod(args);
    Checker checker(base, scoreMod, dflt);
    std::vector<bool> checked(cands.size(), false);
    for (size_t i = 0; i < cands.size(); ++i) {
      Candidate &c = cands[i];
      if (!eligible(c))
        continue;
      std::optional<std::string> wrong;
      try {
        wrong = checker.check(c.tiling);
      } catch (const Error &e) {
        // A launch the runtime refuses (dualkv::Error) drops the candidate; a
        // CUDA error (std::runtime_error from check()) ends the run.
        wrong = fmt::format("failed: {}", e.what());
      }
      if (wrong) {
        c.status = *wrong;
        fmt::print("  {}: {}\n", tilingName(c.tiling), c.status);
      } else {
        checked[i] = true;
      }
    }
    fmt::print(
        "reference check{} done in {:.1f} s\n",
        scoreMod.active() ? " (against the default tiling " + tilingName(dflt) +
                                ": --score-mod)"
                          : std::string(),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count());

    std::string dbPath = args.db.empty() ? TuningDb::defaultPath() : args.db;
    nlohmann::json reports = nlohmann::json::array();
    int failures = 0;
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0), "cudaEventCreate");
    cudaCheck(cudaEventCreate(&e1), "cudaEventCreate");
    for (const Job &job : jobs) {
      const std::string shape = shapeName(job.shape);
      const double flops = usefulFlops(base, job.shape);
      Args timing = args;
      timing.P = job.shape.P;
      timing.N = job.shape.N;
      timing.R = job.shape.R;
      start = std::chrono::steady_clock::now();
      Timer timer(timing, base, scoreMod);
      fmt::print(
          "\n{}{} inputs ready in {:.1f} s\n",
          job.cls.any() ? "" : fmt::format("shape class {}: ", job.cls.name()),
          shape,
          std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                        start)
              .count());
      std::vector<Candidate> timed = cands;
      size_t done = 0, total = std::count(checked.begin(), checked.end(), true);
      start = std::chrono::steady_clock::now();
      for (size_t ci = 0; ci < timed.size(); ++ci) {
        if (!checked[ci])
          continue;
        Candidate &c = timed[ci];
        std::vector<float> ms;
        for (int i = 0; i < args.reps + 2; ++i) {
          cudaCheck(cudaEventRecord(e0), "cudaEventRecord");
          timer.run(i, c.tiling);
          cudaCheck(cudaEventRecord(e1), "cudaEventRecord");
          cudaCheck(cudaEventSynchronize(e1), "timing");
          float m = 0;
          cudaCheck(cudaEventElapsedTime(&m, e0, e1), "cudaEventElapsedTime");
          if (i >= 2) // two warm-up runs
            ms.push_back(m);
        }
        std::sort(ms.begin(), ms.end());
        c.ms = ms[ms.size() / 2];
        c.tflops = flops / (c.ms * 1e-3) / 1e12;
        c.timed = true;
        ++done;
        double elapsed = std::chrono::duration<double>(
                             std::chrono::steady_clock::now() - start)
                             .count();
        fmt::print("[{}/{}] {}: {:.3f} ms, {:.1f} TFLOP/s  (ETA {:.0f} s)\n",
                   done, total, tilingName(c.tiling), c.ms, c.tflops,
                   elapsed / done * (total - done));
        std::fflush(stdout);
      }

      std::vector<Candidate> ranked;
      for (const Candidate &c : timed)
        if (c.timed)
          ranked.push_back(c);
      std::sort(
          ranked.begin(), ranked.end(),
          [](const Candidate &a, const Candidate &b) { return a.ms < b.ms; });
      if (ranked.empty()) {
        fmt::print(stderr, "dualkv-tune: no candidate survived{}\n",
                   job.cls.any() ? "" : " for " + job.cls.name());
        reports.push_back(
            reportJson(base, shape, job.cls, flops, timed, dflt, {}));
        ++failures;
        continue;
      }
      double defaultMs = 0;
      for (const Candidate &c : ranked)
        if (c.tiling == dflt)
          defaultMs = c.ms;
      fmt::print("\nranked on {} ({} useful GFLOP{}):\n{:>4} {:>14} {:>9} "
                 "{:>13} {:>9} {:>8} {:>10}\n",
                 shape, flops / 1e9, bwd ? ", the whole backward call" : "",
                 "rank", "tiling", "registers", "shared bytes", "ms", "TFLOP/s",
                 "vs default");
      for (size_t i = 0; i < ranked.size(); ++i) {
        const Candidate &c = ranked[i];
        fmt::print(
            "{:>4} {:>14} {:>9} {:>13} {:>9.3f} {:>8.1f} {:>10}{}{}\n", i + 1,
            tilingName(c.tiling), c.registers, c.sharedBytes, c.ms, c.tflops,
            defaultMs > 0 ? fmt::format("{:.2f}x", defaultMs / c.ms) : "-",
            c.tiling == dflt ? "  default" : "",
            c.status == "ok" ? "" : ", " + c.status);
      }
      reports.push_back(reportJson(base, shape, job.cls, flops, timed, dflt,
                                   ranked.front().tiling));

      if (!base.scoreMod.empty()) {
        // The runtime never looks a score modifier's kernels up in the
        // tuning database (runtime/lib/selection/Select.cpp): an entry would
        // serve nothing.
        fmt::print("\nnot recorded: the runtime takes no tuned tiling for a "
                   "score modifier; pass {} as ForwardArgs/BackwardArgs::"
                   "tiling (or to dualkv-aot) to run it\n",
                   tilingName(ranked.front().tiling));
        continue;
      }
      // Saved after every class: a later failure keeps the earlier ones.
      std::string error;
      TuningDb db = TuningDb::load(dbPath, &error);
      if (!error.empty())
        fmt::print(stderr, "dualkv-tune: {} (it will be replaced)\n", error);
      TunedEntry best;
      best.spec = base;
      best.spec.P = job.cls.P;
      best.spec.N = job.cls.N;
      best.spec.R = job.cls.R;
      best.spec.tiling = ranked.front().tiling;
      best.ms = ranked.front().ms;
      best.tflops = ranked.front().tflops;
      best.shape = shape;
      db.put(best);
      if (!db.save(dbPath, &error)) {
        fmt::print(stderr, "dualkv-tune: {}\n", error);
        return 1;
      }
      fmt::print("\nwrote {} {} (shape class {}) to {}\n", toString(base.kind),
                 tilingName(best.spec.tiling), job.cls.name(), dbPath);
    }
    if (!args.report.empty()) {
      // One tuning's report as before; with --shapes, one per class.
      nlohmann::json doc =
          args.shapes.empty()
              ? reports.front()
              : nlohmann::json{{"shapes", args.shapes}, {"classes", reports}};
      if (!writeReport(args.report, doc))
        return 1;
    }
    return failures ? 1 : 0;
  } catch (const std::exception &e) {
    fmt::print(stderr, "dualkv-tune: {}\n", e.what());
    return 1;
  }
}
