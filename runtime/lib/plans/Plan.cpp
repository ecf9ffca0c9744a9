// The packed layout of one micro-batch: its groups, segments and device table.
#include "dualkv/Plan.h"

#include "driver/CudaDriver.h"
#include "plans/PlanDevice.h"
#include "plans/WorkItems.h"
#include "support/Status.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

namespace dualkv {

/// The device copies of the segment table and of the backward's work items,
/// and the context they live in.
struct Plan::Device {
  std::mutex mutex;
  cuda::Driver *driver = nullptr;
  cuda::CUcontext context = nullptr;
  cuda::CUdeviceptr table = 0;
  /// The chain table (plans whose segments see several ancestor ranges).
  cuda::CUdeviceptr chain = 0;
  /// Work-item tables by (blockM, chunk, order, window).
  std::map<std::tuple<int, int64_t, BackwardOrder, int64_t>, BackwardTable>
      backward;
  /// Forward work orders by blockM.
  std::map<int, ForwardTable> forward;
  /// Each token's logical position (score modifiers), on first use.
  cuda::CUdeviceptr lpos = 0;

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
    if (chain)
      driver->memFree(chain);
    if (lpos)
      driver->memFree(lpos);
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

Plan::Plan() : device_(std::make_unique<Device>()) {}

namespace {

/// The forest of `groups` (each prompt a root, its responses, empty ones too,
/// children of it) in `lengths` and `parents`; an InvalidArgument error
/// naming the group at fault.
llvm::Error forestOfGroups(const std::vector<PlanGroup> &groups,
                           std::vector<int64_t> &lengths,
                           std::vector<int64_t> &parents) {
  if (groups.empty())
    return invalidArgument(
        "the plan has no groups: a batch needs at least one group");
  if (groups.size() > static_cast<size_t>(std::numeric_limits<int>::max()))
    return invalidArgument(fmt::format(
        "the plan has {} groups, more than INT32_MAX", groups.size()));
  constexpr int64_t kMaxTokens = std::numeric_limits<int32_t>::max();
  // The shorthand's own checks (and messages), then its forest: each prompt a
  // root, its responses (empty ones too) children of it.
  int64_t tokens = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const PlanGroup &group = groups[g];
    if (group.prompt_len < 1)
      return invalidArgument(
          fmt::format("group {}: prompt_len = {}; every group needs a "
                      "prompt of at least 1 token",
                      g, group.prompt_len));
    for (size_t r = 0; r < group.response_lens.size(); ++r)
      if (group.response_lens[r] < 0)
        return invalidArgument(
            fmt::format("group {}: response_lens[{}] = {} is negative", g, r,
                        group.response_lens[r]));
    if (group.prompt_len > kMaxTokens)
      return invalidArgument(
          fmt::format("group {}: prompt_len = {} exceeds the int32 limit", g,
                      group.prompt_len));
    // Kernels index tokens with int32, so the running total is checked
    // before every narrowing.
    auto add = [&](int64_t length) -> llvm::Error {
      if (tokens + length > kMaxTokens)
        return invalidArgument(
            fmt::format("group {} brings the batch to {} tokens, more than "
                        "the kernels' int32 limit ({})",
                        g, tokens + length, kMaxTokens));
      tokens += length;
      return llvm::Error::success();
    };
    if (llvm::Error e = add(group.prompt_len))
      return e;
    const int64_t root = static_cast<int64_t>(lengths.size());
    lengths.push_back(group.prompt_len);
    parents.push_back(-1);
    for (int64_t length : group.response_lens) {
      if (length > kMaxTokens)
        return invalidArgument(
            fmt::format("group {}: a response of {} tokens exceeds the "
                        "int32 limit",
                        g, length));
      if (llvm::Error e = add(length))
        return e;
      lengths.push_back(length);
      parents.push_back(root);
    }
  }
  if (lengths.size() > static_cast<size_t>(kMaxTokens))
    return invalidArgument(
        fmt::format("the plan has {} prompts and responses, more than "
                    "INT32_MAX",
                    lengths.size()));
  return llvm::Error::success();
}

/// An InvalidArgument error naming the node and field of `tree` at fault.
llvm::Error checkTree(const PlanTree &tree) {
  constexpr int64_t kMaxTokens = std::numeric_limits<int32_t>::max();
  const std::vector<int64_t> &lengths = tree.lengths, &parents = tree.parents;
  if (lengths.empty())
    return invalidArgument(
        "the tree has no nodes: a batch needs at least one node");
  if (parents.size() != lengths.size())
    return invalidArgument(
        fmt::format("the tree has {} lengths but {} parents; give one "
                    "of each per node",
                    lengths.size(), parents.size()));
  if (lengths.size() > static_cast<size_t>(kMaxTokens))
    return invalidArgument(fmt::format(
        "the tree has {} nodes, more than INT32_MAX", lengths.size()));
  const int64_t n = static_cast<int64_t>(lengths.size());
  for (int64_t i = 0; i < n; ++i) {
    if (lengths[i] < 0)
      return invalidArgument(
          fmt::format("node {}: length = {} is negative", i, lengths[i]));
    if (parents[i] < -1 || parents[i] >= n)
      return invalidArgument(
          fmt::format("node {}: parent = {} is out of range (-1 for a "
                      "root, else a node index below {})",
                      i, parents[i], n));
  }
  // Cycles first (each is also a parent at or after its child, but the
  // cycle is what to report): colour every chain of parents once, O(nodes).
  {
    std::vector<int8_t> state(n, 0); // 0 unseen, 1 on the walk, 2 done
    std::vector<int64_t> walk;
    for (int64_t i = 0; i < n; ++i) {
      int64_t x = i;
      while (x >= 0 && state[x] == 0) {
        state[x] = 1;
        walk.push_back(x);
        x = parents[x];
      }
      if (x >= 0 && state[x] == 1) {
        // The cycle's first nodes and the count of the rest: a cycle of 10^6
        // nodes spelled out was a 9.9 MB message.
        constexpr int64_t kShownNodes = 16;
        std::string cycle = std::to_string(x);
        int64_t length = 1;
        for (int64_t y = parents[x]; y != x; y = parents[y], ++length)
          if (length < kShownNodes)
            cycle += " -> " + std::to_string(y);
        if (length > kShownNodes)
          cycle += fmt::format(" -> ... ({} more node{})", length - kShownNodes,
                               length - kShownNodes == 1 ? "" : "s");
        return invalidArgument(
            fmt::format("node {}: parent = {} closes a cycle ({} -> {}); "
                        "a tree's parents end at a root (-1)",
                        x, parents[x], cycle, x));
      }
      for (int64_t y : walk)
        state[y] = 2;
      walk.clear();
    }
  }
  // Pre-order: a node's parent is the node before it or one of that node's
  // ancestors, i.e. on the path kept by this stack (amortised O(nodes)).
  {
    std::vector<int64_t> path;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = parents[i];
      if (p >= i)
        return invalidArgument(
            fmt::format("node {}: parent = {} comes after its child; list "
                        "every parent before its children (pre-order)",
                        i, p));
      while (!path.empty() && path.back() != p)
        path.pop_back();
      if (p >= 0 && path.empty())
        return invalidArgument(fmt::format(
            "node {}: parent = {} is not node {} or one of its ancestors, so "
            "node {}'s subtree would not be contiguous; list the nodes in "
            "pre-order (each subtree right after its root)",
            i, p, i - 1, p));
      path.push_back(i);
    }
  }
  int64_t tokens = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (lengths[i] > kMaxTokens - tokens)
      return invalidArgument(
          fmt::format("node {} brings the batch to {} tokens, more than "
                      "the kernels' int32 limit ({})",
                      i, tokens + lengths[i], kMaxTokens));
    tokens += lengths[i];
  }
  if (tokens == 0)
    return invalidArgument(
        fmt::format("the tree's {} nodes hold no tokens; a batch needs at "
                    "least one",
                    n));
  return llvm::Error::success();
}

} // namespace

Plan::Plan(const std::vector<PlanGroup> &groups) : Plan() {
  std::vector<int64_t> lengths, parents;
  throwIfError(forestOfGroups(groups, lengths, parents));
  layout(std::move(lengths), std::move(parents));
}

Plan::Plan(const PlanTree &tree) : Plan() {
  throwIfError(checkTree(tree));
  layout(tree.lengths, tree.parents);
}

void Plan::layout(std::vector<int64_t> lengths, std::vector<int64_t> parents) {
  const size_t n = lengths.size();
  nodeStarts_.resize(n);
  int64_t next = 0;
  for (size_t i = 0; i < n; ++i) {
    nodeStarts_[i] = next;
    next += lengths[i];
    if (parents[i] < 0)
      ++numGroups_;
  }
  numTokens_ = next;
  // Subtree ends: in pre-order a subtree ends where its last descendant does.
  std::vector<int64_t> subtreeEnd(n);
  for (size_t i = 0; i < n; ++i)
    subtreeEnd[i] = nodeStarts_[i] + lengths[i];
  for (size_t i = n; i-- > 0;)
    if (parents[i] >= 0)
      subtreeEnd[parents[i]] = std::max(subtreeEnd[parents[i]], subtreeEnd[i]);
  // Chain rows of the nodes' own paths: pathRow[i] is the row holding the
  // last range of [ancestors of i, i] (adjacent ranges merged), -1 if that
  // path has no token. Shared rows follow the segments' rows, so they are
  // numbered once the segments are counted.
  size_t numSegments = 0;
  for (size_t i = 0; i < n; ++i)
    numSegments += lengths[i] > 0;
  struct Row {
    int64_t start, length, next, tokens, ranges;
  };
  std::vector<Row> rows(numSegments);
  std::vector<int64_t> pathRow(n, -1);
  for (size_t i = 0; i < n; ++i) {
    const int64_t up = parents[i] >= 0 ? pathRow[parents[i]] : -1;
    if (lengths[i] == 0) {
      pathRow[i] = up;
    } else {
      const int64_t s = nodeStarts_[i], e = s + lengths[i];
      // The segment itself: its nearest ancestor range, then the rest.
      const size_t seg = segments_.size();
      Row own = up >= 0 ? rows[up] : Row{0, 0, -1, 0, 0};
      rows[seg] = own;
      segments_.push_back(Segment{int32_t(s), int32_t(lengths[i]),
                                  int32_t(own.start), int32_t(own.length)});
      segmentNodes_.push_back(int32_t(i));
      subtreeEnds_.push_back(subtreeEnd[i]);
      ancestorTokens_.push_back(own.tokens);
      maxSegmentLen_ = std::max(maxSegmentLen_, int(lengths[i]));
      maxAncestorRanges_ = std::max(maxAncestorRanges_, int(own.ranges));
      // The path through i, for its descendants (leaves need none).
      if (subtreeEnd[i] > e) {
        if (up >= 0 && rows[up].start + rows[up].length == s)
          rows.push_back(Row{rows[up].start, e - rows[up].start, rows[up].next,
                             rows[up].tokens + lengths[i], rows[up].ranges});
        else
          rows.push_back(Row{s, lengths[i], up,
                             (up >= 0 ? rows[up].tokens : 0) + lengths[i],
                             (up >= 0 ? rows[up].ranges : 0) + 1});
        pathRow[i] = int64_t(rows.size()) - 1;
      }
    }
  }
  chain_.reserve(rows.size() * 4);
  for (const Row &r : rows)
    chain_.insert(chain_.end(), {int32_t(r.start), int32_t(r.length),
                                 int32_t(r.next), int32_t(r.ranges)});
  nodeLengths_ = std::move(lengths);
  nodeParents_ = std::move(parents);
}

namespace {

/// The groups of the C API's flat arrays; an InvalidArgument error naming the
/// array at fault.
llvm::Error groupsOfArrays(const int32_t *prompt_lens,
                           const int32_t *num_responses,
                           const int32_t *response_lens, int32_t num_groups,
                           std::vector<PlanGroup> &groups) {
  if (num_groups < 1)
    return invalidArgument(fmt::format(
        "num_groups = {}; a plan needs at least one group", num_groups));
  if (!prompt_lens)
    return invalidArgument("prompt_lens is null");
  if (!num_responses)
    return invalidArgument("num_responses is null");
  groups.assign(num_groups, PlanGroup());
  int64_t flat = 0; // index into response_lens
  for (int32_t g = 0; g < num_groups; ++g) {
    if (num_responses[g] < 0)
      return invalidArgument(fmt::format("num_responses[{}] = {} is negative",
                                         g, num_responses[g]));
    if (num_responses[g] > 0 && !response_lens)
      return invalidArgument(
          fmt::format("response_lens is null but num_responses[{}] = {}", g,
                      num_responses[g]));
    groups[g].prompt_len = prompt_lens[g];
    for (int32_t r = 0; r < num_responses[g]; ++r)
      groups[g].response_lens.push_back(response_lens[flat++]);
  }
  return llvm::Error::success();
}

/// The tree of the C API's flat arrays; an InvalidArgument error naming the
/// array at fault.
llvm::Error treeOfArrays(const int32_t *lengths, const int32_t *parents,
                         int32_t num_nodes, PlanTree &tree) {
  if (num_nodes < 1)
    return invalidArgument(fmt::format(
        "num_nodes = {}; a tree needs at least one node", num_nodes));
  if (!lengths)
    return invalidArgument("lengths is null");
  if (!parents)
    return invalidArgument("parents is null");
  tree.lengths.assign(lengths, lengths + num_nodes);
  tree.parents.assign(parents, parents + num_nodes);
  return llvm::Error::success();
}

} // namespace

Plan Plan::fromArrays(const int32_t *prompt_lens, const int32_t *num_responses,
                      const int32_t *response_lens, int32_t num_groups) {
  std::vector<PlanGroup> groups;
  throwIfError(groupsOfArrays(prompt_lens, num_responses, response_lens,
                              num_groups, groups));
  return Plan(groups);
}

Plan Plan::fromTreeArrays(const int32_t *lengths, const int32_t *parents,
                          int32_t num_nodes) {
  PlanTree tree;
  throwIfError(treeOfArrays(lengths, parents, num_nodes, tree));
  return Plan(tree);
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

namespace {

/// Copies `data` to a new device buffer, the copy complete on return; a Cuda
/// error names `what`. From pageable memory cuMemcpyHtoD returns once the
/// data is staged, with the DMA possibly still in flight ("API
/// synchronization behavior" in CUDA's documentation), ordered only on the
/// legacy default stream: a kernel on a non-blocking stream could read the
/// table before it lands. Waiting for the legacy stream closes that window
/// (the copy already waited for its earlier work before starting).
llvm::Expected<cuda::CUdeviceptr> copyToDevice(cuda::Driver &driver,
                                               const std::vector<int32_t> &data,
                                               const char *what) {
  size_t bytes = data.size() * sizeof(int32_t);
  cuda::CUdeviceptr ptr = 0;
  if (llvm::Error e = cuda::check(driver.memAlloc(&ptr, bytes),
                                  fmt::format("cuMemAlloc ({})", what).c_str()))
    return e;
  cuda::CUresult r = driver.memcpyHtoD(ptr, data.data(), bytes);
  if (r == cuda::CUDA_SUCCESS)
    r = driver.streamSynchronize(nullptr);
  if (r != cuda::CUDA_SUCCESS) {
    driver.memFree(ptr);
    return cuda::check(r, fmt::format("cuMemcpyHtoD ({})", what).c_str());
  }
  return ptr;
}

} // namespace

llvm::Error PlanDevice::upload(const Plan &plan) {
  if (!plan.device_)
    return invalidArgument("the plan was moved from");
  Plan::Device &device = *plan.device_;
  std::lock_guard<std::mutex> lock(device.mutex);
  if (device.table)
    return llvm::Error::success();
  llvm::Expected<cuda::CUcontext> ctx = cuda::currentContext();
  if (!ctx)
    return ctx.takeError();
  llvm::Expected<cuda::Driver &> driver = cuda::driver();
  if (!driver)
    return driver.takeError();
  llvm::Expected<cuda::CUdeviceptr> table =
      copyToDevice(*driver, plan.segmentTable(), "plan segment table");
  if (!table)
    return table.takeError();
  cuda::CUdeviceptr chain = 0;
  if (plan.maxAncestorRanges_ > 1) {
    llvm::Expected<cuda::CUdeviceptr> copied =
        copyToDevice(*driver, plan.chain_, "plan chain table");
    if (!copied) {
      driver->memFree(*table);
      return copied.takeError();
    }
    chain = *copied;
  }
  device.driver = &*driver;
  device.context = *ctx;
  device.table = *table;
  device.chain = chain;
  // The warp-specialized forward's order (128-row tiles) too, so a CUDA graph
  // captured after upload() never allocates or copies.
  return forwardTableLocked(plan, Plan::kForwardOrderBlockM).takeError();
}

void Plan::upload() const { throwIfError(PlanDevice::upload(*this)); }

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

std::vector<int32_t> Plan::logicalPositions() const {
  std::vector<int32_t> lpos(static_cast<size_t>(numTokens_));
  for (size_t s = 0; s < segments_.size(); ++s) {
    const Segment &seg = segments_[s];
    for (int32_t i = 0; i < seg.length; ++i)
      lpos[static_cast<size_t>(seg.start + i)] =
          static_cast<int32_t>(ancestorTokens_[s] + i);
  }
  return lpos;
}

llvm::Expected<uint64_t> PlanDevice::logicalPositions(const Plan &plan) {
  if (llvm::Error e = requirePlanInCurrentContext(plan))
    return e;
  Plan::Device &device = *plan.device_;
  std::lock_guard<std::mutex> lock(device.mutex);
  if (device.lpos)
    return device.lpos;
  llvm::Expected<cuda::CUdeviceptr> copied = copyToDevice(
      *device.driver, plan.logicalPositions(), "plan logical positions");
  if (!copied)
    return copied.takeError();
  device.lpos = *copied;
  return device.lpos;
}

uint64_t Plan::deviceChainTable() const {
  if (!device_)
    return 0;
  std::lock_guard<std::mutex> lock(device_->mutex);
  return device_->chain;
}

llvm::Expected<BackwardTable>
PlanDevice::backwardTable(const Plan &plan, int blockM, int64_t chunk,
                          BackwardOrder order, int64_t window) {
  if (order == BackwardOrder::Auto)
    order = BackwardOrder::LongestFirst;
  // Uploads: fixes the context.
  if (llvm::Error e = requirePlanInCurrentContext(plan))
    return e;
  Plan::Device &device = *plan.device_;
  std::lock_guard<std::mutex> lock(device.mutex);
  auto found = device.backward.find({blockM, chunk, order, window});
  if (found != device.backward.end())
    return found->second;

  llvm::Expected<BackwardItems> built =
      buildBackwardItems(plan, blockM, chunk, order, window);
  if (!built)
    return built.takeError();
  cuda::Driver &driver = *device.driver;
  BackwardTable table;
  table.numItems = built->numItems();
  table.numAccRows = built->numAccRows();
  if (llvm::Error e = copyToDevice(driver, built->items, "backward work items")
                          .moveInto(table.items))
    return e;
  if (!built->accTokens.empty()) {
    llvm::Expected<cuda::CUdeviceptr> accTokens =
        copyToDevice(driver, built->accTokens, "backward accumulator tokens");
    if (!accTokens) {
      driver.memFree(table.items);
      return accTokens.takeError();
    }
    table.accTokens = *accTokens;
  }
  device.backward.emplace(std::make_tuple(blockM, chunk, order, window), table);
  return table;
}

BackwardTable Plan::backwardTable(int blockM, int64_t chunk,
                                  BackwardOrder order, int64_t window) const {
  return valueOrThrow(
      PlanDevice::backwardTable(*this, blockM, chunk, order, window));
}

llvm::Expected<std::vector<int32_t>> PlanDevice::forwardOrder(const Plan &plan,
                                                              int blockM) {
  if (blockM <= 0)
    return invalidArgument(
        fmt::format("forwardOrder: blockM must be positive, got {}", blockM));
  struct Tile {
    int64_t keys;
    int32_t segment, tile;
  };
  const std::vector<Segment> &segments = plan.segments();
  std::vector<Tile> tiles;
  for (size_t s = 0; s < segments.size(); ++s) {
    const Segment &seg = segments[s];
    int64_t count = (int64_t(seg.length) + blockM - 1) / blockM;
    for (int64_t m = 0; m < count; ++m)
      tiles.push_back({plan.ancestorTokens()[s] +
                           std::min<int64_t>((m + 1) * blockM, seg.length),
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

std::vector<int32_t> Plan::forwardOrder(int blockM) const {
  return valueOrThrow(PlanDevice::forwardOrder(*this, blockM));
}

llvm::Expected<ForwardTable> PlanDevice::forwardTable(const Plan &plan,
                                                      int blockM) {
  // Uploads: fixes the context.
  if (llvm::Error e = requirePlanInCurrentContext(plan))
    return e;
  std::lock_guard<std::mutex> lock(plan.device_->mutex);
  return forwardTableLocked(plan, blockM);
}

ForwardTable Plan::forwardTable(int blockM) const {
  return valueOrThrow(PlanDevice::forwardTable(*this, blockM));
}

llvm::Expected<ForwardTable> PlanDevice::forwardTableLocked(const Plan &plan,
                                                            int blockM) {
  Plan::Device &device = *plan.device_;
  auto found = device.forward.find(blockM);
  if (found != device.forward.end())
    return found->second;
  llvm::Expected<std::vector<int32_t>> order = forwardOrder(plan, blockM);
  if (!order)
    return order.takeError();
  ForwardTable table;
  table.numItems = int64_t(order->size() / 2);
  if (llvm::Error e = copyToDevice(*device.driver, *order, "forward work order")
                          .moveInto(table.items))
    return e;
  device.forward.emplace(blockM, table);
  return table;
}

llvm::Error requirePlanInCurrentContext(const Plan &plan) {
  llvm::Expected<cuda::CUcontext> ctx = cuda::currentContext();
  if (!ctx)
    return ctx.takeError();
  // Once per plan; a no-op afterwards.
  if (llvm::Error e = PlanDevice::upload(plan))
    return e;
  if (plan.deviceContext() != *ctx)
    return invalidArgument(
        "the plan's segment table lives in another CUDA context than the "
        "current one; build one plan per device");
  return llvm::Error::success();
}

} // namespace dualkv
