// Running independent work items on worker threads.
#ifndef DUALKV_RUNTIME_SUPPORT_PARALLEL_H
#define DUALKV_RUNTIME_SUPPORT_PARALLEL_H

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <functional>
#include <system_error>
#include <thread>
#include <vector>

namespace dualkv {

/// Runs work(i) for every i below n, on up to min(n, cores) threads (the
/// caller's among them). `work` must not throw.
inline void parallelFor(size_t n, const std::function<void(size_t)> &work) {
  std::atomic<size_t> next{0};
  auto drain = [&] {
    for (size_t i; (i = next++) < n;)
      work(i);
  };
  const size_t width =
      std::min<size_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  for (size_t t = 1; t < width; ++t) {
    try {
      threads.emplace_back(drain);
    } catch (const std::system_error &) {
      break; // no more threads: the ones we have share the rest
    }
  }
  drain();
  for (std::thread &t : threads)
    t.join();
}

} // namespace dualkv

#endif
