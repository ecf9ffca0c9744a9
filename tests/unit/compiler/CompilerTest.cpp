// Tests of the Compiler API: every shipped forward and backward spec compiles
// to PTX with the sm_80 schedule's instructions, launch geometry matches the
// tiling (docs/backward-abi.md for the backward), bad specs fail with a
// message, DUALKV_DUMP_IR-style dumps hold every stage (one folder a kernel;
// a dump that cannot be written is a warning), and ptxas is found as
// docs/environment.md says.
#include "dualkv/Compiler/Compiler.h"

// The runtime's compile table, for the per-kernel DUALKV_DUMP_IR folders.
#include "cache/CacheKey.h"
#include "cache/CompileTable.h"

#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>

#include <unistd.h>

using namespace dualkv;

namespace {

std::string readFile(const std::filesystem::path &p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

/// A fresh folder under the temporary directory, removed at the end.
struct TempFolder {
  std::filesystem::path path;
  TempFolder() {
    static int n = 0;
    path = std::filesystem::temp_directory_path() /
           ("dualkv-compiler-test-" + std::to_string(::getpid()) + "-" +
            std::to_string(n++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempFolder() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

/// Sets (or, with nullopt, unsets) an environment variable for one scope.
struct ScopedVariable {
  std::string name;
  std::optional<std::string> saved;
  ScopedVariable(const char *n, std::optional<std::string> value) : name(n) {
    if (const char *old = std::getenv(n))
      saved = old;
    if (value)
      ::setenv(n, value->c_str(), 1);
    else
      ::unsetenv(n);
  }
  ~ScopedVariable() {
    if (saved)
      ::setenv(name.c_str(), saved->c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
};

size_t count(const std::string &text, const std::string &what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos;
       at = text.find(what, at + 1))
    ++n;
  return n;
}

} // namespace

TEST_CASE("compiler: default tilings are the measured spill-free ones",
          "[compiler]") {
  KernelSpec spec;
  for (const char *arch : {"sm_80", "sm_90", "sm_90a"})
    for (int d : {64, 128, 256, 512}) {
      spec.arch = arch;
      spec.headDim = d;
      Tiling t = defaultTiling(spec);
      if (d == 512) {
        // Each CTA 256 of O's columns: on sm_90a warp-specialized with
        // 32-key tiles (Q and the ring take 225 KB); elsewhere mma_sync, 128
        // rows in 8 warps where Q rows of 512 fit (sm_90's 227 KB), 64 in 4
        // on sm_80 (163 KB).
        const bool sm90a = spec.arch == "sm_90a";
        CHECK(resolveSpec(spec).schedule ==
              (sm90a ? Schedule::WarpSpecialized : Schedule::MmaSync));
        CHECK(threadsPerBlock(resolveSpec(spec)) ==
              (sm90a ? 384 : t.warps * 32));
        CHECK(t == (spec.arch == "sm_80" ? Tiling{64, 32, 4, 2}
                                         : Tiling{128, 32, 8, 2}));
        continue;
      }
      if (spec.arch == "sm_90a") {
        // The warp-specialized schedule: two consumer warpgroups of 64 rows
        // (and a producer warpgroup), 128-key tiles, 64 at head_dim 256.
        CHECK(t == Tiling{128, d == 256 ? 64 : 128, 8, 2});
        CHECK(resolveSpec(spec).schedule == Schedule::WarpSpecialized);
        CHECK(threadsPerBlock(resolveSpec(spec)) == 384);
        continue;
      }
      CHECK(resolveSpec(spec).schedule != Schedule::WarpSpecialized);
      CHECK(t.blockM == 128);
      CHECK(t.blockN == 32);
      CHECK(t.warps == (d == 256 ? 8 : 4));
      CHECK(t.stages == 2);
    }
  spec.arch = "sm_80";
  spec.headDim = 128;
  spec.tiling = {64, 0, 0, 1};
  KernelSpec r = resolveSpec(spec);
  CHECK(r.tiling ==
        Tiling{64, 32, 4, 1}); // explicit fields kept, the rest filled
}

TEST_CASE("compiler: backward default tilings depend on the kind and, for "
          "the KV-major kernels, the arch",
          "[compiler][backward]") {
  // compiler/lib/Spec/KernelSpec.cpp: the KV-major kernels (fused and
  // deterministic dK/dV) 128 keys in 8 warps with 64-query tiles from sm_90 on;
  // before it the fused kernel streams 32-query tiles (an sm_80 SM's shared
  // memory is smaller) and the dK/dV one holds 64 keys in 4 warps; at head_dim
  // 256 both hold 64 keys in 8 warps (dK and dV split across them) and stream
  // 32-query tiles on every arch; dQ 64 rows x 32 keys; elementwise 64 rows;
  // one stage each. The archs of 99 KB of shared memory a CTA (sm_86, sm_89,
  // sm_120) take 64:32:4 where those do not fit them (at head_dim 128; sm_120
  // at 64 too). Head_dim 512 (below): 32 keys in 8 warps on every arch.
  KernelSpec spec;
  const Tiling small = {64, 32, 4, 1};
  for (int d : {64, 128, 256}) {
    spec.headDim = d;
    for (const char *arch : {"sm_80", "sm_86", "sm_89", "", "compute_90"}) {
      spec.arch = arch;
      bool fits = d == 64 || (std::string(arch) != "sm_86" &&
                              std::string(arch) != "sm_89");
      spec.kind = KernelKind::Bwd;
      CHECK(defaultTiling(spec) == (d == 256 ? Tiling{64, 32, 8, 1}
                                    : fits   ? Tiling{128, 32, 8, 1}
                                             : small));
      spec.kind = KernelKind::BwdKV;
      CHECK(defaultTiling(spec) == (d == 256 ? Tiling{64, 32, 8, 1}
                                    : fits   ? Tiling{64, 64, 4, 1}
                                             : small));
    }
    for (const char *arch : {"sm_90", "sm_90a", "sm_100", "sm_120"}) {
      spec.arch = arch;
      spec.kind = KernelKind::Bwd;
      // sm_90a at head_dim 256: bwd_kv warp-specialized, 64 keys that two
      // consumer warpgroups share, Q and dO by TMA (2 stages); bwd so only
      // by name.
      bool sm90a = std::string(arch) == "sm_90a";
      Tiling kvMajor = d == 256                        ? Tiling{64, 32, 8, 1}
                       : std::string(arch) == "sm_120" ? small
                                                       : Tiling{128, 64, 8, 1};
      CHECK(defaultTiling(spec) == kvMajor);
      spec.kind = KernelKind::BwdKV;
      // sm_90a at head_dim 64: bwd_kv takes 128-query tiles.
      CHECK(defaultTiling(spec) == (d == 256 && sm90a  ? Tiling{64, 64, 8, 2}
                                    : d == 64 && sm90a ? Tiling{128, 128, 8, 1}
                                                       : kvMajor));
    }
    spec.kind = KernelKind::BwdDQ;
    CHECK(defaultTiling(spec) == Tiling{64, 32, 4, 1});
    spec.arch = "sm_90a";
    CHECK(defaultTiling(spec) ==
          (d == 256 ? Tiling{128, 32, 8, 3} : Tiling{128, 64, 8, 3}));
    spec.arch = "sm_120";
    spec.kind = KernelKind::BwdPre;
    CHECK(defaultTiling(spec) == Tiling{64, 16, 4, 1});
    spec.kind = KernelKind::BwdPost;
    CHECK(defaultTiling(spec) == Tiling{64, 16, 4, 1});
  }
  // Head_dim 512, mma_sync everywhere: bwd and bwd_kv hold 32 keys in 8 warps
  // (the two-dimensional layout: 32 keys x 64 columns of dK and dV a warp)
  // and stream 32-query tiles on every arch (204 KB: the archs of 227 KB
  // only, checked below); dQ 64 rows x 32 keys in 4 warps, 32 rows in 2
  // where those (195 KB) do not fit; the elementwise kernels as at every
  // head_dim.
  spec.headDim = 512;
  for (const char *arch : {"sm_80", "sm_86", "sm_89", "sm_90", "sm_90a",
                           "sm_100", "sm_120", "", "compute_90"}) {
    CAPTURE(arch);
    spec.arch = arch;
    for (KernelKind kind : {KernelKind::Bwd, KernelKind::BwdKV}) {
      spec.kind = kind;
      CHECK(defaultTiling(spec) == Tiling{32, 32, 8, 1});
      CHECK(resolveSpec(spec).schedule == Schedule::MmaSync);
    }
    const std::string a = arch;
    const bool smaller =
        a == "sm_80" || a == "sm_86" || a == "sm_89" || a == "sm_120";
    spec.kind = KernelKind::BwdDQ;
    CHECK(defaultTiling(spec) ==
          (smaller ? Tiling{32, 32, 2, 1} : Tiling{64, 32, 4, 1}));
    CHECK(resolveSpec(spec).schedule == Schedule::MmaSync);
    for (KernelKind kind : {KernelKind::BwdPre, KernelKind::BwdPost}) {
      spec.kind = kind;
      CHECK(defaultTiling(spec) == Tiling{64, 16, 4, 1});
    }
  }
}

TEST_CASE("compiler: only the head_dim-256 and 512 mma_sync dQ kernels from "
          "sm_90 on mask every tile",
          "[compiler][backward]") {
  // compiler/lib/Spec/KernelSpec.cpp maskEveryTile: one masked loop a region
  // (two tile bodies instead of four) where a tile body is 192 mma.sync a warp;
  // not the warp-specialized dQ kernel, sm_90a's default at head_dim 256. At
  // head_dim 512 (256 columns of dQ a CTA, scores over 512) the dQ kernel is
  // mma_sync's on sm_90a too.
  auto resolved = [](KernelKind kind, int d, const char *arch) {
    KernelSpec spec;
    spec.kind = kind;
    spec.headDim = d;
    spec.arch = arch;
    return resolveSpec(spec);
  };
  for (const char *arch : {"sm_90", "sm_100", "sm_120"})
    CHECK(maskEveryTile(resolved(KernelKind::BwdDQ, 256, arch)));
  CHECK_FALSE(maskEveryTile(resolved(KernelKind::BwdDQ, 256, "sm_90a")));
  CHECK_FALSE(maskEveryTile(resolved(KernelKind::BwdDQ, 256, "sm_80")));
  CHECK_FALSE(maskEveryTile(resolved(KernelKind::BwdDQ, 256, "sm_89")));
  for (const char *arch : {"sm_90", "sm_90a", "sm_100", "sm_120"})
    CHECK(maskEveryTile(resolved(KernelKind::BwdDQ, 512, arch)));
  CHECK_FALSE(maskEveryTile(resolved(KernelKind::BwdDQ, 512, "sm_80")));
  for (int d : {64, 128})
    CHECK_FALSE(maskEveryTile(resolved(KernelKind::BwdDQ, d, "sm_90a")));
  for (KernelKind kind : {KernelKind::Fwd, KernelKind::Bwd, KernelKind::BwdKV,
                          KernelKind::BwdPre, KernelKind::BwdPost})
    for (int d : {256, 512})
      CHECK_FALSE(maskEveryTile(resolved(kind, d, "sm_90a")));
  // The tree variant takes the same kernel body.
  KernelSpec tree;
  tree.kind = KernelKind::BwdDQ;
  tree.headDim = 256;
  tree.tree = true;
  tree.arch = "sm_90";
  CHECK(maskEveryTile(resolveSpec(tree)));
}

TEST_CASE("compiler: every shipped forward spec compiles to the sm_80 schedule",
          "[compiler]") {
  for (int d : {64, 96, 128, 256, 512})
    for (DType t : {DType::BF16, DType::FP16}) {
      KernelSpec spec;
      spec.headDim = d;
      spec.dtype = t;
      spec.arch = "sm_80";
      CompileOptions options;
      options.emitCubin = false;
      CompileResult r = compile(spec, options);
      INFO("head_dim " << d << " " << toString(t) << ": " << r.error);
      REQUIRE(r.ok);
      Tiling tiling = defaultTiling(spec);
      CHECK(r.info.name == "attention_fwd_mma_sync");
      CHECK(r.info.threads == tiling.warps * 32);
      CHECK(r.info.blockM == tiling.blockM);
      // Q and K rows of head_dim, V rows of the CTA's block of O's columns
      // (at head_dim 512 each CTA computes 256 of them), padded by 8.
      const int vCols = d == 512 ? 256 : d;
      CHECK(r.info.sharedBytes ==
            (tiling.blockM + tiling.blockN) * (d + 8) * 2 +
                tiling.blockN * (vCols + 8) * 2);
      std::string mma =
          t == DType::BF16
              ? "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
              : "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32";
      CHECK(count(r.ptx, mma) > 0);
      CHECK(count(r.ptx, "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") >
            0); // V
      CHECK(count(r.ptx, "cp.async.cg.shared.global") > 0);
      CHECK(count(r.ptx, "ex2.approx.ftz.f32") > 0);
      CHECK(count(r.ptx, ".target sm_80") == 1);
      CHECK(count(r.ptx, ".maxnreg 255") == 1);
      CHECK(r.cubin.empty());
    }
}

namespace {

/// Dynamic shared memory of a backward kernel by docs/backward-abi.md and the
/// buffers Lowering/Skeletons/KVMajorSkeleton.h /
/// Lowering/Skeletons/QueryMajorSkeleton.h lay out: tiles of 2-byte elements
/// with rows padded by 8 elements.
int expectedBackwardSharedBytes(KernelKind kind, int d, const Tiling &t) {
  const int row = (d + 8) * 2;
  switch (kind) {
  case KernelKind::Bwd:
  case KernelKind::BwdKV: {
    // K, V (block_m rows); Q and dO double buffered (2 x 2 x block_n rows);
    // dSᵀ, block_m rows of block_n + 8 (bwd only: dQ), or in the
    // two-dimensional warp layout (8 warps: 128 keys and 64-query tiles, 64
    // keys at head_dim 256, or 32 at head_dim 512) P and dS, 2 x block_n
    // rows of block_m + 8; LSE and Delta of the two query tiles in flight (4
    // arrays of block_n fp32, or of one a thread when there are more threads:
    // each thread copies into a slot of its own).
    bool grid2d = t.warps == 8 && ((t.blockM == 128 && t.blockN == 64) ||
                                   (d >= 256 && t.blockM == 64) ||
                                   (d == 512 && t.blockM == 32));
    int scores = grid2d                    ? 2 * t.blockN * (t.blockM + 8) * 2
                 : kind == KernelKind::Bwd ? t.blockM * (t.blockN + 8) * 2
                                           : 0;
    return 2 * t.blockM * row + 4 * t.blockN * row + scores +
           4 * std::max(t.blockN, 32 * t.warps) * 4;
  }
  case KernelKind::BwdDQ:
    // Q, dO (block_m rows), K, V (block_n rows), whole rows at head_dim 512
    // too (each CTA computes 256 of dQ's columns).
    return (2 * t.blockM + 2 * t.blockN) * row;
  default: // bwd_pre, bwd_post: registers only
    return 0;
  }
}

/// The number of kernel parameters of docs/backward-abi.md.
int expectedBackwardParams(KernelKind kind) {
  switch (kind) {
  case KernelKind::BwdPre:
    return 9;
  case KernelKind::Bwd:
  case KernelKind::BwdKV:
    return 28;
  case KernelKind::BwdPost:
    return 15;
  case KernelKind::BwdDQ:
    return 22;
  default:
    return -1;
  }
}

} // namespace

TEST_CASE("compiler: every backward kind compiles to PTX with its ABI",
          "[compiler][backward]") {
  const std::pair<KernelKind, const char *> kinds[] = {
      {KernelKind::BwdPre, "attention_bwd_pre_mma_sync"},
      {KernelKind::Bwd, "attention_bwd_mma_sync"},
      {KernelKind::BwdPost, "attention_bwd_post_mma_sync"},
      {KernelKind::BwdKV, "attention_bwd_kv_mma_sync"},
      {KernelKind::BwdDQ, "attention_bwd_dq_mma_sync"}};
  for (auto [kind, entry] : kinds)
    for (int d : {64, 96, 128, 256, 512})
      for (DType t : {DType::BF16, DType::FP16}) {
        KernelSpec spec;
        spec.kind = kind;
        spec.headDim = d;
        spec.dtype = t;
        spec.arch = "sm_80";
        CompileOptions options;
        options.emitCubin = false;
        // The KV-major backward at head_dim 512 (32:32:8:1) needs 204 KB of
        // shared memory a CTA: sm_80 refuses it, sm_90 (mma_sync too) takes
        // it.
        if (d == 512 &&
            (kind == KernelKind::Bwd || kind == KernelKind::BwdKV)) {
          CompileResult refused = compile(spec, options);
          CHECK_FALSE(refused.ok);
          CHECK(refused.error ==
                std::string("a ") + toString(kind) +
                    " kernel of tiling 32:32:8:1 at head_dim 512 needs 208896 "
                    "bytes of shared memory, more than sm_80's 166912 (163 "
                    "KB) a CTA");
          spec.arch = "sm_90";
        }
        CompileResult r = compile(spec, options);
        INFO(toString(kind)
             << " head_dim " << d << " " << toString(t) << ": " << r.error);
        REQUIRE(r.ok);
        Tiling tiling = resolveSpec(spec).tiling;
        CHECK(r.info.name == entry);
        CHECK(r.info.threads == tiling.warps * 32);
        CHECK(r.info.blockM == tiling.blockM);
        CHECK(r.info.sharedBytes ==
              expectedBackwardSharedBytes(kind, d, tiling));
        CHECK(count(r.ptx, std::string(".visible .entry ") + entry + "(") == 1);
        // Parameters 0 .. n-1 and no more.
        int n = expectedBackwardParams(kind);
        std::string param = std::string(entry) + "_param_";
        CHECK(count(r.ptx, param + std::to_string(n - 1)) > 0);
        CHECK(count(r.ptx, param + std::to_string(n) + "\n") == 0);
        CHECK(count(r.ptx, param + std::to_string(n) + ",") == 0);
        CHECK(count(r.ptx, param + std::to_string(n) + "]") == 0);
        CHECK(count(r.ptx, ".target " + spec.arch) == 1);
        CHECK(r.cubin.empty());
        bool mma = kind == KernelKind::Bwd || kind == KernelKind::BwdKV ||
                   kind == KernelKind::BwdDQ;
        std::string mmaName =
            t == DType::BF16
                ? "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
                : "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32";
        CHECK((count(r.ptx, mmaName) > 0) == mma);
        CHECK((count(r.ptx, "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") >
               0) == mma);
        // fp32 atomics: dQ (bwd) and the split prompt dK/dV (bwd, bwd_kv); the
        // deterministic dQ kernel and the elementwise ones have none.
        bool atomics = kind == KernelKind::Bwd || kind == KernelKind::BwdKV;
        CHECK((count(r.ptx, ".global.add.f32") > 0) == atomics);
      }
}

TEST_CASE("compiler: backward KernelInfo follows an explicit tiling",
          "[compiler][backward]") {
  KernelSpec spec;
  spec.kind = KernelKind::Bwd;
  spec.headDim = 64;
  spec.arch = "sm_80";
  spec.tiling = {64, 32, 4, 1};
  CompileResult r = compile(spec, {false, "", ""});
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(r.info.name == "attention_bwd_mma_sync");
  CHECK(r.info.threads == 128);
  CHECK(r.info.blockM == 64);
  // 2 * 64 * (64 + 8) * 2 + 4 * 32 * (64 + 8) * 2 + 64 * (32 + 8) * 2, then
  // LSE and Delta of two tiles, a slot for each of the 128 threads: 4 * 128 * 4
  CHECK(r.info.sharedBytes == 18432 + 18432 + 5120 + 2048);

  spec.kind = KernelKind::BwdDQ;
  spec.tiling = {128, 64, 8, 1};
  r = compile(spec, {false, "", ""});
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(r.info.name == "attention_bwd_dq_mma_sync");
  CHECK(r.info.threads == 256);
  CHECK(r.info.blockM == 128);
  // (2 * 128 + 2 * 64) * (64 + 8) * 2
  CHECK(r.info.sharedBytes == 55296);
}

TEST_CASE("compiler: ptxas turns the PTX into a cubin without spills",
          "[compiler]") {
  if (ptxasPath({}).empty())
    return; // the lit suite's REQUIRES: ptxas tests cover this where ptxas
            // exists
  KernelSpec spec; // the Qwen3-8B shape: head_dim 128, 32:8 heads, bf16, sm_90a
  CompileResult r = compile(spec);
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(r.cubin.size() > 1000);
  CHECK(count(r.ptxasLog, "0 bytes spill stores, 0 bytes spill loads") == 1);
  CHECK(r.compileMs > 0);
}

TEST_CASE("compiler: a bad spec fails with the field and value", "[compiler]") {
  KernelSpec spec;
  spec.headDim = 80;
  CompileResult r = compile(spec, {false, "", ""});
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("head_dim must be 64, 96, 128, 256 or 512, got 80") !=
        std::string::npos);

  spec.headDim = 128;
  spec.numQHeads = 6;
  spec.numKVHeads = 4;
  r = compile(spec, {false, "", ""});
  CHECK_FALSE(r.ok);
  CHECK(
      r.error.find("num_q_heads (6) must be a multiple of num_kv_heads (4)") !=
      std::string::npos);

  spec.numQHeads = 32;
  spec.numKVHeads = 8;
  spec.tiling = {128, 64, 4, 2}; // 32 rows of 128 fp32 a warp leave no room
  spec.tiling.blockM = 256;
  r = compile(spec, {false, "", ""});
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("accumulator registers") != std::string::npos);

  // The KV-major backward holds two accumulators (dK, dV): a 128-key block in
  // 8 warps at head_dim 256 (head_dim 128's default) needs 2 * 128 * 256 /
  // 256 = 256 registers a thread.
  spec.kind = KernelKind::Bwd;
  spec.headDim = 256;
  spec.tiling = {128, 64, 8, 1};
  r = compile(spec, {false, "", ""});
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("tiling gives each thread 256 accumulator registers") !=
        std::string::npos);
}

TEST_CASE("compiler: dumps hold every stage", "[compiler]") {
  auto dir = std::filesystem::temp_directory_path() /
             ("dualkv-dump-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  KernelSpec spec;
  spec.headDim = 64;
  spec.arch = "sm_80";
  CompileOptions options;
  options.emitCubin = false;
  options.dumpDir = dir.string();
  CompileResult r = compile(spec, options);
  REQUIRE(r.ok);
  CHECK(readFile(dir / "template.mlir") == kernelTemplate(KernelKind::Fwd));
  std::string passes = readFile(dir / "passes.mlir");
  for (const char *pass : {"dualkv-bind-spec", "dualkv-tile-regions",
                           "dualkv-lower-to-nvgpu", "convert-gpu-to-nvvm"})
    CHECK(count(passes, pass) > 0);
  CHECK(count(readFile(dir / "kernel.ll"),
              "define ptx_kernel void @attention_fwd_mma_sync(") == 1);
  CHECK(readFile(dir / "kernel.ptx") == r.ptx);
  std::filesystem::remove_all(dir);
}

TEST_CASE("compiler: a dump it cannot write is one warning naming the path",
          "[compiler]") {
  TempFolder tmp;
  KernelSpec spec;
  spec.headDim = 64;
  spec.arch = "sm_80";
  CompileOptions options;
  options.emitCubin = false;

  // A file where a folder of the path goes: nothing can be created below it
  // (DUALKV_DUMP_IR=/etc/passwd/x). The compile succeeds, with one warning.
  const auto file = tmp.path / "file";
  std::ofstream(file) << "x";
  options.dumpDir = (file / "dump").string();
  CompileResult r = compile(spec, options);
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK_FALSE(r.ptx.empty());
  REQUIRE(r.warnings.size() == 1);
  CHECK(r.warnings[0] == "cannot write the IR dump '" + options.dumpDir +
                             "': Not a directory; the compile goes on "
                             "without it");
  CHECK(readFile(file) == "x");

  // A folder where one of the files goes: the files before it are written,
  // then one warning names that file, and nothing after it is written.
  const auto dir = tmp.path / "partial";
  std::filesystem::create_directories(dir / "kernel.ll");
  options.dumpDir = dir.string();
  r = compile(spec, options);
  REQUIRE(r.ok);
  REQUIRE(r.warnings.size() == 1);
  CHECK(r.warnings[0] == "cannot write the IR dump '" +
                             (dir / "kernel.ll").string() +
                             "': Is a directory; the compile goes on "
                             "without it");
  CHECK(readFile(dir / "template.mlir") == kernelTemplate(KernelKind::Fwd));
  CHECK_FALSE(std::filesystem::exists(dir / "kernel.ptx"));

  // A dump that works has no warning.
  options.dumpDir = (tmp.path / "good").string();
  r = compile(spec, options);
  REQUIRE(r.ok);
  CHECK(r.warnings.empty());
  CHECK(readFile(tmp.path / "good" / "kernel.ptx") == r.ptx);
}

TEST_CASE("compiler: DUALKV_DUMP_IR gives each kernel its own folder",
          "[compiler]") {
  // The runtime's compiles (compileOnce) of two kernels of one process: each
  // dumps into <DUALKV_DUMP_IR>/<kernel name>, so neither overwrites the
  // other's four files (they all went to the same four).
  TempFolder tmp;
  ScopedVariable dumpIR("DUALKV_DUMP_IR", tmp.path.string());
  ScopedVariable ptxas("DUALKV_PTXAS", (tmp.path / "no-ptxas").string());
  KernelSpec fwd;
  fwd.headDim = 64;
  fwd.numQHeads = fwd.numKVHeads = 4;
  fwd.arch = "sm_80";
  KernelSpec dq = fwd;
  dq.kind = KernelKind::BwdDQ;
  // A fingerprint of this test's own, so that no other test's compile of
  // these keys is joined instead of compiled here.
  const std::string fingerprint = "dump-test-" + std::to_string(::getpid());
  std::map<std::string, std::string> ptxOf;
  for (KernelSpec spec : {fwd, dq}) {
    spec = resolveSpec(spec);
    CacheKey key = CacheKey::fromSpec(spec, fingerprint);
    // No ptxas (DUALKV_PTXAS names none): the compile fails after the PTX,
    // which the dump holds all the same.
    llvm::Expected<CacheEntry> entry =
        compileOnce(spec, key, key.hash(), /*disk=*/nullptr);
    CHECK_FALSE(static_cast<bool>(entry));
    llvm::consumeError(entry.takeError());
    ptxOf[toString(spec.kind)] = compile(spec, {false, "", ""}).ptx;
  }
  const auto fwdDir =
      tmp.path / "dualkv_fwd_d64_h4x4_bf16_sm_80_m128n32w4s2_mma_sync";
  const auto dqDir =
      tmp.path / "dualkv_bwd_dq_d64_h4x4_bf16_sm_80_m64n32w4s1_mma_sync";
  size_t folders = 0;
  for (const auto &e : std::filesystem::directory_iterator(tmp.path)) {
    CAPTURE(e.path().string());
    CHECK(e.is_directory());
    ++folders;
  }
  CHECK(folders == 2);
  REQUIRE(std::filesystem::exists(fwdDir / "kernel.ptx"));
  REQUIRE(std::filesystem::exists(dqDir / "kernel.ptx"));
  CHECK(readFile(fwdDir / "kernel.ptx") == ptxOf["fwd"]);
  CHECK(readFile(dqDir / "kernel.ptx") == ptxOf["bwd_dq"]);
  CHECK(readFile(fwdDir / "template.mlir") == kernelTemplate(KernelKind::Fwd));
  CHECK(readFile(dqDir / "template.mlir") == kernelTemplate(KernelKind::BwdDQ));
}

TEST_CASE("compiler: an empty DUALKV_PTXAS or CUDA_HOME is unset",
          "[compiler]") {
  TempFolder tmp;
  std::filesystem::create_directories(tmp.path / "cuda" / "bin");
  const auto fake = tmp.path / "cuda" / "bin" / "ptxas";
  std::ofstream(fake) << "#!/bin/sh\nexit 0\n";
  std::filesystem::permissions(fake, std::filesystem::perms::owner_all);
  ScopedVariable cudaHome("CUDA_HOME", (tmp.path / "cuda").string());
  {
    // "" meant "no ptxas": kernels silently shipped without cubins.
    ScopedVariable ptxas("DUALKV_PTXAS", std::string());
    CHECK(ptxasPath({}) == fake.string());
  }
  ScopedVariable ptxas("DUALKV_PTXAS", std::nullopt);
  CHECK(ptxasPath({}) == fake.string());
  {
    ScopedVariable emptyHome("CUDA_HOME", std::string());
    ScopedVariable cudaPath("CUDA_PATH", (tmp.path / "cuda").string());
    CHECK(ptxasPath({}) == fake.string());
  }
}

TEST_CASE("compiler: the fingerprint is stable and covers the templates",
          "[compiler]") {
  std::string f = compilerFingerprint();
  CHECK(f.size() == 16);
  CHECK(f.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(compilerFingerprint() == f);
  CHECK(kernelTemplate(KernelKind::Fwd).find("dualkv.kv_loop <shared>") !=
        std::string::npos);
}

//===----------------------------------------------------------------------===//
// Archs and schedules
//===----------------------------------------------------------------------===//

TEST_CASE("compiler: archs are parsed once into the supported set",
          "[compiler][schedule]") {
  const std::pair<const char *, int> supported[] = {
      {"sm_80", 81},  {"sm_86", 81},  {"sm_87", 81},  {"sm_89", 81},
      {"sm_90", 81},  {"sm_90a", 81}, {"sm_100", 86}, {"sm_103", 88},
      {"sm_110", 90}, {"sm_120", 87}, {"sm_121", 88}};
  for (auto [text, ptx] : supported) {
    CAPTURE(text);
    std::optional<Arch> arch = Arch::parse(text);
    REQUIRE(arch);
    CHECK(arch->str() == text);
    CHECK(arch->ptxVersion() == ptx);
    CHECK(arch->hasWgmma() == (std::string(text) == "sm_90a"));
  }
  CHECK(Arch::parse("sm_90a")->number == 90);
  CHECK(Arch::parse("sm_90a")->archSpecific);
  CHECK_FALSE(Arch::parse("sm_90")->archSpecific);
  for (const char *text : {"sm_75", "sm_70", "sm_90ab", "sm_", "", "SM_80",
                           "compute_90", "gfx90a", "sm_100a", " sm_80"}) {
    CAPTURE(text);
    std::string error;
    CHECK_FALSE(Arch::parse(text, &error));
    CHECK(error == "arch '" + std::string(text) +
                       "' is not supported; supported: " + supportedArchs());
  }
  CHECK(supportedArchs() == "sm_80, sm_86, sm_87, sm_89, sm_90, sm_90a, "
                            "sm_100, sm_103, sm_110, sm_120, sm_121");
}

TEST_CASE("compiler: schedules are spelled one way", "[compiler][schedule]") {
  for (Schedule s : {Schedule::Auto, Schedule::MmaSync, Schedule::Wgmma,
                     Schedule::WarpSpecialized})
    CHECK(parseSchedule(toString(s)) == s);
  CHECK(std::string(toString(Schedule::MmaSync)) == "mma_sync");
  CHECK(std::string(toString(Schedule::WarpSpecialized)) == "warp_specialized");
  CHECK_FALSE(parseSchedule("wgmma "));
  CHECK_FALSE(parseSchedule("MMA_SYNC"));
}

namespace {

KernelSpec specOf(KernelKind kind, const char *arch, int headDim,
                  Tiling tiling = {}, Schedule schedule = Schedule::Auto) {
  KernelSpec spec;
  spec.kind = kind;
  spec.arch = arch;
  spec.headDim = headDim;
  spec.tiling = tiling;
  spec.schedule = schedule;
  return spec;
}

} // namespace

TEST_CASE("compiler: resolveSpec chooses the schedule by today's rules",
          "[compiler][schedule]") {
  using K = KernelKind;
  const Schedule W = Schedule::Wgmma, M = Schedule::MmaSync,
                 S = Schedule::WarpSpecialized;
  struct Case {
    KernelSpec spec;
    Schedule expected;
  };
  const Case cases[] = {
      // The forward on sm_90a: warp-specialized at head_dim 64, 128 and 256
      // with 128 query rows in 8 consumer warps, 2 stages and key tiles that
      // divide them; else wgmma at head_dim 128 with whole warpgroups of one
      // m16 block a warp and block_n a multiple of 16 up to 256.
      {specOf(K::Fwd, "sm_90a", 128), S},
      {specOf(K::Fwd, "sm_90a", 64), S},
      {specOf(K::Fwd, "sm_90a", 256), S},
      {specOf(K::Fwd, "sm_90a", 128, {128, 64, 8, 2}), W}, // S by name
      {specOf(K::Fwd, "sm_90a", 128, {128, 64, 8, 2}, S), S},
      {specOf(K::Fwd, "sm_90a", 256, {128, 128, 8, 2}), M}, // > 227 KB
      {specOf(K::Fwd, "sm_90a", 128, {128, 128, 8, 1}), W}, // one stage
      {specOf(K::Fwd, "sm_90a", 128, {64, 64, 4, 1}), W},
      {specOf(K::Fwd, "sm_90a", 128, {256, 256, 16, 2}), W},
      {specOf(K::Fwd, "sm_90a", 128, {128, 32, 4, 2}), M}, // 2 m16 a warp
      {specOf(K::Fwd, "sm_90a", 128, {32, 32, 2, 1}), M},  // half a group
      {specOf(K::Fwd, "sm_90a", 64, {128, 32, 4, 2}), M},
      {specOf(K::Fwd, "sm_90", 128), M},
      {specOf(K::Fwd, "sm_80", 128), M},
      {specOf(K::Fwd, "sm_100", 128), M},
      {specOf(K::Fwd, "sm_120", 128), M},
      // The KV-major backward: warp-specialized at 128:64:8 on sm_90a,
      // head_dim 64 and 128 (wgmma by name at 128).
      {specOf(K::Bwd, "sm_90a", 128), S},
      {specOf(K::BwdKV, "sm_90a", 128), S},
      {specOf(K::Bwd, "sm_90a", 128, {}, W), W},
      {specOf(K::BwdKV, "sm_90a", 128, {128, 64, 8, 1}, W), W},
      {specOf(K::Bwd, "sm_90a", 64), S},
      {specOf(K::BwdKV, "sm_90a", 64), S},
      {specOf(K::Bwd, "sm_90a", 64, {}, M), M}, // by name
      {specOf(K::Bwd, "sm_90a", 256), M},
      {specOf(K::Bwd, "sm_90a", 256, {}, S), S},
      {specOf(K::Bwd, "sm_90a", 256, {64, 64, 8, 2}), S},
      {specOf(K::BwdKV, "sm_90a", 256), S},
      {specOf(K::BwdKV, "sm_90a", 256, {64, 64, 8, 1}), S},
      {specOf(K::BwdKV, "sm_90a", 256, {64, 32, 8, 1}), M},
      {specOf(K::Bwd, "sm_90", 256), M},
      {specOf(K::Bwd, "sm_90a", 128, {128, 32, 8, 1}), M},
      {specOf(K::BwdKV, "sm_90a", 128, {64, 64, 4, 1}), M},
      {specOf(K::Bwd, "sm_80", 128), M},
      {specOf(K::Bwd, "sm_90", 128), M},
      // The dQ kernel: warp-specialized on sm_90a at head_dim 64 and 128 by
      // default, by name or by a three-stage ring (which only it has); wgmma
      // at 128:64:8 with fewer stages at head_dim 128 (or by name), mma.sync
      // at other tilings and elsewhere.
      {specOf(K::BwdDQ, "sm_90a", 128), S},
      {specOf(K::BwdDQ, "sm_90a", 64), S},
      {specOf(K::BwdDQ, "sm_90a", 128, {}, W), W},
      {specOf(K::BwdDQ, "sm_90a", 128, {128, 64, 8, 1}), W},
      {specOf(K::BwdDQ, "sm_90a", 64, {128, 64, 8, 1}), M},
      {specOf(K::BwdDQ, "sm_90a", 64, {}, M), M},
      // Pinned fields that disagree with 128:64:8:3 keep the other defaults
      // (one stage), as a whole backward set pinned to 64:32:4 needs.
      {specOf(K::BwdDQ, "sm_90a", 128, {64, 32, 4, 0}), M},
      {specOf(K::BwdDQ, "sm_90a", 64, {0, 32, 0, 0}), M},
      {specOf(K::BwdDQ, "sm_90a", 128, {}, S), S},
      {specOf(K::BwdDQ, "sm_90a", 64, {}, S), S},
      {specOf(K::BwdDQ, "sm_90a", 128, {128, 64, 8, 3}), S},
      {specOf(K::BwdDQ, "sm_90a", 64, {128, 64, 8, 3}), S},
      {specOf(K::BwdDQ, "sm_90a", 128, {128, 32, 8, 2}, S), S},
      {specOf(K::BwdDQ, "sm_90a", 128, {128, 64, 8, 2}), W},
      {specOf(K::BwdDQ, "sm_90a", 128, {64, 32, 4, 1}), M},
      {specOf(K::BwdDQ, "sm_90a", 128, {64, 32, 4, 1}, W), W},
      {specOf(K::BwdDQ, "sm_90a", 64, {64, 32, 4, 1}), M},
      {specOf(K::BwdDQ, "sm_90a", 256), S},
      {specOf(K::BwdDQ, "sm_90a", 256, {64, 32, 4, 1}), M},
      {specOf(K::BwdDQ, "sm_90", 128), M},
      {specOf(K::BwdDQ, "sm_80", 128), M},
      // Head_dim 512: the forward warp-specialized on sm_90a at 128:32:8:2
      // (mma_sync at other tilings); the backward mma_sync there too (the
      // warp-specialized backward stops at head_dim 256, the warpgroup one
      // has 128 only).
      {specOf(K::Fwd, "sm_90a", 512), S},
      {specOf(K::Fwd, "sm_90a", 512, {128, 16, 8, 2}), M},
      {specOf(K::Fwd, "sm_90a", 512, {128, 16, 8, 2}, S), S},
      {specOf(K::Fwd, "sm_90", 512), M},
      {specOf(K::Bwd, "sm_90a", 512), M},
      {specOf(K::BwdKV, "sm_90a", 512), M},
      {specOf(K::BwdDQ, "sm_90a", 512), M},
      // Never wgmma: the elementwise kernels.
      {specOf(K::BwdPre, "sm_90a", 128), M},
      {specOf(K::BwdPost, "sm_90a", 128), M},
      // An explicit schedule stays; mma_sync takes its own default tiling.
      {specOf(K::Fwd, "sm_90a", 128, {}, M), M},
  };
  for (const Case &c : cases) {
    KernelSpec r = resolveSpec(c.spec);
    CAPTURE(toString(c.spec.kind), c.spec.arch, c.spec.headDim, r.tiling.blockM,
            r.tiling.blockN, r.tiling.warps);
    CHECK(r.schedule == c.expected);
    CHECK(checkSpec(r).empty());
    // Resolving twice changes nothing: the choice is made once.
    CHECK(resolveSpec(r).schedule == r.schedule);
  }
  CHECK(resolveSpec(specOf(K::Fwd, "sm_90a", 128, {}, M)).tiling ==
        Tiling{128, 32, 4, 2});
  CHECK(resolveSpec(specOf(K::Fwd, "sm_90a", 128, {}, W)).tiling ==
        Tiling{128, 128, 8, 2});
}

TEST_CASE("compiler: an explicit schedule the spec cannot use is an error",
          "[compiler][schedule]") {
  using K = KernelKind;
  const Schedule W = Schedule::Wgmma, S = Schedule::WarpSpecialized;
  std::vector<std::pair<KernelSpec, std::string>> cases = {
      {specOf(K::Fwd, "sm_80", 128, {}, W),
       "the wgmma schedule cannot compute this fwd kernel: it needs sm_90a, "
       "not sm_80"},
      {specOf(K::Fwd, "sm_90", 128, {}, W),
       "the wgmma schedule cannot compute this fwd kernel: it needs sm_90a, "
       "not sm_90"},
      {specOf(K::Fwd, "sm_90a", 64, {}, W),
       "the wgmma schedule cannot compute this fwd kernel: it has head_dim "
       "128 only, not 64"},
      {specOf(K::BwdDQ, "sm_90a", 512, {}, W),
       "the wgmma schedule cannot compute this bwd_dq kernel: it has head_dim "
       "128 only, not 512"},
      {specOf(K::Fwd, "sm_90a", 128, {128, 32, 4, 2}, W),
       "the wgmma schedule cannot compute this fwd kernel: its forward needs "
       "block_m = 16 x warps, warps a multiple of 4 and block_n a multiple "
       "of 16 up to 256"},
      {specOf(K::BwdKV, "sm_90a", 128, {64, 64, 4, 1}, W),
       "the wgmma schedule cannot compute this bwd_kv kernel: its backward "
       "needs block_m 128, block_n 64 and 8 warps"},
      {specOf(K::BwdDQ, "sm_90a", 128, {64, 32, 8, 1}, W),
       "the wgmma schedule cannot compute this bwd_dq kernel: its dQ kernel "
       "needs block_m = 16 x warps, warps a multiple of 4 and block_n a "
       "multiple of 16 up to 256"},
      {specOf(K::BwdPre, "sm_90a", 128, {}, W),
       "the wgmma schedule cannot compute this bwd_pre kernel: it has no "
       "bwd_pre kernel"},
      {specOf(K::Fwd, "sm_80", 128, {}, S),
       "the warp_specialized schedule cannot compute this fwd kernel: it "
       "needs sm_90a, not sm_80"},
      {specOf(K::Fwd, "sm_90a", 128, {128, 32, 4, 2}, S),
       "the warp_specialized schedule cannot compute this fwd kernel: it "
       "needs block_m 128, 8 (consumer) warps, 2 stages and block_n 16, 32, "
       "64 or 128"},
      {specOf(K::Fwd, "sm_90a", 256, {128, 128, 8, 2}, S),
       "the warp_specialized schedule cannot compute this fwd kernel: its "
       "tiles exceed 227 KB of shared memory at block_n 128"},
      {specOf(K::Fwd, "sm_90a", 512, {128, 64, 8, 2}, S),
       "the warp_specialized schedule cannot compute this fwd kernel: its "
       "tiles exceed 227 KB of shared memory at block_n 64"},
      {specOf(K::BwdKV, "sm_90a", 512, {64, 64, 8, 2}, S),
       "the warp_specialized schedule cannot compute this bwd_kv kernel: its "
       "bwd_kv kernel stops at head_dim 256, not 512"},
      {specOf(K::BwdDQ, "sm_90a", 512, {}, S),
       "the warp_specialized schedule cannot compute this bwd_dq kernel: its "
       "bwd_dq kernel stops at head_dim 256, not 512"},
      {specOf(K::BwdDQ, "sm_90a", 256, {128, 32, 8, 4}, S),
       "the warp_specialized schedule cannot compute this bwd_dq kernel: its "
       "tiles exceed 227 KB of shared memory at block_n 32"},
      {specOf(K::BwdDQ, "sm_90a", 128, {128, 128, 8, 3}, S),
       "the warp_specialized schedule cannot compute this bwd_dq kernel: its "
       "dQ kernel needs block_m 128, 8 (consumer) warps, 2 to 4 stages and "
       "block_n 16, 32 or 64 (or 128 at head_dim 64)"},
      {specOf(K::BwdDQ, "sm_90a", 128, {128, 64, 8, 3}, W),
       "stages 3 and 4 are the warp-specialized dQ kernel's only; this bwd_dq "
       "kernel takes 1 or 2"},
      {specOf(K::Bwd, "sm_90a", 256, {64, 32, 8, 1}, S),
       "the warp_specialized schedule cannot compute this bwd kernel: its "
       "backward at head_dim 256 needs block_m 64, block_n 64 and 8 "
       "(consumer) warps"},
      {specOf(K::BwdKV, "sm_90a", 128, {64, 64, 4, 1}, S),
       "the warp_specialized schedule cannot compute this bwd_kv kernel: its "
       "backward needs block_m 128, block_n 64 (128 for bwd_kv at head_dim "
       "64) and 8 (consumer) warps"},
      {specOf(K::Bwd, "sm_80", 128, {}, S),
       "the warp_specialized schedule cannot compute this bwd kernel: it "
       "needs sm_90a, not sm_80"},
      {specOf(K::Fwd, "sm_75", 128),
       "arch 'sm_75' is not supported; supported: " + supportedArchs()},
  };
  // A tree's dQ kernel of 3 stages on an arch without the warp-specialized
  // one.
  KernelSpec treeDq = specOf(K::BwdDQ, "sm_80", 128, {128, 64, 8, 3});
  treeDq.tree = true;
  cases.push_back({treeDq, "stages 3 and 4 are the warp-specialized dQ "
                           "kernel's only; this bwd_dq kernel takes 1 or 2"});
  for (const auto &[spec, why] : cases) {
    CAPTURE(why);
    CHECK(checkSpec(spec) == why);
    // compile() reports the same, and never reaches LLVM with it.
    CompileResult r = compile(spec, {false, "", ""});
    CHECK_FALSE(r.ok);
    CHECK(r.error == why);
    CHECK(r.ptx.empty());
  }
}

TEST_CASE("compiler: checkSpec holds every kernel to CUDA's launch limits",
          "[compiler][schedule]") {
  using K = KernelKind;
  // The opt-in shared memory a CTA, per arch (the CUDA C++ Programming Guide).
  const std::pair<const char *, int64_t> limits[] = {
      {"sm_80", 166912},  {"sm_86", 101376},  {"sm_87", 166912},
      {"sm_89", 101376},  {"sm_90", 232448},  {"sm_90a", 232448},
      {"sm_100", 232448}, {"sm_103", 232448}, {"sm_110", 232448},
      {"sm_120", 101376}, {"sm_121", 101376}};
  for (const auto &[arch, bytes] : limits) {
    CAPTURE(arch);
    CHECK(maxSharedBytes(*Arch::parse(arch)) == bytes);
  }
  // Every default kernel fits its arch but the KV-major backward at head_dim
  // 256 on the 99 KB archs, which no tiling fits, and the backward at
  // head_dim 512 below 227 KB: its KV-major kernels (32:32:8:1, 204 KB) on
  // the archs of 163 KB and 99 KB, its dQ kernel (32:32:2:1, 130 KB) on the
  // 99 KB ones.
  for (const auto &[arch, bytes] : limits)
    for (K kind : {K::Fwd, K::BwdPre, K::Bwd, K::BwdPost, K::BwdKV, K::BwdDQ})
      for (int d : {64, 96, 128, 256, 512}) {
        KernelSpec r = resolveSpec(specOf(kind, arch, d));
        CAPTURE(arch, toString(kind), d);
        bool kvMajor = kind == K::Bwd || kind == K::BwdKV;
        bool unfit = (kvMajor && d == 256 && bytes == 101376) ||
                     (kvMajor && d == 512 && bytes < 232448) ||
                     (kind == K::BwdDQ && d == 512 && bytes == 101376);
        if (unfit) {
          CHECK(checkSpec(r).find("bytes of shared memory, more than") !=
                std::string::npos);
          continue;
        }
        CHECK(checkSpec(r).empty());
        CHECK(sharedBytes(r) <= bytes);
      }
  // The KV-major backward takes 64:32:4 there only where its usual default
  // does not fit.
  auto tiling = [](K kind, const char *arch, int d) {
    return resolveSpec(specOf(kind, arch, d)).tiling;
  };
  CHECK(tiling(K::Bwd, "sm_86", 128) == Tiling{64, 32, 4, 1});
  CHECK(tiling(K::BwdKV, "sm_89", 128) == Tiling{64, 32, 4, 1});
  CHECK(tiling(K::Bwd, "sm_120", 64) == Tiling{64, 32, 4, 1});
  CHECK(tiling(K::BwdKV, "sm_121", 64) == Tiling{64, 32, 4, 1});
  CHECK(tiling(K::Bwd, "sm_86", 64) == Tiling{128, 32, 8, 1});
  CHECK(tiling(K::BwdKV, "sm_86", 64) == Tiling{64, 64, 4, 1});
  CHECK(tiling(K::Bwd, "sm_80", 128) == Tiling{128, 32, 8, 1});
  CHECK(tiling(K::Bwd, "sm_90", 64) == Tiling{128, 64, 8, 1});
  // The mma.sync forward's layout: (128 + 2 * 32) rows of (128 + 8) * 2 bytes.
  CHECK(sharedBytes(resolveSpec(specOf(K::Fwd, "sm_80", 128))) == 52224);
  CHECK(checkSpec(specOf(K::Fwd, "sm_80", 128, {256, 256, 16, 2})) ==
        "a fwd kernel of tiling 256:256:16:2 at head_dim 128 needs 208896 "
        "bytes of shared memory, more than sm_80's 166912 (163 KB) a CTA");
  CHECK(checkSpec(specOf(K::Fwd, "sm_90", 128, {256, 256, 16, 2})).empty());

  // Heads: z for fwd and bwd_dq, y for the backward's others (bwd_post holds
  // the query and the KV heads), 65535 at most.
  auto heads = [](K kind, int hq, int hkv) {
    KernelSpec spec = specOf(kind, "sm_80", 128);
    spec.numQHeads = hq;
    spec.numKVHeads = hkv;
    return checkSpec(spec);
  };
  CHECK(heads(K::Fwd, 65535, 1).empty());
  CHECK(heads(K::Fwd, 65536, 1) ==
        "num_q_heads = 65536 exceeds 65535, the limit of gridDim.z, along "
        "which a fwd kernel launches its heads");
  CHECK(heads(K::BwdDQ, 65536, 2).find("gridDim.z") != std::string::npos);
  CHECK(heads(K::BwdPre, 65536, 1).find("gridDim.y") != std::string::npos);
  CHECK(heads(K::Bwd, 65536, 65536) ==
        "num_kv_heads = 65536 exceeds 65535, the limit of gridDim.y, along "
        "which a bwd kernel launches its heads");
  CHECK(heads(K::Bwd, 65536, 1).empty());
  CHECK(heads(K::BwdPost, 65535, 5) ==
        "num_q_heads + num_kv_heads = 65535 + 5 exceeds 65535, the limit of "
        "gridDim.y, along which a bwd_post kernel launches its heads");
  CHECK(heads(K::BwdPost, 65530, 5).empty());
  // What no kernel takes is refused by the same check, not by the pipeline.
  CHECK(heads(K::Fwd, 12, 8) ==
        "num_q_heads (12) must be a multiple of num_kv_heads (8)");
  KernelSpec d80 = specOf(K::Fwd, "sm_80", 80);
  CHECK(checkSpec(d80) == "head_dim must be 64, 96, 128, 256 or 512, got 80");
  CHECK(checkSpec(specOf(K::Fwd, "sm_90a", 128, {128, 8, 8, 2})) ==
        "block_n must be a power of two in [16, 256], got 8");
  CHECK(checkSpec(specOf(K::Fwd, "sm_80", 128, {1 << 30, 32, 4, 2})) ==
        "block_m must be a power of two in [16, 256], got 1073741824");
}

TEST_CASE("compiler: archs LLVM aborted on compile or are refused",
          "[compiler][schedule]") {
  // sm_75 used to abort the process in instruction selection (cp.async) and
  // sm_100 on "PTX version 8.1 does not support target 'sm_100'".
  CompileResult old = compile(specOf(KernelKind::Fwd, "sm_75", 64));
  CHECK_FALSE(old.ok);
  CHECK(old.error.find("supported: sm_80") != std::string::npos);
  for (const char *arch : {"sm_100", "sm_120"}) {
    CAPTURE(arch);
    CompileResult r =
        compile(specOf(KernelKind::Fwd, arch, 64), {false, "", ""});
    INFO(r.error);
    REQUIRE(r.ok);
    CHECK(r.info.name == "attention_fwd_mma_sync");
    CHECK(count(r.ptx, std::string(".target ") + arch + "\n") == 1);
    CHECK(count(r.ptx, std::string(".version ") +
                           (std::string(arch) == "sm_100" ? "8.6" : "8.7")) ==
          1);
  }
  // The warpgroup schedules name their entry points.
  CompileResult ws =
      compile(specOf(KernelKind::Fwd, "sm_90a", 128), {false, "", ""});
  REQUIRE(ws.ok);
  CHECK(ws.info.name == "attention_fwd_warp_specialized");
  CHECK(ws.info.threads == 384);
  CHECK(count(ws.ptx, "cp.async.bulk.tensor") > 0);
  CompileResult wg =
      compile(specOf(KernelKind::Fwd, "sm_90a", 128, {}, Schedule::Wgmma),
              {false, "", ""});
  REQUIRE(wg.ok);
  CHECK(wg.info.name == "attention_fwd_wgmma");
  CHECK(wg.info.threads == 256);
  CHECK(count(wg.ptx, "wgmma.mma_async") > 0);
}
