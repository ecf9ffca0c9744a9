// Small CUDA-runtime helpers shared by the examples and the GPU tests: device
// buffers and bf16/fp16 conversions on the host.
#ifndef DUALKV_EXAMPLES_CUDA_HELPERS_H
#define DUALKV_EXAMPLES_CUDA_HELPERS_H

#include "dualkv/dualkv.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace dualkv::examples {

/// ctest treats this exit status as "skipped" (SKIP_RETURN_CODE).
constexpr int kSkip = 77;

inline void check(cudaError_t e, const char *what) {
  if (e != cudaSuccess)
    throw std::runtime_error(
        fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

/// True when a CUDA device is usable; the GPU tests skip otherwise.
inline bool haveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0 &&
         dualkv::gpuAvailable();
}

inline uint16_t toBF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f))
    return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1); // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}
inline float fromBF16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t toF16(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}
inline float fromF16(uint16_t u) {
  _Float16 h;
  std::memcpy(&h, &u, 2);
  return static_cast<float>(h);
}
inline uint16_t to16(float f, DType t) {
  return t == DType::BF16 ? toBF16(f) : toF16(f);
}
inline float from16(uint16_t u, DType t) {
  return t == DType::BF16 ? fromBF16(u) : fromF16(u);
}

/// A device allocation freed on scope exit.
struct DeviceBuffer {
  void *ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) {
    check(cudaMalloc(&ptr, n ? n : 1), "cudaMalloc");
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer &) = delete;
  DeviceBuffer &operator=(const DeviceBuffer &) = delete;
  /// Synchronous for every stream: cudaMemcpy from pageable memory may
  /// return before its DMA lands, ordered only on the legacy default stream,
  /// and cudaMemset is asynchronous there too; a launch on a non-blocking
  /// stream (a captured graph's replay) would race with either.
  template <typename T> void upload(const std::vector<T> &h) {
    check(
        cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice),
        "upload");
    check(cudaStreamSynchronize(nullptr), "upload");
  }
  template <typename T> std::vector<T> download(size_t n) const {
    std::vector<T> h(n);
    check(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost),
          "download");
    return h;
  }
  /// Every byte 0xff: NaN in bf16, fp16 and fp32, so unwritten outputs show.
  void poison() {
    check(cudaMemset(ptr, 0xff, bytes), "poison");
    check(cudaStreamSynchronize(nullptr), "poison");
  }
};

} // namespace dualkv::examples

#endif
