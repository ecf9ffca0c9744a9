// The packed layout of one micro-batch: its groups, segments and device table.
#include "dualkv/Plan.h"

#include "Backward.h"
#include "CudaDriver.h"
#include "Validate.h"

#include "dualkv/dualkv.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <mutex>
#include <utility>

namespace dualkv {

namespace {

[[noreturn]] void invalid(const std::string &message) {
  throw Error(ErrorCode::InvalidArgument, message);
}

} // namespace

/// The device copies of the segment table and of the backward's work items,
/// and the context they live in.
struct Plan::Device {
  std::mutex mutex;
  cuda::Driver *driver = nullptr;
  cuda::CUcontext context = nullptr;
  cuda::CUdeviceptr table = 0;
  /// Work-item tables by (blockM, chunk).
  std::map<std::pair<int, int64_t>, BackwardTable> backward;
  /// Forward work orders by blockM.
  std::map<int, ForwardTable> forward;

  ~Device() {
    if (!table || !driver)
      return;
    // Free in the table's own context, then give the thread its context
    // back. Errors are ignored: at process exit the driver may be gone.
    cuda::CUcontext previous = nullptr;
    if (driver->ctxGetCurrent(&previous) != cuda::CUDA_SUCCESS)
      return;
    if (previous != context)
      driver->ctxSetCurrent(context);
    driver->memFree(table);
    for (const auto &entry : forward)
      driver->memFree(entry.second.items);
    for (const auto &entry : backward) {
      driver->memFree(entry.second.items);
      if (entry.second.accTokens)
        driver->memFree(entry.second.accTokens);
    }
    if (previous != context)
      driver->ctxSetCurrent(previous);
  }
};

Plan::Plan(const std::vector<PlanGroup> &groups)
    : device_(std::make_unique<Device>()) {
  if (groups.empty())
    invalid("the plan has no groups: a batch needs at least one group");
  if (groups.size() > static_cast<size_t>(std::numeric_limits<int>::max()))
    invalid(fmt::format("the plan has {} groups, more than INT32_MAX",
                        groups.size()));
  constexpr int64_t kMaxTokens = std::numeric_limits<int32_t>::max();
  int64_t next = 0; // first token of the next segment
  // Adds tokens [next, next + length) as one segment; kernels index tokens
  // with int32, so the running total is checked before every narrowing.
  auto addSegment = [&](size_t g, int64_t length, int64_t sharedStart,
                        int64_t sharedLen) {
    if (next + length > kMaxTokens)
      invalid(fmt::format("group {} brings the batch to {} tokens, more than "
                          "the kernels' int32 limit ({})",
                          g, next + length, kMaxTokens));
    segments_.push_back(Segment{
        static_cast<int32_t>(next), static_cast<int32_t>(length),
        static_cast<int32_t>(sharedStart), static_cast<int32_t>(sharedLen)});
    maxSegmentLen_ = std::max(maxSegmentLen_, static_cast<int>(length));
    next += length;
  };
  for (size_t g = 0; g < groups.size(); ++g) {
    const PlanGroup &group = groups[g];
    if (group.prompt_len < 1)
      invalid(fmt::format("group {}: prompt_len = {}; every group needs a "
                          "prompt of at least 1 token",
                          g, group.prompt_len));
    for (size_t r = 0; r < group.response_lens.size(); ++r)
      if (group.response_lens[r] < 0)
        invalid(fmt::format("group {}: response_lens[{}] = {} is negative", g,
                            r, group.response_lens[r]));
    if (group.prompt_len > kMaxTokens)
      invalid(fmt::format("group {}: prompt_len = {} exceeds the int32 limit",
                          g, group.prompt_len));
    // The prompt is causal over itself and sees no other region.
    int64_t promptStart = next;
    addSegment(g, group.prompt_len, 0, 0);
    for (int64_t length : group.response_lens) {
      if (length > kMaxTokens)
        invalid(fmt::format("group {}: a response of {} tokens exceeds the "
                            "int32 limit",
                            g, length));
      // A zero-length response has no queries, hence no segment.
      if (length > 0)
        addSegment(g, length, promptStart, group.prompt_len);
    }
  }
  numTokens_ = next;
  numGroups_ = static_cast<int>(groups.size());
}

Plan Plan::fromArrays(const int32_t *prompt_lens, const int32_t *num_responses,
                      const int32_t *response_lens, int32_t num_groups) {
  if (num_groups < 1)
    invalid(fmt::format("num_groups = {}; a plan needs at least one group",
                        num_groups));
  if (!prompt_lens)
    invalid("prompt_lens is null");
  if (!num_responses)
    invalid("num_responses is null");
  std::vector<PlanGroup> groups(num_groups);
  int64_t flat = 0; // index into response_lens
  for (int32_t g = 0; g < num_groups; ++g) {
    if (num_responses[g] < 0)
      invalid(fmt::format("num_responses[{}] = {} is negative", g,
                          num_responses[g]));
    if (num_responses[g] > 0 && !response_lens)
      invalid(fmt::format("response_lens is null but num_responses[{}] = {}", g,
                          num_responses[g]));
    groups[g].prompt_len = prompt_lens[g];
    for (int32_t r = 0; r < num_responses[g]; ++r)
      groups[g].response_lens.push_back(response_lens[flat++]);
  }
  return Plan(groups);
}

Plan::Plan(Plan &&) noexcept = default;
Plan &Plan::operator=(Plan &&) noexcept = default;
Plan::~Plan() = default;

std::vector<int32_t> Plan::segmentTable() const {
  std::vector<int32_t> table;
  table.reserve(segments_.size() * 4);
  for (const Segment &s : segments_)
    table.insert(table.end(),
                 {s.start, s.length, s.shared_start, s.shared_len});
  return table;
}

void Plan::upload() const {
  if (!device_)
    invalid("the plan was moved from");
  std::lock_guard<std::mutex> lock(device_->mutex);
  if (device_->table)
    return;
  cuda::CUcontext ctx = cuda::currentContext();
  cuda::Driver &driver = cuda::driver();
  std::vector<int32_t> table = segmentTable();
  size_t bytes = table.size() * sizeof(int32_t);
  cuda::CUdeviceptr ptr = 0;
  cuda::check(driver.memAlloc(&ptr, bytes), "cuMemAlloc (plan segment table)");
  if (cuda::CUresult r = driver.memcpyHtoD(ptr, table.data(), bytes)) {
    driver.memFree(ptr);
    cuda::check(r, "cuMemcpyHtoD (plan segment table)");
  }
  device_->driver = &driver;
  device_->context = ctx;
  device_->table = ptr;
  // The warp-specialized forward's order (128-row tiles) too, so a CUDA graph
  // captured after upload() never allocates or copies.
  forwardTableLocked(kForwardOrderBlockM);
}

bool Plan::uploaded() const {
  if (!device_)
    return false;
  std::lock_guard<std::mutex> lock(device_->mutex);
  return device_->table != 0;
}

uint64_t Plan::deviceTable() const {
  if (!device_)
    return 0;
  std::lock_guard<std::mutex> lock(device_->mutex);
  return device_->table;
}

void *Plan::deviceContext() const {
  if (!device_)
    return nullptr;
  std::lock_guard<std::mutex> lock(device_->mutex);
  return device_->context;
}

namespace {

/// Copies `data` to a new device buffer; throws Error (Cuda) naming `what`.
cuda::CUdeviceptr copyToDevice(cuda::Driver &driver,
                               const std::vector<int32_t> &data,
                               const char *what) {
  size_t bytes = data.size() * sizeof(int32_t);
  cuda::CUdeviceptr ptr = 0;
  cuda::check(driver.memAlloc(&ptr, bytes),
              fmt::format("cuMemAlloc ({})", what).c_str());
  if (cuda::CUresult r = driver.memcpyHtoD(ptr, data.data(), bytes)) {
    driver.memFree(ptr);
    cuda::check(r, fmt::format("cuMemcpyHtoD ({})", what).c_str());
  }
  return ptr;
}

} // namespace

BackwardTable Plan::backwardTable(int blockM, int64_t chunk) const {
  detail::requirePlanInCurrentContext(*this); // uploads: fixes the context
  std::lock_guard<std::mutex> lock(device_->mutex);
  auto found = device_->backward.find({blockM, chunk});
  if (found != device_->backward.end())
    return found->second;

  BackwardItems built = buildBackwardItems(*this, blockM, chunk);
  cuda::Driver &driver = *device_->driver;
  BackwardTable table;
  table.numItems = built.numItems();
  table.numAccRows = built.numAccRows();
  table.items = copyToDevice(driver, built.items, "backward work items");
  if (!built.accTokens.empty()) {
    try {
      table.accTokens =
          copyToDevice(driver, built.accTokens, "backward accumulator tokens");
    } catch (...) {
      driver.memFree(table.items);
      throw;
    }
  }
  device_->backward.emplace(std::make_pair(blockM, chunk), table);
  return table;
}

std::vector<int32_t> Plan::forwardOrder(int blockM) const {
  if (blockM <= 0)
    invalid(
        fmt::format("forwardOrder: blockM must be positive, got {}", blockM));
  struct Tile {
    int64_t keys;
    int32_t segment, tile;
  };
  std::vector<Tile> tiles;
  for (size_t s = 0; s < segments_.size(); ++s) {
    const Segment &seg = segments_[s];
    int64_t count = (int64_t(seg.length) + blockM - 1) / blockM;
    for (int64_t m = 0; m < count; ++m)
      tiles.push_back(
          {seg.shared_len + std::min<int64_t>((m + 1) * blockM, seg.length),
           int32_t(s), int32_t(m)});
  }
  std::stable_sort(
      tiles.begin(), tiles.end(),
      [](const Tile &a, const Tile &b) { return a.keys > b.keys; });
  std::vector<int32_t> order;
  order.reserve(2 * tiles.size());
  for (const Tile &t : tiles) {
    order.push_back(t.segment);
    order.push_back(t.tile);
  }
  return order;
}

ForwardTable Plan::forwardTable(int blockM) const {
  detail::requirePlanInCurrentContext(*this); // uploads: fixes the context
  std::lock_guard<std::mutex> lock(device_->mutex);
  return forwardTableLocked(blockM);
}

ForwardTable Plan::forwardTableLocked(int blockM) const {
  auto found = device_->forward.find(blockM);
  if (found != device_->forward.end())
    return found->second;
  std::vector<int32_t> order = forwardOrder(blockM);
  ForwardTable table;
  table.numItems = int64_t(order.size() / 2);
  table.items = copyToDevice(*device_->driver, order, "forward work order");
  device_->forward.emplace(blockM, table);
  return table;
}

} // namespace dualkv
