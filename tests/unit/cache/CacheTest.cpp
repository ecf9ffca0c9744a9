// The cache layer: the key's JSON and hash, the disk cache's entries.
#include "FakeDriver.h"
#include "operations/Validate.h"

#include "dualkv/Reference.h"
#include "dualkv/Tuning.h"
#include "dualkv/dualkv.h"
#include "dualkv/dualkv_c.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

using namespace dualkv;
using namespace dualkv::testing;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

//===----------------------------------------------------------------------===//
// Helpers
//===----------------------------------------------------------------------===//

std::vector<std::string> listDir(const std::string &dir) {
  std::vector<std::string> names;
  for (const fs::directory_entry &entry : fs::directory_iterator(dir))
    names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

void requireSameEntry(const CacheEntry &a, const CacheEntry &b) {
  CHECK(a.info.name == b.info.name);
  CHECK(a.info.threads == b.info.threads);
  CHECK(a.info.sharedBytes == b.info.sharedBytes);
  CHECK(a.info.blockM == b.info.blockM);
  CHECK(a.ptx == b.ptx);
  CHECK(a.cubin == b.cubin);
}

/// Leaf fields of a JSON object (nested objects counted by their leaves).
int countLeaves(const nlohmann::json &j) {
  if (!j.is_object())
    return 1;
  int n = 0;
  for (const auto &item : j.items())
    n += countLeaves(item.value());
  return n;
}

} // namespace

TEST_CASE("cache key: canonical JSON and its SHA-256", "[runtime]") {
  CacheKey key = sampleKey();
  // Written out by hand: sorted keys, no spaces. The hash was computed
  // independently (Python hashlib over this exact string).
  CHECK(key.toJson().dump() ==
        R"({"N":0,"P":0,"arch":"sm_90a","compiler":"test-fingerprint",)"
        R"("dtype":"bf16","head_dim":128,"kind":"fwd","num_kv_heads":8,)"
        R"("num_q_heads":32,"schedule":"wgmma","schema":3,"tiling":{)"
        R"("block_m":128,"block_n":64,"stages":2,"warps":8}})");
  CHECK(key.hash() ==
        "a6633cc76e6219d2e5407107139ea2305500a58bd232a6962e5ab5998d04f0ed");
  CHECK(sampleKey().hash() == key.hash());
  CHECK(CacheKey::fromSpec(key.spec(), key.compilerFingerprint) == key);
}

TEST_CASE("cache key: every field changes the hash", "[runtime]") {
  using Mutator = std::function<void(CacheKey &)>;
  std::vector<std::pair<const char *, Mutator>> mutators = {
      {"kind", [](CacheKey &k) { k.kind = KernelKind::Bwd; }},
      {"P", [](CacheKey &k) { k.P = 512; }},
      {"N", [](CacheKey &k) { k.N = 8; }},
      {"headDim", [](CacheKey &k) { k.headDim = 64; }},
      {"numQHeads", [](CacheKey &k) { k.numQHeads = 16; }},
      {"numKVHeads", [](CacheKey &k) { k.numKVHeads = 4; }},
      {"dtype", [](CacheKey &k) { k.dtype = DType::FP16; }},
      {"arch", [](CacheKey &k) { k.arch = "sm_80"; }},
      {"tiling.blockM", [](CacheKey &k) { k.tiling.blockM = 64; }},
      {"tiling.blockN", [](CacheKey &k) { k.tiling.blockN = 128; }},
      {"tiling.warps", [](CacheKey &k) { k.tiling.warps = 4; }},
      {"tiling.stages", [](CacheKey &k) { k.tiling.stages = 3; }},
      {"schedule", [](CacheKey &k) { k.schedule = Schedule::MmaSync; }},
      {"compilerFingerprint",
       [](CacheKey &k) { k.compilerFingerprint = "other"; }},
  };
  // One mutator per serialised field besides the schema version: a field
  // added to the key without a case here fails this check.
  CHECK(static_cast<int>(mutators.size()) ==
        countLeaves(sampleKey().toJson()) - 1);

  std::set<std::string> hashes = {sampleKey().hash()};
  for (const auto &[field, mutate] : mutators) {
    CAPTURE(field);
    CacheKey key = sampleKey();
    mutate(key);
    CHECK_FALSE(key == sampleKey());
    CHECK(hashes.insert(key.hash()).second);
  }
}

TEST_CASE("cache key: the variants are spelled only when set and each has "
          "its own hash",
          "[runtime]") {
  // tree, softcap and dlse are absent from the plain key's JSON (so every
  // key from before them is spelled as it was) and, when set, make a key of
  // their own: a softcap kernel is never served for a plain request.
  const CacheKey plain = sampleKey();
  for (const char *field : {"tree", "softcap", "dlse", "sinks"})
    CHECK_FALSE(plain.toJson().contains(field));
  CacheKey tree = plain, capped = plain, capped2 = plain, dlse = plain;
  tree.tree = true;
  capped.softcap = 30.0f;
  capped2.softcap = 50.0f;
  dlse.kind = KernelKind::BwdPre;
  dlse.dlse = true;
  CacheKey pre = plain;
  pre.kind = KernelKind::BwdPre;
  CacheKey sinks = plain;
  sinks.sinks = true;
  CHECK(capped.toJson().at("softcap") == 30.0);
  CHECK(dlse.toJson().at("dlse") == true);
  std::set<std::string> hashes;
  for (const CacheKey &k : {plain, tree, capped, capped2, dlse, pre, sinks})
    CHECK(hashes.insert(k.hash()).second);
  // The spec round-trips with its variants.
  CHECK(CacheKey::fromSpec(capped.spec(), capped.compilerFingerprint) ==
        capped);
  CHECK(CacheKey::fromSpec(dlse.spec(), dlse.compilerFingerprint) == dlse);
  CHECK(capped.spec().softcap == 30.0f);
  CHECK(dlse.spec().dlse);
}

TEST_CASE("cache key: a sliding window is spelled only when set and has "
          "its own hash",
          "[runtime][window]") {
  // A window kernel is never served for a plain request (W itself is a
  // launch parameter: one kernel, one key, for every W); the plain key is
  // spelled as before windows existed.
  const CacheKey plain = sampleKey();
  CHECK_FALSE(plain.toJson().contains("window"));
  CHECK(plain.describe().find("window") == std::string::npos);
  CacheKey windowed = plain, capped = plain;
  windowed.window = true;
  capped.window = true;
  capped.softcap = 30.0f;
  CHECK(windowed.toJson().at("window") == true);
  CHECK_FALSE(windowed == plain);
  std::set<std::string> hashes;
  for (const CacheKey &k : {plain, windowed, capped})
    CHECK(hashes.insert(k.hash()).second);
  CHECK_THAT(windowed.describe(), Catch::Matchers::Contains(", window)"));
  // The spec round-trips with its window, and a spec's window makes its key.
  CHECK(windowed.spec().window);
  CHECK(CacheKey::fromSpec(windowed.spec(), windowed.compilerFingerprint) ==
        windowed);
  KernelSpec spec = plain.spec();
  CHECK(CacheKey::fromSpec(spec, plain.compilerFingerprint) == plain);
  spec.window = true;
  CHECK(CacheKey::fromSpec(spec, plain.compilerFingerprint) == windowed);
}

TEST_CASE("cache key: a value head_dim apart from head_dim is spelled only "
          "then and has its own hash",
          "[runtime][head-shape]") {
  // The equal shapes keep their spelling (the canonical JSON above is
  // unchanged, whether the spec says v_head_dim 0 or head_dim); MLA's
  // (192, 128) is a key of its own, never the (192, 192) one's.
  const CacheKey plain = sampleKey();
  CHECK_FALSE(plain.toJson().contains("v_head_dim"));
  KernelSpec spec = plain.spec();
  spec.valueHeadDim = spec.headDim;
  CHECK(CacheKey::fromSpec(spec, plain.compilerFingerprint) == plain);
  CHECK(CacheKey::fromSpec(spec, plain.compilerFingerprint).hash() ==
        plain.hash());
  spec.headDim = 192;
  spec.valueHeadDim = 128;
  const CacheKey mla = CacheKey::fromSpec(spec, plain.compilerFingerprint);
  CHECK(mla.toJson().at("head_dim") == 192);
  CHECK(mla.toJson().at("v_head_dim") == 128);
  CHECK(mla.describe().find("head_dim=192 v_head_dim=128") !=
        std::string::npos);
  CacheKey same192 = mla;
  same192.valueHeadDim = 0;
  CacheKey v128 = plain; // head_dim 128, value rows 128
  std::set<std::string> hashes;
  for (const CacheKey &k : {plain, mla, same192, v128})
    hashes.insert(k.hash());
  CHECK(hashes.size() == 3); // v128 is plain
  CHECK(mla.hash() != same192.hash());
  // The spec round-trips with its value head_dim.
  CHECK(mla.spec().headDim == 192);
  CHECK(mla.spec().vDim() == 128);
  CHECK(CacheKey::fromSpec(mla.spec(), mla.compilerFingerprint) == mla);
}

TEST_CASE("cache key: every kernel kind and dtype has its own spelling",
          "[runtime]") {
  std::set<std::string> hashes;
  for (KernelKind kind : {KernelKind::Fwd, KernelKind::BwdPre, KernelKind::Bwd,
                          KernelKind::BwdPost})
    for (DType dtype : {DType::BF16, DType::FP16}) {
      CacheKey key = sampleKey();
      key.kind = kind;
      key.dtype = dtype;
      CHECK(key.toJson()["kind"] != "unknown");
      CHECK(hashes.insert(key.hash()).second);
    }
}

TEST_CASE("disk cache: root from the environment", "[runtime]") {
  {
    ScopedEnv dir("DUALKV_CACHE_DIR", "/tmp/explicit");
    ScopedEnv xdg("XDG_CACHE_HOME", "/tmp/xdg");
    CHECK(DiskCache::defaultRoot() == "/tmp/explicit");
  }
  {
    ScopedEnv dir("DUALKV_CACHE_DIR", std::nullopt);
    ScopedEnv xdg("XDG_CACHE_HOME", "/tmp/xdg");
    CHECK(DiskCache::defaultRoot() == "/tmp/xdg/dualkv");
  }
  {
    ScopedEnv dir("DUALKV_CACHE_DIR", std::nullopt);
    ScopedEnv xdg("XDG_CACHE_HOME", std::nullopt);
    ScopedEnv home("HOME", "/tmp/home");
    CHECK(DiskCache::defaultRoot() == "/tmp/home/.cache/dualkv");
  }
}

TEST_CASE("disk cache: empty variables are unset and relative ones are no "
          "root",
          "[runtime]") {
  ScopedEnv home("HOME", "/tmp/home");
  {
    // XDG_CACHE_HOME= once put the cache at the relative path ./dualkv.
    ScopedEnv dir("DUALKV_CACHE_DIR", "");
    ScopedEnv xdg("XDG_CACHE_HOME", "");
    CHECK(DiskCache::defaultRoot() == "/tmp/home/.cache/dualkv");
    CHECK(TuningDb::defaultPath() == "/tmp/home/.cache/dualkv/tuning.json");
    ScopedEnv db("DUALKV_TUNING_DB", ""); // empty: the root's database
    CHECK(TuningDb::defaultPath() == "/tmp/home/.cache/dualkv/tuning.json");
  }
  {
    // XDG: a relative path in the variable is invalid and ignored.
    ScopedEnv dir("DUALKV_CACHE_DIR", std::nullopt);
    ScopedEnv xdg("XDG_CACHE_HOME", "relative/cache");
    CHECK(DiskCache::defaultRoot() == "/tmp/home/.cache/dualkv");
  }
  {
    // An explicit relative root is refused, not swapped for another.
    ScopedEnv dir("DUALKV_CACHE_DIR", "cache");
    ScopedEnv xdg("XDG_CACHE_HOME", "/tmp/xdg");
    CHECK(DiskCache::defaultRoot().empty());
    CHECK(TuningDb::defaultPath().empty());
  }
  {
    ScopedEnv dir("DUALKV_CACHE_DIR", std::nullopt);
    ScopedEnv xdg("XDG_CACHE_HOME", std::nullopt);
    ScopedEnv relative("HOME", "relative/home");
    CHECK(DiskCache::defaultRoot().empty());
  }
  {
    // HOME= is HOME unset: both take the password database's home, which
    // is absolute, or give no root.
    ScopedEnv dir("DUALKV_CACHE_DIR", std::nullopt);
    ScopedEnv xdg("XDG_CACHE_HOME", "");
    std::string unset;
    {
      ScopedEnv none("HOME", std::nullopt);
      unset = DiskCache::defaultRoot();
    }
    ScopedEnv empty("HOME", "");
    CHECK(DiskCache::defaultRoot() == unset);
    CHECK((unset.empty() || unset.front() == '/'));
  }
}

TEST_CASE("disk cache: store then load round-trips", "[runtime]") {
  TempDir tmp;
  DiskCache disk(tmp.path);
  CacheKey key = sampleKey();
  CHECK_FALSE(disk.load(key));

  requireSuccess(disk.store(key, sampleEntry()));
  const std::string dir = disk.entryDir(key);
  CHECK(dir == tmp.path + "/v3/sm_90a/" + key.hash());
  // No temp file is left behind.
  CHECK(listDir(dir) ==
        std::vector<std::string>{"kernel.cubin", "kernel.ptx", "meta.json"});

  std::optional<CacheEntry> loaded = disk.load(key);
  REQUIRE(loaded);
  requireSameEntry(*loaded, sampleEntry());

  // Another key misses, even with the same arch.
  CacheKey other = key;
  other.headDim = 64;
  CHECK_FALSE(disk.load(other));
}

TEST_CASE("disk cache: an entry without a cubin", "[runtime]") {
  TempDir tmp;
  DiskCache disk(tmp.path);
  CacheEntry entry = sampleEntry();
  entry.cubin.clear();
  requireSuccess(disk.store(sampleKey(), entry));
  CHECK(listDir(disk.entryDir(sampleKey())) ==
        std::vector<std::string>{"kernel.ptx", "meta.json"});
  std::optional<CacheEntry> loaded = disk.load(sampleKey());
  REQUIRE(loaded);
  requireSameEntry(*loaded, entry);
}

TEST_CASE("disk cache: damaged entries are misses", "[runtime]") {
  TempDir tmp;
  DiskCache disk(tmp.path);
  CacheKey key = sampleKey();
  requireSuccess(disk.store(key, sampleEntry()));
  const std::string dir = disk.entryDir(key);
  const std::string metaPath = dir + "/meta.json";
  REQUIRE(disk.load(key));

  SECTION("PTX changed") {
    std::string ptx = readFile(dir + "/kernel.ptx");
    ptx[3] ^= 1;
    writeFile(dir + "/kernel.ptx", ptx);
  }
  SECTION("cubin changed") {
    std::string cubin = readFile(dir + "/kernel.cubin");
    cubin[500] ^= 0x40;
    writeFile(dir + "/kernel.cubin", cubin);
  }
  SECTION("cubin missing") { fs::remove(dir + "/kernel.cubin"); }
  SECTION("PTX missing") { fs::remove(dir + "/kernel.ptx"); }
  SECTION("meta.json truncated") {
    std::string meta = readFile(metaPath);
    writeFile(metaPath, meta.substr(0, meta.size() / 2));
  }
  SECTION("meta.json empty") { writeFile(metaPath, ""); }
  SECTION("meta.json of a foreign schema version") {
    auto meta = nlohmann::json::parse(readFile(metaPath));
    meta["schema"] = CacheKey::kSchemaVersion + 1;
    writeFile(metaPath, meta.dump());
  }
  SECTION("meta.json with a field of the wrong type") {
    auto meta = nlohmann::json::parse(readFile(metaPath));
    meta["kernel"]["threads"] = "many";
    writeFile(metaPath, meta.dump());
  }
  SECTION("meta.json of another key") {
    CacheKey other = key;
    other.numQHeads = 64;
    auto meta = nlohmann::json::parse(readFile(metaPath));
    meta["key"] = other.toJson();
    writeFile(metaPath, meta.dump());
  }
  CHECK_FALSE(disk.load(key));

  // Storing again repairs the entry.
  requireSuccess(disk.store(key, sampleEntry()));
  std::optional<CacheEntry> loaded = disk.load(key);
  REQUIRE(loaded);
  requireSameEntry(*loaded, sampleEntry());
}

TEST_CASE("disk cache: forged meta.json values with a valid checksum are "
          "misses, never wrapped or truncated",
          "[runtime]") {
  TempDir tmp;
  DiskCache disk(tmp.path);
  const CacheKey key = sampleKey();
  requireSuccess(disk.store(key, sampleEntry()));
  const std::string metaPath = disk.entryDir(key) + "/meta.json";
  const nlohmann::json stored = nlohmann::json::parse(readFile(metaPath));
  // The forger's checksum: SHA-256 of the canonical JSON without it
  // (DiskCache.h).
  auto forge = [&](const std::function<void(nlohmann::json &)> &edit) {
    nlohmann::json meta = stored;
    edit(meta);
    meta.erase("sha256");
    meta["sha256"] = sha256Hex(meta.dump());
    writeFile(metaPath, meta.dump(2));
  };
  using nlohmann::json;
  struct Forged {
    const char *field;
    json value;
  };
  const std::vector<Forged> bad = {
      // 2^32 + 128 read as an int is 128; 128.9 truncates to 128.
      {"threads", json(uint64_t(4294967424u))},
      {"threads", json(128.9)},
      {"threads", json(128.0)},
      {"threads", json(-4294967168ll)}, // -2^32 + 128
      {"threads", json(std::numeric_limits<uint64_t>::max())},
      {"threads", json("128")},
      {"threads", json(true)},
      {"threads", json(nullptr)},
      {"threads", json(1056)},
      {"threads", json(100)},
      {"threads", json(0)},
      // 1e300 converted to an int is undefined behaviour.
      {"shared_bytes", json(1e300)},
      {"shared_bytes", json(-1e300)},
      {"shared_bytes", json(-1)},
      {"shared_bytes", json(227 * 1024 + 1)},
      {"shared_bytes", json(int64_t(1) << 32)},
      {"shared_bytes", json(1024.5)},
      {"block_m", json(0)},
      {"block_m", json(65537)},
      {"block_m", json(uint64_t(4294967424u))},
      {"block_m", json(64.0)},
      {"name", json(42)},
      {"name", json("a b")},
  };
  for (const Forged &f : bad) {
    INFO(f.field << " = " << f.value.dump());
    forge([&](json &m) { m["kernel"][f.field] = f.value; });
    CHECK_FALSE(disk.load(key));
  }
  // Fields outside "kernel": the schema (2^32 + 3 read as an int is 3), the
  // checksums' types.
  for (const json &schema :
       {json(uint64_t(4294967296u) + CacheKey::kSchemaVersion),
        json(double(CacheKey::kSchemaVersion)),
        json(std::to_string(CacheKey::kSchemaVersion))}) {
    INFO("schema = " << schema.dump());
    forge([&](json &m) { m["schema"] = schema; });
    CHECK_FALSE(disk.load(key));
  }
  forge([](json &m) { m["ptx_sha256"] = 7; });
  CHECK_FALSE(disk.load(key));
  forge([](json &m) { m["cubin_sha256"] = json::array(); });
  CHECK_FALSE(disk.load(key));

  // Valid values forged in are indistinguishable from a store: a hit with
  // exactly those values.
  forge([](json &m) {
    m["kernel"]["threads"] = 1024;
    m["kernel"]["shared_bytes"] = 227 * 1024;
    m["kernel"]["block_m"] = 64;
  });
  std::optional<CacheEntry> forged = disk.load(key);
  REQUIRE(forged);
  CHECK(forged->info.threads == 1024);
  CHECK(forged->info.sharedBytes == 227 * 1024);
  CHECK(forged->info.blockM == 64);

  // A bad entry is a damaged one: the next store repairs it.
  forge([](json &m) { m["kernel"]["threads"] = uint64_t(4294967424u); });
  CHECK_FALSE(disk.load(key));
  requireSuccess(disk.store(key, sampleEntry()));
  std::optional<CacheEntry> repaired = disk.load(key);
  REQUIRE(repaired);
  requireSameEntry(*repaired, sampleEntry());
}

TEST_CASE("disk cache: 8 concurrent writers of one key leave a valid entry",
          "[runtime]") {
  TempDir tmp;
  DiskCache disk(tmp.path);
  CacheKey key = sampleKey();
  const CacheEntry entry = sampleEntry();
  constexpr int kWriters = 8;
  std::vector<int> stored(kWriters, 0);
  std::vector<int> badReads(kWriters, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kWriters; ++t)
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round) {
        stored[t] += llvm::errorToBool(disk.store(key, entry)) ? 0 : 1;
        // A reader racing the writers sees the whole entry or nothing.
        if (std::optional<CacheEntry> seen = disk.load(key))
          badReads[t] += seen->ptx != entry.ptx || seen->cubin != entry.cubin;
      }
    });
  for (std::thread &t : threads)
    t.join();
  for (int t = 0; t < kWriters; ++t) {
    CHECK(stored[t] == 20);
    CHECK(badReads[t] == 0);
  }
  std::optional<CacheEntry> loaded = disk.load(key);
  REQUIRE(loaded);
  requireSameEntry(*loaded, entry);
  CHECK(listDir(disk.entryDir(key)) ==
        std::vector<std::string>{"kernel.cubin", "kernel.ptx", "meta.json"});
}
