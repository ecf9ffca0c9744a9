// The driver layer: the fake driver's cuInit and devices, errors, modules,
// launch parameters by name.
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

TEST_CASE("driver: gpuAvailable follows cuInit and the device count",
          "[runtime]") {
  ScopedFakeDriver scoped;
  SECTION("cuInit fails") {
    scoped.fake.initResult = cuda::CUDA_ERROR_NO_DEVICE;
    CHECK_FALSE(gpuAvailable());
    CHECK(dualkv_gpu_available() == 0);
  }
  SECTION("no device") {
    scoped.fake.deviceCount = 0;
    CHECK_FALSE(gpuAvailable());
  }
  SECTION("one device") { CHECK(gpuAvailable()); }
}

TEST_CASE("driver: arch string from the compute capability", "[runtime]") {
  CHECK(cuda::archForComputeCapability(9, 0) == "sm_90a");
  CHECK(cuda::archForComputeCapability(8, 0) == "sm_80");
  CHECK(cuda::archForComputeCapability(8, 6) == "sm_86");
  CHECK(cuda::archForComputeCapability(8, 9) == "sm_89");
  CHECK(cuda::archForComputeCapability(10, 0) == "sm_100");

  ScopedFakeDriver scoped;
  scoped.fake.ccMajor = 8;
  scoped.fake.ccMinor = 6;
  cuda::currentContext();
  CHECK(cuda::currentDeviceArch() == "sm_86");
}

TEST_CASE("driver: CUDA errors name the call and the error", "[runtime]") {
  ScopedFakeDriver scoped;
  CHECK_NOTHROW(cuda::check(cuda::CUDA_SUCCESS, "cuNothing"));
  std::optional<Error> e = errorOf([] { cuda::check(2, "cuMemAlloc"); });
  REQUIRE(e);
  CHECK(e->code() == ErrorCode::Cuda);
  CHECK_THAT(e->what(), Contains("cuMemAlloc failed") &&
                            Contains("CUDA_ERROR_OUT_OF_MEMORY") &&
                            Contains("fake description"));
  // cuInit failing at the first use is reported, not hidden.
  scoped.fake.initResult = cuda::CUDA_ERROR_NO_DEVICE;
  std::optional<Error> init = errorOf([] { cuda::currentContext(); });
  REQUIRE(init);
  CHECK(init->code() == ErrorCode::NoGpu);
  CHECK_THAT(init->what(), Contains("cuInit"));
}

TEST_CASE("modules: cubin first, PTX when the cubin does not fit",
          "[runtime]") {
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  bool fromPtx = true;
  {
    ModuleHandle m = loadModule(fake, sampleEntry(), &fromPtx);
    CHECK(m.get() != nullptr);
    CHECK_FALSE(fromPtx);
    CHECK(fake.cubinLoads == 1);
    CHECK(fake.ptxLoads == 0);
  }
  CHECK(fake.unloads == 1); // RAII

  fake.cubinLoadResult = cuda::CUDA_ERROR_NO_BINARY_FOR_GPU;
  ModuleHandle jit = loadModule(fake, sampleEntry(), &fromPtx);
  CHECK(fromPtx);
  CHECK(fake.ptxLoads == 1);
  CHECK(fake.lastPtx == sampleEntry().ptx);

  fake.cubinLoadResult = cuda::CUDA_ERROR_INVALID_IMAGE;
  loadModule(fake, sampleEntry(), &fromPtx);
  CHECK(fake.ptxLoads == 2);

  CacheEntry noCubin = sampleEntry();
  noCubin.cubin.clear();
  fake.cubinLoadResult = cuda::CUDA_SUCCESS;
  int cubinLoads = fake.cubinLoads;
  loadModule(fake, noCubin, &fromPtx);
  CHECK(fromPtx);
  CHECK(fake.cubinLoads == cubinLoads);

  // Other failures are errors, not silent fallbacks.
  fake.cubinLoadResult = 2;
  std::optional<Error> e =
      errorOf([&] { loadModule(fake, sampleEntry(), nullptr); });
  REQUIRE(e);
  CHECK_THAT(e->what(), Contains("CUDA_ERROR_OUT_OF_MEMORY"));
  fake.cubinLoadResult = cuda::CUDA_SUCCESS;
  fake.ptxLoadResult = 218;
  e = errorOf([&] { loadModule(fake, noCubin, nullptr); });
  REQUIRE(e);
  CHECK_THAT(e->what(), Contains("CUDA_ERROR_INVALID_PTX"));
}

TEST_CASE("launch parameters are filled by name from the kernel's table",
          "[runtime]") {
  uint64_t p = 0;
  int64_t i = 0;
  float f = 0;
  // Every parameter of the forward set, in any order: data() gives the
  // table's order.
  LaunchParams params(KernelKind::Fwd);
  params.f32("scaleLog2", f).ptr("q", p);
  std::optional<Error> unset = errorOf([&] { params.data(); });
  REQUIRE(unset);
  CHECK(unset->code() == ErrorCode::Internal);
  CHECK_THAT(unset->what(), Contains("parameter 'k' is not set"));
  for (const char *name : {"k", "v", "o", "lse", "segs"})
    params.ptr(name, p);
  for (const char *name :
       {"qStrideT", "qStrideH", "kStrideT", "kStrideH", "vStrideT", "vStrideH",
        "oStrideT", "oStrideH", "lseStrideH"})
    params.i64(name, i);
  void **slots = params.data();
  CHECK(slots[0] == &p);
  CHECK(slots[6] == &i);
  CHECK(slots[15] == &f);
  // A name or a type the table does not declare.
  for (auto bad : std::vector<std::function<void()>>{
           [&] { params.ptr("dout", p); }, [&] { params.i64("q", i); },
           [&] { params.f32("qStrideT", f); }}) {
    std::optional<Error> e = errorOf(bad);
    REQUIRE(e);
    CHECK(e->code() == ErrorCode::Internal);
    CHECK_THAT(e->what(), Contains("of that type"));
  }
}
