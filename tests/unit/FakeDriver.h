// Test helpers shared by the runtime tests: a fake CUDA driver, scoped
// environment variables and temp folders.
#ifndef DUALKV_TESTS_UNIT_FAKEDRIVER_H
#define DUALKV_TESTS_UNIT_FAKEDRIVER_H

#include "cache/DiskCache.h"
#include "driver/CudaDriver.h"
#include "driver/Launch.h"
#include "operations/Workspace.h"
#include "plans/WorkItems.h"
#include "selection/Background.h"
#include "selection/Select.h"
#include "support/Status.h"

#include "dualkv/Reference.h"
#include "dualkv/dualkv.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace dualkv::testing {

/// A fresh directory, removed with everything in it at scope exit.
struct TempDir {
  std::string path;
  TempDir() {
    namespace fs = std::filesystem;
    std::random_device random;
    fs::path p =
        fs::temp_directory_path() /
        fmt::format("dualkv-runtime-test-{:08x}{:08x}", random(), random());
    REQUIRE(fs::create_directory(p));
    // The user's alone whatever the umask: a cache root must be.
    fs::permissions(p, fs::perms::owner_all);
    path = p.string();
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

/// Sets (or, with nullopt, unsets) an environment variable for one scope.
struct ScopedEnv {
  std::string name;
  std::optional<std::string> saved;
  ScopedEnv(const char *n, std::optional<std::string> value) : name(n) {
    if (const char *old = std::getenv(n))
      saved = old;
    if (value)
      setenv(n, value->c_str(), 1);
    else
      unsetenv(n);
  }
  ~ScopedEnv() {
    if (saved)
      setenv(name.c_str(), saved->c_str(), 1);
    else
      unsetenv(name.c_str());
  }
};

/// The bytes of a file the test wrote.
inline std::string readFile(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

/// Replaces a file's bytes.
inline void writeFile(const std::string &path, const std::string &bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
  REQUIRE(out.good());
}

/// A cache key and an entry of a forward kernel for sm_90a, for cache tests.
inline CacheKey sampleKey() {
  CacheKey key;
  key.kind = KernelKind::Fwd;
  key.P = 0;
  key.N = 0;
  key.headDim = 128;
  key.numQHeads = 32;
  key.numKVHeads = 8;
  key.dtype = DType::BF16;
  key.arch = "sm_90a";
  key.tiling = Tiling{128, 64, 8, 2};
  key.schedule = Schedule::Wgmma;
  key.compilerFingerprint = "test-fingerprint";
  return key;
}

inline CacheEntry sampleEntry() {
  CacheEntry entry;
  entry.info = KernelInfo{"dualkv_fwd_test", 256, 96 * 1024, 128};
  entry.ptx = "//\n// fake PTX\n.version 8.0\n.target sm_90a\n";
  for (int i = 0; i < 1000; ++i)
    entry.cubin.push_back(static_cast<char>(i * 7));
  return entry;
}

/// The Error `body` throws, or nullopt if it returns.
template <typename F> std::optional<Error> errorOf(F &&body) {
  try {
    body();
  } catch (const Error &e) {
    return e;
  }
  return std::nullopt;
}

/// A change to valid arguments, and a part of the message that refuses it.
template <typename Args>
using Refusal = std::pair<std::function<void(Args &)>, std::string>;

/// For each of `cases`: `call` on `valid` changed by the case throws an
/// InvalidArgument Error whose message contains the case's text.
template <typename Args, typename Call>
void checkRefusals(const std::vector<Refusal<Args>> &cases, const Args &valid,
                   Call call) {
  for (const auto &[mutate, expected] : cases) {
    CAPTURE(expected);
    Args args = valid;
    mutate(args);
    std::optional<Error> e = errorOf([&] { call(args); });
    REQUIRE(e);
    CHECK(e->code() == ErrorCode::InvalidArgument);
    CHECK_THAT(e->what(), Catch::Matchers::Contains(expected));
  }
}

/// The parts (code, message, cause) of `error`, which must be a failure;
/// consumes it.
inline ErrorParts partsOf(llvm::Error error) {
  const bool failed = static_cast<bool>(error);
  REQUIRE(failed);
  return takeErrorParts(std::move(error));
}
template <typename T> ErrorParts partsOf(llvm::Expected<T> value) {
  return partsOf(value.takeError());
}

/// The message of a failure (an llvm::Error or an Expected that holds one).
template <typename E> std::string messageOf(E &&failure) {
  return partsOf(std::forward<E>(failure)).message;
}

/// The ErrorCode of a failure (an llvm::Error or an Expected that holds one).
template <typename E> ErrorCode codeOf(E &&failure) {
  return partsOf(std::forward<E>(failure)).code;
}

/// Requires `error` to be a success, else fails with its message.
inline void requireSuccess(llvm::Error error) {
  if (error)
    FAIL(takeErrorParts(std::move(error)).message);
}

/// The value of `value`, which must be a success (else the test fails with
/// its message).
template <typename T> T valueOf(llvm::Expected<T> value) {
  if (!value)
    FAIL(takeErrorParts(value.takeError()).message);
  return std::move(*value);
}

inline void *fakePointer(uintptr_t address) {
  return reinterpret_cast<void *>(address);
}

/// A CUDA driver that needs no GPU: it records what the runtime asks of it
/// and answers with configurable results.
struct FakeDriver : cuda::Driver {
  using CUresult = cuda::CUresult;

  // Configuration.
  CUresult initResult = cuda::CUDA_SUCCESS;
  int deviceCount = 1;
  int ccMajor = 9, ccMinor = 0;
  CUresult cubinLoadResult = cuda::CUDA_SUCCESS;
  CUresult ptxLoadResult = cuda::CUDA_SUCCESS;
  cuda::CUcontext current = nullptr; ///< null: no context is current
  cuda::CUcontext primary = reinterpret_cast<cuda::CUcontext>(0xC0);
  /// Parameter sizes in bytes (8 or 4) of kernels by entry-point name: a
  /// launch of one of these is decoded into `events`; any other launch is
  /// taken for the forward and decoded into `last`.
  std::map<std::string, std::vector<int>> signatures;

  // Observations.
  int inits = 0, primaryRetains = 0, cubinLoads = 0, ptxLoads = 0, unloads = 0,
      allocs = 0, frees = 0, launches = 0, streamSyncs = 0, ctxSyncs = 0;
  /// Synchronisations of the legacy default stream (stream 0), counted
  /// apart from streamSyncs; host-to-device copies since the last one (a
  /// real copy from pageable memory may still be in flight until then); and
  /// launches made while such a copy was.
  int legacySyncs = 0, copiesInFlight = 0, launchesBehindCopies = 0;
  std::vector<std::pair<int, int>> funcAttributes;
  std::vector<cuda::CUdeviceptr> freed; ///< every memFree, in order
  /// Runs once, inside the next recorded launch (a call in flight).
  std::function<void()> onLaunch;
  std::vector<int32_t> uploaded; ///< bytes of the last cuMemcpyHtoD
  /// Every cuMemcpyHtoD by destination, as int32.
  std::map<cuda::CUdeviceptr, std::vector<int32_t>> copies;
  std::map<cuda::CUdeviceptr, size_t> allocSizes;
  struct Launch {
    unsigned grid[3], block[3], shared;
    cuda::CUstream stream;
    uint64_t ptrs[6];
    int64_t strides[9];
    float scaleLog2;
    uint64_t workOrder;
  } last{};
  /// Whether launches carry the warp-specialized forward's work order.
  bool captureWorkOrder = false;
  /// Stream work in order: a memset (name "memset") or a launch of a kernel
  /// with a signature (its name and parameters, 4-byte ones zero-extended).
  struct Event {
    std::string name;
    unsigned grid[3] = {0, 0, 0}, block[3] = {0, 0, 0}, shared = 0;
    cuda::CUstream stream = nullptr;
    std::vector<uint64_t> params; ///< memset: {dst, value, count}
  };
  std::vector<Event> events;
  std::map<std::string, cuda::CUfunction> functions;

  CUresult init(unsigned) override {
    ++inits;
    return initResult;
  }
  CUresult deviceGetCount(int *count) override {
    *count = deviceCount;
    return cuda::CUDA_SUCCESS;
  }
  CUresult deviceGet(cuda::CUdevice *device, int ordinal) override {
    if (ordinal >= deviceCount)
      return cuda::CUDA_ERROR_NO_DEVICE;
    *device = ordinal;
    return cuda::CUDA_SUCCESS;
  }
  CUresult deviceGetAttribute(int *value, int attribute,
                              cuda::CUdevice) override {
    if (attribute == cuda::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
      *value = ccMajor;
    else if (attribute == cuda::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
      *value = ccMinor;
    else
      return cuda::CUDA_ERROR_INVALID_VALUE;
    return cuda::CUDA_SUCCESS;
  }
  CUresult ctxGetCurrent(cuda::CUcontext *ctx) override {
    *ctx = current;
    return cuda::CUDA_SUCCESS;
  }
  CUresult ctxSetCurrent(cuda::CUcontext ctx) override {
    current = ctx;
    return cuda::CUDA_SUCCESS;
  }
  CUresult ctxGetDevice(cuda::CUdevice *device) override {
    *device = 0;
    return current ? cuda::CUDA_SUCCESS : 201; // CUDA_ERROR_INVALID_CONTEXT
  }
  CUresult ctxSynchronize() override {
    ++ctxSyncs;
    return cuda::CUDA_SUCCESS;
  }
  CUresult devicePrimaryCtxRetain(cuda::CUcontext *ctx,
                                  cuda::CUdevice) override {
    ++primaryRetains;
    *ctx = primary;
    return cuda::CUDA_SUCCESS;
  }
  CUresult moduleLoadData(cuda::CUmodule *module, const void *) override {
    ++cubinLoads;
    *module = reinterpret_cast<cuda::CUmodule>(0x3000 + cubinLoads);
    return cubinLoadResult;
  }
  CUresult moduleLoadDataEx(cuda::CUmodule *module, const void *image, unsigned,
                            cuda::CUjit_option *, void **) override {
    ++ptxLoads;
    lastPtx = static_cast<const char *>(image);
    *module = reinterpret_cast<cuda::CUmodule>(0x4000 + ptxLoads);
    return ptxLoadResult;
  }
  CUresult moduleUnload(cuda::CUmodule) override {
    ++unloads;
    return cuda::CUDA_SUCCESS;
  }
  CUresult moduleGetFunction(cuda::CUfunction *f, cuda::CUmodule,
                             const char *name) override {
    lastFunctionName = name;
    // One handle per entry-point name, so launches can be told apart.
    auto it = functions.find(name);
    if (it == functions.end())
      it = functions
               .emplace(name, reinterpret_cast<cuda::CUfunction>(
                                  0x5000 + 0x10 * functions.size()))
               .first;
    *f = it->second;
    return cuda::CUDA_SUCCESS;
  }
  CUresult funcSetAttribute(cuda::CUfunction, int attribute,
                            int value) override {
    funcAttributes.emplace_back(attribute, value);
    return cuda::CUDA_SUCCESS;
  }
  std::string nameOf(cuda::CUfunction f) const {
    for (const auto &[name, handle] : functions)
      if (handle == f)
        return name;
    return "?";
  }
  CUresult launchKernel(cuda::CUfunction f, unsigned gx, unsigned gy,
                        unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, cuda::CUstream stream, void **params,
                        void **) override {
    ++launches;
    launchesBehindCopies += copiesInFlight > 0;
    std::string name = nameOf(f);
    lastLaunchName = name;
    if (auto sig = signatures.find(name); sig != signatures.end()) {
      Event e{name, {gx, gy, gz}, {bx, by, bz}, shared, stream, {}};
      for (size_t i = 0; i < sig->second.size(); ++i) {
        uint64_t value = 0;
        std::memcpy(&value, params[i], sig->second[i]);
        e.params.push_back(value);
      }
      events.push_back(std::move(e));
      if (onLaunch) {
        // Once: what runs here may launch again.
        std::function<void()> hook = std::move(onLaunch);
        onLaunch = nullptr;
        hook();
      }
      return cuda::CUDA_SUCCESS;
    }
    last = Launch{{gx, gy, gz}, {bx, by, bz}, shared, stream, {}, {}, 0, 0};
    for (int i = 0; i < 6; ++i)
      std::memcpy(&last.ptrs[i], params[i], sizeof(uint64_t));
    for (int i = 0; i < 9; ++i)
      std::memcpy(&last.strides[i], params[6 + i], sizeof(int64_t));
    std::memcpy(&last.scaleLog2, params[15], sizeof(float));
    if (captureWorkOrder) // the warp-specialized forward: 3 tensor maps first
      std::memcpy(&last.workOrder, params[19], sizeof(uint64_t));
    return cuda::CUDA_SUCCESS;
  }
  CUresult memAlloc(cuda::CUdeviceptr *ptr, size_t bytes) override {
    ++allocs;
    *ptr = 0x7000000 + 0x1000 * allocs;
    allocSizes[*ptr] = bytes;
    return cuda::CUDA_SUCCESS;
  }
  CUresult memFree(cuda::CUdeviceptr ptr) override {
    ++frees;
    freed.push_back(ptr);
    return cuda::CUDA_SUCCESS;
  }
  CUresult memcpyHtoD(cuda::CUdeviceptr dst, const void *src,
                      size_t bytes) override {
    uploaded.resize(bytes / sizeof(int32_t));
    std::memcpy(uploaded.data(), src, bytes);
    copies[dst] = uploaded;
    ++copiesInFlight;
    return cuda::CUDA_SUCCESS;
  }
  CUresult memcpyDtoH(void *, cuda::CUdeviceptr, size_t) override {
    return cuda::CUDA_SUCCESS;
  }
  CUresult memsetD32(cuda::CUdeviceptr, unsigned, size_t) override {
    return cuda::CUDA_SUCCESS;
  }
  CUresult memsetD32Async(cuda::CUdeviceptr dst, unsigned value, size_t count,
                          cuda::CUstream stream) override {
    Event e;
    e.name = "memset";
    e.stream = stream;
    e.params = {dst, value, count};
    events.push_back(std::move(e));
    return cuda::CUDA_SUCCESS;
  }
  CUresult streamSynchronize(cuda::CUstream stream) override {
    if (stream) {
      ++streamSyncs;
    } else {
      ++legacySyncs;
      copiesInFlight = 0;
    }
    return cuda::CUDA_SUCCESS;
  }
  CUresult getErrorString(CUresult, const char **str) override {
    *str = "fake description";
    return cuda::CUDA_SUCCESS;
  }
  CUresult getErrorName(CUresult e, const char **str) override {
    switch (e) {
    case 2:
      *str = "CUDA_ERROR_OUT_OF_MEMORY";
      return cuda::CUDA_SUCCESS;
    case cuda::CUDA_ERROR_NO_BINARY_FOR_GPU:
      *str = "CUDA_ERROR_NO_BINARY_FOR_GPU";
      return cuda::CUDA_SUCCESS;
    case 218:
      *str = "CUDA_ERROR_INVALID_PTX";
      return cuda::CUDA_SUCCESS;
    }
    return cuda::CUDA_ERROR_INVALID_VALUE;
  }
  /// Records the shape of the last tensor map (rank, dims, strides, box).
  CUresult tensorMapEncodeTiled(cuda::CUtensorMap *map, int, unsigned rank,
                                void *, const uint64_t *dims,
                                const uint64_t *strides, const uint32_t *box,
                                const uint32_t *, int, int, int, int) override {
    ++tensorMaps;
    *map = {};
    lastTensorMapDims.assign(dims, dims + rank);
    lastTensorMapStrides.assign(strides, strides + rank - 1);
    lastTensorMapBox.assign(box, box + rank);
    return cuda::CUDA_SUCCESS;
  }

  int tensorMaps = 0;
  std::vector<uint64_t> lastTensorMapDims, lastTensorMapStrides;
  std::vector<uint32_t> lastTensorMapBox;
  std::string lastPtx, lastFunctionName;
  /// The entry point of the last launch (lastFunctionName is the last one
  /// looked up, which a kernel already loaded skips).
  std::string lastLaunchName;
};

/// Installs a fake driver for one scope; the kernel cache and the backward's
/// workspaces are emptied on both sides so nothing outlives the driver that
/// made it.
struct ScopedFakeDriver {
  FakeDriver fake;
  ScopedFakeDriver() {
    clearKernelCache();
    clearBackwardWorkspaces();
    cuda::setDriverForTesting(&fake);
  }
  ~ScopedFakeDriver() {
    clearKernelCache();
    clearBackwardWorkspaces();
    cuda::setDriverForTesting(nullptr);
  }
};

/// Tiles of the deterministic backward: one per blockM keys of a segment.
inline int64_t countTiles(const std::vector<PlanGroup> &groups, int blockM) {
  int64_t tiles = 0;
  for (const PlanGroup &g : groups) {
    tiles += (g.prompt_len + blockM - 1) / blockM;
    for (int64_t r : g.response_lens)
      tiles += (r + blockM - 1) / blockM;
  }
  return tiles;
}

/// The reference's groups of `groups`.
inline std::vector<reference::Group>
refGroups(const std::vector<PlanGroup> &groups) {
  std::vector<reference::Group> out;
  for (const PlanGroup &g : groups)
    out.push_back({g.prompt_len, g.response_lens});
  return out;
}

/// Checks a work-item table against docs/architecture.md §1 by brute force:
/// every allowed (key, query) pair is visited by exactly one item, no other
/// pair with key <= query is; tiles are disjoint, stay in one segment and cover
/// every token; accumulator rows map back to their keys; every split tile
/// owns its rows, an unsplit tile is its keys' only item; chunks are at
/// most `chunk` long; items are sorted longest first (unless !longestFirst,
/// for another order, which the caller checks).
inline void checkItems(const std::vector<PlanGroup> &groups, int blockM,
                       int64_t chunk, const std::vector<int32_t> &items,
                       const std::vector<int32_t> &accTokens,
                       bool longestFirst = true) {
  reference::Problem problem{refGroups(groups), 1, 1, 64, 1.0};
  std::vector<reference::TokenInfo> info = reference::token_info(problem);
  const int64_t T = static_cast<int64_t>(info.size());
  REQUIRE(items.size() % kBwdItemFields == 0);
  const size_t n = items.size() / kBwdItemFields;

  // [key][query]; a byte is enough, any count above 1 is an error.
  std::vector<uint8_t> visits(T * T, 0);
  std::map<int32_t, std::vector<size_t>> byTile;
  std::vector<int> accRowUses(accTokens.size(), 0);
  int64_t previousLength = INT64_MAX;
  for (size_t it = 0; it < n; ++it) {
    const int32_t *f = &items[it * kBwdItemFields];
    const int32_t k0 = f[0], kvEnd = f[1], qb = f[2], qe = f[3], acc = f[4];
    CAPTURE(it, k0, kvEnd, qb, qe, acc);
    REQUIRE(f[5] == 0);
    REQUIRE(0 <= k0);
    REQUIRE(k0 < kvEnd);
    REQUIRE(kvEnd <= T);
    REQUIRE(k0 <= qb);
    REQUIRE(qb < qe);
    REQUIRE(qe <= T);
    if (info[k0].response < 0) // a prompt tile: its queries come in chunks
      CHECK(qe - qb <= chunk);
    if (longestFirst)
      CHECK(qe - qb <= previousLength);
    previousLength = qe - qb;
    // The tile ends where its segment ends (or blockM keys later).
    const int64_t seg = info[k0].segment_start;
    CHECK(info[kvEnd - 1].segment_start == seg);
    CHECK((kvEnd == T || info[kvEnd].segment_start != seg));
    CHECK((k0 - seg) % blockM == 0);
    byTile[k0].push_back(it);
    const int32_t keyEnd = std::min(k0 + blockM, kvEnd);
    for (int32_t j = k0; j < keyEnd; ++j)
      for (int32_t i = std::max(qb, j); i < qe; ++i)
        ++visits[j * T + i];
    if (acc >= 0) {
      REQUIRE(acc + (keyEnd - k0) <= static_cast<int64_t>(accTokens.size()));
      int32_t mapped = 0; // rows that name their own key
      for (int32_t r = 0; r < keyEnd - k0; ++r)
        mapped += accTokens[acc + r] == k0 + r;
      CHECK(mapped == keyEnd - k0);
    }
  }
  // Counted first, so that a pass costs one assertion, not T^2.
  int64_t wrong = 0, firstKey = -1, firstQuery = -1;
  for (int64_t j = 0; j < T; ++j)
    for (int64_t i = j; i < T; ++i)
      if (int(visits[j * T + i]) != (reference::allowed(info, i, j) ? 1 : 0) &&
          wrong++ == 0) {
        firstKey = j;
        firstQuery = i;
      }
  CAPTURE(firstKey, firstQuery);
  CHECK(wrong == 0);

  // Tiles: disjoint, covering every token; accumulator rows per tile.
  std::vector<int> tileOf(T, 0);
  for (const auto &[k0, its] : byTile) {
    const int32_t *first = &items[its[0] * kBwdItemFields];
    const int32_t keyEnd = std::min(k0 + blockM, first[1]);
    for (int32_t j = k0; j < keyEnd; ++j)
      ++tileOf[j];
    for (size_t it : its) {
      // Every item of a tile agrees on kvEnd and accRow.
      CHECK(items[it * kBwdItemFields + 1] == first[1]);
      CHECK(items[it * kBwdItemFields + 4] == first[4]);
    }
    if (first[4] < 0) {
      CHECK(its.size() == 1); // writes dK/dV directly: the only one
    } else {
      CHECK(its.size() > 1); // accumulates only when split
      for (int32_t r = 0; r < keyEnd - k0; ++r)
        ++accRowUses[first[4] + r];
    }
  }
  CHECK(std::count(tileOf.begin(), tileOf.end(), 1) == T);
  CHECK(std::count(accRowUses.begin(), accRowUses.end(), 1) ==
        static_cast<int64_t>(accRowUses.size()));
}

/// `bytes` rounded up to the workspace's 256-byte alignment.
inline int64_t align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

} // namespace dualkv::testing

#endif
