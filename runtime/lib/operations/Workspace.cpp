// The backward's device workspace: its layout, and the buffers the runtime
// keeps per context and stream for callers that pass none.
#include "operations/Workspace.h"

#include <fmt/format.h>

#include <map>
#include <mutex>

namespace dualkv {

BackwardWorkspaceLayout backwardWorkspaceLayout(int64_t numTokens,
                                                int numQHeads, int numKVHeads,
                                                int headDim, int valueHeadDim,
                                                bool split, int64_t accRows,
                                                int kvHeadsPerLaunch) {
  BackwardWorkspaceLayout l;
  const int64_t f32 = sizeof(float);
  l.deltaStrideH = numTokens;
  l.delta = 0;
  l.bytes = alignUp(numQHeads * numTokens * f32, kWorkspaceAlign);
  if (split)
    return l;
  const int64_t sliceQHeads =
      int64_t(numQHeads) / numKVHeads * kvHeadsPerLaunch;
  l.dqacc = l.bytes;
  l.bytes += alignUp(numTokens * sliceQHeads * headDim * f32, kWorkspaceAlign);
  if (accRows > 0) {
    const int64_t rows = accRows * kvHeadsPerLaunch;
    l.dkacc = l.bytes;
    l.bytes += alignUp(rows * headDim * f32, kWorkspaceAlign);
    l.dvacc = l.bytes;
    l.bytes += alignUp(rows * valueHeadDim * f32, kWorkspaceAlign);
  }
  return l;
}

namespace {

/// Workspaces backward() owns, one per (context, stream): calls on one
/// stream run in order, so they may share one; calls on different streams
/// may overlap, so they never do.
struct OwnedWorkspace {
  cuda::Driver *driver = nullptr;
  cuda::CUdeviceptr ptr = 0;
  int64_t bytes = 0;
  uint64_t lastUse = 0; ///< Workspaces::uses at the last call
  int users = 0;        ///< calls between taking it and enqueuing their last
                        ///< kernel: never freed meanwhile
};

struct Workspaces {
  std::mutex mutex;
  std::map<std::pair<cuda::CUcontext, cuda::CUstream>, OwnedWorkspace> owned;
  uint64_t uses = 0;
};

Workspaces &workspaces() {
  // Leaked on purpose, like the kernel cache: freeing during static
  // destruction would race the driver's teardown.
  static Workspaces *w = new Workspaces();
  return *w;
}

/// Before a new stream of `ctx` gets a workspace: when the context already
/// holds kMaxOwnedWorkspaces, the least recently used one is freed, so that a
/// program making a stream per step does not leak one workspace per stream.
/// Its stream may be gone, so the whole context is synchronised first (rare:
/// only past that many streams).
llvm::Error evictOldestWorkspace(Workspaces &w, cuda::CUcontext ctx,
                                 cuda::Driver &driver) {
  auto oldest = w.owned.end();
  size_t held = 0;
  for (auto it = w.owned.begin(); it != w.owned.end(); ++it)
    if (it->first.first == ctx) {
      ++held;
      // One a call is still enqueuing kernels on is not a candidate: the
      // synchronisation below would not cover what it has yet to enqueue.
      if (it->second.users == 0 &&
          (oldest == w.owned.end() ||
           it->second.lastUse < oldest->second.lastUse))
        oldest = it;
    }
  if (held < kMaxOwnedWorkspaces || oldest == w.owned.end())
    return llvm::Error::success();
  if (llvm::Error e =
          cuda::check(driver.ctxSynchronize(),
                      "cuCtxSynchronize (freeing a backward workspace)"))
    return e;
  if (oldest->second.ptr)
    driver.memFree(oldest->second.ptr);
  w.owned.erase(oldest);
  return llvm::Error::success();
}

} // namespace

WorkspaceLease::~WorkspaceLease() {
  if (!held_)
    return;
  Workspaces &w = workspaces();
  std::lock_guard<std::mutex> lock(w.mutex);
  auto it = w.owned.find(key_);
  if (it != w.owned.end())
    --it->second.users;
}

llvm::Expected<cuda::CUdeviceptr> ownedWorkspace(cuda::CUcontext ctx,
                                                 void *stream, int64_t bytes,
                                                 WorkspaceLease &lease) {
  Workspaces &w = workspaces();
  std::lock_guard<std::mutex> lock(w.mutex);
  auto s = static_cast<cuda::CUstream>(stream);
  llvm::Expected<cuda::Driver &> driver = cuda::driver();
  if (!driver)
    return driver.takeError();
  if (!w.owned.count({ctx, s}))
    if (llvm::Error e = evictOldestWorkspace(w, ctx, *driver))
      return e;
  OwnedWorkspace &ws = w.owned[{ctx, s}];
  ws.lastUse = ++w.uses;
  ++ws.users;
  lease.hold({ctx, s});
  if (ws.ptr && ws.bytes >= bytes)
    return ws.ptr;
  if (ws.ptr) {
    // Earlier launches on this stream may still read the old buffer.
    if (llvm::Error e =
            cuda::check(driver->streamSynchronize(s),
                        "cuStreamSynchronize (growing the backward workspace)"))
      return e;
    driver->memFree(ws.ptr);
    ws.ptr = 0;
    ws.bytes = 0;
  }
  // A little headroom, so that a batch a few tokens longer reuses it.
  int64_t size = alignUp(bytes + bytes / 8, int64_t(2) << 20);
  cuda::CUdeviceptr ptr = 0;
  if (llvm::Error e = cuda::check(
          driver->memAlloc(&ptr, static_cast<size_t>(size)),
          fmt::format("cuMemAlloc ({} bytes of backward workspace)", size)
              .c_str()))
    return e;
  ws.driver = &*driver;
  ws.ptr = ptr;
  ws.bytes = size;
  return ptr;
}

void clearBackwardWorkspaces() {
  Workspaces &w = workspaces();
  std::lock_guard<std::mutex> lock(w.mutex);
  for (auto &[key, ws] : w.owned) {
    if (!ws.ptr)
      continue;
    // Free in the buffer's own context, then give the thread its own back.
    cuda::CUcontext previous = nullptr;
    if (ws.driver->ctxGetCurrent(&previous) != cuda::CUDA_SUCCESS)
      continue;
    if (previous != key.first)
      ws.driver->ctxSetCurrent(key.first);
    ws.driver->memFree(ws.ptr);
    if (previous != key.first)
      ws.driver->ctxSetCurrent(previous);
  }
  w.owned.clear();
}

} // namespace dualkv
