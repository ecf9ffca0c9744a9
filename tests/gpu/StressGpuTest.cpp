// GPU tests of many callers at once and of many launches: 8 host threads on
// their own streams and, separately, 8 processes sharing one fresh kernel
// cache run forward + backward over random plans concurrently, every result
// bit-identical to the same case run alone (which is checked against the fp64
// reference); and 10 000 launches over random plans leave device memory, host
// RSS and the kernel cache flat.
#include "GpuHarness.h"
#include "GpuTests.h"

#include "dualkv/Cache.h"
#include "operations/Workspace.h" // kMaxOwnedWorkspaces (a constant)

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <sstream>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

using namespace dualkv;
using namespace dualkv::testing;

namespace {

constexpr int kCallers = 8;
/// Small cases: the point is contention, and the reference must stay quick.
constexpr double kWorkBudget = 5e7;

/// Random cases for the backward (head_dim 64 or 128), inputs and dO filled.
std::vector<Case> stressCases(uint64_t seed, int count) {
  std::mt19937_64 rng(seed);
  std::vector<Case> cases;
  for (int i = 0; i < count; ++i) {
    cases.push_back(randomCase(rng, {64, 128}, kWorkBudget));
    cases.back().fill(rng);
    cases.back().fillGrad(rng);
  }
  return cases;
}

/// The bits of every output of one forward + backward.
struct Outputs {
  ForwardResult fwd;
  BackwardResult bwd;
  bool operator==(const Outputs &o) const {
    return bitwiseMismatches(fwd.o, o.fwd.o) == 0 &&
           bitwiseMismatches(fwd.lse, o.fwd.lse) == 0 &&
           bitwiseMismatches(bwd.dq, o.bwd.dq) == 0 &&
           bitwiseMismatches(bwd.dk, o.bwd.dk) == 0 &&
           bitwiseMismatches(bwd.dv, o.bwd.dv) == 0;
  }
};

/// FNV-1a over the bits of every output: what processes compare.
uint64_t fingerprint(const Outputs &o) {
  uint64_t h = 1469598103934665603ull;
  for (const std::vector<float> *v :
       {&o.fwd.o, &o.fwd.lse, &o.bwd.dq, &o.bwd.dk, &o.bwd.dv})
    for (float f : *v) {
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      for (int b = 0; b < 4; ++b)
        h = (h ^ ((bits >> (8 * b)) & 0xff)) * 1099511628211ull;
    }
  return h;
}

/// One case's buffers, used from one thread on one stream: outputs poisoned
/// on that stream before each run, the deterministic backward (so that the
/// bits of dK and dV do not depend on the order of atomics).
struct StreamRunner {
  BackwardDeviceCase dc;
  cudaStream_t stream;
  StreamRunner(const Case &c, cudaStream_t s) : dc(c), stream(s) {
    // The uploads ran on the legacy default stream, which a non-blocking
    // stream does not wait for.
    check(cudaDeviceSynchronize(), "upload");
  }

  void poison(DeviceBuffer &b) {
    check(cudaMemsetAsync(b.ptr, 0xff, b.bytes, stream), "poison");
  }
  Outputs run(bool deterministic = true) {
    poison(dc.o);
    poison(dc.lse);
    poison(dc.dq);
    poison(dc.dk);
    poison(dc.dv);
    ForwardArgs f = dc.args();
    f.stream = stream;
    dualkv::forward(f);
    BackwardOptions options;
    options.deterministic = deterministic;
    BackwardArgs b = dc.backwardArgs(options);
    b.stream = stream;
    dualkv::backward(b);
    check(cudaStreamSynchronize(stream), "stream");
    return {dc.download(), dc.downloadGrads()};
  }
};

/// Each case alone on the default stream, checked against the reference.
std::vector<Outputs> baseline(const std::vector<Case> &cases, int *failures) {
  std::vector<Outputs> out;
  for (const Case &c : cases)
    out.push_back(StreamRunner(c, nullptr).run());
  std::mutex mutex;
  parallelFor(cases.size(), [&](size_t i) {
    std::string error = forwardReferenceError(cases[i], out[i].fwd);
    if (error.empty())
      error = backwardReferenceError(cases[i], out[i].fwd, out[i].bwd);
    if (!error.empty()) {
      std::lock_guard<std::mutex> lock(mutex);
      fmt::print("FAIL (alone) {}\n", error);
      ++*failures;
    }
  });
  return out;
}

/// 8 threads, each on a stream of its own, run every case (each thread in
/// its own order) `rounds` times, the deterministic backward and the default
/// one in turn; the kernels are unloaded first, so the threads also race to
/// load them.
int testThreads(int rounds) {
  std::vector<Case> cases = stressCases(20260214, 16);
  int failures = 0;
  std::vector<Outputs> alone = baseline(cases, &failures);
  clearKernelCache();

  std::mutex mutex;
  std::vector<std::thread> threads;
  std::atomic<int> runs{0};
  for (int t = 0; t < kCallers; ++t)
    threads.emplace_back([&, t] {
      try {
        cudaStream_t stream;
        check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
              "cudaStreamCreate");
        std::vector<std::unique_ptr<StreamRunner>> runners;
        for (const Case &c : cases)
          runners.push_back(std::make_unique<StreamRunner>(c, stream));
        for (int r = 0; r < rounds; ++r)
          for (size_t k = 0; k < cases.size(); ++k) {
            // Each thread its own order: rotated, reversed on odd threads.
            const size_t n = cases.size();
            size_t i = ((t % 2 ? n - 1 - k : k) + size_t(t) + size_t(r)) % n;
            // Odd rounds take the default (atomic) backward, whose dK and dV
            // bits depend on the order of atomics: those are checked
            // against the reference instead.
            const bool deterministic = r % 2 == 0;
            Outputs got = runners[i]->run(deterministic);
            ++runs;
            std::string error;
            if (deterministic && !(got == alone[i]))
              error = "differs from the same case run alone";
            if (!deterministic &&
                (bitwiseMismatches(got.fwd.o, alone[i].fwd.o) != 0 ||
                 bitwiseMismatches(got.fwd.lse, alone[i].fwd.lse) != 0))
              error = "forward differs from the same case run alone";
            if (!deterministic && error.empty())
              error = backwardReferenceError(cases[i], got.fwd, got.bwd);
            if (!error.empty()) {
              std::lock_guard<std::mutex> lock(mutex);
              fmt::print("FAIL thread {} round {}: {}: {}\n", t, r,
                         cases[i].describe(), error);
              ++failures;
            }
          }
        runners.clear();
        check(cudaStreamDestroy(stream), "cudaStreamDestroy");
      } catch (const std::exception &e) {
        std::lock_guard<std::mutex> lock(mutex);
        fmt::print("FAIL thread {}: {}\n", t, e.what());
        ++failures;
      }
    });
  for (std::thread &t : threads)
    t.join();
  fmt::print("stress_threads: {} threads x {} cases x {} rounds = {} "
             "forward+backward runs, {} failures\n",
             kCallers, cases.size(), rounds, runs.load(), failures);
  return failures ? 1 : 0;
}

/// One process of testProcesses: every case, in an order of its own,
/// `rounds` times; prints "case <i> <fingerprint>" per case; worker 0 also
/// checks each case against the reference.
int worker(int index, int rounds) {
  std::vector<Case> cases = stressCases(20260215, 12);
  int failures = 0;
  std::vector<uint64_t> prints(cases.size(), 0);
  for (int r = 0; r < rounds; ++r)
    for (size_t k = 0; k < cases.size(); ++k) {
      size_t i = (k + size_t(index) * 5 + size_t(r)) % cases.size();
      Outputs got = StreamRunner(cases[i], nullptr).run();
      uint64_t h = fingerprint(got);
      if (r > 0 && h != prints[i]) {
        fmt::print("FAIL worker {}: {} changed between rounds\n", index,
                   cases[i].describe());
        ++failures;
      }
      prints[i] = h;
      if (index == 0 && r == 0) {
        std::string error = forwardReferenceError(cases[i], got.fwd);
        if (error.empty())
          error = backwardReferenceError(cases[i], got.fwd, got.bwd);
        if (!error.empty()) {
          fmt::print("FAIL worker 0: {}\n", error);
          ++failures;
        }
      }
    }
  for (size_t i = 0; i < cases.size(); ++i)
    fmt::print("case {} {:016x}\n", i, prints[i]);
  std::fflush(stdout);
  return failures ? 1 : 0;
}

/// 8 processes (this binary, `stress-worker <i>`) share one fresh kernel
/// cache (DUALKV_CACHE_DIR), so they also compile and store the same keys at
/// once; every process must exit 0 and give every case the same bits.
int testProcesses(int rounds, char **argv) {
  namespace fs = std::filesystem;
  std::string dir =
      (fs::temp_directory_path() / fmt::format("dualkv-stress-{}", ::getpid()))
          .string();
  fs::create_directories(dir + "/cache");
  fs::permissions(dir, fs::perms::owner_all);
  fs::permissions(dir + "/cache", fs::perms::owner_all);
  ::setenv("DUALKV_CACHE_DIR", (dir + "/cache").c_str(), 1);
  std::string self = fs::read_symlink("/proc/self/exe").string();
  std::vector<pid_t> pids;
  for (int w = 0; w < kCallers; ++w) {
    std::string out = fmt::format("{}/worker-{}.txt", dir, w);
    std::string index = std::to_string(w), count = std::to_string(rounds);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, out.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0600);
    char *args[] = {const_cast<char *>(self.c_str()),
                    const_cast<char *>("stress-worker"),
                    const_cast<char *>(count.c_str()),
                    const_cast<char *>(index.c_str()), nullptr};
    pid_t pid = 0;
    if (posix_spawn(&pid, self.c_str(), &actions, nullptr, args, environ) != 0)
      throw std::runtime_error("cannot start a worker process");
    posix_spawn_file_actions_destroy(&actions);
    pids.push_back(pid);
  }
  int failures = 0;
  std::vector<std::string> outputs;
  for (int w = 0; w < kCallers; ++w) {
    int status = 0;
    ::waitpid(pids[size_t(w)], &status, 0);
    std::ifstream in(fmt::format("{}/worker-{}.txt", dir, w));
    std::string text((std::istreambuf_iterator<char>(in)),
                     std::istreambuf_iterator<char>());
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      fmt::print("FAIL worker {} (status {:#x}):\n{}\n", w, status, text);
      ++failures;
    }
    // Only the fingerprint lines are compared.
    std::string prints;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);)
      if (line.rfind("case ", 0) == 0)
        prints += line + "\n";
    outputs.push_back(prints);
  }
  for (int w = 1; w < kCallers; ++w)
    if (outputs[size_t(w)] != outputs[0] || outputs[0].empty()) {
      fmt::print("FAIL worker {} gives other bits than worker 0\n", w);
      ++failures;
    }
  std::error_code ec;
  fs::remove_all(dir, ec);
  fmt::print("stress_processes: {} processes x 12 cases x {} rounds, one "
             "shared cache, {} failures\n",
             kCallers, rounds, failures);
  return failures ? 1 : 0;
}

/// Resident set size of this process in bytes.
int64_t residentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

int64_t deviceUsedBytes() {
  size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return int64_t(total - free);
}

/// Preallocated buffers for the largest problem testLeak draws, and the
/// launch of one random problem in them.
struct LeakRig {
  static constexpr int64_t kMaxPrompt = 300, kMaxResponse = 200;
  static constexpr int kMaxGroups = 3, kMaxResponses = 4;
  static constexpr int64_t kMaxTokens =
      kMaxGroups * (kMaxPrompt + kMaxResponses * kMaxResponse);
  static constexpr size_t kBytes = size_t(kMaxTokens) * 8 * 128 * 2;
  DeviceBuffer q{kBytes}, k{kBytes}, v{kBytes}, o{kBytes}, dout{kBytes},
      dq{kBytes}, dk{kBytes}, dv{kBytes}, lse{size_t(kMaxTokens) * 8 * 4};
  std::mt19937_64 rng{20260216};
  std::uniform_int_distribution<int> pct{0, 99};

  LeakRig() {
    for (DeviceBuffer *b : {&q, &k, &v, &dout})
      check(cudaMemset(b->ptr, 0x3c, b->bytes), "fill"); // ~1 in 16 bits
    check(cudaDeviceSynchronize(), "fill");
  }

  /// A random problem: 1-3 groups, P 1-300, 0-4 responses of 0-200, heads
  /// 4:1 or 8:2, head_dim 64 or 128, bf16 or fp16.
  Case randomProblem() {
    Case c;
    for (int g = 1 + pct(rng) % kMaxGroups; g > 0; --g) {
      PlanGroup grp{logUniform(rng, 1, kMaxPrompt), {}};
      for (int r = pct(rng) % (kMaxResponses + 1); r > 0; --r)
        grp.response_lens.push_back(
            pct(rng) < 15 ? 0 : logUniform(rng, 1, kMaxResponse));
      c.groups.push_back(grp);
    }
    c.hkv = 1 + pct(rng) % 2;
    c.hq = c.hkv * 4;
    c.d = pct(rng) % 2 ? 64 : 128;
    c.dtype = pct(rng) % 2 ? DType::BF16 : DType::FP16;
    return c;
  }

  BackwardArgs backwardArgs(const Case &c, const Plan &plan,
                            cudaStream_t stream) {
    auto t = [&](DeviceBuffer &b, int heads) {
      return TensorArg{b.ptr, int64_t(heads) * c.d, c.d};
    };
    BackwardArgs a;
    setProblem(a, c, plan);
    a.q = t(q, c.hq);
    a.k = t(k, c.hkv);
    a.v = t(v, c.hkv);
    a.o = t(o, c.hq);
    a.dout = t(dout, c.hq);
    a.dq = t(dq, c.hq);
    a.dk = t(dk, c.hkv);
    a.dv = t(dv, c.hkv);
    a.lse = static_cast<const float *>(lse.ptr);
    a.stream = stream;
    return a;
  }

  /// A forward (even n) or backward (odd n) of `c` over a plan that lives
  /// for this call only, synchronised.
  void launch(const Case &c, int n, cudaStream_t stream, bool deterministic) {
    Plan plan(c.groups);
    BackwardArgs b = backwardArgs(c, plan, stream);
    if (n % 2 == 0) {
      ForwardArgs a;
      setProblem(a, c, plan);
      a.q = b.q;
      a.k = b.k;
      a.v = b.v;
      a.o = b.o;
      a.lse = static_cast<float *>(lse.ptr);
      a.stream = stream;
      dualkv::forward(a);
    } else {
      b.deterministic = deterministic;
      dualkv::backward(b);
    }
    // The plan dies here: its device table must not outlive the launch.
    check(cudaStreamSynchronize(stream), "launch");
  }

  /// The largest runtime workspace any problem here needs.
  int64_t maxWorkspaceBytes() {
    Case c;
    c.groups.assign(kMaxGroups,
                    PlanGroup{kMaxPrompt, std::vector<int64_t>(kMaxResponses,
                                                               kMaxResponse)});
    c.hq = 8;
    c.hkv = 2;
    c.d = 128;
    Plan plan(c.groups);
    BackwardArgs b = backwardArgs(c, plan, nullptr);
    int64_t bytes = backwardWorkspaceBytes(b);
    b.deterministic = true;
    return std::max(bytes, backwardWorkspaceBytes(b));
  }
};

/// `launches` forward or backward calls, each over a new random plan (a plan
/// is created and destroyed per call, its segment table uploaded and freed),
/// in preallocated buffers on one stream: after a warm-up that loads every
/// kernel variant and grows the stream's workspace to its largest, device
/// memory, host RSS and the number of loaded kernels must stay flat; every
/// 1000th call is checked against the reference. Then 400 calls on a new
/// stream every 10: the runtime's per-stream workspaces stay bounded
/// (kMaxOwnedWorkspaces).
int testLeak(int launches) {
  LeakRig rig;
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const int64_t maxWorkspace = rig.maxWorkspaceBytes();
  {
    // The largest problem in both modes: the stream's workspace at its
    // largest from the start.
    Case c;
    c.groups.assign(LeakRig::kMaxGroups,
                    PlanGroup{LeakRig::kMaxPrompt,
                              std::vector<int64_t>(LeakRig::kMaxResponses,
                                                   LeakRig::kMaxResponse)});
    c.hq = 8;
    c.hkv = 2;
    c.d = 128;
    rig.launch(c, 1, stream, false);
    rig.launch(c, 1, stream, true);
  }

  const int warmup = std::min(1000, launches / 2);
  int64_t rss0 = 0, dev0 = 0;
  CacheStats stats0;
  int failures = 0;
  for (int n = 0; n < launches; ++n) {
    if (n == warmup) {
      check(cudaDeviceSynchronize(), "sync");
      rss0 = residentBytes();
      dev0 = deviceUsedBytes();
      stats0 = cacheStats();
    }
    Case c = rig.randomProblem();
    const bool deterministic = rig.pct(rig.rng) < 30;
    if (n % 1000 == 999) {
      // A real case through the harness, checked against the reference.
      std::mt19937_64 fillRng{uint64_t(n)};
      c.fill(fillRng);
      c.fillGrad(fillRng);
      Outputs got = StreamRunner(c, stream).run(deterministic);
      std::string error = forwardReferenceError(c, got.fwd);
      if (error.empty())
        error = backwardReferenceError(c, got.fwd, got.bwd);
      if (!error.empty()) {
        fmt::print("FAIL launch {}: {}\n", n, error);
        ++failures;
      }
      continue;
    }
    rig.launch(c, n, stream, deterministic);
  }
  check(cudaDeviceSynchronize(), "sync");
  const int64_t rssGrowth = residentBytes() - rss0;
  const int64_t dev1 = deviceUsedBytes();
  const int64_t devGrowth = dev1 - dev0;
  const CacheStats stats = cacheStats();
  const int64_t loads =
      int64_t(stats.compiles + stats.diskHits + stats.aotHits) -
      int64_t(stats0.compiles + stats0.diskHits + stats0.aotHits);
  fmt::print("stress_leak: {} launches over random plans; after {} warm-up "
             "launches: device memory {:+} B, host RSS {:+} B, kernels "
             "loaded {:+}\n",
             launches, warmup, devGrowth, rssGrowth, loads);
  // Flat: a few MiB of slack for the driver's and allocator's own pools; a
  // leak of one segment table per launch would be far more.
  if (devGrowth > (8 << 20)) {
    fmt::print("FAIL device memory grew by {} B\n", devGrowth);
    ++failures;
  }
  if (rssGrowth > (16 << 20)) {
    fmt::print("FAIL host RSS grew by {} B\n", rssGrowth);
    ++failures;
  }
  if (loads != 0) {
    fmt::print("FAIL {} kernels loaded after the warm-up: the kernel cache "
               "grows with plans\n",
               loads);
    ++failures;
  }

  // A stream per 10 calls: at most kMaxOwnedWorkspaces workspaces (each at
  // most the largest, with the runtime's headroom) are ever held.
  for (int n = 0; n < 400; ++n) {
    if (n % 10 == 0) {
      check(cudaStreamDestroy(stream), "stream");
      check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
            "stream");
    }
    rig.launch(rig.randomProblem(), 2 * n + 1, stream, n % 3 == 0);
  }
  check(cudaDeviceSynchronize(), "sync");
  const int64_t churn = deviceUsedBytes() - dev1;
  const int64_t bound = int64_t(kMaxOwnedWorkspaces) *
                            (maxWorkspace + maxWorkspace / 8 + (2 << 20)) +
                        (8 << 20);
  fmt::print("stress_leak: 400 backward calls on 40 streams: device memory "
             "{:+} B (bound {} B)\n",
             churn, bound);
  if (churn > bound) {
    fmt::print("FAIL device memory grew by {} B over 40 streams\n", churn);
    ++failures;
  }
  check(cudaStreamDestroy(stream), "stream");
  return failures ? 1 : 0;
}

} // namespace

int dualkv::testing::stressTest(const std::string &which, int count,
                                char **argv) {
  if (which == "threads")
    return testThreads(count > 0 ? count : 3);
  if (which == "processes")
    return testProcesses(count > 0 ? count : 3, argv);
  if (which == "worker")
    return worker(argv && argv[0] ? std::atoi(argv[0]) : 0,
                  count > 0 ? count : 3);
  if (which == "leak")
    return testLeak(count > 0 ? count : 10000);
  return kUnknownTest;
}
