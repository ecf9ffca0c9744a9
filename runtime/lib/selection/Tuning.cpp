// The tuning database: JSON in, JSON out, every field checked.
#include "dualkv/Tuning.h"

#include "cache/DiskCache.h"
#include "cache/Files.h"
#include "driver/Launch.h"
#include "dualkv/HeadDims.h"
#include "selection/KernelSets.h"
#include "selection/Tuned.h"
#include "support/Env.h"
#include "support/Status.h"

#include "dualkv/Bounded.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <llvm/ADT/SmallString.h>
#include <llvm/Support/Path.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>

#include <fcntl.h>
#include <unistd.h>

namespace dualkv {
namespace {

using nlohmann::json;

constexpr const char *kSchema = "dualkv-tuning";
/// A database of every kernel kind, shape class and arch is a few hundred
/// kilobytes; nothing larger is read.
constexpr size_t kMaxFileBytes = 64u << 20;

/// Everything that selects an entry, the kernel kind included: the spec
/// without its tiling.
bool sameKey(const KernelSpec &a, const KernelSpec &b) {
  return a.kind == b.kind && a.P == b.P && a.N == b.N && a.R == b.R &&
         a.headDim == b.headDim && a.vDim() == b.vDim() &&
         a.numQHeads == b.numQHeads && a.numKVHeads == b.numKVHeads &&
         a.dtype == b.dtype && a.arch == b.arch;
}

json toJsonEntry(const TunedEntry &e) {
  const KernelSpec &s = e.spec;
  json j = {{"kind", toString(s.kind)},
            {"P", s.P},
            {"N", s.N},
            {"head_dim", s.headDim},
            {"num_q_heads", s.numQHeads},
            {"num_kv_heads", s.numKVHeads},
            {"dtype", toString(s.dtype)},
            {"arch", s.arch},
            {"tiling",
             {{"block_m", s.tiling.blockM},
              {"block_n", s.tiling.blockN},
              {"warps", s.tiling.warps},
              {"stages", s.tiling.stages}}},
            {"ms", e.ms},
            {"tflops", e.tflops},
            {"shape", e.shape}};
  // Only a class entry has an R: a generic entry is spelled as before.
  if (s.R != 0)
    j["R"] = s.R;
  // Likewise a value head_dim apart from head_dim (MLA's 192 with 128).
  if (s.vDim() != s.headDim)
    j["v_head_dim"] = s.vDim();
  return j;
}

/// The entry `j` (entries[index]); an InvalidArgument error naming the field
/// when it is not well formed: every integer a JSON integer within its range
/// (no wrap, no truncation), every tiling field within the compiler's ranges.
llvm::Expected<TunedEntry> fromJsonEntry(const json &j, size_t index) {
  auto where = [&](const char *field) {
    return fmt::format("entries[{}].{}", index, field);
  };
  auto need = [&](const json &o, const char *field) -> const json * {
    if (!o.is_object() || !o.contains(field))
      return nullptr;
    return &o.at(field);
  };
  auto missing = [&](const char *field) {
    return invalidArgument(fmt::format("{} is missing", where(field)));
  };
  auto integer = [&](const json &o, const char *field, int64_t lo, int64_t hi,
                     int64_t &out) -> llvm::Error {
    const json *v = need(o, field);
    if (!v)
      return missing(field);
    std::optional<int64_t> value = jsonInteger(*v, lo, hi);
    if (!value)
      return invalidArgument(
          fmt::format("{} is not a valid integer (one in [{}, {}]): {}",
                      where(field), lo, hi, clipForMessage(v->dump(), 80)));
    out = *value;
    return llvm::Error::success();
  };
  auto text = [&](const char *field, std::string &out) -> llvm::Error {
    const json *v = need(j, field);
    if (!v)
      return missing(field);
    if (!v->is_string())
      return invalidArgument(fmt::format("{} is not a string: {}", where(field),
                                         clipForMessage(v->dump(), 80)));
    out = v->get<std::string>();
    return llvm::Error::success();
  };
  TunedEntry e;
  KernelSpec &s = e.spec;
  // The kind is part of the key: a forward entry never answers a backward
  // lookup, nor one backward kernel's entry another's.
  std::string kind;
  if (llvm::Error err = text("kind", kind))
    return err;
  std::optional<KernelKind> known = parseKernelKind(kind);
  if (!known)
    return invalidArgument(
        fmt::format("{} '{}' is not a known kernel kind ({})", where("kind"),
                    clipForMessage(kind, 80), names::listOf(names::kKinds)));
  s.kind = *known;
  if (llvm::Error err = integer(j, "P", 0, kShapeClassMax, s.P))
    return err;
  if (llvm::Error err = integer(j, "N", 0, kShapeClassMax, s.N))
    return err;
  s.R = 0;
  if (j.is_object() && j.contains("R"))
    if (llvm::Error err = integer(j, "R", 0, kShapeClassMax, s.R))
      return err;
  if (!isShapeClass({s.P, s.N, s.R}))
    return invalidArgument(fmt::format(
        "{} (P {}, N {}, R {}) is not a shape class: all 0, or powers of two "
        "with P >= {}, N >= {}, R >= {}",
        where("P"), s.P, s.N, s.R, kShapeClassMinP, kShapeClassMinN,
        kShapeClassMinR));
  // Heads as a launch takes them: within the grid (kMaxGridYZ).
  int64_t headDim = 0, valueHeadDim = 0, numQHeads = 0, numKVHeads = 0;
  if (llvm::Error err = integer(j, "head_dim", 0, 1 << 30, headDim))
    return err;
  // "v_head_dim" only where the value rows are narrower; absent: head_dim.
  const bool hasValueHeadDim = j.is_object() && j.contains("v_head_dim");
  if (hasValueHeadDim)
    if (llvm::Error err = integer(j, "v_head_dim", 1, 1 << 30, valueHeadDim))
      return err;
  if (!hasValueHeadDim && !isSupportedHeadDim(headDim))
    return invalidArgument(fmt::format("{} ({}) must be {}", where("head_dim"),
                                       headDim, headDimChoices()));
  if (hasValueHeadDim && !isSupportedHeadShape(headDim, valueHeadDim))
    return invalidArgument(fmt::format(
        "{} ({}) with {} ({}) must be {}", where("head_dim"), headDim,
        where("v_head_dim"), valueHeadDim, headShapeChoices()));
  if (llvm::Error err = integer(j, "num_q_heads", 1, kMaxGridYZ, numQHeads))
    return err;
  if (llvm::Error err = integer(j, "num_kv_heads", 1, kMaxGridYZ, numKVHeads))
    return err;
  if (numQHeads % numKVHeads != 0)
    return invalidArgument(fmt::format("{} ({}) is not a multiple of "
                                       "num_kv_heads ({})",
                                       where("num_q_heads"), numQHeads,
                                       numKVHeads));
  s.headDim = static_cast<int>(headDim);
  s.valueHeadDim = valueHeadDim == headDim ? 0 : static_cast<int>(valueHeadDim);
  s.numQHeads = static_cast<int>(numQHeads);
  s.numKVHeads = static_cast<int>(numKVHeads);
  std::string dtype;
  if (llvm::Error err = text("dtype", dtype))
    return err;
  std::optional<DType> knownDType = parseDType(dtype);
  if (!knownDType || dtype != toString(*knownDType))
    return invalidArgument(fmt::format("{} '{}' is not {}", where("dtype"),
                                       clipForMessage(dtype, 80),
                                       names::listOf(names::kDTypes)));
  s.dtype = *knownDType;
  if (llvm::Error err = text("arch", s.arch))
    return err;
  const json *t = need(j, "tiling");
  if (!t)
    return missing("tiling");
  int64_t tiling[4] = {};
  const char *fields[4] = {"block_m", "block_n", "warps", "stages"};
  for (int f = 0; f < 4; ++f)
    if (llvm::Error err = integer(*t, fields[f], 0, 1 << 30, tiling[f]))
      return err;
  s.tiling = {static_cast<int>(tiling[0]), static_cast<int>(tiling[1]),
              static_cast<int>(tiling[2]), static_cast<int>(tiling[3])};
  if (!s.tiling.blockM || !s.tiling.blockN || !s.tiling.warps ||
      !s.tiling.stages)
    return invalidArgument(fmt::format("{} has a zero field", where("tiling")));
  if (llvm::Error err = checkTilingFields(where("tiling"), s.tiling,
                                          /*zeroTakesDefault=*/false))
    return err;
  if (j.contains("ms") && j["ms"].is_number())
    e.ms = j["ms"].get<double>();
  if (j.contains("tflops") && j["tflops"].is_number())
    e.tflops = j["tflops"].get<double>();
  if (j.contains("shape") && j["shape"].is_string())
    e.shape = j["shape"].get<std::string>();
  return e;
}

/// An entry's key and tiling, for messages: "fwd generic head_dim 64 heads
/// 4:4 bf16 sm_80 tiling 128,32,4,3" ("fwd P=1024 N=8 R=256 ..." for a
/// class's).
std::string describeEntry(const KernelSpec &s) {
  std::string shape =
      s.R ? fmt::format("P={} N={} R={}", s.P, s.N, s.R) : "generic";
  return fmt::format(
      "{} {} head_dim {}{} heads {}:{} {} {} tiling {},{},{},{}",
      toString(s.kind), shape, s.headDim,
      s.vDim() == s.headDim ? std::string()
                            : fmt::format(" v_head_dim {}", s.vDim()),
      s.numQHeads, s.numKVHeads, toString(s.dtype), clipForMessage(s.arch, 80),
      s.tiling.blockM, s.tiling.blockN, s.tiling.warps, s.tiling.stages);
}

/// The entries of the database text `text`; an InvalidArgument error saying
/// what is wrong with it. A well-formed entry the compiler's spec check
/// refuses is left out, with a line in `skipped`. (nlohmann's accessors may
/// still throw json exceptions on values of the wrong type.)
llvm::Expected<std::vector<TunedEntry>>
parseEntries(const std::string &text, std::vector<std::string> &skipped) {
  if (jsonNestsDeeperThan(text, kMaxJsonDepth))
    return invalidArgument(
        fmt::format("nests deeper than {} levels", kMaxJsonDepth));
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded())
    return invalidArgument("not valid JSON (truncated?)");
  if (!doc.is_object() || doc.value("schema", "") != kSchema)
    return invalidArgument(
        fmt::format("not a DualKV tuning database (schema '{}')",
                    doc.is_object() ? doc.value("schema", "") : ""));
  if (doc.value("version", -1) != TuningDb::kSchemaVersion)
    return invalidArgument(fmt::format("schema version {} is not {}",
                                       doc.value("version", -1),
                                       TuningDb::kSchemaVersion));
  if (!doc.contains("entries") || !doc["entries"].is_array())
    return invalidArgument("'entries' is missing or not an array");
  std::vector<TunedEntry> entries;
  for (size_t i = 0; i < doc["entries"].size(); ++i) {
    llvm::Expected<TunedEntry> entry = fromJsonEntry(doc["entries"][i], i);
    if (!entry)
      return entry.takeError();
    // The spec check a compile of this entry's kernel runs (a fwd entry of
    // 3 stages, an arch the compiler does not know): its kernel takes the
    // default tiling, as a launch of an unbuildable tuned tiling does.
    if (std::string why = checkSpec(entry->spec); !why.empty()) {
      skipped.push_back(fmt::format("entries[{}] ({}) is left out: {}; its "
                                    "kernel takes the default tiling",
                                    i, describeEntry(entry->spec), why));
      continue;
    }
    entries.push_back(std::move(*entry));
  }
  return entries;
}

bool isPowerOfTwo(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

} // namespace

int64_t shapeBucket(int64_t x, int64_t floor) {
  int64_t b = std::max<int64_t>(floor, 1);
  while (b < x && b < kShapeClassMax)
    b *= 2;
  return std::min(b, kShapeClassMax);
}

ShapeClass shapeClassOf(int64_t P, int64_t N, int64_t R) {
  return {shapeBucket(P, kShapeClassMinP), shapeBucket(N, kShapeClassMinN),
          shapeBucket(R, kShapeClassMinR)};
}

ShapeClass shapeClassOf(const Plan &plan) {
  const std::vector<int64_t> &len = plan.nodeLengths();
  const std::vector<int64_t> &parent = plan.nodeParents();
  // Per root: its prompt, its children's count and total length; a node
  // below a child makes the plan a chain or tree: no class.
  struct Group {
    int64_t prompt = 0, responses = 0, responseTokens = 0;
  };
  std::vector<Group> groups;
  std::vector<int64_t> groupOf(len.size(), -1);
  for (size_t i = 0; i < len.size(); ++i) {
    if (parent[i] < 0) {
      groupOf[i] = static_cast<int64_t>(groups.size());
      groups.push_back({len[i], 0, 0});
      continue;
    }
    const size_t p = static_cast<size_t>(parent[i]);
    if (parent[p] >= 0)
      return {};
    Group &g = groups[static_cast<size_t>(groupOf[p])];
    ++g.responses;
    g.responseTokens += len[i];
  }
  const Group *largest = nullptr;
  for (const Group &g : groups)
    if (!largest ||
        g.prompt + g.responseTokens > largest->prompt + largest->responseTokens)
      largest = &g;
  if (!largest)
    return {};
  const int64_t n = largest->responses;
  const int64_t r = n ? (largest->responseTokens + n - 1) / n : 0;
  return shapeClassOf(largest->prompt, n, r);
}

bool isShapeClass(const ShapeClass &c) {
  if (c.any())
    return true;
  auto bucket = [](int64_t x, int64_t floor) {
    return isPowerOfTwo(x) && x >= floor && x <= kShapeClassMax;
  };
  return bucket(c.P, kShapeClassMinP) && bucket(c.N, kShapeClassMinN) &&
         bucket(c.R, kShapeClassMinR);
}

std::string ShapeClass::name() const {
  return any() ? std::string("any") : fmt::format("P{}_N{}_R{}", P, N, R);
}

TuningDb TuningDb::load(const std::string &path, std::string *error,
                        std::vector<std::string> *skipped) {
  error->clear();
  if (skipped)
    skipped->clear();
  TuningDb db;
  if (path.empty())
    return db;
  // The path may be a link (a shared database, say); what it leads to must
  // be a regular file of sane size, or nothing is read.
  llvm::Expected<std::string> text =
      readFileChecked(AT_FDCWD, path, FileRules{kMaxFileBytes});
  if (!text) {
    ErrorParts why = takeErrorParts(text.takeError());
    if (!isMissingFile(why))
      *error = clipForMessage(
          fmt::format("tuning database {} ignored: {}", path, why.message));
    return db; // no database is not an error
  }
  std::vector<std::string> left;
  auto parse = [&]() -> llvm::Expected<std::vector<TunedEntry>> {
    try {
      return parseEntries(*text, left);
    } catch (const std::exception &e) { // a json accessor's type error
      return invalidArgument(e.what());
    }
  };
  llvm::Expected<std::vector<TunedEntry>> entries = parse();
  if (!entries) {
    *error = clipForMessage(
        fmt::format("tuning database {} ignored: {}", path,
                    takeErrorParts(entries.takeError()).message));
    return TuningDb();
  }
  for (const std::string &why : left) {
    std::string line = fmt::format("tuning database {}: {}", path, why);
    if (skipped)
      skipped->push_back(std::move(line));
    else
      warnOnce(line);
  }
  db.entries_ = std::move(*entries);
  return db;
}

std::string TuningDb::defaultPath() {
  if (std::optional<std::string> p = env("DUALKV_TUNING_DB"))
    return *p;
  std::string root = DiskCache::defaultRoot();
  return root.empty() ? std::string() : root + "/tuning.json";
}

std::optional<Tiling> TuningDb::find(const KernelSpec &spec) const {
  for (const TunedEntry &e : entries_)
    if (sameKey(e.spec, spec))
      return e.spec.tiling;
  return std::nullopt;
}

std::optional<Tiling> TuningDb::findForClass(const KernelSpec &spec,
                                             const ShapeClass &c,
                                             bool *fromClass) const {
  if (fromClass)
    *fromClass = false;
  KernelSpec key = spec;
  if (!c.any()) {
    key.P = c.P;
    key.N = c.N;
    key.R = c.R;
    if (std::optional<Tiling> t = find(key)) {
      if (fromClass)
        *fromClass = true;
      return t;
    }
  }
  key.P = key.N = key.R = 0;
  return find(key);
}

void TuningDb::put(const TunedEntry &entry) {
  for (TunedEntry &e : entries_)
    if (sameKey(e.spec, entry.spec)) {
      e = entry;
      return;
    }
  entries_.push_back(entry);
}

std::string TuningDb::toJson() const {
  json doc = {{"schema", kSchema},
              {"version", kSchemaVersion},
              {"entries", json::array()}};
  for (const TunedEntry &e : entries_)
    doc["entries"].push_back(toJsonEntry(e));
  return doc.dump(2) + "\n";
}

bool TuningDb::save(const std::string &path, std::string *error) const {
  // Through the cache's writer: a complete file or none, no link followed.
  llvm::SmallString<256> dir(path);
  llvm::sys::path::remove_filename(dir);
  if (dir.empty())
    dir = ".";
  std::string name = llvm::sys::path::filename(path).str();
  FileDescriptor fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) {
    *error = fmt::format("cannot write {}: cannot open the folder {}: {}", path,
                         dir.str(), std::strerror(errno));
    return false;
  }
  if (llvm::Error e =
          writeAtomically(fd.get(), dir.str().str(), name, toJson())) {
    *error = takeErrorParts(std::move(e)).message;
    return false;
  }
  return true;
}

const TuningDb &processTuningDb() {
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

std::optional<KernelSpec> tunedSpec(const KernelSpec &spec, int tunedQHeads,
                                    int tunedKVHeads) {
  if (!(spec.tiling == Tiling{}))
    return std::nullopt;
  KernelSpec tunedKey = spec;
  if (tunedKVHeads > 0) {
    tunedKey.numQHeads = tunedQHeads;
    tunedKey.numKVHeads = tunedKVHeads;
  }
  std::optional<Tiling> tuned = processTuningDb().find(tunedKey);
  if (!tuned)
    return std::nullopt;
  KernelSpec s = spec;
  s.tiling = *tuned;
  return s;
}

} // namespace dualkv
