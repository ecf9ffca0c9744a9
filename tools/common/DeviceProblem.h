// Attention problems on the GPU for the tools that run kernels (dualkv-tune):
// device arrays, 16-bit elements on the host, and one packed batch with the
// forward's and backward's arguments over it.
#ifndef DUALKV_TOOLS_DEVICE_PROBLEM_H
#define DUALKV_TOOLS_DEVICE_PROBLEM_H

#include "dualkv/dualkv.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace dualkv::tools {

/// Throws std::runtime_error "<what>: <CUDA's message>" unless `status` is
/// cudaSuccess.
void cudaCheck(cudaError_t status, const char *what);

/// Whether the CUDA runtime sees a device and DualKV can launch on it.
bool gpuPresent();

/// `x` rounded to nearest (even) in `dtype`, as the element's bits.
uint16_t toElement(float x, DType dtype);
/// The value of the `dtype` element whose bits are `bits`.
float fromElement(uint16_t bits, DType dtype);

/// `size` values of T in device memory, freed with the array. Copies are
/// synchronous for every stream: a cudaMemcpy from pageable memory may return
/// before its DMA lands, ordered only on the legacy default stream, and
/// cudaMemset is asynchronous there too; a launch on a non-blocking stream
/// would race with either.
template <typename T> class DeviceArray {
public:
  explicit DeviceArray(size_t size) : size_(size) {
    cudaCheck(cudaMalloc(reinterpret_cast<void **>(&data_),
                         (size ? size : 1) * sizeof(T)),
              "cudaMalloc");
  }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray &) = delete;
  DeviceArray &operator=(const DeviceArray &) = delete;

  T *data() const { return data_; }
  size_t size() const { return size_; }

  /// The first host.size() values become `host`'s.
  void write(const std::vector<T> &host) {
    cudaCheck(cudaMemcpy(data_, host.data(), host.size() * sizeof(T),
                         cudaMemcpyHostToDevice),
              "copy to the device");
    cudaCheck(cudaStreamSynchronize(nullptr), "copy to the device");
  }
  std::vector<T> read() const {
    std::vector<T> host(size_);
    cudaCheck(cudaMemcpy(host.data(), data_, size_ * sizeof(T),
                         cudaMemcpyDeviceToHost),
              "copy to the host");
    return host;
  }
  /// Every byte 0xff: NaN in bf16, fp16 and fp32, so values never written
  /// show.
  void poison() {
    cudaCheck(cudaMemset(data_, 0xff, size_ * sizeof(T)), "poison");
    cudaCheck(cudaStreamSynchronize(nullptr), "poison");
  }

private:
  T *data_ = nullptr;
  size_t size_;
};

/// The head configuration of a problem: Q and K rows of headDim elements, V
/// and O rows of valueHeadDim (0: headDim).
struct HeadShape {
  int numQHeads = 0, numKVHeads = 0, headDim = 0;
  DType dtype = DType::BF16;
  int valueHeadDim = 0;
  int vDim() const { return valueHeadDim ? valueHeadDim : headDim; }
};

/// One packed batch of `plan` on the GPU, dense [T][H][D] (V and O
/// [T][H][Dv]): Q, K and V of random normal values in the element type
/// (never all zeros; their host copies kept for references), O and LSE
/// [Hq][T] poisoned.
class DeviceProblem {
public:
  /// `plan` must outlive the problem.
  DeviceProblem(const Plan &plan, const HeadShape &shape, std::mt19937_64 &rng);

  const HeadShape shape;
  const int64_t tokens;
  const std::vector<uint16_t> hostQ, hostK, hostV;
  DeviceArray<uint16_t> q, k, v, o;
  DeviceArray<float> lse;

  /// A forward over Q, K, V into O and LSE.
  ForwardArgs forwardArgs(const Tiling &tiling = {}) const;
  /// A backward of that forward with dO read from `dout` and the gradients
  /// written to `dq`, `dk`, `dv`: dense arrays shaped like O, Q, K and V.
  BackwardArgs backwardArgs(const void *dout, void *dq, void *dk,
                            void *dv) const;

private:
  /// The arguments a forward and a backward share.
  template <typename Args> Args over() const;

  const Plan &plan_;
};

} // namespace dualkv::tools

#endif
