// The C API: thin wrappers that turn errors (dualkv::Error from the C++ API,
// llvm::Error from their own checks) into status codes.
#include "dualkv/dualkv_c.h"

#include "support/Status.h"

#include "dualkv/dualkv.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <new>
#include <string>

/// The C handle is the C++ plan itself.
struct dualkv_plan {
  dualkv::Plan plan;
};

namespace {

thread_local std::string lastError;

/// Runs `body`, recording the message and status of the error it returns
/// (its own checks) or of whatever the C++ API it calls throws.
template <typename F> int guarded(F &&body) {
  try {
    lastError.clear();
    if (llvm::Error error = body()) {
      dualkv::ErrorParts parts = dualkv::takeErrorParts(std::move(error));
      lastError = std::move(parts.message);
      return static_cast<int>(parts.code);
    }
    return DUALKV_OK;
  } catch (const dualkv::Error &e) {
    lastError = e.what();
    return static_cast<int>(e.code());
  } catch (const std::bad_alloc &) {
    lastError = "out of host memory";
  } catch (const std::exception &e) {
    lastError = fmt::format("internal error: {}", e.what());
  } catch (...) {
    lastError = "internal error: unknown exception";
  }
  return DUALKV_ERROR_INTERNAL;
}

dualkv::Tiling toTiling(const dualkv_tiling_t &t) {
  return {t.block_m, t.block_n, t.warps, t.stages};
}

dualkv::TensorArg toTensor(const dualkv_tensor_t &t) {
  return {t.data, t.stride_t, t.stride_h};
}

/// Sets `out` to the enumerator of `value`, or says why not.
template <typename E, size_t N>
llvm::Error toEnum(const dualkv::names::Row<E> (&rows)[N], int32_t value,
                   const char *what, E &out) {
  if (value < 0 || static_cast<size_t>(value) >= N)
    return dualkv::invalidArgument(
        fmt::format("{} ({}) is not one of 0..{} ({})", what, value, N - 1,
                    dualkv::names::listOf(rows)));
  out = rows[value].value;
  return llvm::Error::success();
}

/// The struct at `args` as this library knows it: a caller's struct_size
/// below `firstSize` (the struct's first version) is refused; the fields
/// past struct_size (a caller built against an older header) stay zero;
/// bytes past this library's sizeof(T) must be zero (a newer caller's fields
/// this library would otherwise ignore).
template <typename T>
llvm::Expected<T> readArgs(const T *args, const char *what,
                           size_t firstSize = sizeof(T)) {
  if (!args)
    return dualkv::invalidArgument(fmt::format("{} is null", what));
  const size_t size = args->struct_size;
  if (size < firstSize)
    return dualkv::invalidArgument(
        fmt::format("{}->struct_size ({}) is below the struct's first "
                    "version ({} bytes): set it to sizeof the struct",
                    what, size, firstSize));
  T copy{};
  std::memcpy(&copy, args, std::min(size, sizeof(T)));
  const auto *extra = reinterpret_cast<const unsigned char *>(args);
  for (size_t i = sizeof(T); i < size; ++i)
    if (extra[i] != 0)
      return dualkv::invalidArgument(
          fmt::format("{} sets a field at byte {}, past the {} bytes this "
                      "library ({}) knows",
                      what, i, sizeof(T), dualkv::version()));
  return copy;
}

/// Writes `value` into `out` up to out->struct_size bytes (a caller built
/// against an older header receives the fields it knows).
template <typename T> llvm::Error writeOut(T *out, T value, const char *what) {
  if (!out)
    return dualkv::invalidArgument(fmt::format("{} is null", what));
  const size_t size = out->struct_size;
  if (size < sizeof(size_t))
    return dualkv::invalidArgument(
        fmt::format("{}->struct_size ({}) is not set", what, size));
  value.struct_size = size;
  std::memcpy(out, &value, std::min(size, sizeof(T)));
  return llvm::Error::success();
}

/// The fields the forward's and the backward's arguments share, from the C
/// struct `a` into the C++ `args` (the same names on both sides): q, k, v, o,
/// lse, the shape (v_head_dim included), dtype, scale, plan, stream and the
/// main kernel's tiling.
template <typename C, typename Cpp>
llvm::Error toSharedArgs(const C &a, Cpp &args) {
  args.q = toTensor(a.q);
  args.k = toTensor(a.k);
  args.v = toTensor(a.v);
  args.o = toTensor(a.o);
  args.lse = a.lse;
  args.lse_stride_h = a.lse_stride_h;
  args.num_tokens = a.num_tokens;
  args.num_q_heads = a.num_q_heads;
  args.num_kv_heads = a.num_kv_heads;
  args.head_dim = a.head_dim;
  if (a.v_head_dim < 0 || a.v_head_dim > std::numeric_limits<int32_t>::max())
    return dualkv::invalidArgument(
        fmt::format("v_head_dim ({}) must be >= 0 and below 2^31 (0: head_dim)",
                    a.v_head_dim));
  args.v_head_dim = static_cast<int>(a.v_head_dim);
  args.scale = a.scale;
  args.plan = a.plan ? &a.plan->plan : nullptr;
  args.stream = a.stream;
  args.tiling = toTiling(a.tiling);
  return toEnum(dualkv::names::kDTypes, a.dtype, "dtype", args.dtype);
}

/// The oldest layouts of the forward's and the backward's argument structs
/// this library reads: those before `window` was appended (a pointer ends
/// them, so their size is exactly the offset of `window`, and a caller built
/// against them passes window 0).
constexpr size_t kForwardArgsOldestSize =
    offsetof(dualkv_forward_args_t, window);
constexpr size_t kBackwardArgsOldestSize =
    offsetof(dualkv_backward_args_t, window);
static_assert(kForwardArgsOldestSize ==
                  offsetof(dualkv_forward_args_t, sinks) + sizeof(void *),
              "window follows sinks without padding");
static_assert(kBackwardArgsOldestSize ==
                  offsetof(dualkv_backward_args_t, dsinks) + sizeof(void *),
              "window follows dsinks without padding");
// v_head_dim was appended after num_score_mod_inputs: the structs must grow
// by it, so that a caller built before it (whose struct_size ends at the
// padding after num_score_mod_inputs) passes none.
static_assert(offsetof(dualkv_forward_args_t, v_head_dim) >=
                  offsetof(dualkv_forward_args_t, num_score_mod_inputs) +
                      sizeof(int64_t),
              "v_head_dim lies past the padding after num_score_mod_inputs");
static_assert(offsetof(dualkv_backward_args_t, v_head_dim) >=
                  offsetof(dualkv_backward_args_t, num_score_mod_inputs) +
                      sizeof(int64_t),
              "v_head_dim lies past the padding after num_score_mod_inputs");

/// The C++ arguments of the C struct at `in`.
llvm::Expected<dualkv::BackwardArgs>
toBackwardArgs(const dualkv_backward_args_t *in) {
  llvm::Expected<dualkv_backward_args_t> read =
      readArgs(in, "args", kBackwardArgsOldestSize);
  if (!read)
    return read.takeError();
  const dualkv_backward_args_t &a = *read;
  dualkv::BackwardArgs args;
  if (llvm::Error e = toSharedArgs(a, args))
    return e;
  args.dout = toTensor(a.dout);
  args.dq = toTensor(a.dq);
  args.dk = toTensor(a.dk);
  args.dv = toTensor(a.dv);
  args.deterministic = a.deterministic != 0;
  if (llvm::Error e = toEnum(dualkv::names::kAlgorithms, a.algorithm,
                             "algorithm", args.algorithm))
    return e;
  args.workspace = a.workspace;
  args.workspace_bytes = a.workspace_bytes;
  args.dq_tiling = toTiling(a.dq_tiling);
  if (llvm::Error e = toEnum(dualkv::names::kSchedules, a.schedule, "schedule",
                             args.schedule))
    return e;
  args.softcap = a.softcap;
  args.dlse = a.dlse;
  args.dlse_stride_h = a.dlse_stride_h;
  args.sinks = a.sinks;
  args.dsinks = a.dsinks;
  args.window = a.window;
  args.score_mod = a.score_mod;
  args.score_mod_inputs = a.score_mod_inputs;
  args.num_score_mod_inputs = a.num_score_mod_inputs;
  return args;
}

/// The vocabulary as JSON (dualkv_names).
std::string namesJson() {
  auto rows = [](const auto &table) {
    std::string out = "[";
    int value = 0;
    for (const auto &row : table) {
      out +=
          fmt::format("{}{{\"name\": \"{}\", \"value\": {}{}}}",
                      value ? ", " : "", row.name, value,
                      row.alias ? fmt::format(", \"alias\": \"{}\"", row.alias)
                                : std::string());
      ++value;
    }
    return out + "]";
  };
  using namespace dualkv::names;
  // The argument structs' sizes, so that a binding can check its own
  // declarations against the library's.
  std::string sizes = fmt::format(
      "{{\"tensor\": {}, \"tiling\": {}, \"forward_args\": {}, "
      "\"backward_args\": {}, \"precompile_args\": {}, "
      "\"precompile_report\": {}, \"cache_stats\": {}}}",
      sizeof(dualkv_tensor_t), sizeof(dualkv_tiling_t),
      sizeof(dualkv_forward_args_t), sizeof(dualkv_backward_args_t),
      sizeof(dualkv_precompile_args_t), sizeof(dualkv_precompile_report_t),
      sizeof(dualkv_cache_stats_t));
  return fmt::format("{{\"kinds\": {}, \"dtypes\": {}, \"schedules\": {}, "
                     "\"algorithms\": {}, \"orders\": {}, \"struct_sizes\": "
                     "{}}}",
                     rows(kKinds), rows(kDTypes), rows(kSchedules),
                     rows(kAlgorithms), rows(kOrders), sizes);
}

} // namespace

extern "C" {

const char *dualkv_last_error(void) { return lastError.c_str(); }

const char *dualkv_version(void) { return dualkv::version(); }

int dualkv_gpu_available(void) { return dualkv::gpuAvailable() ? 1 : 0; }

int dualkv_plan_create(const int32_t *prompt_lens, const int32_t *num_responses,
                       const int32_t *response_lens, int32_t num_groups,
                       dualkv_plan **out) {
  return guarded([&]() -> llvm::Error {
    if (!out)
      return dualkv::invalidArgument("out is null");
    *out = nullptr;
    *out = new dualkv_plan{dualkv::Plan::fromArrays(prompt_lens, num_responses,
                                                    response_lens, num_groups)};
    return llvm::Error::success();
  });
}

int dualkv_plan_create_tree(const int32_t *lengths, const int32_t *parents,
                            int32_t num_nodes, dualkv_plan **out) {
  return guarded([&]() -> llvm::Error {
    if (!out)
      return dualkv::invalidArgument("out is null");
    *out = nullptr;
    *out = new dualkv_plan{
        dualkv::Plan::fromTreeArrays(lengths, parents, num_nodes)};
    return llvm::Error::success();
  });
}

int32_t dualkv_plan_max_ancestor_ranges(const dualkv_plan *plan) {
  return plan ? plan->plan.maxAncestorRanges() : -1;
}

int32_t dualkv_plan_num_chain_rows(const dualkv_plan *plan) {
  return plan ? static_cast<int32_t>(plan->plan.chainTable().size() / 4) : -1;
}

int dualkv_plan_chain_table(const dualkv_plan *plan, int32_t *out,
                            int64_t capacity) {
  return guarded([&]() -> llvm::Error {
    if (!plan)
      return dualkv::invalidArgument("plan is null");
    const std::vector<int32_t> &table = plan->plan.chainTable();
    if (!out || capacity < static_cast<int64_t>(table.size()))
      return dualkv::invalidArgument(
          fmt::format("capacity ({}) is less than the chain table's {} "
                      "entries (or out is null)",
                      capacity, table.size()));
    std::copy(table.begin(), table.end(), out);
    return llvm::Error::success();
  });
}

void dualkv_plan_destroy(dualkv_plan *plan) { delete plan; }

int dualkv_plan_upload(const dualkv_plan *plan) {
  return guarded([&]() -> llvm::Error {
    if (!plan)
      return dualkv::invalidArgument("plan is null");
    plan->plan.upload();
    return llvm::Error::success();
  });
}

int64_t dualkv_plan_num_tokens(const dualkv_plan *plan) {
  return plan ? plan->plan.numTokens() : -1;
}

int32_t dualkv_plan_num_segments(const dualkv_plan *plan) {
  return plan ? plan->plan.numSegments() : -1;
}

int dualkv_plan_segment_table(const dualkv_plan *plan, int32_t *out,
                              int64_t capacity) {
  return guarded([&]() -> llvm::Error {
    if (!plan)
      return dualkv::invalidArgument("plan is null");
    std::vector<int32_t> table = plan->plan.segmentTable();
    if (!out || capacity < static_cast<int64_t>(table.size()))
      return dualkv::invalidArgument(
          fmt::format("capacity ({}) is less than the table's {} entries (or "
                      "out is null)",
                      capacity, table.size()));
    std::copy(table.begin(), table.end(), out);
    return llvm::Error::success();
  });
}

int dualkv_forward(const dualkv_forward_args_t *in) {
  return guarded([&]() -> llvm::Error {
    llvm::Expected<dualkv_forward_args_t> read =
        readArgs(in, "args", kForwardArgsOldestSize);
    if (!read)
      return read.takeError();
    const dualkv_forward_args_t &a = *read;
    dualkv::ForwardArgs args;
    if (llvm::Error e = toSharedArgs(a, args))
      return e;
    if (llvm::Error e = toEnum(dualkv::names::kSchedules, a.schedule,
                               "schedule", args.schedule))
      return e;
    args.softcap = a.softcap;
    args.sinks = a.sinks;
    args.window = a.window;
    args.score_mod = a.score_mod;
    args.score_mod_inputs = a.score_mod_inputs;
    args.num_score_mod_inputs = a.num_score_mod_inputs;
    dualkv::forward(args);
    return llvm::Error::success();
  });
}

int dualkv_backward(const dualkv_backward_args_t *in) {
  return guarded([&]() -> llvm::Error {
    llvm::Expected<dualkv::BackwardArgs> args = toBackwardArgs(in);
    if (!args)
      return args.takeError();
    dualkv::backward(*args);
    return llvm::Error::success();
  });
}

int dualkv_backward_workspace_size(const dualkv_backward_args_t *in,
                                   int64_t *out_bytes) {
  return guarded([&]() -> llvm::Error {
    if (!out_bytes)
      return dualkv::invalidArgument("out_bytes is null");
    llvm::Expected<dualkv::BackwardArgs> args = toBackwardArgs(in);
    if (!args)
      return args.takeError();
    *out_bytes = dualkv::backwardWorkspaceBytes(*args);
    return llvm::Error::success();
  });
}

int dualkv_cache_stats(dualkv_cache_stats_t *out) {
  return guarded([&]() -> llvm::Error {
    dualkv::CacheStats s = dualkv::cacheStats();
    return writeOut(out,
                    {0, s.memoryHits, s.diskHits, s.diskMisses, s.compiles,
                     s.lastCompileMs, s.totalCompileMs, s.aotHits},
                    "out");
  });
}

int dualkv_precompile(const dualkv_precompile_args_t *in,
                      dualkv_precompile_report_t *out) {
  return guarded([&]() -> llvm::Error {
    llvm::Expected<dualkv_precompile_args_t> read =
        readArgs(in, "args", offsetof(dualkv_precompile_args_t, softcap));
    if (!read)
      return read.takeError();
    const dualkv_precompile_args_t &args = *read;
    dualkv::PrecompileArgs a;
    a.head_dim = args.head_dim;
    a.num_q_heads = args.num_q_heads;
    a.num_kv_heads = args.num_kv_heads;
    if (llvm::Error e =
            toEnum(dualkv::names::kDTypes, args.dtype, "dtype", a.dtype))
      return e;
    a.arch = args.arch ? args.arch : "";
    a.backward = args.backward != 0;
    a.deterministic = args.deterministic != 0;
    a.tiling = toTiling(args.tiling);
    a.softcap = args.softcap;
    a.dlse = args.dlse != 0;
    a.sinks = args.sinks != 0;
    a.window = args.window != 0;
    a.score_mod = args.score_mod;
    a.v_head_dim = args.v_head_dim;
    dualkv::PrecompileReport r = dualkv::precompile(a);
    if (!out)
      return llvm::Error::success();
    return writeOut(out,
                    {0, r.kernels, r.compiles, r.diskHits, r.memoryHits,
                     r.aotHits, r.wallMs},
                    "out");
  });
}

const char *dualkv_names(void) {
  static const std::string text = namesJson();
  return text.c_str();
}

} // extern "C"
