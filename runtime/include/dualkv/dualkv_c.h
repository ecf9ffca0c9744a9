/* DualKV's C API, for ctypes and other foreign-function callers. */
#ifndef DUALKV_DUALKV_C_H
#define DUALKV_DUALKV_C_H

#include "dualkv/Export.h"
#include "dualkv/Version.h"

#include <stddef.h>
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

/*
 * Argument structs. Each begins with struct_size, which the caller sets to
 * sizeof(the struct) as its header declared it: fields are only ever added
 * at the end, so a caller built against an older header passes a smaller
 * size and the fields it does not know take their defaults (zero), and one
 * built against a newer header is refused only if it sets a field this
 * library does not know. Zero-initialise the struct, set struct_size, then
 * the fields you need.
 */

/** One packed THD tensor: strides count elements, the last dim is dense. */
typedef struct dualkv_tensor_t {
  void *data;
  int64_t stride_t; /**< between consecutive tokens */
  int64_t stride_h; /**< between consecutive heads */
} dualkv_tensor_t;

/** A tile shape; zero fields take the defaults. */
typedef struct dualkv_tiling_t {
  int32_t block_m;
  int32_t block_n;
  int32_t warps;
  int32_t stages;
} dualkv_tiling_t;

/** Kernel schedules (dualkv::Schedule); 0 is the compiler's choice. */
enum dualkv_schedule {
  DUALKV_SCHEDULE_AUTO = 0,
  DUALKV_SCHEDULE_MMA_SYNC = 1,
  DUALKV_SCHEDULE_WGMMA = 2,
  DUALKV_SCHEDULE_WARP_SPECIALIZED = 3
};

/** Backward algorithms (dualkv::BackwardAlgorithm); 0 is the default. */
enum dualkv_backward_algorithm {
  DUALKV_BACKWARD_AUTO = 0,
  DUALKV_BACKWARD_ATOMIC = 1,
  DUALKV_BACKWARD_SPLIT_DQ = 2
};

/** The forward's arguments (dualkv::ForwardArgs). */
typedef struct dualkv_forward_args_t {
  size_t struct_size; /**< sizeof(dualkv_forward_args_t) */
  dualkv_tensor_t q, k, v, o;
  float *lse;           /**< fp32 [Hq][T], natural log */
  int64_t lse_stride_h; /**< elements between heads of lse */
  int64_t num_tokens;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t dtype; /**< a dualkv_dtype */
  float scale;   /**< 0: 1/sqrt(head_dim); finite and >= 0 */
  const dualkv_plan *plan;
  void *stream; /**< a CUstream; null is the legacy default stream */
  dualkv_tiling_t tiling;
  int32_t schedule; /**< a dualkv_schedule */
  /** logit softcap c > 0 (c tanh(logit / c)); 0: none. Callers built before
   * it pass a struct_size without it: none. */
  float softcap;
  const float *sinks; /**< null, or one fp32 sink logit per query head */
  /** sliding window W >= 1 (a query sees the keys fewer than W logical
   * positions before it); 0: none. Callers built before it pass a
   * struct_size without it: none. */
  int64_t window;
  /** score modifier: MLIR text of func.func @score_mod
   * (dualkv::ForwardArgs::score_mod); null or "": none. Callers built before
   * it pass a struct_size without it: none. */
  const char *score_mod;
  /** its tensors: one fp32 device pointer per memref argument, in order */
  const float *const *score_mod_inputs;
  int32_t num_score_mod_inputs;
  /** value rows' width Dv, of v and o (dualkv::ForwardArgs::v_head_dim): 0
   * or head_dim for rows as wide as q's and k's, 128 with head_dim 192
   * (MLA). int64_t, so that the struct grows by it: an int32_t would sit in
   * the padding after num_score_mod_inputs, which callers built before it
   * pass within their struct_size. Callers built before it: 0. */
  int64_t v_head_dim;
} dualkv_forward_args_t;

/** The forward pass (dualkv::forward). */
DUALKV_API int dualkv_forward(const dualkv_forward_args_t *args);

/** The backward's arguments (dualkv::BackwardArgs). */
typedef struct dualkv_backward_args_t {
  size_t struct_size; /**< sizeof(dualkv_backward_args_t) */
  dualkv_tensor_t q, k, v, o, dout, dq, dk, dv;
  const float *lse; /**< the forward's lse */
  int64_t lse_stride_h;
  int64_t num_tokens;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t dtype;
  float scale;           /**< must match the forward's */
  int32_t deterministic; /**< != 0: the split-dQ algorithm, same bits */
  int32_t algorithm;     /**< a dualkv_backward_algorithm */
  /** null (the runtime's own; the first call allocates) or device memory of
   * workspace_bytes >= dualkv_backward_workspace_size, 256-byte aligned */
  void *workspace;
  int64_t workspace_bytes;
  const dualkv_plan *plan;
  void *stream;
  dualkv_tiling_t tiling;    /**< the main kernel's */
  dualkv_tiling_t dq_tiling; /**< the split-dQ algorithm's dQ kernel's */
  int32_t schedule;          /**< the main kernel's, a dualkv_schedule */
  float softcap;             /**< the forward's softcap; must match it */
  /** null, or the gradient of the forward's lse (fp32 [Hq][T]) */
  const float *dlse;
  int64_t dlse_stride_h; /**< elements between heads of dlse */
  const float *sinks;    /**< the forward's sinks, or null */
  float *dsinks;         /**< null, or fp32 [Hq] written with dL/dsinks */
  int64_t window;        /**< the forward's window; must match it */
  /** the forward's score modifier and tensors; must match them */
  const char *score_mod;
  const float *const *score_mod_inputs;
  int32_t num_score_mod_inputs;
  /** the forward's v_head_dim (dualkv_forward_args_t): the width of v, o,
   * dout and dv rows; 0: head_dim. Callers built before it: 0. */
  int64_t v_head_dim;
} dualkv_backward_args_t;

/**
 * The backward pass (dualkv::backward): writes dq (like q), dk and dv (like
 * k and v) from dout (like o: v_head_dim wide), the forward's o and lse.
 */
DUALKV_API int dualkv_backward(const dualkv_backward_args_t *args);

/**
 * Sets *out_bytes to the device workspace dualkv_backward needs for `args`
 * (dualkv::backwardWorkspaceBytes; only the plan, num_tokens, the heads,
 * head_dim, v_head_dim, deterministic, algorithm, tiling and window are
 * read): for the
 * current device's default algorithm; without a GPU the atomic algorithm's,
 * which is enough for either.
 */
DUALKV_API int
dualkv_backward_workspace_size(const dualkv_backward_args_t *args,
                               int64_t *out_bytes);

/** Kernel cache counters (dualkv::CacheStats). */
typedef struct dualkv_cache_stats_t {
  size_t struct_size; /**< set by the caller: the fields it can receive */
  int64_t memory_hits;
  int64_t disk_hits;
  int64_t disk_misses;
  int64_t compiles;
  double last_compile_ms;
  double total_compile_ms;
  int64_t aot_hits;
} dualkv_cache_stats_t;

/** Fills *out (up to out->struct_size) with this process's counters. */
DUALKV_API int dualkv_cache_stats(dualkv_cache_stats_t *out);

/** What dualkv_precompile should make ready (dualkv::PrecompileArgs). */
typedef struct dualkv_precompile_args_t {
  size_t struct_size; /**< sizeof(dualkv_precompile_args_t) */
  int32_t head_dim;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t dtype;
  /** null or "": the current device's (needs a GPU); else e.g. "sm_90a" */
  const char *arch;
  int32_t backward;      /**< != 0: the backward's kernels too */
  int32_t deterministic; /**< != 0: the split-dQ set only */
  dualkv_tiling_t tiling;
  /** The variants' kernels (PrecompileArgs); callers built before them pass
   * a struct_size without them: none. */
  float softcap;  /**< logit softcap c > 0; 0: none */
  int32_t dlse;   /**< != 0: bwd_pre with a differentiated LSE */
  int32_t sinks;  /**< != 0: attention sinks */
  int32_t window; /**< != 0: a sliding window (every W) */
  /** null or "": none; else a score modifier's MLIR text (its kernels) */
  const char *score_mod;
  /** the value head_dim (dualkv_forward_args_t::v_head_dim); 0: head_dim.
   * Callers built before it pass a struct_size without it: 0. */
  int32_t v_head_dim;
} dualkv_precompile_args_t;

/** What dualkv_precompile found (dualkv::PrecompileReport). */
typedef struct dualkv_precompile_report_t {
  size_t struct_size; /**< set by the caller: the fields it can receive */
  int32_t kernels;
  int32_t compiles;
  int32_t disk_hits;
  int32_t memory_hits;
  int32_t aot_hits;
  double wall_ms;
} dualkv_precompile_report_t;

/**
 * dualkv::precompile: compiles in parallel, and writes into the disk cache,
 * every kernel a forward (and a backward) of this configuration needs. out
 * may be null.
 */
DUALKV_API int dualkv_precompile(const dualkv_precompile_args_t *args,
                                 dualkv_precompile_report_t *out);

/**
 * DualKV's vocabulary (dualkv/Names.h) as JSON: {"kinds": [...], "dtypes":
 * [...], "schedules": [...], "algorithms": [...], "orders": [...], ...}, each a
 * list of {"name", "value"[, "alias"]} in enumerator order, so that bindings
 * spell values as the library does; and "struct_sizes", the sizeof of each
 * argument struct, for bindings to check their declarations against. The
 * text lives as long as the library.
 */
DUALKV_API const char *dualkv_names(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif
