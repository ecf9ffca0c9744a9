// Tests of the tuning database: round trip, lookup by key, and every way a file
// can be wrong is reported and leaves the database empty.
#include "dualkv/Tuning.h"

#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <unistd.h>

using namespace dualkv;

namespace {

TunedEntry sample(int headDim, const char *arch, Tiling t) {
  TunedEntry e;
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
  wrongVersion.replace(wrongVersion.find("\"version\": 1"), 12,
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
        Bad{wrongVersion, "schema version 7 is not 1"},
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
