// The C API: thin wrappers that turn exceptions into status codes.
#include "dualkv/dualkv_c.h"

#include "dualkv/dualkv.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <string>

/// The C handle is the C++ plan itself.
struct dualkv_plan {
  dualkv::Plan plan;
};

namespace {

thread_local std::string lastError;

/// Runs `body`, recording the message of whatever it throws.
template <typename F> int guarded(F &&body) {
  try {
    lastError.clear();
    body();
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

template <typename E, size_t N>
E toEnum(const dualkv::names::Row<E> (&rows)[N], int32_t value,
         const char *what) {
  if (value < 0 || static_cast<size_t>(value) >= N)
    throw dualkv::Error(dualkv::ErrorCode::InvalidArgument,
                        fmt::format("{} ({}) is not one of 0..{} ({})", what,
                                    value, N - 1, dualkv::names::listOf(rows)));
  return rows[value].value;
}

/// The struct at `args` as this library knows it: a caller's struct_size
/// below `firstSize` (the struct's first version) is refused; the fields
/// past struct_size (a caller built against an older header) stay zero;
/// bytes past this library's sizeof(T) must be zero (a newer caller's fields
/// this library would otherwise ignore).
template <typename T>
T readArgs(const T *args, const char *what, size_t firstSize = sizeof(T)) {
  if (!args)
    throw dualkv::Error(dualkv::ErrorCode::InvalidArgument,
                        fmt::format("{} is null", what));
  const size_t size = args->struct_size;
  if (size < firstSize)
    throw dualkv::Error(
        dualkv::ErrorCode::InvalidArgument,
        fmt::format("{}->struct_size ({}) is below the struct's first "
                    "version ({} bytes): set it to sizeof the struct",
                    what, size, firstSize));
  T copy{};
  std::memcpy(&copy, args, std::min(size, sizeof(T)));
  const auto *extra = reinterpret_cast<const unsigned char *>(args);
  for (size_t i = sizeof(T); i < size; ++i)
    if (extra[i] != 0)
      throw dualkv::Error(
          dualkv::ErrorCode::InvalidArgument,
          fmt::format("{} sets a field at byte {}, past the {} bytes this "
                      "library ({}) knows",
                      what, i, sizeof(T), dualkv::version()));
  return copy;
}

/// Writes `value` into `out` up to out->struct_size bytes (a caller built
/// against an older header receives the fields it knows).
template <typename T> void writeOut(T *out, T value, const char *what) {
  if (!out)
    throw dualkv::Error(dualkv::ErrorCode::InvalidArgument,
                        fmt::format("{} is null", what));
  const size_t size = out->struct_size;
  if (size < sizeof(size_t))
    throw dualkv::Error(
        dualkv::ErrorCode::InvalidArgument,
        fmt::format("{}->struct_size ({}) is not set", what, size));
  value.struct_size = size;
  std::memcpy(out, &value, std::min(size, sizeof(T)));
}

dualkv::BackwardArgs toBackwardArgs(const dualkv_backward_args_t &a) {
  dualkv::BackwardArgs args;
  args.q = toTensor(a.q);
  args.k = toTensor(a.k);
  args.v = toTensor(a.v);
  args.o = toTensor(a.o);
  args.dout = toTensor(a.dout);
  args.dq = toTensor(a.dq);
  args.dk = toTensor(a.dk);
  args.dv = toTensor(a.dv);
  args.lse = a.lse;
  args.lse_stride_h = a.lse_stride_h;
  args.num_tokens = a.num_tokens;
  args.num_q_heads = a.num_q_heads;
  args.num_kv_heads = a.num_kv_heads;
  args.head_dim = a.head_dim;
  args.dtype = toEnum(dualkv::names::kDTypes, a.dtype, "dtype");
  args.scale = a.scale;
  args.deterministic = a.deterministic != 0;
  args.algorithm = toEnum(dualkv::names::kAlgorithms, a.algorithm, "algorithm");
  args.workspace = a.workspace;
  args.workspace_bytes = a.workspace_bytes;
  args.plan = a.plan ? &a.plan->plan : nullptr;
  args.stream = a.stream;
  args.tiling = toTiling(a.tiling);
  args.dq_tiling = toTiling(a.dq_tiling);
  args.schedule = toEnum(dualkv::names::kSchedules, a.schedule, "schedule");
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
  return guarded([&] {
    if (!out)
      throw dualkv::Error(dualkv::ErrorCode::InvalidArgument, "out is null");
    *out = nullptr;
    *out = new dualkv_plan{dualkv::Plan::fromArrays(prompt_lens, num_responses,
                                                    response_lens, num_groups)};
  });
}

int dualkv_plan_create_tree(const int32_t *lengths, const int32_t *parents,
                            int32_t num_nodes, dualkv_plan **out) {
  return guarded([&] {
    if (!out)
      throw dualkv::Error(dualkv::ErrorCode::InvalidArgument, "out is null");
    *out = nullptr;
    *out = new dualkv_plan{
        dualkv::Plan::fromTreeArrays(lengths, parents, num_nodes)};
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
  return guarded([&] {
    using dualkv::Error, dualkv::ErrorCode;
    if (!plan)
      throw Error(ErrorCode::InvalidArgument, "plan is null");
    const std::vector<int32_t> &table = plan->plan.chainTable();
    if (!out || capacity < static_cast<int64_t>(table.size()))
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("capacity ({}) is less than the chain table's "
                              "{} entries (or out is null)",
                              capacity, table.size()));
    std::copy(table.begin(), table.end(), out);
  });
}

void dualkv_plan_destroy(dualkv_plan *plan) { delete plan; }

int dualkv_plan_upload(const dualkv_plan *plan) {
  return guarded([&] {
    if (!plan)
      throw dualkv::Error(dualkv::ErrorCode::InvalidArgument, "plan is null");
    plan->plan.upload();
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
  return guarded([&] {
    using dualkv::Error, dualkv::ErrorCode;
    if (!plan)
      throw Error(ErrorCode::InvalidArgument, "plan is null");
    std::vector<int32_t> table = plan->plan.segmentTable();
    if (!out || capacity < static_cast<int64_t>(table.size()))
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("capacity ({}) is less than the table's {} "
                              "entries (or out is null)",
                              capacity, table.size()));
    std::copy(table.begin(), table.end(), out);
  });
}

int dualkv_forward(const dualkv_forward_args_t *in) {
  return guarded([&] {
    const dualkv_forward_args_t a = readArgs(in, "args");
    dualkv::ForwardArgs args;
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
    args.dtype = toEnum(dualkv::names::kDTypes, a.dtype, "dtype");
    args.scale = a.scale;
    args.plan = a.plan ? &a.plan->plan : nullptr;
    args.stream = a.stream;
    args.tiling = toTiling(a.tiling);
    args.schedule = toEnum(dualkv::names::kSchedules, a.schedule, "schedule");
    dualkv::forward(args);
  });
}

int dualkv_backward(const dualkv_backward_args_t *in) {
  return guarded(
      [&] { dualkv::backward(toBackwardArgs(readArgs(in, "args"))); });
}

int dualkv_backward_workspace_size(const dualkv_backward_args_t *in,
                                   int64_t *out_bytes) {
  return guarded([&] {
    if (!out_bytes)
      throw dualkv::Error(dualkv::ErrorCode::InvalidArgument,
                          "out_bytes is null");
    *out_bytes =
        dualkv::backwardWorkspaceBytes(toBackwardArgs(readArgs(in, "args")));
  });
}

int dualkv_cache_stats(dualkv_cache_stats_t *out) {
  return guarded([&] {
    dualkv::CacheStats s = dualkv::cacheStats();
    writeOut(out,
             {0, s.memoryHits, s.diskHits, s.diskMisses, s.compiles,
              s.lastCompileMs, s.totalCompileMs, s.aotHits},
             "out");
  });
}

int dualkv_precompile(const dualkv_precompile_args_t *in,
                      dualkv_precompile_report_t *out) {
  return guarded([&] {
    const dualkv_precompile_args_t args = readArgs(in, "args");
    dualkv::PrecompileArgs a;
    a.head_dim = args.head_dim;
    a.num_q_heads = args.num_q_heads;
    a.num_kv_heads = args.num_kv_heads;
    a.dtype = toEnum(dualkv::names::kDTypes, args.dtype, "dtype");
    a.arch = args.arch ? args.arch : "";
    a.backward = args.backward != 0;
    a.deterministic = args.deterministic != 0;
    a.tiling = toTiling(args.tiling);
    dualkv::PrecompileReport r = dualkv::precompile(a);
    if (out)
      writeOut(out,
               {0, r.kernels, r.compiles, r.diskHits, r.memoryHits, r.aotHits,
                r.wallMs},
               "out");
  });
}

const char *dualkv_names(void) {
  static const std::string text = namesJson();
  return text.c_str();
}

} // extern "C"
