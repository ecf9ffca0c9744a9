// Score modifiers written by users (docs/score-modifiers.md): MLIR text of
// one func.func @score_mod applied to every logit, lowered per score by the
// compiler and differentiated by it for the backward. Each modifier here is
// also written in C++ (with its derivative, by hand) for the fp64 reference,
// so the kernels' results are checked against an independent statement of
// the same function. `dualkv-gpu-tests variant-score-mod [count]` runs:
//   - control: the plain kernels checked against ALiBi's reference must fail;
//   - refusals: the deterministic and the split-dQ backward refuse a
//     modifier, and a modifier the compiler cannot differentiate, a wrong
//     tensor count and a null tensor are refused by name;
//   - the shipped modifiers (examples/score_mods: ALiBi, a relative-position
//     bias table, the softcap at c = 50) and three written for the test (a
//     softcap at c = 2, a nonlinear function of the score through max, sin
//     and exp, and a bias on the region, which takes the 7-argument form),
//     at head_dim 64, 128 and 256, bf16 and fp16, every schedule that can
//     compute the kernels, forward and backward against fp64;
//   - trees: ALiBi, the bias table and the nonlinear modifier on branching
//     prefix trees (positions along each root-to-node path), the tree
//     schedules, forward and the atomic backward against fp64;
//   - random: `count` (at most 24) random batches with ALiBi and the bias
//     table, forward and backward against fp64;
//   - the text softcap against the built-in softcap kernels.
// DUALKV_SCORE_MOD_DIR names examples/score_mods (default: that path under
// the current directory).
#include "GpuHarness.h"
#include "GpuTests.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

using namespace dualkv;
using namespace dualkv::testing;

namespace {

/// A modifier: its text, how to make its tensors for a case, and its C++
/// statement for the reference.
struct Modifier {
  std::string name;
  std::string text;
  std::function<std::vector<std::vector<float>>(const Case &)> inputs;
  /// Sets the reference's function and derivative of a case whose inputs
  /// are set (Case::scoreModRef, scoreModRefGrad).
  std::function<void(Case &)> reference;
};

std::string shipped(const std::string &file) {
  const char *dir = std::getenv("DUALKV_SCORE_MOD_DIR");
  std::string path =
      std::string(dir && *dir ? dir : "examples/score_mods") + "/" + file;
  std::ifstream in(path);
  if (!in)
    throw std::runtime_error("cannot read " + path +
                             " (set DUALKV_SCORE_MOD_DIR)");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

double one(double, int64_t, int64_t, int64_t) { return 1.0; }

/// ALiBi's slopes of Press et al. for `hq` heads (2^(-8 h / hq), h from 1).
std::vector<float> alibiSlopes(int hq) {
  std::vector<float> slopes(static_cast<size_t>(hq));
  for (int h = 0; h < hq; ++h)
    slopes[size_t(h)] = std::exp2(-8.0f * float(h + 1) / float(hq));
  return slopes;
}

Modifier alibi() {
  Modifier m;
  m.name = "alibi";
  m.text = shipped("alibi.mlir");
  m.inputs = [](const Case &c) {
    return std::vector<std::vector<float>>{alibiSlopes(c.hq)};
  };
  m.reference = [](Case &c) {
    std::vector<float> slopes = c.scoreModInputs[0];
    c.scoreModRef = [slopes](double x, int64_t h, int64_t q, int64_t k) {
      return x + double(slopes[size_t(h)]) * double(k - q);
    };
    c.scoreModRefGrad = one;
  };
  return m;
}

Modifier relativeBias() {
  Modifier m;
  m.name = "relative_bias";
  m.text = shipped("relative_bias.mlir");
  m.inputs = [](const Case &c) {
    std::mt19937_64 rng(uint64_t(c.hq) * 7919 + uint64_t(c.d));
    std::normal_distribution<float> n(0.f, 1.f);
    std::vector<float> table(static_cast<size_t>(c.hq) * 257);
    for (float &e : table)
      e = n(rng);
    return std::vector<std::vector<float>>{table};
  };
  m.reference = [](Case &c) {
    std::vector<float> table = c.scoreModInputs[0];
    c.scoreModRef = [table](double x, int64_t h, int64_t q, int64_t k) {
      int64_t d = std::clamp<int64_t>(k - q, -128, 128) + 128;
      return x + double(table[size_t(h * 257 + d)]);
    };
    c.scoreModRefGrad = one;
  };
  return m;
}

Modifier softcapText(const std::string &name, const std::string &text,
                     double cap) {
  Modifier m;
  m.name = name;
  m.text = text;
  m.inputs = [](const Case &) { return std::vector<std::vector<float>>{}; };
  m.reference = [cap](Case &c) {
    c.scoreModRef = [cap](double x, int64_t, int64_t, int64_t) {
      return cap * std::tanh(x / cap);
    };
    c.scoreModRefGrad = [cap](double x, int64_t, int64_t, int64_t) {
      double t = std::tanh(x / cap);
      return 1 - t * t;
    };
  };
  return m;
}

/// A nonlinear function of the score alone: 0.9 max(x, -2) + 0.3 sin(x) -
/// 0.1 exp(-x^2), through maximumf, sin, exp, negf and mulf.
Modifier nonlinear() {
  Modifier m;
  m.name = "nonlinear";
  m.text = R"(func.func @score_mod(%x: f32, %h: i32, %q: i32, %k: i32) -> f32 {
  %floor = arith.constant -2.0 : f32
  %a = arith.constant 0.9 : f32
  %b = arith.constant 0.3 : f32
  %c = arith.constant 0.1 : f32
  %m = arith.maximumf %x, %floor : f32
  %t0 = arith.mulf %a, %m : f32
  %s = math.sin %x : f32
  %t1 = arith.mulf %b, %s : f32
  %x2 = arith.mulf %x, %x : f32
  %nx2 = arith.negf %x2 : f32
  %e = math.exp %nx2 : f32
  %t2 = arith.mulf %c, %e : f32
  %sum = arith.addf %t0, %t1 : f32
  %out = arith.subf %sum, %t2 : f32
  return %out : f32
}
)";
  m.inputs = [](const Case &) { return std::vector<std::vector<float>>{}; };
  m.reference = [](Case &c) {
    c.scoreModRef = [](double x, int64_t, int64_t, int64_t) {
      return 0.9 * std::max(x, -2.0) + 0.3 * std::sin(x) -
             0.1 * std::exp(-x * x);
    };
    c.scoreModRefGrad = [](double x, int64_t, int64_t, int64_t) {
      return (x >= -2.0 ? 0.9 : 0.0) + 0.3 * std::cos(x) +
             0.2 * x * std::exp(-x * x);
    };
  };
  return m;
}

/// The 7-argument form: a bias of 0.75 on the keys of the query's own
/// segment (region 1) and -0.5 on the shared prompt's, times the head's
/// index + 1. Its cases' groups share one prompt length P, so the reference
/// tells the regions from logical positions: a key is the prompt's for a
/// response query (lpos >= P) when its lpos < P.
Modifier regionBias() {
  Modifier m;
  m.name = "region_bias";
  m.text = R"(func.func @score_mod(%x: f32, %h: i32, %q: i32, %k: i32,
                     %qp: i32, %kp: i32, %region: i32) -> f32 {
  %one = arith.constant 1 : i32
  %own = arith.constant 0.75 : f32
  %shared = arith.constant -0.5 : f32
  %zero = arith.constant 0 : i32
  %isOwn = arith.cmpi ne, %region, %zero : i32
  %bias = arith.select %isOwn, %own, %shared : f32
  %h1 = arith.addi %h, %one : i32
  %hf = arith.sitofp %h1 : i32 to f32
  %scaled = arith.mulf %bias, %hf : f32
  %out = arith.addf %x, %scaled : f32
  return %out : f32
}
)";
  m.inputs = [](const Case &) { return std::vector<std::vector<float>>{}; };
  m.reference = [](Case &c) {
    const int64_t P = c.groups.front().prompt_len;
    c.scoreModRef = [P](double x, int64_t h, int64_t q, int64_t k) {
      bool shared = q >= P && k < P;
      return x + (shared ? -0.5 : 0.75) * double(h + 1);
    };
    c.scoreModRefGrad = one;
  };
  return m;
}

void attach(Case &c, const Modifier &m) {
  c.scoreMod = m.text;
  c.scoreModInputs = m.inputs(c);
  m.reference(c);
}

/// Forward and the atomic backward of `c` (modifier attached) in
/// `schedule`, against fp64; "" when within tolerance, "skip: ..." when the
/// schedule cannot compute a kernel of the case.
std::string checkCase(const Case &c, Schedule schedule) {
  BackwardDeviceCase dc(c);
  ForwardArgs f = dc.args();
  f.schedule = schedule;
  try {
    dualkv::forward(f);
  } catch (const Error &e) {
    if (std::string(e.what()).find("cannot compute") != std::string::npos)
      return std::string("skip: ") + e.what();
    throw;
  }
  check(cudaDeviceSynchronize(), "forward");
  ForwardResult fwd = dc.download();
  std::string error = forwardReferenceError(c, fwd);
  if (!error.empty())
    return "forward: " + error;
  BackwardOptions o;
  o.algorithm = BackwardAlgorithm::Atomic;
  BackwardArgs b = dc.backwardArgs(o);
  b.schedule = schedule;
  dc.poisonGrads();
  try {
    dualkv::backward(b);
  } catch (const Error &e) {
    if (std::string(e.what()).find("cannot compute") != std::string::npos)
      return std::string("skip backward: ") + e.what();
    throw;
  }
  check(cudaDeviceSynchronize(), "backward");
  error = backwardReferenceError(c, fwd, dc.downloadGrads());
  return error.empty() ? std::string() : "backward: " + error;
}

/// The cases of one modifier: two batches (an empty response, several
/// groups of one prompt length, lengths off the tiles) at every head_dim,
/// bf16 and fp16 in turn, in the default schedule or `everySchedule`.
int modifierCases(const Modifier &m, bool everySchedule) {
  int failures = 0, checked = 0;
  std::mt19937_64 rng(2026120710);
  const std::vector<std::vector<PlanGroup>> batches = {
      {{300, {200, 0, 90}}},
      {{130, {1, 64, 257}}, {130, {129}}},
  };
  std::vector<Schedule> schedules = {Schedule::Auto};
  if (everySchedule)
    schedules = {Schedule::Auto, Schedule::MmaSync, Schedule::Wgmma,
                 Schedule::WarpSpecialized};
  int dtype = 0;
  for (const auto &groups : batches)
    for (int d : {64, 96, 128, 256})
      for (Schedule s : schedules) {
        Case c;
        c.groups = groups;
        c.hq = 4;
        c.hkv = 2;
        c.d = d;
        c.dtype = (dtype++ % 2) ? DType::FP16 : DType::BF16;
        c.fill(rng);
        c.fillGrad(rng);
        attach(c, m);
        std::string error;
        try {
          error = checkCase(c, s);
        } catch (const std::exception &e) {
          error = e.what();
        }
        if (error.rfind("skip", 0) == 0)
          continue;
        ++checked;
        if (!error.empty()) {
          ++failures;
          fmt::print("FAIL score_mod {} {} ({}): {}\n", m.name, toString(s),
                     c.describe(), error);
        }
      }
  fmt::print("score_mod {}: {} checks, {} failed\n", m.name, checked, failures);
  return failures;
}

int randomCases(int count) {
  std::mt19937_64 rng(2026120711);
  int failures = 0;
  for (int i = 0; i < count; ++i) {
    Case c = randomCase(rng, {64, 96, 128, 256}, 1e8);
    c.fill(rng);
    c.fillGrad(rng);
    const Modifier m = i % 2 ? relativeBias() : alibi();
    attach(c, m);
    std::string error;
    try {
      error = checkCase(c, Schedule::Auto);
    } catch (const std::exception &e) {
      error = e.what();
    }
    if (!error.empty()) {
      ++failures;
      fmt::print("FAIL score_mod random {} {} ({}): {}\n", i, m.name,
                 c.describe(), error);
    }
  }
  fmt::print("score_mod random: {} cases, {} failed\n", count, failures);
  return failures;
}

/// Branching prefix trees (the tree workload's forest, every head_dim and
/// dtype, the chain walks of the default and the other schedules) with
/// `m`: positions along each root-to-node path.
int treeCases(const Modifier &m) {
  Case forHeads;
  forHeads.hq = 4;
  forHeads.hkv = 2;
  forHeads.d = 64;
  TreeScoreMod tree;
  tree.text = m.text;
  tree.inputs = m.inputs(forHeads);
  forHeads.scoreModInputs = tree.inputs;
  m.reference(forHeads);
  tree.ref = forHeads.scoreModRef;
  tree.grad = forHeads.scoreModRefGrad;
  int failures = treeSanitizeWorkload(1.0, 0, 0, &tree);
  fmt::print("score_mod {} trees: {} failed\n", m.name, failures);
  return failures;
}

/// The plain forward checked against ALiBi's reference must fail.
int control() {
  std::mt19937_64 rng(2026120712);
  Case c = controlCase(rng, 128);
  ForwardResult plain = runForward(c);
  attach(c, alibi());
  if (forwardReferenceError(c, plain).empty()) {
    fmt::print("FAIL score_mod control: the plain forward passed ALiBi's "
               "check\n");
    return 1;
  }
  return 0;
}

/// What must be refused with dualkv::Error, naming why.
int refusals() {
  std::mt19937_64 rng(2026120713);
  int failures = 0;
  auto expectRefusal = [&](const char *what, const char *needle,
                           const std::function<void()> &run) {
    try {
      run();
      ++failures;
      fmt::print("FAIL score_mod refusal: {} ran\n", what);
    } catch (const Error &e) {
      if (std::string(e.what()).find(needle) == std::string::npos) {
        ++failures;
        fmt::print("FAIL score_mod refusal: {}: '{}' lacks '{}'\n", what,
                   e.what(), needle);
      } else {
        fmt::print("ok score_mod refusal: {}: {}\n", what, e.what());
      }
    }
  };
  Case c = controlCase(rng, 128);
  c.fillGrad(rng);
  attach(c, alibi());
  {
    BackwardDeviceCase dc(c);
    dualkv::forward(dc.args());
    check(cudaDeviceSynchronize(), "forward");
    BackwardOptions o;
    o.deterministic = true;
    expectRefusal("deterministic backward", "deterministic",
                  [&] { dualkv::backward(dc.backwardArgs(o)); });
    o.deterministic = false;
    o.algorithm = BackwardAlgorithm::SplitDQ;
    expectRefusal("split-dQ backward", "split-dQ",
                  [&] { dualkv::backward(dc.backwardArgs(o)); });
  }
  {
    Case bad = c;
    bad.scoreMod =
        R"(func.func @score_mod(%x: f32, %h: i32, %q: i32, %k: i32) -> f32 {
  %f = math.floor %x : f32
  return %f : f32
}
)";
    bad.scoreModInputs.clear();
    DeviceCase dc(bad);
    expectRefusal("math.floor", "math.floor",
                  [&] { dualkv::forward(dc.args()); });
  }
  {
    Case none = c;
    none.scoreModInputs.clear(); // ALiBi takes one tensor
    DeviceCase dc(none);
    expectRefusal("no tensor", "num_score_mod_inputs",
                  [&] { dualkv::forward(dc.args()); });
    ForwardArgs a = dc.args();
    const float *null = nullptr;
    a.score_mod_inputs = &null;
    a.num_score_mod_inputs = 1;
    expectRefusal("null tensor", "score_mod_inputs[0]",
                  [&] { dualkv::forward(a); });
  }
  return failures;
}

/// The softcap as text against the built-in softcap's kernels: the same
/// function, so within the forward and backward tests' tolerances of each
/// other.
int softcapAgreement(const std::string &softcap2) {
  std::mt19937_64 rng(2026120714);
  int failures = 0;
  for (int d : {64, 96, 128, 256}) {
    Case c = controlCase(rng, d);
    c.fillGrad(rng);
    c.softcap = 2.0;
    BackwardDeviceCase builtin(c);
    dualkv::forward(builtin.args());
    check(cudaDeviceSynchronize(), "forward");
    ForwardResult fb = builtin.download();
    BackwardResult bb = builtin.runBackward();
    Case t = c;
    t.softcap = 0;
    attach(t, softcapText("softcap2", softcap2, 2.0));
    BackwardDeviceCase text(t);
    dualkv::forward(text.args());
    check(cudaDeviceSynchronize(), "forward");
    ForwardResult ft = text.download();
    BackwardResult bt = text.runBackward();
    std::string error = forwardAgreementError(c, ft, fb);
    if (error.empty())
      error = backwardAgreementError(c, bt, bb);
    if (!error.empty()) {
      ++failures;
      fmt::print("FAIL score_mod softcap text vs built-in, head_dim {}: {}\n",
                 d, error);
    }
  }
  fmt::print("score_mod softcap text vs built-in: {} failed\n", failures);
  return failures;
}

} // namespace

int dualkv::testing::scoreModTest(int count) {
  // DUALKV_SCORE_MOD_PARTS (comma-separated: control, refusals, shipped,
  // written, trees, random, softcap) runs those parts only; unset, all of
  // them.
  const char *parts = std::getenv("DUALKV_SCORE_MOD_PARTS");
  auto wants = [&](const std::string &part) {
    if (!parts || !*parts)
      return true;
    std::string list = std::string(",") + parts + ",";
    return list.find("," + part + ",") != std::string::npos;
  };
  const std::string softcap2 =
      R"(func.func @score_mod(%x: f32, %h: i32, %q: i32, %k: i32) -> f32 {
  %c = arith.constant 2.0 : f32
  %y = arith.divf %x, %c : f32
  %t = math.tanh %y : f32
  %out = arith.mulf %t, %c : f32
  return %out : f32
}
)";
  int failures = 0;
  if (wants("control"))
    failures += control();
  if (wants("refusals"))
    failures += refusals();
  // The shipped modifiers in the default schedules; those written for the
  // test, which reach the positions, heads and regions, in every schedule.
  if (wants("shipped"))
    for (const Modifier &m :
         {alibi(), relativeBias(),
          softcapText("softcap50", shipped("softcap.mlir"), 50.0)})
      failures += modifierCases(m, m.name == "alibi");
  if (wants("written"))
    for (const Modifier &m :
         {softcapText("softcap2", softcap2, 2.0), nonlinear(), regionBias()})
      failures += modifierCases(m, m.name != "softcap2");
  // DUALKV_SCORE_MOD_TREES (comma-separated modifier names) narrows the
  // trees part, so that processes can share it.
  const char *treeNames = std::getenv("DUALKV_SCORE_MOD_TREES");
  if (wants("trees"))
    for (const Modifier &m : {alibi(), relativeBias(), nonlinear()})
      if (!treeNames || !*treeNames ||
          (std::string(",") + treeNames + ",").find("," + m.name + ",") !=
              std::string::npos)
        failures += treeCases(m);
  if (wants("random"))
    failures += randomCases(std::min(count, 24));
  if (wants("softcap"))
    failures += softcapAgreement(softcap2);
  fmt::print("variant score_mod: {}\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
