// Tests of the tuning database: round trip, lookup by key (the kernel kind
// included, also through the runtime), and every way a file can be wrong is
// reported and leaves the database empty.
#include "FakeDriver.h"

#include "dualkv/Tuning.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>

#include <sys/stat.h>
#include <unistd.h>

using namespace dualkv;
using namespace dualkv::testing;

namespace {

TunedEntry sample(int headDim, const char *arch, Tiling t,
                  KernelKind kind = KernelKind::Fwd) {
  TunedEntry e;
  e.spec.kind = kind;
  e.spec.headDim = headDim;
  e.spec.arch = arch;
  e.spec.tiling = t;
  e.ms = 1.5;
  e.tflops = 330.0;
  e.shape = "P8192_N16_R1024";
  return e;
}

std::string tempPath(const char *name) {
  return (std::filesystem::temp_directory_path() /
          (std::string(name) + "." + std::to_string(::getpid()) + ".json"))
      .string();
}

void writeText(const std::string &path, const std::string &text) {
  std::ofstream(path) << text;
}

} // namespace

TEST_CASE("tuning: save, load and find by key", "[tuning]") {
  TuningDb db;
  db.put(sample(128, "sm_90a", {128, 32, 4, 2}));
  db.put(sample(64, "sm_90a", {64, 64, 4, 1}));
  db.put(sample(128, "sm_90a", {128, 64, 8, 2})); // replaces the first
  REQUIRE(db.entries().size() == 2);
  std::string path = tempPath("dualkv-tuning");
  std::string error;
  REQUIRE(db.save(path, &error));
  TuningDb back = TuningDb::load(path, &error);
  CHECK(error.empty());
  REQUIRE(back.entries().size() == 2);
  KernelSpec spec;
  spec.headDim = 128;
  spec.arch = "sm_90a";
  spec.tiling = {1, 2, 3, 4}; // ignored by the lookup
  REQUIRE(back.find(spec).has_value());
  CHECK(*back.find(spec) == Tiling{128, 64, 8, 2});
  spec.arch = "sm_80"; // another arch has no entry
  CHECK_FALSE(back.find(spec).has_value());
  spec.arch = "sm_90a";
  spec.numKVHeads = 4; // nor other heads
  CHECK_FALSE(back.find(spec).has_value());
  std::remove(path.c_str());
}

TEST_CASE("tuning: a missing file is an empty database, not an error",
          "[tuning]") {
  std::string error = "stale";
  TuningDb db = TuningDb::load(tempPath("dualkv-no-such-db"), &error);
  CHECK(error.empty());
  CHECK(db.entries().empty());
}

TEST_CASE("tuning: corrupt or foreign files are reported and ignored",
          "[tuning]") {
  TuningDb good;
  good.put(sample(128, "sm_90a", {128, 32, 4, 2}));
  std::string valid = good.toJson();
  std::string path = tempPath("dualkv-bad-tuning");
  struct Bad {
    std::string text, expect;
  };
  std::string wrongVersion = valid;
  wrongVersion.replace(wrongVersion.find("\"version\": 2"), 12,
                       "\"version\": 7");
  std::string wrongType = valid;
  wrongType.replace(wrongType.find("\"block_m\": 128"), 14,
                    "\"block_m\": \"x\"");
  std::string zeroTile = valid;
  zeroTile.replace(zeroTile.find("\"warps\": 4"), 10, "\"warps\": 0");
  for (const Bad &bad :
       {Bad{valid.substr(0, valid.size() / 2), "not valid JSON"},
        Bad{"{\"schema\": \"other\", \"version\": 1}", "not a DualKV tuning"},
        Bad{"[1, 2]", "not a DualKV tuning"},
        Bad{wrongVersion, "schema version 7 is not 2"},
        Bad{wrongType, "entries[0].block_m is not a valid integer"},
        Bad{zeroTile, "entries[0].tiling has a zero field"}}) {
    writeText(path, bad.text);
    std::string error;
    TuningDb db = TuningDb::load(path, &error);
    INFO(bad.text);
    CHECK(db.entries().empty());
    CHECK(error.find("ignored") != std::string::npos);
    CHECK(error.find(bad.expect) != std::string::npos);
  }
  std::remove(path.c_str());
}

TEST_CASE("tuning: the kernel kind is part of the key", "[tuning]") {
  TuningDb db;
  db.put(sample(128, "sm_90a", {128, 32, 4, 2}));
  db.put(sample(128, "sm_90a", {128, 32, 8, 1}, KernelKind::Bwd));
  db.put(sample(64, "sm_90a", {64, 64, 4, 2}));
  // The same key but another kind is another entry, not a replacement.
  REQUIRE(db.entries().size() == 3);
  std::string path = tempPath("dualkv-tuning-kinds");
  std::string error;
  REQUIRE(db.save(path, &error));
  TuningDb back = TuningDb::load(path, &error);
  CHECK(error.empty());
  REQUIRE(back.entries().size() == 3);
  CHECK(back.entries()[1].spec.kind == KernelKind::Bwd);
  KernelSpec spec;
  spec.headDim = 128;
  spec.arch = "sm_90a";
  spec.kind = KernelKind::Fwd;
  REQUIRE(back.find(spec).has_value());
  CHECK(*back.find(spec) == Tiling{128, 32, 4, 2});
  spec.kind = KernelKind::Bwd;
  REQUIRE(back.find(spec).has_value());
  CHECK(*back.find(spec) == Tiling{128, 32, 8, 1});
  // Neither answers for the deterministic backward's kernel ...
  spec.kind = KernelKind::BwdKV;
  CHECK_FALSE(back.find(spec).has_value());
  // ... and head_dim 64 has a forward entry only: the backward has none.
  spec.headDim = 64;
  spec.kind = KernelKind::Bwd;
  CHECK_FALSE(back.find(spec).has_value());
  spec.kind = KernelKind::Fwd;
  CHECK(back.find(spec).has_value());
  // Replacing keeps to its own kind.
  back.put(sample(128, "sm_90a", {64, 16, 4, 1}, KernelKind::Bwd));
  spec.headDim = 128;
  CHECK(*back.find(spec) == Tiling{128, 32, 4, 2});
  spec.kind = KernelKind::Bwd;
  CHECK(*back.find(spec) == Tiling{64, 16, 4, 1});
  std::remove(path.c_str());
}

TEST_CASE("tuning: a value head_dim apart from head_dim is part of the key "
          "and written only then",
          "[tuning][head-shape]") {
  TuningDb db;
  db.put(sample(128, "sm_80", {128, 32, 4, 2}));
  TunedEntry mla = sample(192, "sm_80", {128, 32, 4, 2});
  mla.spec.valueHeadDim = 128;
  db.put(mla);
  TunedEntry mlaBwd = sample(192, "sm_80", {64, 32, 8, 1}, KernelKind::Bwd);
  mlaBwd.spec.valueHeadDim = 128;
  db.put(mlaBwd);
  REQUIRE(db.entries().size() == 3);
  // The equal shape is spelled as before v_head_dim existed; MLA's entries
  // carry it.
  nlohmann::json doc = nlohmann::json::parse(db.toJson());
  REQUIRE(doc.at("entries").size() == 3);
  CHECK_FALSE(doc["entries"][0].contains("v_head_dim"));
  CHECK(doc["entries"][1].at("head_dim") == 192);
  CHECK(doc["entries"][1].at("v_head_dim") == 128);
  CHECK(doc["entries"][2].at("v_head_dim") == 128);

  std::string path = tempPath("dualkv-tuning-head-shape");
  std::string error;
  std::vector<std::string> skipped;
  REQUIRE(db.save(path, &error));
  TuningDb back = TuningDb::load(path, &error, &skipped);
  CHECK(error.empty());
  CHECK(skipped == std::vector<std::string>{});
  REQUIRE(back.entries().size() == 3);
  CHECK(back.entries()[1].spec.headDim == 192);
  CHECK(back.entries()[1].spec.vDim() == 128);
  KernelSpec spec;
  spec.headDim = 192;
  spec.valueHeadDim = 128;
  spec.arch = "sm_80";
  REQUIRE(back.find(spec).has_value());
  CHECK(*back.find(spec) == Tiling{128, 32, 4, 2});
  spec.kind = KernelKind::Bwd;
  REQUIRE(back.find(spec).has_value());
  CHECK(*back.find(spec) == Tiling{64, 32, 8, 1});
  // Neither answers for another value head_dim, nor the equal shape's for
  // MLA's.
  spec.valueHeadDim = 0;
  CHECK_FALSE(back.find(spec).has_value());
  spec.kind = KernelKind::Fwd;
  spec.headDim = 128;
  spec.valueHeadDim = 128; // the same as 0
  REQUIRE(back.find(spec).has_value());
  CHECK(*back.find(spec) == Tiling{128, 32, 4, 2});
  // Replacing keeps to its own head shape.
  TunedEntry mla2 = mla;
  mla2.spec.tiling = {64, 64, 4, 2};
  back.put(mla2);
  CHECK(back.entries().size() == 3);
  CHECK(*back.find(spec) == Tiling{128, 32, 4, 2});

  // Files: "v_head_dim" equal to head_dim reads as the equal shape; a
  // head_dim 192 without one, or a pair no kernel takes, refuses the file by
  // name.
  auto file = [&](const std::string &shape) {
    return R"({"schema": "dualkv-tuning", "version": 2, "entries": [)"
           R"({"kind": "fwd", "P": 0, "N": 0, )" +
           shape +
           R"(, "num_q_heads": 32, "num_kv_heads": 8, "dtype": "bf16",)"
           R"( "arch": "sm_80", "tiling": {"block_m": 128, "block_n": 32,)"
           R"( "warps": 4, "stages": 2}}]})";
  };
  writeText(path, file(R"("head_dim": 128, "v_head_dim": 128)"));
  TuningDb equal = TuningDb::load(path, &error);
  CHECK(error.empty());
  REQUIRE(equal.entries().size() == 1);
  CHECK(equal.entries()[0].spec.valueHeadDim == 0);
  for (const auto &[shape, expect] :
       std::vector<std::pair<std::string, std::string>>{
           {R"("head_dim": 192)", "entries[0].head_dim (192) must be 64, 96, "
                                  "128, 256 or 512"},
           {R"("head_dim": 128, "v_head_dim": 64)",
            "entries[0].head_dim (128) with entries[0].v_head_dim (64) must "
            "be 64, 96, 128, 256 or 512 with an equal value head_dim, or 192 "
            "with value head_dim 128"},
           {R"("head_dim": 192, "v_head_dim": 0)",
            "entries[0].v_head_dim is not a valid integer"},
           {R"("head_dim": 192, "v_head_dim": "128")",
            "entries[0].v_head_dim is not a valid integer"},
       }) {
    INFO(shape);
    writeText(path, file(shape));
    TuningDb refused = TuningDb::load(path, &error);
    CHECK(refused.entries().empty());
    CHECK(error.find(expect) != std::string::npos);
  }
  std::remove(path.c_str());
}

TEST_CASE("tuning: version 2 holds every kind and other versions or "
          "unknown kinds are foreign",
          "[tuning]") {
  // Every kind reads back; version 1, which spelled fp16 "f16", and any
  // later version are foreign: reported, nothing read, never misread.
  std::string path = tempPath("dualkv-tuning-schema");
  auto entry = [](const std::string &kind) {
    return R"({"kind": ")" + kind +
           R"(", "P": 0, "N": 0, "head_dim": 128, "num_q_heads": 32,)"
           R"( "num_kv_heads": 8, "dtype": "bf16", "arch": "sm_90a", "tiling":)"
           R"( {"block_m": 128, "block_n": 64, "warps": 8, "stages": 2}})";
  };
  auto file = [&](int version, const std::string &entries) {
    return fmt::format(R"({{"schema": "dualkv-tuning", "version": {}, )"
                       R"("entries": [{}]}})",
                       version, entries);
  };
  std::string error;
  writeText(path, file(2, entry("fwd")));
  TuningDb old = TuningDb::load(path, &error);
  CHECK(error.empty());
  REQUIRE(old.entries().size() == 1);
  CHECK(old.entries()[0].spec.kind == KernelKind::Fwd);

  for (const char *kind : {"bwd", "bwd_kv"}) {
    writeText(path, file(2, entry(kind)));
    TuningDb db = TuningDb::load(path, &error);
    INFO(kind);
    CHECK(error.empty());
    REQUIRE(db.entries().size() == 1);
    CHECK(toString(db.entries()[0].spec.kind) == std::string(kind));
  }

  // Another version (the earlier schema, or a later one) is foreign:
  // reported, nothing read.
  for (int version : {1, 3}) {
    writeText(path, file(version, entry("fwd")));
    TuningDb other = TuningDb::load(path, &error);
    INFO(version);
    CHECK(other.entries().empty());
    CHECK(error.find(fmt::format("ignored: schema version {} is not 2",
                                 version)) != std::string::npos);
  }

  // An unknown kind names the field and the value, and the whole file goes.
  writeText(path, file(2, entry("fwd") + ", " + entry("bwd_fused")));
  TuningDb unknown = TuningDb::load(path, &error);
  CHECK(unknown.entries().empty());
  CHECK(error.find("entries[1].kind 'bwd_fused' is not a known kernel kind") !=
        std::string::npos);

  // fp16 is spelled "fp16" (dualkv/Names.h); version 1's "f16" is refused
  // by name even inside a version-2 file.
  std::string f16 = entry("fwd");
  f16.replace(f16.find("\"bf16\""), 6, "\"f16\"");
  writeText(path, file(2, f16));
  TuningDb misspelt = TuningDb::load(path, &error);
  CHECK(misspelt.entries().empty());
  CHECK(error.find("entries[0].dtype 'f16' is not bf16 or fp16") !=
        std::string::npos);
  std::remove(path.c_str());
}

TEST_CASE("tuning: an entry the compiler's spec check refuses is left out "
          "with a warning, fields out of range refuse the file",
          "[tuning]") {
  std::string path = tempPath("dualkv-tuning-spec");
  auto entry = [](const std::string &kind, const std::string &arch,
                  const std::string &tiling,
                  const std::string &heads = R"("num_q_heads": 4, )"
                                             R"("num_kv_heads": 4)",
                  const std::string &headDim = "64") {
    return R"({"kind": ")" + kind + R"(", "P": 0, "N": 0, "head_dim": )" +
           headDim + ", " + heads + R"(, "dtype": "bf16", "arch": ")" + arch +
           R"(", "tiling": )" + tiling + "}";
  };
  auto file = [](const std::string &entries) {
    return R"({"schema": "dualkv-tuning", "version": 2, "entries": [)" +
           entries + "]}";
  };
  const std::string good = R"({"block_m": 128, "block_n": 32, "warps": 4, )"
                           R"("stages": 2})";
  // The loader's own checks passed these (every field in [0, 2^30]); the
  // spec check refuses a forward of 3 stages, and an arch it does not know.
  const std::string threeStages = R"({"block_m": 128, "block_n": 32, )"
                                  R"("warps": 4, "stages": 3})";
  writeText(path, file(entry("fwd", "sm_80", threeStages) + ", " +
                       entry("fwd", "sm_86", good) + ", " +
                       entry("fwd", "sm_75", good)));
  std::string error;
  std::vector<std::string> skipped;
  TuningDb db = TuningDb::load(path, &error, &skipped);
  CHECK(error.empty());
  REQUIRE(db.entries().size() == 1);
  CHECK(db.entries()[0].spec.arch == "sm_86");
  REQUIRE(skipped.size() == 2);
  CHECK(skipped[0] ==
        fmt::format("tuning database {}: entries[0] (fwd generic head_dim 64 "
                    "heads 4:4 bf16 sm_80 tiling 128,32,4,3) is left out: "
                    "stages 3 and 4 are the warp-specialized dQ kernel's "
                    "only; this fwd kernel takes 1 or 2; its kernel takes the "
                    "default tiling",
                    path));
  CHECK(skipped[1].find("entries[2] (") != std::string::npos);
  CHECK(skipped[1].find("arch 'sm_75' is not supported") != std::string::npos);
  // The lookup finds nothing for the refused entry: the default tiling.
  KernelSpec spec;
  spec.headDim = 64;
  spec.numQHeads = 4;
  spec.numKVHeads = 4;
  spec.arch = "sm_80";
  CHECK_FALSE(db.find(spec).has_value());

  // Values out of range (up to 2^30 passed before, wrapping as int on the
  // way to the spec helpers) make the file malformed: it is not used at all.
  struct Bad {
    std::string entry, expect;
  };
  for (const Bad &bad : {
           Bad{entry("fwd", "sm_80",
                     R"({"block_m": 1073741824, "block_n": 32, "warps": 4, )"
                     R"("stages": 2})"),
               "entries[0].tiling.blockM (1073741824) must be a power of two "
               "in [16, 256]"},
           Bad{entry("fwd", "sm_80",
                     R"({"block_m": 128, "block_n": 48, "warps": 4, )"
                     R"("stages": 2})"),
               "entries[0].tiling.blockN (48) must be a power of two in [16, "
               "256]"},
           Bad{entry("fwd", "sm_80",
                     R"({"block_m": 128, "block_n": 32, "warps": 1073741824, )"
                     R"("stages": 2})"),
               "entries[0].tiling.warps (1073741824) must be a power of two "
               "up to 16"},
           Bad{entry("fwd", "sm_80",
                     R"({"block_m": 128, "block_n": 32, "warps": 4, )"
                     R"("stages": 5})"),
               "entries[0].tiling.stages (5) must be 1 to 4"},
           Bad{entry("fwd", "sm_80",
                     R"({"block_m": 128.0, "block_n": 32, "warps": 4, )"
                     R"("stages": 2})"),
               "entries[0].block_m is not a valid integer"},
           Bad{entry("fwd", "sm_80",
                     R"({"block_m": 18446744073709551615, "block_n": 32, )"
                     R"("warps": 4, "stages": 2})"),
               "entries[0].block_m is not a valid integer"},
           Bad{entry("fwd", "sm_80", good,
                     R"("num_q_heads": 65536, "num_kv_heads": 1)"),
               "entries[0].num_q_heads is not a valid integer (one in [1, "
               "65535]): 65536"},
           Bad{entry("fwd", "sm_80", good,
                     R"("num_q_heads": 6, "num_kv_heads": 4)"),
               "entries[0].num_q_heads (6) is not a multiple of num_kv_heads "
               "(4)"},
           Bad{entry("fwd", "sm_80", good,
                     R"("num_q_heads": 4, "num_kv_heads": 4)", "80"),
               "entries[0].head_dim (80) must be 64, 96, 128, 256 or 512"},
       }) {
    INFO(bad.entry);
    writeText(path, file(entry("fwd", "sm_86", good) + ", " + bad.entry));
    TuningDb refused = TuningDb::load(path, &error, &skipped);
    CHECK(refused.entries().empty());
    CHECK(skipped.empty());
    CHECK(error.find("ignored") != std::string::npos);
    // The second entry is entries[1].
    std::string expect = bad.expect;
    expect.replace(expect.find("entries[0]"), 10, "entries[1]");
    CHECK(error.find(expect) != std::string::npos);
  }
  std::remove(path.c_str());
}

namespace {

/// Parameter sizes of the backward's kernels (docs/backward-abi.md), so the
/// fake driver records their launches as events.
std::map<std::string, std::vector<int>> backwardSignatures() {
  std::vector<int> main(26, 8);
  main.insert(main.end(), {4, 4});
  std::vector<int> dq(20, 8);
  dq.insert(dq.end(), {4, 4});
  return {{"attention_bwd_pre", std::vector<int>(9, 8)},
          {"attention_bwd", main},
          {"attention_bwd_kv", main},
          {"attention_bwd_post", std::vector<int>(15, 8)},
          {"attention_bwd_dq", dq}};
}

/// Puts a fake kernel for `spec` (resolved here) into the disk cache at
/// `root`, telling itself apart by its name and shared bytes.
void seedSpec(const std::string &root, KernelSpec spec, const std::string &name,
              int threads, int shared) {
  spec = resolveSpec(spec);
  CacheEntry entry;
  entry.info = {name, threads, shared, spec.tiling.blockM};
  entry.ptx = fmt::format("// fake {}\n", name);
  entry.cubin = {'c', 'u', 'b', 'i', 'n'};
  requireSuccess(DiskCache(root).store(
      CacheKey::fromSpec(spec, compilerFingerprint()), entry));
}

/// Puts a fake kernel for (kind, head_dim, tiling; heads 8:2, bf16, sm_90a)
/// into the disk cache at `root`, telling itself apart by its shared bytes.
void seed(const std::string &root, KernelKind kind, int headDim, Tiling tiling,
          const std::string &name, int threads, int shared, int qHeads = 8,
          int kvHeads = 2) {
  KernelSpec spec;
  spec.kind = kind;
  spec.headDim = headDim;
  spec.numQHeads = qHeads;
  spec.numKVHeads = kvHeads;
  spec.arch = "sm_90a";
  spec.tiling = tiling;
  seedSpec(root, spec, name, threads, shared);
}

ForwardArgs fakeForwardArgs(const Plan &plan, int headDim) {
  ForwardArgs a;
  const int64_t T = plan.numTokens(), D = headDim, Hq = 8, Hkv = 2;
  a.q = {fakePointer(0x100000), Hq * D, D};
  a.k = {fakePointer(0x200000), Hkv * D, D};
  a.v = {fakePointer(0x300000), Hkv * D, D};
  a.o = {fakePointer(0x400000), Hq * D, D};
  a.lse = static_cast<float *>(fakePointer(0x500000));
  a.lse_stride_h = T;
  a.num_tokens = T;
  a.num_q_heads = int(Hq);
  a.num_kv_heads = int(Hkv);
  a.head_dim = headDim;
  a.plan = &plan;
  return a;
}

BackwardArgs fakeBackwardArgs(const Plan &plan, int headDim, bool det) {
  ForwardArgs f = fakeForwardArgs(plan, headDim);
  const int64_t D = headDim, Hq = 8, Hkv = 2;
  BackwardArgs a;
  a.q = f.q;
  a.k = f.k;
  a.v = f.v;
  a.o = f.o;
  a.dout = {fakePointer(0x600000), Hq * D, D};
  a.dq = {fakePointer(0x700000), Hq * D, D};
  a.dk = {fakePointer(0x800000), Hkv * D, D};
  a.dv = {fakePointer(0x900000), Hkv * D, D};
  a.lse = f.lse;
  a.lse_stride_h = f.lse_stride_h;
  a.num_tokens = f.num_tokens;
  a.num_q_heads = f.num_q_heads;
  a.num_kv_heads = f.num_kv_heads;
  a.head_dim = headDim;
  a.deterministic = det;
  // The atomic algorithm's kernel is what the default-mode cases tune (the
  // fake device is sm_90a, whose default is split-dQ).
  a.algorithm = BackwardAlgorithm::Atomic;
  a.plan = &plan;
  return a;
}

/// A kernel cache in a temporary directory and a tuning database beside it
/// holding `entries`. The runtime reads the database once per process, at the
/// first kernel lookup, so each test using this runs in a process of its own
/// (one ctest entry per test case).
struct TunedCache {
  TempDir tmp;
  ScopedEnv cacheDir{"DUALKV_CACHE_DIR", tmp.path};
  ScopedEnv always{"DUALKV_ALWAYS_COMPILE", std::nullopt};
  std::string dbPath = tmp.path + "/tuning.json";
  ScopedEnv dbEnv{"DUALKV_TUNING_DB", dbPath};
  explicit TunedCache(const std::vector<TunedEntry> &entries) {
    TuningDb db;
    for (const TunedEntry &e : entries)
      db.put(e);
    std::string error;
    REQUIRE(db.save(dbPath, &error));
  }
};

/// A tuned entry of the backward's main kernel for 8:2 heads, head_dim 128.
TunedEntry tunedBwd(const Tiling &tiling) {
  TunedEntry e;
  e.spec.kind = KernelKind::Bwd;
  e.spec.numQHeads = 8;
  e.spec.numKVHeads = 2;
  e.spec.tiling = tiling;
  return e;
}

/// The shared bytes of the last launch of kernel `name`.
unsigned sharedOf(const FakeDriver &fake, const std::string &name) {
  for (auto e = fake.events.rbegin(); e != fake.events.rend(); ++e)
    if (e->name == name)
      return e->shared;
  FAIL("no launch of " << name);
  return 0;
}

} // namespace

TEST_CASE("tuning: the runtime looks tuned tilings up by kernel kind",
          "[tuning][runtime]") {
  const Tiling bwdTuned{64, 32, 4, 1}, fwdTuned{64, 64, 4, 2};
  TunedEntry bwd = tunedBwd(bwdTuned); // head_dim 128: the main kernel only
  TunedEntry fwd = bwd;                // head_dim 64: the forward only
  fwd.spec.kind = KernelKind::Fwd;
  fwd.spec.headDim = 64;
  fwd.spec.tiling = fwdTuned;
  TunedCache cache({bwd, fwd});

  // Every kernel either lookup could pick, each with its own shared bytes; a
  // lookup that took the wrong entry loads the wrong one of these.
  const std::string &root = cache.tmp.path;
  for (int d : {64, 128}) {
    const int base = d * 100;
    seed(root, KernelKind::Fwd, d, {}, "attention_fwd", 128, base + 1);
    seed(root, KernelKind::Fwd, d, fwdTuned, "attention_fwd", 128, base + 2);
    seed(root, KernelKind::Fwd, d, bwdTuned, "attention_fwd", 256, base + 3);
    seed(root, KernelKind::Bwd, d, {}, "attention_bwd", 128, base + 11);
    seed(root, KernelKind::Bwd, d, bwdTuned, "attention_bwd", 256, base + 12);
    seed(root, KernelKind::Bwd, d, fwdTuned, "attention_bwd", 128, base + 13);
    seed(root, KernelKind::BwdKV, d, {}, "attention_bwd_kv", 128, base + 21);
    seed(root, KernelKind::BwdKV, d, bwdTuned, "attention_bwd_kv", 256,
         base + 22);
    seed(root, KernelKind::BwdPre, d, {}, "attention_bwd_pre", 128, 0);
    seed(root, KernelKind::BwdPost, d, {}, "attention_bwd_post", 256, 0);
    seed(root, KernelKind::BwdDQ, d, {}, "attention_bwd_dq", 128, base + 31);
  }

  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  fake.signatures = backwardSignatures();
  resetCacheStats();
  Plan plan({{40, {24, 0, 32}}, {8, {8}}});

  // head_dim 128: the bwd entry serves the atomic backward's main kernel
  // only; the forward and the deterministic backward keep their defaults.
  forward(fakeForwardArgs(plan, 128));
  CHECK(fake.last.shared == 12801);
  backward(fakeBackwardArgs(plan, 128, false));
  CHECK(sharedOf(fake, "attention_bwd") == 12812);
  backward(fakeBackwardArgs(plan, 128, true));
  CHECK(sharedOf(fake, "attention_bwd_kv") == 12821);

  // head_dim 64: the fwd entry serves the forward, never the backward.
  forward(fakeForwardArgs(plan, 64));
  CHECK(fake.last.shared == 6402);
  backward(fakeBackwardArgs(plan, 64, false));
  CHECK(sharedOf(fake, "attention_bwd") == 6411);
  CHECK(cacheStats().compiles == 0);
}

TEST_CASE("tuning: a backward launched a KV head at a time takes the tiling "
          "tuned for all of its heads",
          "[tuning][runtime][backward]") {
  // dualkv-tune measured the whole problem: 8:2 heads.
  const Tiling tuned{64, 32, 4, 1};
  TunedCache cache({tunedBwd(tuned)});

  // The one-KV-head kernels (4:1) with the tuned and the default tiling, each
  // with its own shared bytes; bwd_pre runs on every head (8:2).
  const std::string &root = cache.tmp.path;
  seed(root, KernelKind::Bwd, 128, tuned, "attention_bwd", 128, 401, 4, 1);
  seed(root, KernelKind::Bwd, 128, {}, "attention_bwd", 256, 402, 4, 1);
  seed(root, KernelKind::BwdPost, 128, {}, "attention_bwd_post", 256, 0, 4, 1);
  seed(root, KernelKind::BwdPre, 128, {}, "attention_bwd_pre", 128, 0);

  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  fake.signatures = backwardSignatures();
  resetCacheStats();
  // P = 8192, N = 16, R = 1024: enough work items for one KV head a launch.
  Plan plan({{8192, std::vector<int64_t>(16, 1024)}});
  REQUIRE(backwardKVHeadsPerLaunch(plan, 2, false) == 1);
  backward(fakeBackwardArgs(plan, 128, false));
  int launches = 0;
  for (const FakeDriver::Event &e : fake.events)
    if (e.name == "attention_bwd") {
      ++launches;
      CHECK(e.shared == 401); // the tuned tiling's kernel
    }
  CHECK(launches == 2);
  CHECK(cacheStats().compiles == 0);
}

TEST_CASE("tuning: the default database is not read from a cache root the "
          "cache refuses",
          "[tuning]") {
  if (ptxasPath({}).empty())
    return; // the kernel is compiled for real here
  // The database is read once per process, at the first launch: this test
  // runs in a process of its own (one ctest entry per test case).
  TempDir tmp;
  const std::string root = tmp.path + "/cache";
  std::filesystem::create_directory(root);
  TuningDb db;
  // 4 warps; the default on sm_90a at head_dim 128 has 8.
  TunedEntry e = sample(128, "sm_90a", {128, 32, 4, 2});
  e.spec.numQHeads = 8;
  e.spec.numKVHeads = 2;
  db.put(e);
  std::string error;
  REQUIRE(db.save(root + "/tuning.json", &error));
  ::chmod(root.c_str(), 0777); // anyone could have written that database
  ScopedEnv cacheDir("DUALKV_CACHE_DIR", root);
  ScopedEnv dbPath("DUALKV_TUNING_DB", std::nullopt);
  ScopedEnv always("DUALKV_ALWAYS_COMPILE", std::nullopt);

  ScopedFakeDriver scoped;
  Plan plan({{40, {24, 0, 32}}, {8, {8}}});
  ForwardArgs a = fakeForwardArgs(plan, 128);
  forward(a);
  REQUIRE(scoped.fake.launches == 1);
  CHECK(scoped.fake.last.block[0] != 128); // the default, not the tuned
  CHECK(DiskCache(root).refused());
  CHECK_FALSE(DiskCache(root).usable());
}

//===----------------------------------------------------------------------===//
// Shape classes (docs/architecture.md §4)
//===----------------------------------------------------------------------===//

TEST_CASE("shape class: power-of-two buckets with floors", "[tuning][class]") {
  // Hand-computed: ceil to a power of two, at least 512 / 1 / 64.
  CHECK(shapeBucket(1024, 512) == 1024);
  CHECK(shapeBucket(1025, 512) == 2048);
  CHECK(shapeBucket(3, 512) == 512);
  CHECK(shapeBucket(0, 1) == 1);
  CHECK(shapeBucket(-5, 64) == 64);
  CHECK(shapeBucket(int64_t(1) << 40, 1) == kShapeClassMax);
  CHECK(shapeClassOf(1024, 8, 256) == ShapeClass{1024, 8, 256});
  CHECK(shapeClassOf(1000, 7, 200) == ShapeClass{1024, 8, 256});
  CHECK(shapeClassOf(1025, 9, 257) == ShapeClass{2048, 16, 512});
  CHECK(shapeClassOf(2048, 4, 128) == ShapeClass{2048, 4, 128});
  CHECK(shapeClassOf(1, 0, 0) == ShapeClass{512, 1, 64});
  CHECK(shapeClassOf(8192, 16, 1024).name() == "P8192_N16_R1024");
  CHECK(ShapeClass{}.name() == "any");
  // The standard and the small configurations are each a class of their own.
  std::set<ShapeClass> classes;
  for (auto [p, n, r] : std::vector<std::array<int64_t, 3>>{{4096, 16, 1024},
                                                            {8192, 16, 1024},
                                                            {16384, 16, 1024},
                                                            {32768, 16, 1024},
                                                            {8192, 32, 2048},
                                                            {1024, 8, 256},
                                                            {2048, 4, 128}})
    CHECK(classes.insert(shapeClassOf(p, n, r)).second);
  CHECK(isShapeClass({}));
  CHECK(isShapeClass({512, 1, 64}));
  CHECK_FALSE(isShapeClass({256, 1, 64}));   // below the floor
  CHECK_FALSE(isShapeClass({1000, 8, 256})); // not a power of two
  CHECK_FALSE(isShapeClass({1024, 0, 0}));   // part generic, part class
}

TEST_CASE("shape class: a plan's is its largest group's", "[tuning][class]") {
  // Group 0: 40 + 56 tokens, 3 responses, mean 56 / 3 -> 19: (512, 4, 64).
  CHECK(shapeClassOf(Plan({{40, {24, 0, 32}}, {8, {8}}})) ==
        ShapeClass{512, 4, 64});
  // Group 1 has more tokens (2010 > 1500): P 2000 -> 2048, N 1, R 10 -> 64.
  CHECK(shapeClassOf(Plan({{1000, {300, 200}}, {2000, {10}}})) ==
        ShapeClass{2048, 1, 64});
  // The mean response length, rounded up: (1024, 8, 257 -> 512).
  std::vector<int64_t> rs(8, 256);
  rs[0] = 257;
  CHECK(shapeClassOf(Plan({{1024, rs}})) == ShapeClass{1024, 8, 512});
  // Equal groups: the first; a group without responses: N 1, R 64.
  CHECK(shapeClassOf(Plan({{600, {}}, {300, {300}}})) ==
        ShapeClass{1024, 1, 64});
  // A forest of depth one is groups; a node below a response is not.
  CHECK(shapeClassOf(Plan(PlanTree{{2048, 128, 128}, {-1, 0, 0}})) ==
        ShapeClass{2048, 2, 128});
  CHECK(shapeClassOf(Plan(PlanTree{{2048, 128, 128}, {-1, 0, 1}})).any());
}

TEST_CASE("tuning: class entries round-trip and are looked up class then "
          "generic then none",
          "[tuning][class]") {
  TunedEntry generic = sample(128, "sm_90a", {128, 64, 8, 2});
  TunedEntry small = generic;
  small.spec.P = 1024;
  small.spec.N = 8;
  small.spec.R = 256;
  small.spec.tiling = {64, 32, 4, 2};
  TunedEntry other = small; // same P and N, another R: a key of its own
  other.spec.R = 512;
  other.spec.tiling = {64, 64, 4, 1};
  TuningDb db;
  db.put(generic);
  db.put(small);
  db.put(other);
  REQUIRE(db.entries().size() == 3);
  // A generic entry is spelled without "R", as before classes; a class
  // entry has one.
  nlohmann::json doc = nlohmann::json::parse(db.toJson());
  CHECK_FALSE(doc["entries"][0].contains("R"));
  CHECK(doc["entries"][1]["R"] == 256);
  std::string path = tempPath("dualkv-tuning-class");
  std::string error;
  REQUIRE(db.save(path, &error));
  TuningDb back = TuningDb::load(path, &error);
  CHECK(error.empty());
  REQUIRE(back.entries().size() == 3);

  KernelSpec spec = generic.spec;
  spec.tiling = {};
  bool fromClass = true;
  CHECK(back.findForClass(spec, {1024, 8, 256}, &fromClass) ==
        Tiling{64, 32, 4, 2});
  CHECK(fromClass);
  CHECK(back.findForClass(spec, {1024, 8, 512}, &fromClass) ==
        Tiling{64, 64, 4, 1});
  CHECK(fromClass);
  // A class without an entry takes the generic one; so does "any".
  CHECK(back.findForClass(spec, {2048, 4, 128}, &fromClass) ==
        Tiling{128, 64, 8, 2});
  CHECK_FALSE(fromClass);
  CHECK(back.findForClass(spec, {}, &fromClass) == Tiling{128, 64, 8, 2});
  CHECK_FALSE(fromClass);
  // No generic entry either: nothing (the compiler's default).
  spec.headDim = 64;
  CHECK_FALSE(back.findForClass(spec, {1024, 8, 256}).has_value());
  // find() matches exactly: the class entry is not the generic one.
  spec.headDim = 128;
  spec.P = 1024;
  spec.N = 8;
  CHECK_FALSE(back.find(spec).has_value()); // R 0: no such class
  std::remove(path.c_str());
}

TEST_CASE("tuning: an entry whose P, N, R are not a shape class is malformed",
          "[tuning][class]") {
  std::string path = tempPath("dualkv-tuning-badclass");
  auto file = [](const std::string &pnr) {
    return R"({"schema": "dualkv-tuning", "version": 2, "entries": [{"kind": )"
           R"("fwd", )" +
           pnr +
           R"(, "head_dim": 128, "num_q_heads": 32, "num_kv_heads": 8, )"
           R"("dtype": "bf16", "arch": "sm_90a", "tiling": {"block_m": 128, )"
           R"("block_n": 64, "warps": 8, "stages": 2}}]})";
  };
  std::string error;
  writeText(path, file(R"("P": 1024, "N": 8, "R": 256)"));
  CHECK(TuningDb::load(path, &error).entries().size() == 1);
  CHECK(error.empty());
  writeText(path, file(R"("P": 0, "N": 0)")); // no R: generic, as before
  CHECK(TuningDb::load(path, &error).entries().size() == 1);
  CHECK(error.empty());
  for (const char *bad :
       {R"("P": 1000, "N": 8, "R": 256)", R"("P": 1024, "N": 0, "R": 0)",
        R"("P": 1024, "N": 8)", R"("P": 256, "N": 8, "R": 256)",
        R"("P": 1024, "N": 8, "R": -256)"}) {
    INFO(bad);
    writeText(path, file(bad));
    TuningDb db = TuningDb::load(path, &error);
    CHECK(db.entries().empty());
    CHECK(error.find("entries[0]") != std::string::npos);
  }
  writeText(path, file(R"("P": 1000, "N": 8, "R": 256)"));
  TuningDb::load(path, &error);
  CHECK(error.find("is not a shape class") != std::string::npos);
  std::remove(path.c_str());
}

TEST_CASE("cache key: R is written only for a class and changes the hash",
          "[runtime][class]") {
  KernelSpec spec;
  spec.arch = "sm_90a";
  spec = resolveSpec(spec);
  CacheKey generic = CacheKey::fromSpec(spec, "fp");
  CHECK_FALSE(generic.toJson().contains("R"));
  spec.P = 1024;
  spec.N = 8;
  spec.R = 256;
  CacheKey cls = CacheKey::fromSpec(spec, "fp");
  CHECK(cls.toJson()["R"] == 256);
  CHECK(cls.spec().R == 256);
  CacheKey otherR = cls;
  otherR.R = 512;
  std::set<std::string> hashes = {generic.hash(), cls.hash(), otherR.hash()};
  CHECK(hashes.size() == 3);
  CHECK(cls.describe().find("R=256") != std::string::npos);
  CHECK(generic.describe().find("R=") == std::string::npos);
}

namespace {

/// Puts a fake kernel for (kind, head_dim 128, heads 8:2, bf16, sm_90a,
/// shape class `c`, tiling) into the disk cache at `root`.
void seedClass(const std::string &root, KernelKind kind, const ShapeClass &c,
               Tiling tiling, const std::string &name, int threads, int shared,
               int qHeads = 8, int kvHeads = 2) {
  KernelSpec spec;
  spec.kind = kind;
  spec.P = c.P;
  spec.N = c.N;
  spec.R = c.R;
  spec.numQHeads = qHeads;
  spec.numKVHeads = kvHeads;
  spec.arch = "sm_90a";
  spec.tiling = tiling;
  seedSpec(root, spec, name, threads, shared);
}

TunedEntry tunedFor(KernelKind kind, const ShapeClass &c, Tiling tiling,
                    int headDim = 128) {
  TunedEntry e;
  e.spec.kind = kind;
  e.spec.P = c.P;
  e.spec.N = c.N;
  e.spec.R = c.R;
  e.spec.headDim = headDim;
  e.spec.numQHeads = 8;
  e.spec.numKVHeads = 2;
  e.spec.tiling = tiling;
  return e;
}

} // namespace

TEST_CASE("tuning: the runtime takes the class's tiling else the generic "
          "one else the default",
          "[tuning][runtime][class]") {
  // First: the plans below free their tables through it.
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  const Tiling classTiling{64, 32, 4, 2}, genericTiling{64, 64, 4, 2};
  // Plan A's class has an entry; plan B's has none.
  Plan a({{1024, std::vector<int64_t>(8, 256)}});
  Plan b({{2048, std::vector<int64_t>(4, 128)}});
  const ShapeClass ca = shapeClassOf(a);
  REQUIRE(ca == ShapeClass{1024, 8, 256});
  TunedCache cache({tunedFor(KernelKind::Fwd, ca, classTiling),
                    tunedFor(KernelKind::Fwd, {}, genericTiling)});
  // Every kernel a lookup could pick, told apart by shared bytes: the
  // class's kernel (on disk: no compile), the generic tuned one, the
  // default, and the class tiling's generic kernel (never the answer).
  const std::string &root = cache.tmp.path;
  seedClass(root, KernelKind::Fwd, ca, classTiling, "attention_fwd", 128, 1);
  seedClass(root, KernelKind::Fwd, {}, genericTiling, "attention_fwd", 128, 2);
  seedClass(root, KernelKind::Fwd, {}, {}, "attention_fwd", 128, 3);
  seedClass(root, KernelKind::Fwd, {}, classTiling, "attention_fwd", 128, 4);
  seed(root, KernelKind::Fwd, 64, {}, "attention_fwd", 128, 5);
  resetCacheStats();
  forward(fakeForwardArgs(a, 128));
  CHECK(fake.last.shared == 1); // the class's entry
  forward(fakeForwardArgs(b, 128));
  CHECK(fake.last.shared == 2); // no class entry: the generic one
  forward(fakeForwardArgs(a, 128));
  CHECK(fake.last.shared == 1); // and again, from memory
  forward(fakeForwardArgs(a, 64));
  CHECK(fake.last.shared == 5); // head_dim 64: no entry at all, the default
  // Nothing was compiled, so nothing went to the background.
  CHECK(cacheStats().compiles == 0);
  CHECK(backgroundCompilesStarted() == 0);
}

TEST_CASE("tuning: the backward's main kernel takes its class's tiling else "
          "the generic one",
          "[tuning][runtime][class][backward]") {
  // First: the plans below free their tables through it.
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  // As "a backward launched a KV head at a time": 8:2 heads tuned, 4:1
  // kernels launched; two plans of different classes.
  const Tiling tuned{64, 32, 4, 1};
  Plan a({{8192, std::vector<int64_t>(16, 1024)}});
  Plan b({{4096, std::vector<int64_t>(16, 1024)}});
  REQUIRE(backwardKVHeadsPerLaunch(a, 2, false) == 1);
  REQUIRE(backwardKVHeadsPerLaunch(b, 2, false) == 1);
  const ShapeClass ca = shapeClassOf(a);
  REQUIRE(ca == ShapeClass{8192, 16, 1024});
  TunedCache cache({tunedFor(KernelKind::Bwd, ca, tuned)});
  const std::string &root = cache.tmp.path;
  seedClass(root, KernelKind::Bwd, ca, tuned, "attention_bwd", 128, 401, 4, 1);
  seedClass(root, KernelKind::Bwd, {}, tuned, "attention_bwd", 128, 403, 4, 1);
  seedClass(root, KernelKind::Bwd, {}, {}, "attention_bwd", 256, 402, 4, 1);
  seedClass(root, KernelKind::BwdPost, {}, {}, "attention_bwd_post", 256, 0, 4,
            1);
  seedClass(root, KernelKind::BwdPre, {}, {}, "attention_bwd_pre", 128, 0);

  fake.signatures = backwardSignatures();
  resetCacheStats();
  auto mainShared = [&](const Plan &plan) {
    fake.events.clear();
    backward(fakeBackwardArgs(plan, 128, false));
    std::set<unsigned> shared;
    for (const FakeDriver::Event &e : fake.events)
      if (e.name == "attention_bwd")
        shared.insert(e.shared);
    return shared;
  };
  CHECK(mainShared(a) == std::set<unsigned>{401}); // the class's kernel
  CHECK(mainShared(b) == std::set<unsigned>{402}); // no entry: the default
  CHECK(mainShared(a) == std::set<unsigned>{401});
  CHECK(cacheStats().compiles == 0);
}

TEST_CASE("tuning: the split-dQ backward's dQ kernel takes its class's tiling "
          "else the generic one",
          "[tuning][runtime][class][backward]") {
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  // The warp-specialized dQ kernel at 32-key tiles for one class (the same
  // parameters as the default 128:64:8:3); two plans of different classes.
  const Tiling tuned{128, 32, 8, 3};
  Plan a({{8192, std::vector<int64_t>(16, 1024)}});
  Plan b({{4096, std::vector<int64_t>(16, 1024)}});
  const ShapeClass ca = shapeClassOf(a);
  REQUIRE_FALSE(ca == shapeClassOf(b));
  TunedCache cache({tunedFor(KernelKind::BwdDQ, ca, tuned)});
  const std::string &root = cache.tmp.path;
  seedClass(root, KernelKind::BwdDQ, ca, tuned, "attention_bwd_dq", 384, 501);
  seedClass(root, KernelKind::BwdDQ, {}, {}, "attention_bwd_dq", 384, 502);
  seedClass(root, KernelKind::BwdKV, {}, {}, "attention_bwd_kv", 384, 503);
  seedClass(root, KernelKind::BwdPre, {}, {}, "attention_bwd_pre", 128, 0);

  fake.signatures = backwardSignatures();
  resetCacheStats();
  auto dqShared = [&](const Plan &plan) {
    fake.events.clear();
    backward(fakeBackwardArgs(plan, 128, true));
    return sharedOf(fake, "attention_bwd_dq");
  };
  CHECK(dqShared(a) == 501); // the class's kernel
  CHECK(dqShared(b) == 502); // no entry: the default
  CHECK(dqShared(a) == 501);
  CHECK(cacheStats().compiles == 0);
}

TEST_CASE("tuning: a class's kernel is compiled in the background while the "
          "generic kernel serves and its code is the generic code",
          "[tuning][runtime][class]") {
  if (ptxasPath({}).empty())
    return; // the class's kernel is compiled for real here
  // First: the plans below free their tables through it.
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  const Tiling classTiling{128, 64, 8, 2}; // the default has another shape
  Plan a({{1024, std::vector<int64_t>(8, 256)}});
  const ShapeClass ca = shapeClassOf(a);
  TunedCache cache({tunedFor(KernelKind::Fwd, ca, classTiling)});
  ScopedEnv background("DUALKV_BACKGROUND_COMPILE", std::nullopt);
  seedClass(cache.tmp.path, KernelKind::Fwd, {}, {}, "attention_fwd", 128, 3);

  resetCacheStats();
  forward(fakeForwardArgs(a, 128));
  REQUIRE(fake.launches == 1);
  CHECK(fake.last.shared == 3); // the generic kernel, while the class compiles
  CHECK(backgroundCompilesStarted() == 1);
  waitForBackgroundCompiles();
  CHECK(cacheStats().compiles == 1);
  // The generic kernel at the class's tiling, compiled here independently:
  // what the class's kernel must be.
  KernelSpec spec;
  spec.numQHeads = 8;
  spec.numKVHeads = 2;
  spec.arch = "sm_90a";
  spec.tiling = classTiling;
  spec = resolveSpec(spec);
  CompileResult generic = compile(spec);
  REQUIRE(generic.ok);
  REQUIRE(generic.info.threads != 128); // unlike the seeded generic kernel
  forward(fakeForwardArgs(a, 128));
  REQUIRE(fake.launches == 2);
  CHECK(fake.last.block[0] == unsigned(generic.info.threads)); // 8 warps
  CHECK(fake.last.block[0] == 256);
  CHECK(fake.last.shared == unsigned(generic.info.sharedBytes));
  CHECK(backgroundCompilesStarted() == 1); // compiled once

  // On disk under the class's key (with R), with exactly the generic PTX.
  KernelSpec classSpec = spec;
  classSpec.P = ca.P;
  classSpec.N = ca.N;
  classSpec.R = ca.R;
  std::optional<CacheEntry> stored =
      DiskCache(cache.tmp.path)
          .load(CacheKey::fromSpec(classSpec, compilerFingerprint()));
  REQUIRE(stored.has_value());
  CHECK(stored->ptx == generic.ptx);
  CHECK(stored->info.name == generic.info.name);
  CHECK_FALSE(DiskCache(cache.tmp.path)
                  .load(CacheKey::fromSpec(spec, compilerFingerprint()))
                  .has_value()); // the generic key was never written
}

TEST_CASE("tuning: DUALKV_BACKGROUND_COMPILE=0 compiles a class's kernel at "
          "its first launch",
          "[tuning][runtime][class]") {
  if (ptxasPath({}).empty())
    return; // the class's kernel is compiled for real here
  // First: the plans below free their tables through it.
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  Plan a({{2048, std::vector<int64_t>(4, 128)}});
  TunedCache cache(
      {tunedFor(KernelKind::Fwd, shapeClassOf(a), Tiling{128, 64, 8, 2})});
  ScopedEnv sync("DUALKV_BACKGROUND_COMPILE", "0");
  resetCacheStats();
  forward(fakeForwardArgs(a, 128));
  REQUIRE(fake.launches == 1);
  KernelSpec spec;
  spec.numQHeads = 8;
  spec.numKVHeads = 2;
  spec.arch = "sm_90a";
  spec.tiling = {128, 64, 8, 2};
  CompileResult generic = compile(resolveSpec(spec)); // independently
  REQUIRE(generic.ok);
  CHECK(fake.last.block[0] == 256); // the class's 8 warps
  CHECK(fake.last.shared == unsigned(generic.info.sharedBytes));
  CHECK(cacheStats().compiles == 1);
  CHECK(backgroundCompilesStarted() == 0);
}

TEST_CASE("tuning: a class tiling the spec check refuses leaves the class "
          "to the generic kernel and is never compiled",
          "[tuning][runtime][class]") {
  if (ptxasPath({}).empty())
    return; // the class's kernel is compiled for real here
  // First: the plans below free their tables through it.
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  Plan a({{1024, std::vector<int64_t>(8, 256)}});
  // head_dim 64: block_m 64 cannot hold 8 warps of 16 rows. The loader runs
  // the compiler's spec check, so the entry is left out with a warning.
  TunedCache cache(
      {tunedFor(KernelKind::Fwd, shapeClassOf(a), Tiling{64, 16, 8, 2}, 64)});
  ScopedEnv background("DUALKV_BACKGROUND_COMPILE", std::nullopt);
  seed(cache.tmp.path, KernelKind::Fwd, 64, {}, "attention_fwd", 128, 7);
  for (int i = 0; i < 3; ++i) {
    forward(fakeForwardArgs(a, 64));
    CHECK(fake.last.shared == 7);
    waitForBackgroundCompiles();
  }
  CHECK(fake.launches == 3);
  CHECK(backgroundCompilesStarted() == 0);
}

TEST_CASE("tuning: a class tiling that the spec check takes but does not "
          "build leaves the class to the generic kernel and is compiled once",
          "[tuning][runtime][class]") {
  if (ptxasPath({}).empty())
    return; // the class's kernel is compiled for real here
  // First: the plans below free their tables through it.
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  Plan a({{1024, std::vector<int64_t>(8, 256)}});
  // A tiling checkSpec takes, whose kernel then fails in ptxas.
  TunedCache cache(
      {tunedFor(KernelKind::Fwd, shapeClassOf(a), Tiling{64, 16, 4, 2}, 64)});
  ScopedEnv background("DUALKV_BACKGROUND_COMPILE", std::nullopt);
  seed(cache.tmp.path, KernelKind::Fwd, 64, {}, "attention_fwd", 128, 7);
  // After seed(): the compiler's fingerprint (which names ptxas) is taken.
  ScopedEnv failingPtxas("DUALKV_PTXAS", "/bin/false");
  for (int i = 0; i < 3; ++i) {
    forward(fakeForwardArgs(a, 64));
    CHECK(fake.last.shared == 7);
    waitForBackgroundCompiles();
  }
  CHECK(fake.launches == 3);
  CHECK(backgroundCompilesStarted() == 1);
}

TEST_CASE("tuning: save replaces a link without following it and reports "
          "a write it cannot make",
          "[tuning]") {
  TempDir tmp;
  const std::string victim = tmp.path + "/victim.txt";
  writeText(victim, "keep me\n");
  const std::string path = tmp.path + "/tuning.json";
  REQUIRE(::symlink(victim.c_str(), path.c_str()) == 0);
  TuningDb db;
  db.put(sample(128, "sm_90a", {128, 64, 8, 2}));
  std::string error;
  REQUIRE(db.save(path, &error));
  // The link is gone, replaced by the database; its target is untouched.
  struct stat st {};
  REQUIRE(::lstat(path.c_str(), &st) == 0);
  CHECK(S_ISREG(st.st_mode));
  std::ifstream in(victim);
  std::string line;
  std::getline(in, line);
  CHECK(line == "keep me");
  CHECK(TuningDb::load(path, &error).entries().size() == 1);

  // A folder where the file's folder should be: an error, nothing written.
  const std::string bad = victim + "/tuning.json";
  CHECK_FALSE(db.save(bad, &error));
  CHECK(error.find("cannot write " + bad) != std::string::npos);
}
