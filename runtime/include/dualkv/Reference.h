// fp64 reference of DualKV attention (docs/architecture.md §1), packed and
// replicated.
#pragma once

#include "dualkv/Export.h"

#include <cstdint>
#include <functional>
#include <vector>

/// Slow, exact (fp64) implementations that every kernel and test is checked
/// against. Tensors are dense row-major: q, dq are [T][Hq][D]; k, dk are
/// [T][Hkv][D]; v, dv are [T][Hkv][Dv]; o, dout are [T][Hq][Dv]; lse is
/// [Hq][T] (natural log). D is head_dim, Dv the value head_dim (v_head_dim,
/// or D when that is 0). Every function validates its Problem and throws
/// std::invalid_argument naming the offending field.
///
/// Variants (the trailing fields of Problem and TreeProblem; their defaults
/// give plain attention). With x_ij = scale * q_i.k_j, query i's logits are
/// z_ij = softcap * tanh(x_ij / softcap) (softcap > 0) or x_ij, over the keys
/// j that allowed(i, j) admits and, with a window W > 0, that also satisfy
/// lpos(i) - lpos(j) < W, where lpos is the position in the token's own logical
/// sequence (a prompt token's index in the prompt, P + its index for a
/// response token; tree_positions() for a forest). With sinks, query head h's
/// sink logit joins every row's denominator only:
///   lse_i = log(exp(sink_h) + sum_j exp(z_ij)),
///   o_i = sum_j exp(z_ij - lse_i) v_j.
/// The backward overloads that take `dlse` ([Hq][T], the gradient of the loss
/// with respect to lse; nullptr: zero) use Delta_i = dout_i.o_i - dlse_i, so
///   dz_ij = P_ij (dout_i.v_j - Delta_i),
///   d(q_i.k_j) = dz_ij * scale * (1 - tanh^2(x_ij / softcap)) (or * scale),
///   dsinks_h = -sum_i exp(sink_h - lse_i) Delta_i over query head h's rows.
namespace dualkv::reference {

/// One group: a prompt of P tokens followed by responses of the given lengths
/// (any may be 0).
struct Group {
  int64_t prompt_len;
  std::vector<int64_t> response_lens;
};

/// A packed batch: groups back to back, heads and head size.
struct Problem {
  std::vector<Group> groups;
  int64_t num_q_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  /// Softmax scale; callers usually pass 1/sqrt(head_dim).
  double scale;
  /// Logit softcap c > 0: S_ij = c * tanh(scale * q_i.k_j / c); 0: none.
  double softcap = 0;
  /// Sliding window W >= 1: query i also needs lpos(i) - lpos(j) < W; 0: none.
  int64_t window = 0;
  /// Attention sinks: one logit per query head (size num_q_heads) joining
  /// every row's softmax denominator; empty: none. (`= {}`: GCC's
  /// -Wmissing-field-initializers accepts `Problem{groups, hq, hkv, d, scale}`
  /// only when every trailing member has an initializer.)
  std::vector<double> sinks = {};
  /// A score modifier (docs/score-modifiers.md) applied to each logit after
  /// the softcap: z = score_mod(x, head, lpos(i), lpos(j)), with its
  /// derivative dz/dx score_mod_grad (the same arguments); empty: none.
  std::function<double(double, int64_t, int64_t, int64_t)> score_mod = {},
                                                           score_mod_grad = {};
  /// The value head_dim Dv: the width of v, o, dout and dv rows (q and k
  /// rows are head_dim wide); 0: head_dim. Any width >= 0: the reference
  /// takes every shape, not only the kernels' (MLA's 192 with 128).
  int64_t v_head_dim = 0;
  /// Sum over groups of P + sum R.
  DUALKV_API int64_t num_tokens() const;
};

/// Per-token segment description derived from a Problem.
struct TokenInfo {
  /// Index of the token's group.
  int64_t group;
  /// Index of the token's response within its group; -1 for a prompt token.
  int64_t response;
  /// Packed index of the first prompt token of the token's group.
  int64_t prompt_start;
  /// Prompt length of the token's group.
  int64_t prompt_len;
  /// Packed index of the first token of the token's own segment (its response,
  /// or the prompt for a prompt token).
  int64_t segment_start;
};

/// Describes every packed token of \p problem; throws std::invalid_argument if
/// the problem is malformed.
DUALKV_API std::vector<TokenInfo> token_info(const Problem &problem);

/// allowed(i, j) of docs/architecture.md §1: may query token \p i attend to key
/// token \p j?
DUALKV_API bool allowed(const std::vector<TokenInfo> &info, int64_t i,
                        int64_t j);

/// Packed DualKV forward: writes o [T][Hq][Dv] and lse [Hq][T].
DUALKV_API void forward(const Problem &problem, const double *q,
                        const double *k, const double *v, double *o,
                        double *lse);

/// Packed DualKV backward of forward(): given its o and lse, the upstream
/// gradient dout [T][Hq][Dv] and the gradient \p dlse [Hq][T] of the loss
/// with respect to lse (nullptr: zero), writes dq [T][Hq][D], dk [T][Hkv][D]
/// and dv [T][Hkv][Dv]; where \p dsinks is not null, also dL/dsinks [Hq] (zeros
/// when the problem has no sinks).
DUALKV_API void backward(const Problem &problem, const double *q,
                         const double *k, const double *v, const double *o,
                         const double *lse, const double *dout, double *dq,
                         double *dk, double *dv, const double *dlse = nullptr,
                         double *dsinks = nullptr);

/// Replicated definition of forward(): for each group, each response n runs
/// ordinary causal attention on [prompt | response_n] separately (a group with
/// N = 0 runs the prompt alone once), with the problem's variants and lpos the
/// index in the copy. Prompt tokens take their value from the first copy (all
/// copies agree).
DUALKV_API void forward_replicated(const Problem &problem, const double *q,
                                   const double *k, const double *v, double *o,
                                   double *lse);

/// Replicated definition of backward(): per-copy causal backward where prompt
/// rows receive dout (and dlse) only in the first copy; prompt dk/dv, and
/// dsinks, are summed over the copies (so each token is counted once). Equals
/// backward() up to rounding.
DUALKV_API void backward_replicated(const Problem &problem, const double *q,
                                    const double *k, const double *v,
                                    const double *o, const double *lse,
                                    const double *dout, double *dq, double *dk,
                                    double *dv, const double *dlse = nullptr,
                                    double *dsinks = nullptr);

//===----------------------------------------------------------------------===//
// Trees (docs/architecture.md §1): a forest of segments packed in pre-order.
//===----------------------------------------------------------------------===//

/// One node of a forest: `length` >= 0 tokens, `parent` -1 for a root, else
/// an earlier node (the nodes are listed, and packed, in pre-order).
struct Node {
  int64_t length;
  int64_t parent;
};

/// A packed forest, heads and head size.
struct TreeProblem {
  std::vector<Node> nodes;
  int64_t num_q_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  double scale;
  /// Logit softcap c > 0: S_ij = c * tanh(scale * q_i.k_j / c); 0: none.
  double softcap = 0;
  /// Sliding window W >= 1: query i also needs lpos(i) - lpos(j) < W; 0: none.
  int64_t window = 0;
  /// Attention sinks: one logit per query head (size num_q_heads) joining
  /// every row's softmax denominator; empty: none.
  std::vector<double> sinks = {};
  /// A score modifier (docs/score-modifiers.md) applied to each logit after
  /// the softcap: z = score_mod(x, head, lpos(i), lpos(j)), with its
  /// derivative dz/dx score_mod_grad (the same arguments); empty: none.
  std::function<double(double, int64_t, int64_t, int64_t)> score_mod = {},
                                                           score_mod_grad = {};
  /// The value head_dim (Problem::v_head_dim); 0: head_dim.
  int64_t v_head_dim = 0;
  /// Sum of the nodes' lengths.
  DUALKV_API int64_t num_tokens() const;
};

/// The forest of a group problem: each prompt a root, its responses (empty
/// ones too) its children, in order; the variant fields are copied.
DUALKV_API TreeProblem as_tree(const Problem &problem);

/// Per token of a forest: its node and that node's first token; per node its
/// parent (from the problem).
struct TreeLayout {
  std::vector<int64_t> node;       ///< [T] node of each token
  std::vector<int64_t> node_start; ///< [nodes] first token of each node
  std::vector<int64_t> parent;     ///< [nodes] parent of each node
};

/// Lays out \p problem; throws std::invalid_argument if it is malformed (a
/// negative length, a parent out of range or not earlier, nodes not in
/// pre-order, bad heads, scale, softcap, window or sinks).
DUALKV_API TreeLayout tree_layout(const TreeProblem &problem);

/// tree_allowed(i, j): allowed(i, j) of docs/architecture.md §1 for trees: j <=
/// i and j's node is i's node or one of its ancestors (found by walking i's
/// parents).
DUALKV_API bool tree_allowed(const TreeLayout &layout, int64_t i, int64_t j);

/// The rotary position of every token: the total length of its node's
/// ancestors plus its index in its node.
DUALKV_API std::vector<int64_t> tree_positions(const TreeProblem &problem);

/// Packed forward of a forest, through tree_allowed(): o [T][Hq][Dv], lse
/// [Hq][T].
DUALKV_API void tree_forward(const TreeProblem &problem, const double *q,
                             const double *k, const double *v, double *o,
                             double *lse);

/// Packed backward of a forest, dlse and dsinks as in backward().
DUALKV_API void tree_backward(const TreeProblem &problem, const double *q,
                              const double *k, const double *v, const double *o,
                              const double *lse, const double *dout, double *dq,
                              double *dk, double *dv,
                              const double *dlse = nullptr,
                              double *dsinks = nullptr);

/// Path definition of tree_forward(): for every leaf (a node without
/// children), ordinary causal attention on the tokens of its root-to-leaf
/// path, run separately (with the problem's variants, lpos the index in the
/// path). Each token takes its o and lse from the first path
/// through it (all of them agree).
DUALKV_API void tree_forward_paths(const TreeProblem &problem, const double *q,
                                   const double *k, const double *v, double *o,
                                   double *lse);

/// Path definition of tree_backward(): per-path causal backward where a
/// token's dout (and dlse) enters only the first path through it; every
/// token's dq, dk, dv, and dsinks, are summed over the paths through it (so a
/// shared key's dk and dv are the sum over its paths).
DUALKV_API void tree_backward_paths(const TreeProblem &problem, const double *q,
                                    const double *k, const double *v,
                                    const double *o, const double *lse,
                                    const double *dout, double *dq, double *dk,
                                    double *dv, const double *dlse = nullptr,
                                    double *dsinks = nullptr);

} // namespace dualkv::reference
