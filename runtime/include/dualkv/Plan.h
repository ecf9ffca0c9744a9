// The packed layout of one micro-batch: its groups, segments and device table.
#ifndef DUALKV_PLAN_H
#define DUALKV_PLAN_H

#include "dualkv/Export.h"
#include "dualkv/Names.h"

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dualkv {

/// One group of a micro-batch: a shared prompt followed by its responses.
struct PlanGroup {
  int64_t prompt_len = 0;             ///< at least 1
  std::vector<int64_t> response_lens; ///< each at least 0; 0 adds no tokens
};

/// A forest of segments (docs/architecture.md §1): node n holds
/// lengths[n] >= 0 tokens and has the parent parents[n] (-1 for a root).
/// Nodes are listed, and their tokens packed, in pre-order: every parent
/// before its children, every subtree contiguous. Query token i sees key
/// token j iff j <= i and j's node is i's node or one of its ancestors.
struct PlanTree {
  std::vector<int64_t> lengths;
  std::vector<int64_t> parents;
};

/// A contiguous run of query tokens (one non-empty node of the tree: a
/// prompt, a response) that sees one causal region of its own and, in full,
/// the key ranges of its ancestors. `shared_*` is the nearest of those ranges
/// (adjacent ancestors merged into one): for a response of a group, the
/// prompt; (0, 0) for a root. A segment with more than one ancestor range
/// finds the others through the plan's chain table (Plan::chainTable).
struct Segment {
  int32_t start = 0;        ///< first packed token
  int32_t length = 0;       ///< tokens (> 0)
  int32_t shared_start = 0; ///< first token of the nearest ancestor range
  int32_t shared_len = 0;   ///< its length; 0 for a root
  bool operator==(const Segment &o) const {
    return start == o.start && length == o.length &&
           shared_start == o.shared_start && shared_len == o.shared_len;
  }
};

/// The backward's work-item table of a plan on the device
/// (docs/backward-abi.md), as Plan::backwardTable returns it.
struct BackwardTable {
  uint64_t items = 0;     ///< int32 [numItems][kBwdItemFields]
  uint64_t accTokens = 0; ///< int32 [numAccRows]; 0 when numAccRows = 0
  int64_t numItems = 0;   ///< CTAs per KV head of the main backward kernel
  int64_t numAccRows = 0; ///< rows of the fp32 dK/dV accumulators
};

/// The forward's work order of a plan on the device, as Plan::forwardTable
/// returns it: int32 [numItems][2] = {segment, query tile}, heaviest first.
struct ForwardTable {
  uint64_t items = 0;   ///< device address
  int64_t numItems = 0; ///< query tiles of every segment (CTAs per head)
};

/// The packed layout of a batch, built once per micro-batch on the host: a
/// forest of segments packed in pre-order (PlanTree), or its shorthand, the
/// groups back to back, `[prompt | response_1 | ... | response_N]` (each
/// group a root with its responses as children). It is cut into segments
/// (each non-empty node). The segment table, int32 [numSegments][4] =
/// {start, length, shared_start, shared_len}, is copied to the device once
/// (upload()) and read by every kernel; a plan whose segments see more than
/// one ancestor range also uploads its chain table (chainTable()).
class DUALKV_API Plan {
public:
  /// Validates and lays out `groups`. Throws Error (InvalidArgument) naming
  /// the group at fault: no groups, a prompt shorter than 1 token, a
  /// negative response length, or more than INT32_MAX tokens in all.
  explicit Plan(const std::vector<PlanGroup> &groups);
  /// The same, spelled inline: `Plan plan({{512, {100, 0, 37}}});`.
  explicit Plan(std::initializer_list<PlanGroup> groups)
      : Plan(std::vector<PlanGroup>(groups)) {}

  /// The same from flat arrays (the C API's shape): group g has
  /// prompt_lens[g] prompt tokens and num_responses[g] responses whose
  /// lengths follow each other in response_lens.
  static Plan fromArrays(const int32_t *prompt_lens,
                         const int32_t *num_responses,
                         const int32_t *response_lens, int32_t num_groups);

  /// Validates and lays out a forest (PlanTree). Throws Error
  /// (InvalidArgument) naming the node and field at fault: no nodes,
  /// lengths and parents of different sizes, a negative length, a parent
  /// out of range, a cycle, a parent after its child or not on the path of
  /// the node before it (not pre-order), no tokens at all, or more than
  /// INT32_MAX tokens. Built in O(nodes).
  explicit Plan(const PlanTree &tree);
  /// The same from flat arrays (the C API's shape).
  static Plan fromTreeArrays(const int32_t *lengths, const int32_t *parents,
                             int32_t num_nodes);

  Plan(Plan &&) noexcept;
  Plan &operator=(Plan &&) noexcept;
  Plan(const Plan &) = delete;
  Plan &operator=(const Plan &) = delete;
  /// Frees the device table, if one was uploaded.
  ~Plan();

  int64_t numTokens() const { return numTokens_; }
  /// Trees of the forest (groups of the shorthand).
  int numGroups() const { return numGroups_; }
  /// The forest: per node its length, parent (-1 for a root) and first
  /// token. A plan of groups has one root per prompt with its responses
  /// (empty ones too) as children, in order.
  int numNodes() const { return static_cast<int>(nodeLengths_.size()); }
  const std::vector<int64_t> &nodeLengths() const { return nodeLengths_; }
  const std::vector<int64_t> &nodeParents() const { return nodeParents_; }
  const std::vector<int64_t> &nodeStarts() const { return nodeStarts_; }
  /// The node of each segment.
  const std::vector<int32_t> &segmentNodes() const { return segmentNodes_; }
  /// One past the last token of each segment's subtree (its descendants
  /// follow it contiguously in pre-order).
  const std::vector<int64_t> &subtreeEnds() const { return subtreeEnds_; }
  /// Keys each segment sees outside itself: the total length of its
  /// ancestors.
  const std::vector<int64_t> &ancestorTokens() const { return ancestorTokens_; }
  /// The most disjoint ancestor ranges (after merging adjacent ones) any
  /// segment sees: 0 or 1 for groups and for chains of first children, so
  /// that the segment table's shared range says everything; more for
  /// branching trees, whose segments also need the chain table.
  int maxAncestorRanges() const { return maxAncestorRanges_; }
  /// The chain table, int32 [numChainRows][4] = {start, length, next,
  /// ranges}: row s < numSegments is segment s's nearest ancestor range (its
  /// shared range; (0, 0) for a root), `next` the row of the next range up
  /// the path (-1 after the last) and `ranges` the number of ranges from this
  /// row to the root (0 for a root segment); the rows past numSegments are
  /// the ranges the segments' paths share. Walking `ranges` rows from row s
  /// visits every ancestor range of segment s once. O(nodes) rows.
  const std::vector<int32_t> &chainTable() const { return chain_; }
  int numSegments() const { return static_cast<int>(segments_.size()); }
  int maxSegmentLen() const { return maxSegmentLen_; }
  const std::vector<Segment> &segments() const { return segments_; }
  /// Each packed token's position in its logical sequence (the tokens of its
  /// ancestors, then its own: a response token r of a group with prompt P
  /// is at P + r), int32 [T]: what score modifiers see as q_idx and kv_idx.
  std::vector<int32_t> logicalPositions() const;
  /// The segment table as uploaded: 4 int32 per segment.
  std::vector<int32_t> segmentTable() const;

  /// Copies the segment table to the device of the current CUDA context
  /// (retaining device 0's primary context if none is current). Idempotent;
  /// forward() calls it on first use. It allocates and copies synchronously,
  /// so call it before capturing a CUDA graph.
  void upload() const;
  /// True once upload() has run.
  bool uploaded() const;
  /// Device address of the segment table (0 before upload()).
  uint64_t deviceTable() const;
  /// The CUDA context (CUcontext) the table lives in, or null.
  void *deviceContext() const;
  /// Device address of the chain table (0 before upload(), and for plans
  /// with maxAncestorRanges() <= 1, which never upload it).
  uint64_t deviceChainTable() const;

  /// The backward's work items for KV tiles of `blockM` keys and query
  /// chunks of at most `chunk` tokens (docs/backward-abi.md) in `order`, for
  /// a sliding window of `window` tokens (0: none; its items are cut by
  /// logical sequence and carry their shift), built and copied to the device
  /// on first use per (blockM, chunk, order, window) and kept for the plan's
  /// life. Like upload() (which it calls), the first call allocates and
  /// copies synchronously; the current context must be the plan's.
  BackwardTable backwardTable(int blockM, int64_t chunk,
                              BackwardOrder order = BackwardOrder::Auto,
                              int64_t window = 0) const;
  /// The query tiles of `blockM` rows of every segment, ordered by the keys
  /// they read (their ancestors plus their causal part), longest first,
  /// so the last CTAs of a launch are the shortest; ties keep the segment
  /// order. Built in O(tiles log tiles) and copied on first use per blockM
  /// (by upload() for kForwardOrderBlockM), kept for the plan's life, like
  /// backwardTable.
  ForwardTable forwardTable(int blockM) const;
  /// The host side of forwardTable: {segment, tile} pairs.
  std::vector<int32_t> forwardOrder(int blockM) const;

  /// The tile height whose forward order upload() builds eagerly: the
  /// warp-specialized forward's block_m.
  static constexpr int kForwardOrderBlockM = 128;

private:
  Plan();
  /// Lays out a validated forest.
  void layout(std::vector<int64_t> lengths, std::vector<int64_t> parents);
  /// The runtime's side of the device tables (upload, forwardTable,
  /// backwardTable), which the methods above call.
  friend struct PlanDevice;
  struct Device;
  int64_t numTokens_ = 0;
  int numGroups_ = 0;
  int maxSegmentLen_ = 0;
  int maxAncestorRanges_ = 0;
  std::vector<Segment> segments_;
  std::vector<int64_t> nodeLengths_, nodeParents_, nodeStarts_;
  std::vector<int32_t> segmentNodes_;
  std::vector<int64_t> subtreeEnds_, ancestorTokens_;
  std::vector<int32_t> chain_;
  std::unique_ptr<Device> device_;
};

} // namespace dualkv

#endif
