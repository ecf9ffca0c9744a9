// Seeded fuzzing of the files the runtime reads back: the tuning database and
// disk-cache entries (bytes, JSON values, file types, sizes, modes, owners).
//
//   dualkv-file-fuzz tuning|cache --work DIR [--seed S] [--count N]
//                    [--seconds T]
//
// A tuning database must load or be refused with a message, never throw, and
// what loads must survive a save and a reload unchanged. A cache entry must
// load as exactly what was stored or be a miss, never throw; a forged
// meta.json (values put in, checksum recomputed) must load with exactly the
// forged values when they are valid and be a miss otherwise; after a store
// the entry must load again (the repair), whatever took a file's place. The
// whole run is under an alarm, so a hang fails it; the last line gives the
// number of inputs tried.
#include "cache/DiskCache.h"
#include "cache/Files.h"

#include "dualkv/Tuning.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

using namespace dualkv;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using Rng = std::mt19937_64;

size_t pick(Rng &rng, size_t n) {
  return std::uniform_int_distribution<size_t>(0, n - 1)(rng);
}
bool chance(Rng &rng, double p) {
  return std::uniform_real_distribution<double>(0, 1)(rng) < p;
}

void writeBytes(const std::string &path, const std::string &bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

/// Values that stress a reader: every JSON type, boundaries, deep nesting.
json randomValue(Rng &rng) {
  static const std::vector<json> values = {
      nullptr,
      true,
      false,
      0,
      1,
      -1,
      31,
      32,
      33,
      128,
      129,
      1024,
      1025,
      1 << 30,
      (1ll << 31),
      -(1ll << 31),
      std::numeric_limits<int64_t>::max(),
      std::numeric_limits<uint64_t>::max(),
      1.5,
      -0.0,
      1e308,
      "",
      "x",
      "fwd",
      "bwd",
      "bf16",
      "f16",
      "fp16",
      "sm_90a",
      "sm_80",
      "../../etc",
      "dualkv-tuning",
      json::array(),
      json::array({1, 2}),
      json::object(),
      json{{"block_m", 64}},
      json{{"a", json::array({json::object()})}}};
  json v = values[pick(rng, values.size())];
  if (chance(rng, 0.05)) {
    int depth = static_cast<int>(pick(rng, 60));
    for (int i = 0; i < depth; ++i)
      v = json::array({v});
  }
  return v;
}

/// Replaces one value somewhere inside `doc` (objects and arrays walked at
/// random), or adds or removes a key.
void mutateJson(Rng &rng, json &doc) {
  json *at = &doc;
  while ((at->is_object() || at->is_array()) && !at->empty() &&
         chance(rng, 0.7)) {
    auto it = at->begin();
    std::advance(it, static_cast<long>(pick(rng, at->size())));
    at = &*it;
  }
  if (at->is_object() && chance(rng, 0.3)) {
    if (!at->empty() && chance(rng, 0.5))
      at->erase(at->begin());
    else
      (*at)[chance(rng, 0.5) ? "extra" : ""] = randomValue(rng);
    return;
  }
  *at = randomValue(rng);
}

/// Byte-level damage: flips, cuts, insertions of JSON punctuation and junk.
std::string mutateBytes(Rng &rng, std::string text) {
  static const std::vector<std::string> inserts = {
      "[",       "]",      "{",
      "}",       ",",      ":",
      "\"",      "\\",     std::string(1, '\0'),
      "\xff",    "\xc3",   "1e999",
      "-",       "null",   "\n",
      "\\u0000", "\\ud800"};
  int edits = 1 + static_cast<int>(pick(rng, 4));
  for (int e = 0; e < edits; ++e) {
    size_t op = pick(rng, 4);
    if (op == 0 && !text.empty())
      text[pick(rng, text.size())] ^= static_cast<char>(1 + pick(rng, 255));
    else if (op == 1 && !text.empty())
      text.resize(pick(rng, text.size()));
    else if (op == 2)
      text.insert(pick(rng, text.size() + 1),
                  inserts[pick(rng, inserts.size())]);
    else
      text += inserts[pick(rng, inserts.size())];
  }
  return text;
}

/// Puts something other than a small regular file at `path`; false when the
/// variant does not apply. `copyOf` is a file with the right bytes.
bool replaceWithOddFile(Rng &rng, const std::string &path,
                        const std::string &copyOf) {
  std::error_code ec;
  fs::remove(path, ec);
  switch (pick(rng, 8)) {
  case 0:
    return ::mkfifo(path.c_str(), 0600) == 0;
  case 1:
    fs::create_symlink("/dev/zero", path, ec);
    return !ec;
  case 2:
    fs::create_directory(path, ec);
    return !ec;
  case 3: {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    bool ok = fd >= 0 && ::ftruncate(fd, off_t(4) << 30) == 0;
    if (fd >= 0)
      ::close(fd);
    return ok;
  }
  case 4:
    fs::create_symlink(copyOf, path, ec);
    return !ec;
  case 5:
    fs::create_symlink(path, path, ec); // a loop
    return !ec;
  case 6:
    writeBytes(path, "");
    return true;
  default:
    fs::create_symlink("/nonexistent/dualkv", path, ec);
    return !ec;
  }
}

struct Options {
  std::string mode, work;
  uint64_t seed = 14;
  long count = 100000;
  double seconds = 50;
};

//===----------------------------------------------------------------------===//
// Tuning database
//===----------------------------------------------------------------------===//

std::string validDatabase() {
  TuningDb db;
  for (auto [kind, headDim, arch] :
       {std::tuple{KernelKind::Fwd, 128, "sm_90a"},
        std::tuple{KernelKind::Bwd, 64, "sm_80"},
        std::tuple{KernelKind::BwdKV, 128, "sm_90a"}}) {
    TunedEntry e;
    e.spec.kind = kind;
    e.spec.headDim = headDim;
    e.spec.numQHeads = 32;
    e.spec.numKVHeads = 8;
    e.spec.arch = arch;
    e.spec.tiling = {128, 64, 8, 2};
    e.ms = 1.25;
    e.shape = "P8192_N16_R1024";
    db.put(e);
  }
  return db.toJson();
}

/// One input; returns a failure description or empty.
std::string fuzzTuning(Rng &rng, const std::string &dir, long n) {
  static const std::string valid = validDatabase();
  const std::string path = dir + "/tuning.json";
  const std::string copy = dir + "/copy.json";
  writeBytes(copy, valid);
  size_t kind = pick(rng, 10);
  if (kind < 5) {
    json doc = json::parse(valid);
    for (size_t i = 0, k = 1 + pick(rng, 3); i < k; ++i)
      mutateJson(rng, doc);
    writeBytes(path, doc.dump(-1, ' ', false, json::error_handler_t::replace));
  } else if (kind < 8) {
    writeBytes(path, mutateBytes(rng, valid));
  } else if (!replaceWithOddFile(rng, path, copy)) {
    writeBytes(path, valid);
  }

  std::string error;
  TuningDb db;
  try {
    db = TuningDb::load(path, &error);
    KernelSpec probe;
    probe.headDim = 128;
    probe.numQHeads = 32;
    probe.numKVHeads = 8;
    probe.arch = "sm_90a";
    (void)db.find(probe);
  } catch (const std::exception &e) {
    return fmt::format("input {}: load threw {}", n, e.what());
  }
  if (!error.empty()) {
    if (!db.entries().empty())
      return fmt::format("input {}: refused ({}) but kept {} entries", n, error,
                         db.entries().size());
    if (error.rfind("tuning database ", 0) != 0)
      return fmt::format("input {}: unclear message '{}'", n, error);
    return {};
  }
  // Accepted: it must round-trip through save and load.
  std::string again;
  if (!db.save(dir + "/saved.json", &again))
    return fmt::format("input {}: cannot save an accepted database: {}", n,
                       again);
  TuningDb back = TuningDb::load(dir + "/saved.json", &again);
  if (!again.empty() || back.toJson() != db.toJson())
    return fmt::format("input {}: an accepted database does not round-trip "
                       "({})",
                       n, again);
  return {};
}

//===----------------------------------------------------------------------===//
// Cache entries
//===----------------------------------------------------------------------===//

CacheKey sampleKey() {
  CacheKey key;
  key.headDim = 128;
  key.numQHeads = 32;
  key.numKVHeads = 8;
  key.arch = "sm_90a";
  key.tiling = Tiling{128, 64, 8, 2};
  key.schedule = Schedule::Wgmma;
  key.compilerFingerprint = "fuzz";
  return key;
}

CacheEntry sampleEntry() {
  CacheEntry entry;
  entry.info = KernelInfo{"dualkv_fwd_fuzz", 256, 96 * 1024, 128};
  entry.ptx = "//\n// fuzz PTX\n.version 8.0\n.target sm_90a\n";
  for (int i = 0; i < 700; ++i)
    entry.cubin.push_back(static_cast<char>(i * 13));
  return entry;
}

/// Values a forger may put in meta.json's integer fields: out of range,
/// fractional, huge, negative, of the wrong type, and valid ones.
json forgedValue(Rng &rng) {
  static const std::vector<json> values = {
      0,
      1,
      32,
      64,
      96,
      100,
      128,
      256,
      1024,
      1056,
      65536,
      65537,
      227 * 1024,
      227 * 1024 + 1,
      -1,
      -32,
      int64_t(4294967296) + 128, // 2^32 + 128: 128 as a wrapped int
      -int64_t(4294967296) + 128,
      int64_t(1) << 31,
      (int64_t(1) << 31) - 1,
      -(int64_t(1) << 31),
      std::numeric_limits<int64_t>::max(),
      std::numeric_limits<int64_t>::min(),
      std::numeric_limits<uint64_t>::max(),
      uint64_t(1) << 63,
      128.9,
      128.0,
      -0.0,
      0.5,
      1e300,
      -1e300,
      1e10,
      "128",
      "",
      true,
      false,
      nullptr,
      json::array({128}),
      json::object()};
  return values[pick(rng, values.size())];
}

/// Whether `v` is what a store writes for an int field: a JSON integer
/// (neither a float, even 128.0, nor a bool) that fits an int. Written from
/// the JSON type rules, not from the reader.
std::optional<int> storedInt(const json &v) {
  if (v.is_number_unsigned())
    return v.get<uint64_t>() <= uint64_t(std::numeric_limits<int>::max())
               ? std::optional<int>(static_cast<int>(v.get<uint64_t>()))
               : std::nullopt;
  if (v.is_number_integer()) {
    int64_t x = v.get<int64_t>();
    if (x < std::numeric_limits<int>::min() ||
        x > std::numeric_limits<int>::max())
      return std::nullopt;
    return static_cast<int>(x);
  }
  return std::nullopt;
}

/// The launch shape docs/errors.md allows a cached kernel: a C identifier,
/// 1 to 32 warps, block_m 1 to 65536, shared memory 0 to 227 KiB.
bool launchable(const KernelInfo &info) {
  bool identifier = !info.name.empty() && info.name.size() <= 256 &&
                    !std::isdigit(static_cast<unsigned char>(info.name[0]));
  for (char c : info.name)
    identifier &= std::isalnum(static_cast<unsigned char>(c)) || c == '_';
  return identifier && info.threads >= 32 && info.threads <= 1024 &&
         info.threads % 32 == 0 && info.blockM >= 1 && info.blockM <= 65536 &&
         info.sharedBytes >= 0 && info.sharedBytes <= 227 * 1024;
}

bool sameEntry(const CacheEntry &a, const CacheEntry &b) {
  return a.info.name == b.info.name && a.info.threads == b.info.threads &&
         a.info.sharedBytes == b.info.sharedBytes &&
         a.info.blockM == b.info.blockM && a.ptx == b.ptx && a.cubin == b.cubin;
}

std::string fuzzCache(Rng &rng, const std::string &work, long n) {
  // A root per input: a refused root stays refused for the process.
  const std::string root = fmt::format("{}/root-{}", work, n);
  DiskCache disk(root);
  const CacheKey key = sampleKey();
  CacheEntry stored = sampleEntry();
  if (chance(rng, 0.15)) {
    // Consistent checksums around nonsense values.
    static const std::vector<int> ints = {-1,  0,    1,    31,      32,
                                          129, 1024, 2048, 1 << 20, 1 << 30};
    stored.info.threads = ints[pick(rng, ints.size())];
    stored.info.blockM = ints[pick(rng, ints.size())];
    stored.info.sharedBytes = ints[pick(rng, ints.size())];
    if (chance(rng, 0.3))
      stored.info.name = chance(rng, 0.5) ? "" : "a b";
  }
  if (llvm::Error e = disk.store(key, stored))
    return fmt::format("input {}: store failed: {}", n,
                       llvm::toString(std::move(e)));
  const std::string dir = disk.entryDir(key);
  const bool usable = !llvm::errorToBool(checkLaunchShape(stored.info));

  static const char *files[] = {"meta.json", "kernel.ptx", "kernel.cubin"};
  const std::string file = fmt::format("{}/{}", dir, files[pick(rng, 3)]);
  writeBytes(work + "/copy", stored.ptx);
  size_t kind = pick(rng, 14);
  if (kind >= 12) {
    // A forger's meta.json: values put in with the checksum recomputed
    // (SHA-256 of the canonical JSON without it, DiskCache.h). The entry must
    // load with exactly the forged values when they are what a store writes
    // and launchable, and be a miss otherwise, never wrap, truncate or crash.
    std::ifstream in(dir + "/meta.json");
    json meta = json::parse(in, nullptr, false);
    static const char *fields[] = {"threads", "shared_bytes", "block_m", "name",
                                   "schema"};
    for (size_t i = 0, k = 1 + pick(rng, 3); i < k; ++i) {
      const std::string field = fields[pick(rng, 5)];
      json value = forgedValue(rng);
      if (field == "name" && chance(rng, 0.5))
        value = chance(rng, 0.5) ? json("other_kernel") : json("a b");
      if (field == "schema" && chance(rng, 0.3))
        value = CacheKey::kSchemaVersion;
      (field == "schema" ? meta["schema"] : meta["kernel"][field]) = value;
    }
    // What the forged meta.json says, read by the JSON type rules.
    const json &kernel = meta["kernel"];
    CacheEntry expected = stored;
    bool valid = storedInt(meta["schema"]) == CacheKey::kSchemaVersion &&
                 kernel.at("name").is_string();
    if (kernel.at("name").is_string())
      expected.info.name = kernel.at("name").get<std::string>();
    for (auto [field, out] :
         {std::pair{"threads", &expected.info.threads},
          std::pair{"shared_bytes", &expected.info.sharedBytes},
          std::pair{"block_m", &expected.info.blockM}}) {
      std::optional<int> v = storedInt(kernel.at(field));
      valid &= v.has_value();
      if (v)
        *out = *v;
    }
    valid &= launchable(expected.info);
    meta.erase("sha256");
    meta["sha256"] = sha256Hex(meta.dump());
    writeBytes(dir + "/meta.json", meta.dump(2));
    std::optional<CacheEntry> loaded;
    try {
      loaded = disk.load(key);
    } catch (const std::exception &e) {
      return fmt::format("input {}: load of a forged entry threw {}", n,
                         e.what());
    }
    if (loaded && !valid)
      return fmt::format("input {}: a forged meta.json ({}) was a hit", n,
                         meta["kernel"].dump());
    if (valid && (!loaded || !sameEntry(*loaded, expected)))
      return fmt::format("input {}: a valid forged meta.json ({}) did not load "
                         "as forged",
                         n, meta["kernel"].dump());
  } else if (kind < 3 && file.find("meta.json") != std::string::npos) {
    std::ifstream in(file);
    json meta = json::parse(in, nullptr, false);
    mutateJson(rng, meta);
    writeBytes(file, meta.dump(-1, ' ', false, json::error_handler_t::replace));
  } else if (kind < 6) {
    std::ifstream in(file, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)),
                      std::istreambuf_iterator<char>());
    writeBytes(file, mutateBytes(rng, bytes));
  } else if (kind < 9) {
    replaceWithOddFile(rng, file, work + "/copy");
  } else if (kind < 10) {
    ::chmod(file.c_str(), chance(rng, 0.5) ? 0666 : 0620);
  } else if (kind < 11) {
    // A folder on the way: others may write it, or it is another user's.
    static const char *up[] = {"", "/..", "/../..", "/../../.."};
    std::string folder = dir + up[pick(rng, 4)];
    if (chance(rng, 0.5) || ::geteuid() != 0)
      ::chmod(folder.c_str(), chance(rng, 0.5) ? 0777 : 0770);
    else if (::chown(folder.c_str(), 65534, 65534) != 0)
      return {};
  } else if (::geteuid() == 0) {
    if (::lchown(file.c_str(), 65534, 65534) != 0)
      return {};
  }

  std::optional<CacheEntry> loaded;
  try {
    loaded = disk.load(key);
  } catch (const std::exception &e) {
    return fmt::format("input {}: load threw {}", n, e.what());
  }
  // (A forged entry was checked above, against the forged values.)
  if (kind < 12 && loaded && (!usable || !sameEntry(*loaded, stored)))
    return fmt::format("input {}: loaded an entry that differs from the one "
                       "stored",
                       n);
  // The store after a recompile repairs whatever can be repaired.
  if (disk.refused())
    return {};
  // Whatever took a file's place (a folder included) is replaced.
  if (llvm::Error e = disk.store(key, sampleEntry()))
    return fmt::format("input {}: the repairing store failed: {}", n,
                       llvm::toString(std::move(e)));
  std::optional<CacheEntry> repaired = disk.load(key);
  if (!repaired || !sameEntry(*repaired, sampleEntry()))
    return fmt::format("input {}: the entry does not load after a store", n);
  return {};
}

Options parse(int argc, char **argv) {
  Options o;
  if (argc < 2) {
    std::fprintf(stderr, "usage: dualkv-file-fuzz tuning|cache --work DIR "
                         "[--seed S] [--count N] [--seconds T]\n");
    std::exit(2);
  }
  o.mode = argv[1];
  for (int i = 2; i + 1 < argc; i += 2) {
    std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--work")
      o.work = value;
    else if (flag == "--seed")
      o.seed = std::stoull(value);
    else if (flag == "--count")
      o.count = std::stol(value);
    else if (flag == "--seconds")
      o.seconds = std::stod(value);
  }
  if (o.work.empty() || (o.mode != "tuning" && o.mode != "cache")) {
    std::fprintf(stderr, "dualkv-file-fuzz: need a mode and --work\n");
    std::exit(2);
  }
  return o;
}

} // namespace

int main(int argc, char **argv) {
  Options o = parse(argc, argv);
  // A hang anywhere fails the run (SIGALRM), with room for a slow machine.
  ::alarm(static_cast<unsigned>(o.seconds * 3 + 60));
  std::error_code ec;
  fs::remove_all(o.work, ec);
  fs::create_directories(o.work);
  fs::permissions(o.work, fs::perms::owner_all);
  Rng rng(o.seed);
  auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                         start)
        .count();
  };
  long tried = 0;
  std::vector<std::string> failures;
  for (long n = 0; n < o.count && elapsed() < o.seconds; ++n) {
    std::string dir = fmt::format("{}/in-{}", o.work, n);
    fs::create_directory(dir);
    std::string failure = o.mode == "tuning" ? fuzzTuning(rng, dir, n)
                                             : fuzzCache(rng, o.work, n);
    ++tried;
    if (!failure.empty())
      failures.push_back(failure);
    fs::remove_all(dir, ec);
    fs::remove_all(fmt::format("{}/root-{}", o.work, n), ec);
  }
  for (size_t i = 0; i < failures.size() && i < 20; ++i)
    std::printf("FAIL: %s\n", failures[i].c_str());
  std::printf("fuzz %s: %ld inputs (seed %llu, %.0f s), %zu failures\n",
              o.mode.c_str(), tried, static_cast<unsigned long long>(o.seed),
              elapsed(), failures.size());
  fs::remove_all(o.work, ec);
  return failures.empty() ? 0 : 1;
}
