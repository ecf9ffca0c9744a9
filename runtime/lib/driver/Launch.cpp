// Launching a loaded kernel: its parameters by name, and TMA tensor maps.
#include "driver/Launch.h"

#include "support/Status.h"

#include <fmt/format.h>

#include <string>
#include <utility>

namespace dualkv {

namespace {
llvm::Error tooManyParameters() {
  return internalError("a kernel takes too many parameters");
}
} // namespace

LaunchParams::LaunchParams(KernelKind kind, Schedule schedule, bool tree,
                           bool dlse, bool sinks, bool window,
                           int scoreModInputs)
    : kind(kind), table(abi::kernelParams(kind, schedule, tree, dlse, sinks,
                                          window, scoreModInputs)) {}

LaunchParams::~LaunchParams() { llvm::consumeError(std::move(error_)); }

void LaunchParams::keep(llvm::Error error) {
  if (error_)
    llvm::consumeError(std::move(error));
  else
    error_ = std::move(error);
}

llvm::Error LaunchParams::set(const char *name, void *v, bool pointer,
                              abi::ParamType type) {
  if (table.size > slots.size())
    return tooManyParameters();
  int i = table.indexOf(name);
  abi::ParamType declared = i < 0 ? type : table.params[i].type;
  bool declaredPointer = declared != abi::ParamType::I64 &&
                         declared != abi::ParamType::F32 &&
                         declared != abi::ParamType::TensorMap;
  if (i < 0 || pointer != declaredPointer || (!pointer && declared != type))
    return internalError(
        fmt::format("the {} kernel has no parameter '{}' of that type",
                    toString(kind), name));
  slots[static_cast<size_t>(i)] = v;
  return llvm::Error::success();
}

LaunchParams &LaunchParams::ptr(const char *name, uint64_t &v) {
  keep(set(name, &v, true, abi::ParamType::ElemPtr));
  return *this;
}
LaunchParams &LaunchParams::i64(const char *name, int64_t &v) {
  keep(set(name, &v, false, abi::ParamType::I64));
  return *this;
}
LaunchParams &LaunchParams::strides(const char *tensor, int64_t &t,
                                    int64_t &h) {
  return i64((std::string(tensor) + "StrideT").c_str(), t)
      .i64((std::string(tensor) + "StrideH").c_str(), h);
}
LaunchParams &LaunchParams::f32(const char *name, float &v) {
  keep(set(name, &v, false, abi::ParamType::F32));
  return *this;
}
LaunchParams &LaunchParams::tensorMap(const char *name, cuda::CUtensorMap &v) {
  keep(set(name, &v, false, abi::ParamType::TensorMap));
  return *this;
}

llvm::Expected<void **> LaunchParams::data() {
  if (table.size > slots.size())
    return tooManyParameters();
  if (error_)
    return std::exchange(error_, llvm::Error::success());
  for (size_t i = 0; i < table.size; ++i)
    if (!slots[i])
      return internalError(
          fmt::format("the {} kernel's parameter '{}' is not set",
                      toString(kind), table.params[i].name));
  return slots.data();
}

llvm::Error launch(const LoadedKernel &kernel, unsigned gridX, unsigned gridY,
                   unsigned gridZ, void *stream, LaunchParams &launchParams) {
  void **params = nullptr;
  if (llvm::Error e = launchParams.data().moveInto(params))
    return e;
  llvm::Expected<cuda::Driver &> driver = cuda::driver();
  if (!driver)
    return driver.takeError();
  const KernelInfo &info = kernel.info;
  cuda::CUresult r = driver->launchKernel(
      kernel.function, gridX, gridY, gridZ, static_cast<unsigned>(info.threads),
      1, 1, static_cast<unsigned>(info.sharedBytes),
      static_cast<cuda::CUstream>(stream), params, nullptr);
  if (r == cuda::CUDA_SUCCESS)
    return llvm::Error::success();
  return cuda::check(r, fmt::format("cuLaunchKernel({}, grid {}x{}x{}, block "
                                    "{}, {} B shared)",
                                    info.name, gridX, gridY, gridZ,
                                    info.threads, info.sharedBytes)
                            .c_str());
}

llvm::Expected<cuda::CUtensorMap> tensorMap(void *data, int64_t strideT,
                                            int64_t strideH, int64_t numTokens,
                                            int heads, int headDim, DType dtype,
                                            int rows) {
  // The caller has checked the pointer (16-byte aligned) and the strides
  // (multiples of 8 elements), which TMA needs too. A size-1 dimension's
  // stride is never used (PyTorch gives such dimensions odd strides): any
  // multiple of 16 bytes serves the tensor map.
  const uint64_t elem = 2;
  strideH = heads == 1 ? headDim : strideH;
  strideT = numTokens == 1 ? int64_t(heads) * strideH : strideT;
  uint64_t dims[3] = {uint64_t(headDim), uint64_t(heads), uint64_t(numTokens)};
  uint64_t strides[2] = {uint64_t(strideH) * elem, uint64_t(strideT) * elem};
  uint32_t box[3] = {64, 1, uint32_t(rows)};
  uint32_t unit[3] = {1, 1, 1};
  llvm::Expected<cuda::Driver &> driver = cuda::driver();
  if (!driver)
    return driver.takeError();
  cuda::CUtensorMap map;
  if (llvm::Error e = cuda::check(
          driver->tensorMapEncodeTiled(
              &map,
              dtype == DType::BF16 ? cuda::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                   : cuda::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
              3, data, dims, strides, box, unit,
              cuda::CU_TENSOR_MAP_INTERLEAVE_NONE,
              cuda::CU_TENSOR_MAP_SWIZZLE_128B,
              cuda::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              cuda::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
          "cuTensorMapEncodeTiled"))
    return e;
  return map;
}

} // namespace dualkv
