"""Packing RL micro-batches for DualKV: G groups of (prompt, N responses) laid out as
``[prompt | response_1 | ... | response_N]`` back to back, with the position ids,
per-token segment information and kernel plan that go with them, and the way back
from per-token outputs to per-response values.

Works on plain Python lists; torch is only needed for ``to_torch``.

    packed = pack([(prompt_ids, [resp_a, resp_b]), (prompt2, [resp_c])])
    packed.input_ids, packed.position_ids     # what the model consumes
    plan = packed.plan()                      # what dualkv.forward takes
    idx = packed.logit_positions(0, 1)        # logits that predict response b's tokens

Trees (multi-turn and branching rollouts; docs/architecture.md §1) pack the same way,
segment by segment in pre-order, every common prefix once:

    tree = pack_tree([prompt, turn_1, answer_a, answer_b], parents=[-1, 0, 1, 1])
    tree.position_ids                         # positions continue along each path
    tree.logit_positions(3)                   # logits that predict answer_b's tokens
    tree.unpack_path(values, 3)               # rows of prompt | turn_1 | answer_b
"""

from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

from ._checks import INT64_MAX, integer, sequence
from .plans import check_tree

__all__ = ["PackedGroups", "pack", "PackedTree", "pack_tree"]


@dataclass
class PackedGroups:
    """The packed layout of a micro-batch. Per packed token: its id, its rotary
    position (prompt 0..P-1; every response P..P+R-1, as in its own sequence
    ``[prompt | response]``), its group, and its response index (-1 for prompt)."""

    groups: List[Tuple[int, List[int]]]
    input_ids: List[int] = field(default_factory=list)
    position_ids: List[int] = field(default_factory=list)
    group_ids: List[int] = field(default_factory=list)
    response_ids: List[int] = field(default_factory=list)
    group_starts: List[int] = field(default_factory=list)
    response_starts: List[List[int]] = field(default_factory=list)

    @property
    def num_tokens(self):
        return len(self.input_ids)

    def token_range(self, group, response=None):
        """[start, stop) of a group's prompt (response=None) or of one response."""
        group, response = self._check_index(group, response)
        if response is None:
            start = self.group_starts[group]
            return start, start + self.groups[group][0]
        start = self.response_starts[group][response]
        return start, start + self.groups[group][1][response]

    def logit_positions(self, group, response):
        """Packed positions whose next-token logits predict the response's tokens, in
        order: the first response token is predicted by the prompt's last position
        (not by the previous response's last token), every later one by its
        predecessor."""
        group, response = self._check_index(group, response, need_response=True)
        _, prompt_stop = self.token_range(group)
        start, stop = self.token_range(group, response)
        return [prompt_stop - 1] + list(range(start, stop - 1)) if stop > start else []

    def unpack(self, values, group, response):
        """The rows of a per-token ``values`` (list or tensor indexed by packed token)
        that belong to one response."""
        group, response = self._check_index(group, response, need_response=True)
        start, stop = self.token_range(group, response)
        return values[start:stop]

    def allowed(self, i, j):
        """docs/architecture.md §1: query i sees key j (same group, j <= i,
        prompt or same response)."""
        last = self.num_tokens - 1
        i = integer(i, "i", 0, last)
        j = integer(j, "j", 0, last)
        return (self.group_ids[i] == self.group_ids[j] and j <= i and
                (self.response_ids[j] == -1 or self.response_ids[j] == self.response_ids[i]))

    def plan(self):
        """The dualkv.Plan of this layout (loads libdualkv)."""
        from . import Plan
        return Plan(self.groups)

    def to_torch(self, device=None):
        """input_ids and position_ids as int64 tensors of shape [T]."""
        import torch
        return {
            "input_ids": torch.tensor(self.input_ids, dtype=torch.int64, device=device),
            "position_ids": torch.tensor(self.position_ids, dtype=torch.int64, device=device),
        }

    def _check_index(self, group, response, need_response=False):
        """(group, response) as ints in range, or ValueError naming the one at
        fault; response None means the prompt unless ``need_response``."""
        group = integer(group, "group", 0, len(self.groups) - 1)
        if response is None and not need_response:
            return group, None
        if response is None:
            raise ValueError(f"dualkv: response must be an integer index into "
                             f"group {group}'s responses, got None")
        response = integer(response, f"response (of group {group})", 0,
                           len(self.groups[group][1]) - 1)
        return group, response


def _token_list(ids, what):
    ids = sequence(ids, what)
    return [integer(t, f"{what}[{k}]", 0, INT64_MAX) for k, t in enumerate(ids)]


def pack(groups: Sequence[Tuple[Sequence[int], Sequence[Sequence[int]]]]) -> PackedGroups:
    """Packs ``groups``, each ``(prompt_ids, [response_ids, ...])``; responses may be
    empty (they then add no tokens). Raises ValueError naming the argument at fault."""
    groups = sequence(groups, "groups")
    if not groups:
        raise ValueError("dualkv: groups must be a non-empty sequence of "
                         "(prompt_ids, responses)")
    out = PackedGroups(groups=[])
    for g, item in enumerate(groups):
        item = sequence(item, f"groups[{g}]")
        if len(item) != 2:
            raise ValueError(f"dualkv: groups[{g}] must be a pair (prompt_ids, responses)")
        prompt = _token_list(item[0], f"groups[{g}] prompt")
        if not prompt:
            raise ValueError(f"dualkv: groups[{g}] prompt is empty: every group needs a "
                             "prompt")
        responses_in = sequence(item[1], f"groups[{g}] responses")
        responses = [_token_list(r, f"groups[{g}] response {n}")
                     for n, r in enumerate(responses_in)]
        p = len(prompt)
        out.groups.append((p, [len(r) for r in responses]))
        out.group_starts.append(len(out.input_ids))
        out.input_ids += prompt
        out.position_ids += list(range(p))
        out.group_ids += [g] * p
        out.response_ids += [-1] * p
        starts = []
        for n, r in enumerate(responses):
            starts.append(len(out.input_ids))
            out.input_ids += r
            out.position_ids += list(range(p, p + len(r)))
            out.group_ids += [g] * len(r)
            out.response_ids += [n] * len(r)
        out.response_starts.append(starts)
    if out.num_tokens >= 2 ** 31:
        raise ValueError(f"dualkv: the batch has {out.num_tokens} tokens; at most 2^31 - 1 "
                         "fit")
    return out


@dataclass
class PackedTree:
    """The packed layout of a forest: node n's tokens at ``token_range(n)``, nodes in
    pre-order (every parent before its children, each subtree contiguous). Per packed
    token: its id, its rotary position (the total length of its node's ancestors plus
    its index in the node, as in its own root-to-leaf sequence) and its node."""

    lengths: List[int]
    parents: List[int]
    input_ids: List[int] = field(default_factory=list)
    position_ids: List[int] = field(default_factory=list)
    node_ids: List[int] = field(default_factory=list)
    node_starts: List[int] = field(default_factory=list)
    children: List[List[int]] = field(default_factory=list)

    @property
    def num_tokens(self):
        return len(self.input_ids)

    @property
    def num_nodes(self):
        return len(self.lengths)

    def token_range(self, node):
        """[start, stop) of a node's tokens."""
        node = self._node(node)
        start = self.node_starts[node]
        return start, start + self.lengths[node]

    def path(self, node):
        """The nodes from the node's root down to it."""
        node = self._node(node)
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def leaves(self):
        """The nodes without children, in order: one sequence each."""
        return [n for n in range(self.num_nodes) if not self.children[n]]

    def path_positions(self, node):
        """Packed positions of the tokens of the node's root-to-node sequence, in
        order."""
        out = []
        for n in self.path(node):
            start, stop = self.token_range(n)
            out.extend(range(start, stop))
        return out

    def logit_positions(self, node):
        """Packed positions whose next-token logits predict the node's tokens, in
        order: its first token is predicted by its parent's last token (the nearest
        non-empty ancestor's, skipping empty nodes), every later one by its
        predecessor. A first token with no ancestor token (a root's) has no
        predictor and is left out, so the list is one shorter."""
        node = self._node(node)
        start, stop = self.token_range(node)
        if stop == start:
            return []
        previous = []
        ancestor = self.parents[node]
        while ancestor >= 0 and self.lengths[ancestor] == 0:
            ancestor = self.parents[ancestor]
        if ancestor >= 0:
            previous = [self.token_range(ancestor)[1] - 1]
        return previous + list(range(start, stop - 1))

    def unpack(self, values, node):
        """The rows of a per-token ``values`` (list or tensor) of one node."""
        start, stop = self.token_range(node)
        return values[start:stop]

    def unpack_path(self, values, node):
        """The rows of a per-token ``values`` along the node's root-to-node path (for
        a leaf: its whole sequence), as a list for a list and by index for a tensor;
        they equal what running that sequence alone gives."""
        positions = self.path_positions(node)
        if isinstance(values, (list, tuple)):
            return [values[i] for i in positions]
        import torch
        return values[torch.tensor(positions, dtype=torch.long,
                                   device=getattr(values, "device", None))]

    def allowed(self, i, j):
        """docs/architecture.md §1: query i sees key j (j <= i and j's node is i's
        node or one of its ancestors)."""
        last = self.num_tokens - 1
        i = integer(i, "i", 0, last)
        j = integer(j, "j", 0, last)
        if j > i:
            return False
        target, node = self.node_ids[j], self.node_ids[i]
        while node >= 0:
            if node == target:
                return True
            node = self.parents[node]
        return False

    def plan(self):
        """The dualkv.Plan of this layout (loads libdualkv)."""
        from . import Plan
        return Plan.from_tree(self.lengths, self.parents)

    def to_torch(self, device=None):
        """input_ids and position_ids as int64 tensors of shape [T]."""
        import torch
        return {
            "input_ids": torch.tensor(self.input_ids, dtype=torch.int64, device=device),
            "position_ids": torch.tensor(self.position_ids, dtype=torch.int64, device=device),
        }

    def _node(self, node):
        return integer(node, "node", 0, self.num_nodes - 1)


def pack_tree(segments: Sequence[Sequence[int]], parents: Sequence[int]) -> PackedTree:
    """Packs a forest: ``segments[n]`` is node n's token ids (possibly empty) and
    ``parents[n]`` its parent (-1 for a root, else an earlier node), nodes in
    pre-order. Raises ValueError naming the node and field at fault (as
    ``dualkv.Plan.from_tree``)."""
    segments = sequence(segments, "segments")
    ids = [_token_list(seg, f"segments[{n}]") for n, seg in enumerate(segments)]
    lengths, parents = check_tree([len(x) for x in ids], parents)
    out = PackedTree(lengths=lengths, parents=parents)
    out.children = [[] for _ in lengths]
    depth = [0] * len(lengths)  # tokens of each node's ancestors
    for n, tokens in enumerate(ids):
        p = parents[n]
        if p >= 0:
            out.children[p].append(n)
            depth[n] = depth[p] + lengths[p]
        out.node_starts.append(len(out.input_ids))
        out.input_ids += tokens
        out.position_ids += list(range(depth[n], depth[n] + len(tokens)))
        out.node_ids += [n] * len(tokens)
    return out
