// Tests of the schedule records (dualkv/Compiler/Schedule.h): for every kind,
// arch, head_dim, tree-ness, schedule and a set of pinned tilings, the spec
// functions that read the records (resolveSpec, checkSpec, sharedBytes,
// threadsPerBlock, maskEveryTile, kernelParams) give what the rules written
// down in KernelSpec.h, KernelAbi.h and docs/architecture.md say, computed
// here from those rules; and each record's launch geometry agrees with its
// parameter tables.
#include "dualkv/Compiler/Schedule.h"
#include "dualkv/Compiler/KernelAbi.h"
#include "dualkv/Compiler/KernelSpec.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <iterator>
#include <set>
#include <string>
#include <vector>

using namespace dualkv;

namespace {

constexpr KernelKind kKinds[] = {KernelKind::Fwd,   KernelKind::BwdPre,
                                 KernelKind::Bwd,   KernelKind::BwdPost,
                                 KernelKind::BwdKV, KernelKind::BwdDQ};
constexpr const char *kArchs[] = {"sm_80",  "sm_86",  "sm_87",  "sm_89",
                                  "sm_90",  "sm_90a", "sm_100", "sm_103",
                                  "sm_110", "sm_120", "sm_121", "sm_70"};
constexpr int kHeadDims[] = {64, 96, 128, 256, 512};
constexpr Schedule kSchedules[] = {Schedule::Auto, Schedule::MmaSync,
                                   Schedule::Wgmma, Schedule::WarpSpecialized};
/// Open, pinned and partly pinned tilings, each schedule's own among them.
const Tiling kTilings[] = {
    {0, 0, 0, 0},     {64, 32, 4, 1},  {128, 64, 8, 3}, {128, 64, 8, 0},
    {128, 128, 8, 2}, {128, 32, 4, 2}, {64, 64, 4, 1},  {128, 64, 8, 2},
    {0, 0, 0, 3},     {128, 64, 8, 1}, {128, 32, 8, 1}, {64, 32, 8, 1},
    {0, 64, 0, 0},    {128, 16, 8, 2}, {128, 32, 8, 4}, {128, 256, 8, 2},
    {128, 64, 4, 2},  {64, 64, 8, 2},  {64, 64, 8, 1},  {128, 32, 8, 3}};

bool queryMajor(KernelKind k) {
  return k == KernelKind::Fwd || k == KernelKind::BwdDQ;
}
bool kvMajor(KernelKind k) {
  return k == KernelKind::Bwd || k == KernelKind::BwdKV;
}
/// The blocks of output columns a query-major kernel computes in CTAs of
/// their own (KernelSpec.h's outputColumnBlocks): 256 columns of O or dQ a
/// CTA at head_dim 512.
int64_t columnBlocks(int64_t headDim) {
  return headDim > 256 ? headDim / 256 : 1;
}
int archNumber(const std::string &a) {
  for (const char *known : kArchs)
    if (a == known && a != "sm_70")
      return std::stoi(a.substr(3));
  return 0;
}
/// KernelSpec.h's table of opt-in shared memory a CTA.
int64_t maxSmem(int n) {
  if (n == 80 || n == 87)
    return 163 * 1024;
  if (n == 86 || n == 89 || n == 120 || n == 121)
    return 99 * 1024;
  return n ? 227 * 1024 : 0;
}

/// Shared memory as the emitters lay it out (KernelSpec.h,
/// Lowering/Skeletons/QueryMajorSkeleton.h,
/// Lowering/Skeletons/KVMajorSkeleton.h, Lowering/Products/WgmmaKVProducts.h,
/// Schedules/WarpSpecialized/).
int64_t refSharedBytes(const KernelSpec &r) {
  const int64_t bm = r.tiling.blockM, bn = r.tiling.blockN, d = r.headDim,
                w = r.tiling.warps, st = r.tiling.stages;
  const bool mma =
      r.schedule == Schedule::MmaSync || r.schedule == Schedule::Auto;
  const bool ws = r.schedule == Schedule::WarpSpecialized;
  if (!queryMajor(r.kind) && !kvMajor(r.kind))
    return 0;
  if (queryMajor(r.kind)) {
    const int64_t qRows = (r.kind == KernelKind::BwdDQ ? 2 : 1) * bm;
    // The forward's V tiles hold only the CTA's block of O's columns in the
    // schedules that split them (mma_sync, warp_specialized).
    const int64_t vd = r.kind == KernelKind::Fwd ? d / columnBlocks(d) : d;
    auto atoms = [](int64_t cols) { return cols == 96 ? 128 : cols; };
    if (ws) // Q (dO), K and V rings of rows of whole 64-element atoms
            // (96: 128), 1 + 4 stages mbarriers, 1 KB align
      return (qRows + st * bn) * atoms(d) * 2 + st * bn * atoms(vd) * 2 +
             8 * (1 + 4 * st) + 1024;
    if (mma) // rows padded by 8 elements
      return (qRows + bn) * (d + 8) * 2 + bn * (vd + 8) * 2;
    return (qRows + 2 * bn) * d * 2 + 1024;
  }
  const int64_t row = mma ? d + 8 : d == 96 ? 128 : d;
  int64_t bytes = (2 * bm + 4 * bn) * row * 2; // K, V, 2 x Q, 2 x dO
  const bool grid2d = mma && w == 8 &&
                      ((bm == 128 && bn == 64) || (d >= 256 && bm == 64) ||
                       (d == 512 && bm == 32));
  // The warp-specialized backward at head_dim 256: its two consumer
  // warpgroups share Pᵀ (two buffers) and dSᵀ, and stage no dQ.
  const bool shared = ws && d == 256;
  if (grid2d)
    bytes += 2 * bn * (bm + 8) * 2; // P and dS
  else if (shared)
    bytes += 3 * bm * bn * 2; // Pᵀ twice, dSᵀ
  else if (r.kind == KernelKind::Bwd)
    bytes += bm * (mma ? bn + 8 : bn) * 2;   // dSᵀ
  bytes += 2 * 2 * std::max(bn, 32 * w) * 4; // LSE and Delta, 2 tiles
  if (mma)
    return bytes;
  const int64_t dq =
      r.kind == KernelKind::Bwd && !shared ? bn * (d + 8) * 4 : 0;
  if (ws)
    return bytes + (d == 64 ? 2 : 1) * dq + 6 * 8 + 1024;
  return bytes + dq + 1024;
}

/// The fit rules of KernelSpec.h's checkSpec ("a schedule its arch lacks, a
/// tiling its kind or schedule cannot compute") and docs/architecture.md.
bool refFits(const KernelSpec &r) {
  const Tiling &t = r.tiling;
  const bool sm90a = r.arch == "sm_90a";
  const int d = r.headDim;
  switch (r.schedule) {
  case Schedule::Auto:
  case Schedule::MmaSync:
    return true;
  case Schedule::Wgmma:
    if (!sm90a || d != 128)
      return false;
    if (queryMajor(r.kind))
      return t.blockM == 16 * t.warps && t.warps % 4 == 0 &&
             t.blockN % 16 == 0 && t.blockN <= 256;
    return kvMajor(r.kind) && t.blockM == 128 && t.blockN == 64 && t.warps == 8;
  case Schedule::WarpSpecialized:
    // Head_dim 96 in tiles of 128 columns, but not the fused bwd (its dQ
    // staging); beyond head_dim 256 the forward only.
    if (!sm90a || (r.tree && kvMajor(r.kind)) ||
        (r.kind == KernelKind::Bwd && d == 96) ||
        (d > 256 && r.kind != KernelKind::Fwd))
      return false;
    if (kvMajor(r.kind))
      // bwd_kv at head_dim 64 takes 128-query tiles too.
      return d == 256 ? t.blockM == 64 && t.blockN == 64 && t.warps == 8
                      : t.blockM == 128 && t.warps == 8 &&
                            (t.blockN == 64 || (t.blockN == 128 && d == 64 &&
                                                r.kind == KernelKind::BwdKV));
    if (r.kind == KernelKind::BwdDQ) {
      // Key tiles of 16 to 64 rows dividing 64, or 128 at head_dim 64.
      bool keys =
          t.blockN >= 16 &&
          (t.blockN <= 64 ? 64 % t.blockN == 0 : t.blockN == 128 && d == 64);
      if (t.blockM != 128 || t.warps != 8 || t.stages < 2 || !keys)
        return false;
    } else if (r.kind == KernelKind::Fwd) {
      if (t.blockM != 128 || t.warps != 8 || t.stages != 2 || t.blockN < 16 ||
          t.blockN > 128)
        return false;
    } else {
      return false;
    }
    return refSharedBytes(r) <= 227 * 1024;
  }
  return false;
}

/// defaultTiling's rules, in KernelSpec.h's and performance.md's words.
Tiling refDefaultTiling(const KernelSpec &s) {
  const int n = archNumber(s.arch), d = s.headDim;
  const bool sm90a = s.arch == "sm_90a";
  const bool auto_ = s.schedule == Schedule::Auto;
  auto fit = [&](Tiling t) { // the 99 KB archs fall back to 64:32:4:1
    KernelSpec m = s;
    m.tiling = t;
    m.schedule = Schedule::MmaSync;
    if (n && !sm90a && refSharedBytes(m) > maxSmem(n))
      return Tiling{64, 32, 4, 1};
    return t;
  };
  // sm_90a at head_dim 256: the warp-specialized backward (64 keys, the TMA
  // producer's 2 stages) and dQ kernel (a ring of three 32-key tiles) when
  // the pinned fields agree.
  auto agrees = [&s](Tiling ws) {
    const Tiling &t = s.tiling;
    return (!t.blockM || t.blockM == ws.blockM) &&
           (!t.blockN || t.blockN == ws.blockN) &&
           (!t.warps || t.warps == ws.warps) &&
           (!t.stages || t.stages == ws.stages);
  };
  auto wsDefault = [&](Tiling ws) {
    return sm90a &&
           (s.schedule == Schedule::WarpSpecialized || (auto_ && agrees(ws)));
  };
  // Head_dim 512 (each query-major CTA 256 of O's or dQ's columns): bwd and
  // bwd_kv 32 keys in 8 warps on every arch (the archs below 227 KB refuse
  // them); bwd_dq 64:32:4:1, 32:32:2:1 where that does not fit; the
  // forward warp-specialized on sm_90a (128:32:8:2), else 128:32:8:2,
  // 64:32:4:2 or 32:32:2:2, the first that fits.
  auto fits = [&](Tiling t) {
    KernelSpec m = s;
    m.tiling = t;
    m.schedule = Schedule::MmaSync;
    return !n || refSharedBytes(m) <= maxSmem(n);
  };
  if (d == 512 && kvMajor(s.kind))
    return {32, 32, 8, 1};
  if (d == 512 && s.kind == KernelKind::BwdDQ)
    return fits({64, 32, 4, 1}) ? Tiling{64, 32, 4, 1} : Tiling{32, 32, 2, 1};
  if (d == 512 && s.kind == KernelKind::Fwd)
    return sm90a && (s.schedule == Schedule::WarpSpecialized || auto_)
               ? Tiling{128, 32, 8, 2}
           : fits({128, 32, 8, 2}) ? Tiling{128, 32, 8, 2}
           : fits({64, 32, 4, 2})  ? Tiling{64, 32, 4, 2}
                                   : Tiling{32, 32, 2, 2};
  if (d == 256 && s.kind == KernelKind::BwdKV && wsDefault({64, 64, 8, 2}))
    return {64, 64, 8, 2};
  if (d == 256 && s.kind == KernelKind::Bwd && sm90a &&
      s.schedule == Schedule::WarpSpecialized)
    return {64, 64, 8, 2};
  if (d == 256 && kvMajor(s.kind))
    return {64, 32, 8, 1};
  // sm_90a at head_dim 64: bwd_kv walks 128-query tiles when the pinned
  // fields agree.
  if (d == 64 && s.kind == KernelKind::BwdKV && wsDefault({128, 128, 8, 1}))
    return {128, 128, 8, 1};
  // Head_dim 96: bwd_kv's Q and dO by TMA (two stages).
  if (d == 96 && s.kind == KernelKind::BwdKV && wsDefault({128, 64, 8, 2}))
    return {128, 64, 8, 2};
  if (d == 256 && s.kind == KernelKind::BwdDQ &&
      wsDefault({128, 32, 8, kDqWarpSpecializedStages}))
    return {128, 32, 8, kDqWarpSpecializedStages};
  switch (s.kind) {
  case KernelKind::BwdPre:
  case KernelKind::BwdPost:
    return {64, 16, 4, 1};
  case KernelKind::Bwd: // head_dim 96: 64-query tiles on sm_80 too
    return fit(n >= 90 || d == 96 ? Tiling{128, 64, 8, 1}
                                  : Tiling{128, 32, 8, 1});
  case KernelKind::BwdKV:
    return fit(n >= 90 ? Tiling{128, 64, 8, 1} : Tiling{64, 64, 4, 1});
  case KernelKind::BwdDQ: {
    const Tiling &t = s.tiling;
    bool agrees = (!t.blockM || t.blockM == 128) &&
                  (!t.blockN || t.blockN == 64) && (!t.warps || t.warps == 8) &&
                  (!t.stages || t.stages == kDqWarpSpecializedStages);
    if (sm90a && (d == 64 || d == 96 || d == 128) &&
        (s.schedule == Schedule::WarpSpecialized || (auto_ && agrees)))
      return {128, 64, 8, kDqWarpSpecializedStages};
    if (sm90a && d == 128)
      return {128, 64, 8, 1};
    return {64, 32, 4, 1};
  }
  case KernelKind::Fwd:
    if (sm90a && (s.schedule == Schedule::WarpSpecialized || auto_))
      return {128, d == 256 ? 64 : 128, 8, 2};
    if (sm90a && d == 128 && s.schedule == Schedule::Wgmma)
      return {128, 128, 8, 2};
    return {128, 32, d == 256 ? 8 : 4, 2};
  }
  return {};
}

/// resolveSpec: open fields from the default, then Auto's choice.
KernelSpec refResolve(KernelSpec s) {
  Tiling d = refDefaultTiling(s);
  Tiling &t = s.tiling;
  t.blockM = t.blockM ? t.blockM : d.blockM;
  t.blockN = t.blockN ? t.blockN : d.blockN;
  t.warps = t.warps ? t.warps : d.warps;
  t.stages = t.stages ? t.stages : d.stages;
  if (s.schedule != Schedule::Auto)
    return s;
  KernelSpec ws = s, wg = s;
  ws.schedule = Schedule::WarpSpecialized;
  wg.schedule = Schedule::Wgmma;
  bool wsPreferred = kvMajor(s.kind) ? true
                     : s.kind == KernelKind::BwdDQ
                         ? t.stages > 2
                         : t.blockN == (s.headDim == 512   ? 32
                                        : s.headDim == 256 ? 64
                                                           : 128);
  if (refFits(ws) && wsPreferred)
    s.schedule = Schedule::WarpSpecialized;
  else if (s.kind == KernelKind::BwdDQ &&
           !(t.blockM == 128 && t.blockN == 64 && t.warps == 8))
    s.schedule = Schedule::MmaSync;
  else
    s.schedule = refFits(wg) ? Schedule::Wgmma : Schedule::MmaSync;
  return s;
}

/// The parameters the warp-specialized schedule appends to its kind's
/// (KernelAbi.h), then the tree variant's chain.
std::vector<std::string> refExtraParams(KernelKind kind, Schedule s,
                                        bool tree) {
  std::vector<std::string> out;
  if (s == Schedule::WarpSpecialized) {
    if (kind == KernelKind::Fwd)
      out = {"qMap", "kMap", "vMap", "order"};
    else if (kvMajor(kind))
      out = {"qMap", "doMap"};
    else if (kind == KernelKind::BwdDQ)
      out = {"qMap", "kMap", "vMap", "doMap", "order"};
  }
  if (tree && queryMajor(kind))
    out.push_back("chain");
  return out;
}

abi::ParamTable baseTable(KernelKind kind) {
  switch (kind) {
  case KernelKind::Fwd:
    return abi::tableOf(abi::kFwdParams);
  case KernelKind::BwdPre:
    return abi::tableOf(abi::kBwdPreParams);
  case KernelKind::Bwd:
  case KernelKind::BwdKV:
    return abi::tableOf(abi::kBwdParams);
  case KernelKind::BwdPost:
    return abi::tableOf(abi::kBwdPostParams);
  case KernelKind::BwdDQ:
    return abi::tableOf(abi::kBwdDQParams);
  }
  return {};
}

std::vector<std::string> paramNames(abi::ParamTable t) {
  std::vector<std::string> out;
  for (const abi::Param &p : t)
    out.push_back(p.name);
  return out;
}

std::vector<std::string> refParams(KernelKind kind, Schedule s, bool tree) {
  std::vector<std::string> out = paramNames(baseTable(kind));
  for (const std::string &e : refExtraParams(kind, s, tree))
    out.push_back(e);
  return out;
}

const char *spelling(Schedule s) {
  switch (s) {
  case Schedule::Auto:
    return "auto";
  case Schedule::MmaSync:
    return "mma_sync";
  case Schedule::Wgmma:
    return "wgmma";
  case Schedule::WarpSpecialized:
    return "warp_specialized";
  }
  return "";
}

} // namespace

TEST_CASE("schedules: the spec functions read the records as the rules say",
          "[compiler][schedule-record]") {
  int checked = 0, unfitNamed = 0;
  for (KernelKind kind : kKinds)
    for (const char *arch : kArchs)
      for (int d : kHeadDims)
        for (bool tree : {false, true})
          for (Schedule s : kSchedules)
            for (const Tiling &t : kTilings) {
              KernelSpec spec;
              spec.kind = kind, spec.arch = arch, spec.headDim = d;
              spec.tree = tree, spec.schedule = s, spec.tiling = t;
              CAPTURE(toString(kind), arch, d, tree, spelling(s), t.blockM,
                      t.blockN, t.warps, t.stages);
              const KernelSpec want = refResolve(spec);
              const KernelSpec got = resolveSpec(spec);
              REQUIRE(got.tiling == want.tiling);
              REQUIRE(got.schedule == want.schedule);
              REQUIRE(sharedBytes(got) == refSharedBytes(want));
              REQUIRE(
                  threadsPerBlock(spec) ==
                  want.tiling.warps * 32 +
                      (want.schedule == Schedule::WarpSpecialized ? 128 : 0));
              REQUIRE(maskEveryTile(got) ==
                      (kind == KernelKind::BwdDQ && d >= 256 &&
                       want.schedule == Schedule::MmaSync &&
                       archNumber(arch) >= 90));
              REQUIRE(paramNames(abi::kernelParams(kind, got.schedule, tree)) ==
                      refParams(kind, want.schedule, tree));
              REQUIRE(paramNames(abi::kernelParams(kind, s, tree)) ==
                      refParams(kind, s, tree));
              // The schedule's own verdict in checkSpec, where the checks
              // before it (arch, problem, tiling, tree, stages) pass.
              const Tiling &r = want.tiling;
              bool reaches =
                  archNumber(arch) &&
                  checkTiling(r.blockM, r.blockN, r.warps, r.stages).empty() &&
                  !(tree && !queryMajor(kind)) &&
                  (r.stages <= 2 ||
                   (want.schedule == Schedule::WarpSpecialized &&
                    kind == KernelKind::BwdDQ));
              std::string why = checkSpec(spec);
              std::string prefix = std::string("the ") +
                                   spelling(want.schedule) +
                                   " schedule cannot compute this " +
                                   toString(kind) + " kernel: ";
              bool refused = why.rfind(prefix, 0) == 0;
              if (reaches) {
                REQUIRE(refused == !refFits(want));
                unfitNamed += refused;
              }
              if (!archNumber(arch) || !reaches)
                REQUIRE(!why.empty());
              if (r.stages > 2 && archNumber(arch) &&
                  checkTiling(r.blockM, r.blockN, r.warps, r.stages).empty() &&
                  !(tree && !queryMajor(kind)) &&
                  !(want.schedule == Schedule::WarpSpecialized &&
                    kind == KernelKind::BwdDQ))
                REQUIRE(why.find("stages 3 and 4") == 0);
              ++checked;
            }
  // Every case ran, and the named schedules' fit rules refused some.
  CHECK(checked ==
        6 * 12 * int(std::size(kHeadDims)) * 2 * 4 * int(std::size(kTilings)));
  CHECK(unfitNamed > 100);
}

TEST_CASE("schedules: the table holds one record a schedule, Auto's last",
          "[compiler][schedule-record]") {
  std::set<Schedule> seen;
  for (const ScheduleRecord *r : scheduleRecords()) {
    CHECK(&recordOf(r->schedule) == r);
    CHECK(std::string(r->name) == spelling(r->schedule));
    CHECK(std::string(r->name) == toString(r->schedule));
    seen.insert(r->schedule);
  }
  CHECK(seen == std::set<Schedule>{Schedule::MmaSync, Schedule::Wgmma,
                                   Schedule::WarpSpecialized});
  ScheduleList order = autoOrder();
  REQUIRE(order.size == 3);
  CHECK(order.items[0]->schedule == Schedule::WarpSpecialized);
  CHECK(order.items[2]->schedule == Schedule::MmaSync);
  CHECK(&recordOf(Schedule::Auto) == order.items[2]);
}

TEST_CASE("schedules: launch geometry agrees with the parameter tables",
          "[compiler][schedule-record]") {
  for (const ScheduleRecord *r : scheduleRecords())
    for (KernelKind kind : kKinds)
      for (bool tree : {false, true})
        for (int stages : {1, 2, 3}) {
          KernelSpec spec;
          spec.kind = kind, spec.tree = tree, spec.schedule = r->schedule;
          spec.tiling = {128, 64, 8, stages};
          CAPTURE(r->name, toString(kind), tree, stages);
          LaunchGeometry g = r->launch(spec);
          abi::ParamTable params = r->params(kind, tree);
          std::set<std::string> maps, tableMaps;
          for (int i = 0; i < g.numMaps; ++i)
            maps.insert(g.maps[i].param);
          for (const abi::Param &p : params)
            if (p.type == abi::ParamType::TensorMap)
              tableMaps.insert(p.name);
          CHECK(maps == tableMaps);
          CHECK(g.forwardOrder == (params.indexOf("order") >= 0));
          // The KV-major backward reads its maps only at 2 stages (TMA).
          bool ws = r->schedule == Schedule::WarpSpecialized;
          if (ws && kvMajor(kind))
            CHECK(g.mapsRead == (stages == kKVMajorTmaStages));
          // Q and dO boxes: block_m rows in the query-major kernels, block_n
          // (the query tiles) in the KV-major ones; K and V: block_n.
          for (int i = 0; i < g.numMaps; ++i) {
            const TensorMapUse &m = g.maps[i];
            bool keys =
                m.operand == MapOperand::K || m.operand == MapOperand::V;
            CHECK(m.blockNRows == (keys || kvMajor(kind)));
          }
        }
}

TEST_CASE("schedules: grids per kind, over segments or the work order",
          "[compiler][schedule-record]") {
  LaunchCounts c;
  c.tokens = 1000, c.maxSegmentLen = 300, c.numSegments = 5;
  c.workItems = 17, c.accRows = 1100, c.qHeads = 32, c.kvHeads = 8;
  // The kernel as built counts the rows (KernelInfo::blockM), not the
  // spec's tiling.
  auto grid = [&](KernelKind kind, Schedule s, int blockM) {
    KernelSpec spec;
    spec.kind = kind, spec.schedule = s, spec.tiling = {256, 64, 8, 2};
    c.blockM = blockM;
    return recordOf(s).grid(spec, c);
  };
  auto eq = [](Grid g, unsigned x, unsigned y, unsigned z) {
    return g.x == x && g.y == y && g.z == z;
  };
  // cp.async: ceil(300 / 128) = 3 query tiles, 5 segments, 32 heads.
  CHECK(eq(grid(KernelKind::Fwd, Schedule::MmaSync, 128), 3, 5, 32));
  CHECK(eq(grid(KernelKind::BwdDQ, Schedule::Wgmma, 128), 3, 5, 32));
  // Warp-specialized: the forward order's 17 items, per head.
  CHECK(eq(grid(KernelKind::Fwd, Schedule::WarpSpecialized, 128), 17, 1, 32));
  CHECK(eq(grid(KernelKind::BwdDQ, Schedule::WarpSpecialized, 128), 17, 1, 32));
  // Work items per KV head, every schedule.
  for (Schedule s :
       {Schedule::MmaSync, Schedule::Wgmma, Schedule::WarpSpecialized})
    CHECK(eq(grid(KernelKind::Bwd, s, 128), 17, 8, 1));
  // bwd_pre: ceil(1000 / 64) = 16; bwd_post: ceil(1100 / 64) = 18 blocks of
  // query and KV heads.
  CHECK(eq(grid(KernelKind::BwdPre, Schedule::MmaSync, 64), 16, 32, 1));
  CHECK(eq(grid(KernelKind::BwdPost, Schedule::MmaSync, 64), 18, 40, 1));
  // Head_dim 512: z holds each query head's two blocks of 256 output columns
  // in the forward and the dQ kernel (outputColumnBlocks), not in the others.
  KernelSpec wide;
  wide.headDim = 512, wide.schedule = Schedule::MmaSync;
  wide.tiling = {128, 32, 8, 2};
  c.blockM = 128;
  for (KernelKind kind : {KernelKind::Fwd, KernelKind::BwdDQ}) {
    wide.kind = kind;
    CHECK(eq(recordOf(Schedule::MmaSync).grid(wide, c), 3, 5, 64));
  }
  wide.kind = KernelKind::Bwd;
  CHECK(eq(recordOf(Schedule::MmaSync).grid(wide, c), 17, 8, 1));
  // The warp-specialized forward (sm_90a's default there): the forward
  // order's 17 items, per head and block of columns.
  wide.kind = KernelKind::Fwd, wide.schedule = Schedule::WarpSpecialized;
  CHECK(eq(recordOf(Schedule::WarpSpecialized).grid(wide, c), 17, 1, 64));
}
