// The kernel cache's counters (dualkv/Cache.h).
#include "cache/Stats.h"

#include <mutex>

namespace dualkv {

namespace {
struct Stats {
  std::mutex mutex;
  CacheStats values;
};
Stats &stats() {
  static Stats *s = new Stats(); // leaked, like the kernel cache
  return *s;
}
} // namespace

void updateStats(const std::function<void(CacheStats &)> &update) {
  Stats &s = stats();
  std::lock_guard<std::mutex> lock(s.mutex);
  update(s.values);
}

CacheStats cacheStats() {
  Stats &s = stats();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.values;
}

void resetCacheStats() {
  Stats &s = stats();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.values = CacheStats();
}

} // namespace dualkv
