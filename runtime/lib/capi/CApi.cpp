// The C API: thin wrappers that turn exceptions into status codes.
#include "dualkv/dualkv_c.h"

#include "dualkv/dualkv.h"

#include <fmt/format.h>

#include <algorithm>
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

dualkv::DType toDType(int32_t dtype) {
  if (dtype != DUALKV_BF16 && dtype != DUALKV_FP16)
    throw dualkv::Error(
        dualkv::ErrorCode::InvalidArgument,
        fmt::format("dtype ({}) is neither 0 (bf16) nor 1 (fp16)", dtype));
  return dtype == DUALKV_BF16 ? dualkv::DType::BF16 : dualkv::DType::FP16;
}

dualkv::Tiling toTiling(const int32_t *tiling) {
  if (!tiling)
    return {};
  return {tiling[0], tiling[1], tiling[2], tiling[3]};
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

int dualkv_forward(void *q, int64_t q_stride_t, int64_t q_stride_h, void *k,
                   int64_t k_stride_t, int64_t k_stride_h, void *v,
                   int64_t v_stride_t, int64_t v_stride_h, void *o,
                   int64_t o_stride_t, int64_t o_stride_h, float *lse,
                   int64_t lse_stride_h, int64_t num_tokens,
                   int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                   int32_t dtype, float scale, const dualkv_plan *plan,
                   void *stream, const int32_t *tiling) {
  return guarded([&] {
    dualkv::ForwardArgs args;
    args.q = {q, q_stride_t, q_stride_h};
    args.k = {k, k_stride_t, k_stride_h};
    args.v = {v, v_stride_t, v_stride_h};
    args.o = {o, o_stride_t, o_stride_h};
    args.lse = lse;
    args.lse_stride_h = lse_stride_h;
    args.num_tokens = num_tokens;
    args.num_q_heads = num_q_heads;
    args.num_kv_heads = num_kv_heads;
    args.head_dim = head_dim;
    args.dtype = toDType(dtype);
    args.scale = scale;
    args.plan = plan ? &plan->plan : nullptr;
    args.stream = stream;
    args.tiling = toTiling(tiling);
    dualkv::forward(args);
  });
}

int dualkv_backward(void *q, int64_t q_stride_t, int64_t q_stride_h, void *k,
                    int64_t k_stride_t, int64_t k_stride_h, void *v,
                    int64_t v_stride_t, int64_t v_stride_h, void *o,
                    int64_t o_stride_t, int64_t o_stride_h, void *dout,
                    int64_t dout_stride_t, int64_t dout_stride_h,
                    const float *lse, int64_t lse_stride_h, void *dq,
                    int64_t dq_stride_t, int64_t dq_stride_h, void *dk,
                    int64_t dk_stride_t, int64_t dk_stride_h, void *dv,
                    int64_t dv_stride_t, int64_t dv_stride_h,
                    int64_t num_tokens, int32_t num_q_heads,
                    int32_t num_kv_heads, int32_t head_dim, int32_t dtype,
                    float scale, int32_t deterministic, void *workspace,
                    int64_t workspace_bytes, const dualkv_plan *plan,
                    void *stream, const int32_t *tiling) {
  return guarded([&] {
    dualkv::BackwardArgs args;
    args.q = {q, q_stride_t, q_stride_h};
    args.k = {k, k_stride_t, k_stride_h};
    args.v = {v, v_stride_t, v_stride_h};
    args.o = {o, o_stride_t, o_stride_h};
    args.dout = {dout, dout_stride_t, dout_stride_h};
    args.dq = {dq, dq_stride_t, dq_stride_h};
    args.dk = {dk, dk_stride_t, dk_stride_h};
    args.dv = {dv, dv_stride_t, dv_stride_h};
    args.lse = lse;
    args.lse_stride_h = lse_stride_h;
    args.num_tokens = num_tokens;
    args.num_q_heads = num_q_heads;
    args.num_kv_heads = num_kv_heads;
    args.head_dim = head_dim;
    args.dtype = toDType(dtype);
    args.scale = scale;
    args.deterministic = deterministic != 0;
    args.workspace = workspace;
    args.workspace_bytes = workspace_bytes;
    args.plan = plan ? &plan->plan : nullptr;
    args.stream = stream;
    args.tiling = toTiling(tiling);
    dualkv::backward(args);
  });
}

int dualkv_backward_workspace_size(const dualkv_plan *plan, int64_t num_tokens,
                                   int32_t num_q_heads, int32_t num_kv_heads,
                                   int32_t head_dim, int32_t deterministic,
                                   const int32_t *tiling, int64_t *out_bytes) {
  return guarded([&] {
    if (!out_bytes)
      throw dualkv::Error(dualkv::ErrorCode::InvalidArgument,
                          "out_bytes is null");
    // The shape and the mode are all the size depends on (the default
    // algorithm resolved for the current device, as backward() does).
    dualkv::BackwardArgs args;
    args.plan = plan ? &plan->plan : nullptr;
    args.num_tokens = num_tokens;
    args.num_q_heads = num_q_heads;
    args.num_kv_heads = num_kv_heads;
    args.head_dim = head_dim;
    args.deterministic = deterministic != 0;
    args.tiling = toTiling(tiling);
    *out_bytes = dualkv::backwardWorkspaceBytes(args);
  });
}

int dualkv_cache_stats(dualkv_cache_stats_t *out) {
  return guarded([&] {
    if (!out)
      throw dualkv::Error(dualkv::ErrorCode::InvalidArgument, "out is null");
    dualkv::CacheStats s = dualkv::cacheStats();
    *out = {s.memoryHits, s.diskHits,      s.diskMisses,
            s.compiles,   s.lastCompileMs, s.totalCompileMs};
  });
}

int dualkv_precompile(int32_t head_dim, int32_t num_q_heads,
                      int32_t num_kv_heads, int32_t dtype, const char *arch,
                      int32_t backward, int32_t deterministic,
                      const int32_t *tiling, dualkv_precompile_report_t *out) {
  return guarded([&] {
    dualkv::PrecompileArgs a;
    a.head_dim = head_dim;
    a.num_q_heads = num_q_heads;
    a.num_kv_heads = num_kv_heads;
    a.dtype = toDType(dtype);
    a.arch = arch ? arch : "";
    a.backward = backward != 0;
    a.deterministic = deterministic != 0;
    a.tiling = toTiling(tiling);
    dualkv::PrecompileReport r = dualkv::precompile(a);
    if (out)
      *out = {r.kernels,    r.compiles, r.diskHits,
              r.memoryHits, r.aotHits,  r.wallMs};
  });
}

} // extern "C"
