/* DualKV's C API, for ctypes and other foreign-function callers. */
#ifndef DUALKV_DUALKV_C_H
#define DUALKV_DUALKV_C_H

#include "dualkv/Export.h"
#include "dualkv/Version.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Return codes of every function that returns int. */
enum dualkv_status {
  DUALKV_OK = 0,
  DUALKV_ERROR_INVALID_ARGUMENT = 1, /**< bad input; see dualkv_last_error */
  DUALKV_ERROR_CUDA = 2,             /**< a CUDA driver call failed */
  DUALKV_ERROR_COMPILE = 3,          /**< a kernel failed to compile */
  DUALKV_ERROR_NO_GPU = 4,           /**< no CUDA driver or no device */
  DUALKV_ERROR_INTERNAL = 5          /**< a DualKV bug or out of memory */
};

/** Data types of q, k, v and o. */
enum dualkv_dtype { DUALKV_BF16 = 0, DUALKV_FP16 = 1 };

/** An opaque packed batch layout (dualkv::Plan). */
typedef struct dualkv_plan dualkv_plan;

/** The message of the latest failure on this thread ("" if none). */
DUALKV_API const char *dualkv_last_error(void);

/** The library version, "major.minor.patch". */
DUALKV_API const char *dualkv_version(void);

/** 1 when a CUDA driver and at least one device are present, else 0. */
DUALKV_API int dualkv_gpu_available(void);

/**
 * Builds the plan of num_groups groups: group g has prompt_lens[g] (>= 1)
 * prompt tokens and num_responses[g] responses whose lengths (>= 0) are the
 * next num_responses[g] entries of response_lens. On success *out owns the
 * plan (free it with dualkv_plan_destroy). The segment table is copied to
 * the GPU on first use or by dualkv_plan_upload.
 */
DUALKV_API int dualkv_plan_create(const int32_t *prompt_lens,
                                  const int32_t *num_responses,
                                  const int32_t *response_lens,
                                  int32_t num_groups, dualkv_plan **out);
/**
 * Builds the plan of a forest of num_nodes nodes (docs/architecture.md §1):
 * node n holds lengths[n] (>= 0) tokens and has the parent parents[n] (-1
 * for a root, else an earlier node: the nodes are listed, and their tokens
 * packed, in pre-order). Query token i sees key token j iff j <= i and j's
 * node is i's node or an ancestor of it. A group (prompt, responses) is the
 * tree of a root and its leaves. Errors name the node and field at fault.
 * On success *out owns the plan (free it with dualkv_plan_destroy).
 */
DUALKV_API int dualkv_plan_create_tree(const int32_t *lengths,
                                       const int32_t *parents,
                                       int32_t num_nodes, dualkv_plan **out);
/**
 * The most disjoint ancestor ranges any segment of the plan sees (0 or 1
 * for groups and chains of first children), or -1 for a null plan.
 */
DUALKV_API int32_t dualkv_plan_max_ancestor_ranges(const dualkv_plan *plan);
/** Rows of the plan's chain table (dualkv::Plan::chainTable), or -1. */
DUALKV_API int32_t dualkv_plan_num_chain_rows(const dualkv_plan *plan);
/**
 * Copies the chain table (4 int32 per row: start, length, next, ranges; row
 * s < num_segments is segment s's nearest ancestor range) into out, which
 * holds capacity int32.
 */
DUALKV_API int dualkv_plan_chain_table(const dualkv_plan *plan, int32_t *out,
                                       int64_t capacity);
/** Frees a plan and its device table; null is ignored. */
DUALKV_API void dualkv_plan_destroy(dualkv_plan *plan);
/**
 * Copies the plan's segment table to the device of the current CUDA
 * context. Call it before capturing a CUDA graph; otherwise the first
 * dualkv_forward does it.
 */
DUALKV_API int dualkv_plan_upload(const dualkv_plan *plan);
/** Total packed tokens T, or -1 for a null plan. */
DUALKV_API int64_t dualkv_plan_num_tokens(const dualkv_plan *plan);
/** Number of segments (prompts and non-empty responses), or -1. */
DUALKV_API int32_t dualkv_plan_num_segments(const dualkv_plan *plan);
/**
 * Copies the segment table (4 int32 per segment: start, length,
 * shared_start, shared_len) into out, which holds capacity int32.
 */
DUALKV_API int dualkv_plan_segment_table(const dualkv_plan *plan, int32_t *out,
                                         int64_t capacity);

/**
 * The forward pass (dualkv::forward). Strides count elements. dtype is a
 * dualkv_dtype; scale 0 means 1/sqrt(head_dim) (finite and >= 0: negate q
 * for a negative scale); stream is a CUstream (null:
 * the default stream); tiling is null or 4 int32 {block_m, block_n, warps,
 * stages} (0 = default).
 */
DUALKV_API int dualkv_forward(
    void *q, int64_t q_stride_t, int64_t q_stride_h, void *k,
    int64_t k_stride_t, int64_t k_stride_h, void *v, int64_t v_stride_t,
    int64_t v_stride_h, void *o, int64_t o_stride_t, int64_t o_stride_h,
    float *lse, int64_t lse_stride_h, int64_t num_tokens, int32_t num_q_heads,
    int32_t num_kv_heads, int32_t head_dim, int32_t dtype, float scale,
    const dualkv_plan *plan, void *stream, const int32_t *tiling);

/**
 * The backward pass (dualkv::backward): writes dq (like q), dk and dv (like
 * k and v) from dout (like o), the forward's o and lse. Strides count
 * elements. deterministic != 0 reduces prompt dK/dV and dQ in a fixed order
 * (no atomics; the SplitDQ algorithm, which on sm_90a is also the default:
 * dualkv::BackwardAlgorithm). workspace is null (the
 * runtime's own; the first call allocates) or device memory of workspace_bytes
 * >= dualkv_backward_workspace_size, 256-byte aligned. Other arguments as in
 * dualkv_forward; tiling applies to the main backward kernel.
 */
DUALKV_API int dualkv_backward(
    void *q, int64_t q_stride_t, int64_t q_stride_h, void *k,
    int64_t k_stride_t, int64_t k_stride_h, void *v, int64_t v_stride_t,
    int64_t v_stride_h, void *o, int64_t o_stride_t, int64_t o_stride_h,
    void *dout, int64_t dout_stride_t, int64_t dout_stride_h, const float *lse,
    int64_t lse_stride_h, void *dq, int64_t dq_stride_t, int64_t dq_stride_h,
    void *dk, int64_t dk_stride_t, int64_t dk_stride_h, void *dv,
    int64_t dv_stride_t, int64_t dv_stride_h, int64_t num_tokens,
    int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim, int32_t dtype,
    float scale, int32_t deterministic, void *workspace,
    int64_t workspace_bytes, const dualkv_plan *plan, void *stream,
    const int32_t *tiling);

/**
 * Sets *out_bytes to the device workspace dualkv_backward needs for this
 * shape (dualkv::backwardWorkspaceBytes): for the current device's default
 * algorithm; without a GPU the atomic algorithm's, which is enough for
 * either. tiling is null or 4
 * int32, as for dualkv_backward (the size does not depend on it today).
 */
DUALKV_API int
dualkv_backward_workspace_size(const dualkv_plan *plan, int64_t num_tokens,
                               int32_t num_q_heads, int32_t num_kv_heads,
                               int32_t head_dim, int32_t deterministic,
                               const int32_t *tiling, int64_t *out_bytes);

/** Kernel cache counters (dualkv::CacheStats). */
typedef struct dualkv_cache_stats_t {
  int64_t memory_hits;
  int64_t disk_hits;
  int64_t disk_misses;
  int64_t compiles;
  double last_compile_ms;
  double total_compile_ms;
} dualkv_cache_stats_t;

/** Fills *out with the kernel cache counters of this process. */
DUALKV_API int dualkv_cache_stats(dualkv_cache_stats_t *out);

/** What dualkv_precompile found (dualkv::PrecompileReport). */
typedef struct dualkv_precompile_report_t {
  int32_t kernels;
  int32_t compiles;
  int32_t disk_hits;
  int32_t memory_hits;
  int32_t aot_hits;
  double wall_ms;
} dualkv_precompile_report_t;

/**
 * dualkv::precompile: compiles in parallel, and writes into the disk cache,
 * every kernel a forward (and with backward != 0 a backward, deterministic or
 * not) of this configuration needs. arch is null or "" for the current
 * device (needs a GPU), else e.g. "sm_90a" (needs none). tiling is null or 4
 * int32 as for dualkv_forward. out may be null.
 */
DUALKV_API int dualkv_precompile(int32_t head_dim, int32_t num_q_heads,
                                 int32_t num_kv_heads, int32_t dtype,
                                 const char *arch, int32_t backward,
                                 int32_t deterministic, const int32_t *tiling,
                                 dualkv_precompile_report_t *out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif
