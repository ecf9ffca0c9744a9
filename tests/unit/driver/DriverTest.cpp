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
  requireSuccess(cuda::currentContext().takeError());
  CHECK(valueOf(cuda::currentDeviceArch()) == "sm_86");
}

TEST_CASE("driver: CUDA errors name the call and the error", "[runtime]") {
  ScopedFakeDriver scoped;
  requireSuccess(cuda::check(cuda::CUDA_SUCCESS, "cuNothing"));
  ErrorParts e = partsOf(cuda::check(2, "cuMemAlloc"));
  CHECK(e.code == ErrorCode::Cuda);
  CHECK_THAT(e.message, Contains("cuMemAlloc failed") &&
                            Contains("CUDA_ERROR_OUT_OF_MEMORY") &&
                            Contains("fake description"));
  // cuInit failing at the first use is reported, not hidden.
  scoped.fake.initResult = cuda::CUDA_ERROR_NO_DEVICE;
  ErrorParts init = partsOf(cuda::currentContext());
  CHECK(init.code == ErrorCode::NoGpu);
  CHECK_THAT(init.message, Contains("cuInit"));
}

TEST_CASE("modules: cubin first, PTX when the cubin does not fit",
          "[runtime]") {
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  bool fromPtx = true;
  {
    ModuleHandle m = valueOf(loadModule(fake, sampleEntry(), &fromPtx));
    CHECK(m.get() != nullptr);
    CHECK_FALSE(fromPtx);
    CHECK(fake.cubinLoads == 1);
    CHECK(fake.ptxLoads == 0);
  }
  CHECK(fake.unloads == 1); // RAII

  fake.cubinLoadResult = cuda::CUDA_ERROR_NO_BINARY_FOR_GPU;
  ModuleHandle jit = valueOf(loadModule(fake, sampleEntry(), &fromPtx));
  CHECK(fromPtx);
  CHECK(fake.ptxLoads == 1);
  CHECK(fake.lastPtx == sampleEntry().ptx);

  fake.cubinLoadResult = cuda::CUDA_ERROR_INVALID_IMAGE;
  valueOf(loadModule(fake, sampleEntry(), &fromPtx));
  CHECK(fake.ptxLoads == 2);

  CacheEntry noCubin = sampleEntry();
  noCubin.cubin.clear();
  fake.cubinLoadResult = cuda::CUDA_SUCCESS;
  int cubinLoads = fake.cubinLoads;
  valueOf(loadModule(fake, noCubin, &fromPtx));
  CHECK(fromPtx);
  CHECK(fake.cubinLoads == cubinLoads);

  // Other failures are errors, not silent fallbacks.
  fake.cubinLoadResult = 2;
  CHECK_THAT(messageOf(loadModule(fake, sampleEntry(), nullptr)),
             Contains("CUDA_ERROR_OUT_OF_MEMORY"));
  fake.cubinLoadResult = cuda::CUDA_SUCCESS;
  fake.ptxLoadResult = 218;
  CHECK_THAT(messageOf(loadModule(fake, noCubin, nullptr)),
             Contains("CUDA_ERROR_INVALID_PTX"));
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
  ErrorParts unset = partsOf(params.data());
  CHECK(unset.code == ErrorCode::Internal);
  CHECK_THAT(unset.message, Contains("parameter 'k' is not set"));
  for (const char *name : {"k", "v", "o", "lse", "segs"})
    params.ptr(name, p);
  for (const char *name :
       {"qStrideT", "qStrideH", "kStrideT", "kStrideH", "vStrideT", "vStrideH",
        "oStrideT", "oStrideH", "lseStrideH"})
    params.i64(name, i);
  void **slots = valueOf(params.data());
  CHECK(slots[0] == &p);
  CHECK(slots[6] == &i);
  CHECK(slots[15] == &f);
  // A name or a type the table does not declare: the setter's error is
  // kept, and data() reports it.
  for (auto bad : std::vector<std::function<void()>>{
           [&] { params.ptr("dout", p); }, [&] { params.i64("q", i); },
           [&] { params.f32("qStrideT", f); }}) {
    bad();
    ErrorParts e = partsOf(params.data());
    CHECK(e.code == ErrorCode::Internal);
    CHECK_THAT(e.message, Contains("of that type"));
  }
  CHECK(valueOf(params.data()) == slots); // each error is reported once
}
