// fp64 reference of DualKV attention (docs/architecture.md §1), packed and
// replicated.
#pragma once

#include "dualkv/Export.h"

#include <cstdint>
#include <vector>

/// Slow, exact (fp64) implementations that every kernel and test is checked
/// against. Tensors are dense row-major: q, o, dq are [T][Hq][D]; k, v, dk, dv
/// are [T][Hkv][D]; lse is [Hq][T] (natural log). Every function validates its
/// Problem and throws std::invalid_argument naming the offending field.
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

/// Packed DualKV forward: writes o [T][Hq][D] and lse [Hq][T].
DUALKV_API void forward(const Problem &problem, const double *q,
                        const double *k, const double *v, double *o,
                        double *lse);

/// Packed DualKV backward of forward(): given its o and lse and the upstream
/// gradient dout [T][Hq][D], writes dq [T][Hq][D], dk and dv [T][Hkv][D].
DUALKV_API void backward(const Problem &problem, const double *q,
                         const double *k, const double *v, const double *o,
                         const double *lse, const double *dout, double *dq,
                         double *dk, double *dv);

/// Replicated definition of forward(): for each group, each response n runs
/// ordinary causal attention on [prompt | response_n] separately (a group with
/// N = 0 runs the prompt alone once). Prompt tokens take their value from the
/// first copy (all copies agree).
DUALKV_API void forward_replicated(const Problem &problem, const double *q,
                                   const double *k, const double *v, double *o,
                                   double *lse);

/// Replicated definition of backward(): per-copy causal backward where prompt
/// rows receive dout only in the first copy; prompt dk/dv are summed over the
/// copies. Equals backward() up to rounding.
DUALKV_API void backward_replicated(const Problem &problem, const double *q,
                                    const double *k, const double *v,
                                    const double *o, const double *lse,
                                    const double *dout, double *dq, double *dk,
                                    double *dv);

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
  /// Sum of the nodes' lengths.
  DUALKV_API int64_t num_tokens() const;
};

/// The forest of a group problem: each prompt a root, its responses (empty
/// ones too) its children, in order.
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
/// pre-order, bad heads or scale).
DUALKV_API TreeLayout tree_layout(const TreeProblem &problem);

/// tree_allowed(i, j): allowed(i, j) of docs/architecture.md §1 for trees: j <=
/// i and j's node is i's node or one of its ancestors (found by walking i's
/// parents).
DUALKV_API bool tree_allowed(const TreeLayout &layout, int64_t i, int64_t j);

/// The rotary position of every token: the total length of its node's
/// ancestors plus its index in its node.
DUALKV_API std::vector<int64_t> tree_positions(const TreeProblem &problem);

/// Packed forward of a forest, through tree_allowed(): o [T][Hq][D], lse
/// [Hq][T].
DUALKV_API void tree_forward(const TreeProblem &problem, const double *q,
                             const double *k, const double *v, double *o,
                             double *lse);

/// Packed backward of a forest.
DUALKV_API void tree_backward(const TreeProblem &problem, const double *q,
                              const double *k, const double *v, const double *o,
                              const double *lse, const double *dout, double *dq,
                              double *dk, double *dv);

/// Path definition of tree_forward(): for every leaf (a node without
/// children), ordinary causal attention on the tokens of its root-to-leaf
/// path, run separately. Each token takes its o and lse from the first path
/// through it (all of them agree).
DUALKV_API void tree_forward_paths(const TreeProblem &problem, const double *q,
                                   const double *k, const double *v, double *o,
                                   double *lse);

/// Path definition of tree_backward(): per-path causal backward where a
/// token's dout enters only the first path through it; every token's dq, dk,
/// dv are summed over the paths through it (so a shared key's dk and dv are
/// the sum over its paths).
DUALKV_API void tree_backward_paths(const TreeProblem &problem, const double *q,
                                    const double *k, const double *v,
                                    const double *o, const double *lse,
                                    const double *dout, double *dq, double *dk,
                                    double *dv);

} // namespace dualkv::reference
