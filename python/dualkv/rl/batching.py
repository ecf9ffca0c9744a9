"""Micro-batches by token budget, split groups, and ranks balanced by cost.

A rollout batch is a list of *units*: groups ``(prompt_ids, [response_ids,
...])`` (as ``dualkv.pack`` takes them) or trees (``Tree(segments,
parents)``, as ``dualkv.pack_tree`` takes them). ``schedule`` turns it into
micro-batches of at most ``token_budget`` packed tokens for each
data-parallel rank:

    sched = dualkv.rl.schedule(rollouts, token_budget=65536, world_size=8,
                               cost=dualkv.rl.CostModel.for_transformer(...))
    for mb in sched.ranks[rank]:
        packed = mb.pack()                 # ids, positions, plan, loss index
        ...                                # forward, loss / sched.loss_tokens

A unit larger than the budget is split into *pieces* by its leaves
(responses): each piece holds the root-to-leaf paths of some leaves, every
shared prefix (the prompt) once per piece, and the loss tokens of every node
are counted in exactly one piece (the first that holds the node), so a loss
summed over all micro-batches (and divided by ``Schedule.loss_tokens``) has
exactly the gradient of the unsplit batch: the prompt's gradients from the
pieces add up. Pure Python: no torch needed (``PackedMicroBatch.to_torch``
excepted).
"""

import itertools
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from .._checks import integer, sequence
from ..packing import pack, pack_tree

__all__ = ["Tree", "Piece", "MicroBatch", "PackedMicroBatch", "CostModel",
           "Schedule", "split_unit", "micro_batches", "balance", "schedule",
           "useful_pairs", "token_budget", "activation_bytes_per_token"]


class Tree:
    """A prefix tree (multi-turn, branching rollout) as a unit of a rollout
    batch: ``segments[n]`` node n's token ids, ``parents[n]`` its parent (-1
    for a root, else an earlier node, pre-order). ``loss[n]`` (default: the
    leaves) says whose tokens enter the loss; a node's tokens are predicted
    from its ancestors' (``PackedTree.logit_positions``)."""

    def __init__(self, segments, parents, loss=None):
        self.segments = [list(s) for s in sequence(segments, "segments")]
        packed = pack_tree(self.segments, parents)     # validates
        self.parents = packed.parents
        self.children = packed.children
        n = len(self.segments)
        if loss is None:
            loss = [not self.children[i] for i in range(n)]
        loss = sequence(loss, "loss")
        if len(loss) != n:
            raise ValueError(f"dualkv: loss has {len(loss)} flags for {n} "
                             "nodes")
        self.loss = [bool(x) for x in loss]


def _as_tree(unit, index):
    """(segments, parents, loss flags, is_group) of a unit."""
    if isinstance(unit, Tree):
        return unit.segments, unit.parents, unit.loss, False
    item = sequence(unit, f"rollouts[{index}]")
    if len(item) != 2:
        raise ValueError(f"dualkv: rollouts[{index}] must be a group "
                         "(prompt_ids, [response_ids, ...]) or a "
                         "dualkv.rl.Tree")
    prompt = list(sequence(item[0], f"rollouts[{index}] prompt"))
    if not prompt:
        raise ValueError(f"dualkv: rollouts[{index}] prompt is empty")
    responses = [list(sequence(r, f"rollouts[{index}] response {n}"))
                 for n, r in enumerate(sequence(item[1],
                                                f"rollouts[{index}] responses"))]
    segments = [prompt] + responses
    parents = [-1] + [0] * len(responses)
    loss = [False] + [True] * len(responses)
    return segments, parents, loss, True


@dataclass
class Piece:
    """Part of one unit: ``nodes`` (pre-order, every node's ancestors
    included) of unit ``unit``; ``loss_nodes`` the nodes whose tokens this
    piece puts in the loss. For a group, node 0 is the prompt and node n + 1
    response n."""

    unit: int
    nodes: List[int]
    loss_nodes: List[int]
    tokens: int
    loss_tokens: int
    pairs: int
    is_group: bool


def useful_pairs(lengths, parents):
    """(query, key) pairs attention computes for a forest in pre-order:
    every token sees its node's earlier tokens, itself and all its
    ancestors' tokens; a group is the forest of a prompt with one child per
    response."""
    above = [0] * len(lengths)
    total = 0
    for n, (length, p) in enumerate(zip(lengths, parents)):
        above[n] = 0 if p < 0 else above[p] + lengths[p]
        total += length * above[n] + length * (length + 1) // 2
    return total


def _predicted(segments, parents, node):
    """Tokens of a node that some earlier token predicts: all of them,
    except the first when no ancestor holds a token (a root's first)."""
    n, p = len(segments[node]), parents[node]
    while p >= 0 and not segments[p]:
        p = parents[p]
    return n if p >= 0 or n == 0 else n - 1


def _piece(unit, segments, parents, loss, is_group, nodes, claimed):
    nodes = sorted(nodes)
    index = {n: i for i, n in enumerate(nodes)}
    lengths = [len(segments[n]) for n in nodes]
    local_parents = [index[parents[n]] if parents[n] >= 0 else -1
                     for n in nodes]
    loss_nodes = [n for n in nodes if loss[n] and n not in claimed]
    claimed.update(loss_nodes)
    return Piece(unit=unit, nodes=nodes, loss_nodes=loss_nodes,
                 tokens=sum(lengths),
                 loss_tokens=sum(_predicted(segments, parents, n)
                                 for n in loss_nodes),
                 pairs=useful_pairs(lengths, local_parents),
                 is_group=is_group)


def split_unit(unit, token_budget, index=0):
    """The pieces of one unit under ``token_budget``: the whole unit when it
    fits, else its leaves in order, each with its root-to-leaf path, greedily
    gathered while the union of their paths fits. Raises ValueError when a
    single path is larger than the budget."""
    budget = integer(token_budget, "token_budget", 1)
    segments, parents, loss, is_group = _as_tree(unit, index)
    n = len(segments)
    children = [[] for _ in range(n)]
    for i, p in enumerate(parents):
        if p >= 0:
            children[p].append(i)
    claimed = set()
    total = sum(len(s) for s in segments)
    if total <= budget:
        return [_piece(index, segments, parents, loss, is_group,
                       list(range(n)), claimed)]
    pieces, current, size = [], set(), 0
    for leaf in (i for i in range(n) if not children[i]):
        path, x = [], leaf
        while x >= 0:
            path.append(x)
            x = parents[x]
        need = sum(len(segments[x]) for x in path)
        if need > budget:
            what = (f"response {leaf - 1} ({need} tokens with its prompt)"
                    if is_group else f"the path to node {leaf} ({need} tokens)")
            raise ValueError(f"dualkv: rollouts[{index}]: {what} does not fit "
                             f"the token budget of {budget}")
        extra = sum(len(segments[x]) for x in path if x not in current)
        if current and size + extra > budget:
            pieces.append(_piece(index, segments, parents, loss, is_group,
                                 current, claimed))
            current, size = set(), 0
            extra = need
        current.update(path)
        size += extra
    if current:
        pieces.append(_piece(index, segments, parents, loss, is_group,
                             current, claimed))
    return pieces


@dataclass
class CostModel:
    """Relative cost of a micro-batch: ``per_token`` for every packed token
    (projections, MLP, norms), ``per_pair`` for every (query, key) pair
    attention computes, ``per_loss_token`` for every token in the loss (the
    LM head, response-only). ``for_transformer`` derives them from a
    model's sizes as training FLOPs (forward + backward); the default counts
    tokens only, as sequence balancing by length does."""

    per_token: float = 1.0
    per_pair: float = 0.0
    per_loss_token: float = 0.0

    @classmethod
    def for_transformer(cls, hidden, layers, heads, kv_heads, head_dim,
                        intermediate, vocab=0):
        """FLOPs of a forward and backward (3x the forward's): per token
        ``6 * layers * (weights of a layer)``, per pair ``layers * heads *
        head_dim * 14`` (QK^T and PV, 4 FLOPs a pair and head dim, 3.5x with
        the backward), per loss token ``6 * hidden * vocab``."""
        attn = hidden * (heads + 2 * kv_heads) * head_dim + \
            heads * head_dim * hidden
        mlp = 3 * hidden * intermediate
        return cls(per_token=6.0 * layers * (attn + mlp),
                   per_pair=14.0 * layers * heads * head_dim,
                   per_loss_token=6.0 * hidden * vocab)

    def cost(self, tokens, pairs, loss_tokens=0):
        return (self.per_token * tokens + self.per_pair * pairs +
                self.per_loss_token * loss_tokens)


@dataclass
class MicroBatch:
    """Pieces packed into one row; ``rollouts`` is the batch they come from."""

    pieces: List[Piece]
    rollouts: Sequence = field(repr=False, default=())

    @property
    def tokens(self):
        return sum(p.tokens for p in self.pieces)

    @property
    def loss_tokens(self):
        return sum(p.loss_tokens for p in self.pieces)

    @property
    def pairs(self):
        return sum(p.pairs for p in self.pieces)

    def cost(self, model):
        return model.cost(self.tokens, self.pairs, self.loss_tokens)

    def pack(self):
        """The packed row (``PackedMicroBatch``): groups with ``dualkv.pack``
        when every piece is a group's, else a forest with ``pack_tree``."""
        return PackedMicroBatch(self)


class PackedMicroBatch:
    """A micro-batch laid out as one packed row.

    ``input_ids``, ``position_ids``: lists of T ints; ``plan()``: its
    dualkv.Plan (``Plan.from_position_ids(position_ids)`` gives the same
    plan whenever every group piece has two or more non-empty responses);
    ``logit_index``: the packed positions whose next-token logits predict
    the loss tokens, ``targets`` those tokens, ``segments`` one ``(unit,
    part, length)`` per loss segment in that order (part: the response
    index of a group, the node of a tree). ``layout`` is the PackedGroups
    or PackedTree behind it."""

    def __init__(self, mb):
        self.micro_batch = mb
        groups = all(p.is_group for p in mb.pieces)
        self.logit_index, self.targets, self.segments = [], [], []
        if groups:
            data = []
            for p in mb.pieces:
                segs, _, _, _ = _as_tree(mb.rollouts[p.unit], p.unit)
                data.append((segs[0], [segs[n] for n in p.nodes[1:]]))
            self.layout = pack(data)
            for g, p in enumerate(mb.pieces):
                for r, node in enumerate(p.nodes[1:]):
                    if node in p.loss_nodes:
                        self.logit_index += self.layout.logit_positions(g, r)
                        self.targets += data[g][1][r]
                        self.segments.append((p.unit, node - 1,
                                              len(data[g][1][r])))
        else:
            segments, parents, owners = [], [], []
            for p in mb.pieces:
                segs, pars, _, is_group = _as_tree(mb.rollouts[p.unit], p.unit)
                base = len(segments)
                index = {n: base + i for i, n in enumerate(p.nodes)}
                for n in p.nodes:
                    segments.append(segs[n])
                    parents.append(index[pars[n]] if pars[n] >= 0 else -1)
                    owners.append((p, n, is_group))
            self.layout = pack_tree(segments, parents)
            for i, (p, n, is_group) in enumerate(owners):
                if n in p.loss_nodes:
                    positions = self.layout.logit_positions(i)
                    tokens = segments[i]
                    # A root's first token has no predictor: it is left out.
                    tokens = tokens[len(tokens) - len(positions):]
                    self.logit_index += positions
                    self.targets += tokens
                    self.segments.append((p.unit, n - 1 if is_group else n,
                                          len(tokens)))
        self.input_ids = self.layout.input_ids
        self.position_ids = self.layout.position_ids

    @property
    def num_tokens(self):
        return len(self.input_ids)

    def plan(self):
        return self.layout.plan()

    def to_torch(self, device=None):
        """input_ids and position_ids ``[1, T]``, logit_index and targets
        ``[M]``, int64 tensors."""
        import torch
        out = {name: torch.tensor(getattr(self, name), dtype=torch.int64,
                                  device=device)
               for name in ("input_ids", "position_ids", "logit_index",
                            "targets")}
        out["input_ids"] = out["input_ids"][None]
        out["position_ids"] = out["position_ids"][None]
        return out


def micro_batches(pieces, token_budget, rollouts=(), min_count=1):
    """Pieces into micro-batches of at most ``token_budget`` tokens, first
    fit by decreasing size; then, while fewer than ``min_count``, the
    micro-batch with the most pieces is halved (by tokens) into two."""
    budget = integer(token_budget, "token_budget", 1)
    bins, sizes = [], []
    for p in sorted(pieces, key=lambda p: -p.tokens):
        if p.tokens > budget:
            raise ValueError(f"dualkv: a piece of {p.tokens} tokens (of "
                             f"rollouts[{p.unit}]) exceeds the token budget "
                             f"{budget}")
        for b, size in enumerate(sizes):
            if size + p.tokens <= budget:
                bins[b].append(p)
                sizes[b] += p.tokens
                break
        else:
            bins.append([p])
            sizes.append(p.tokens)
    while len(bins) < min_count:
        b = max(range(len(bins)), key=lambda i: (len(bins[i]), sizes[i]),
                default=None)
        if b is None or len(bins[b]) < 2:
            break
        items = sorted(bins[b], key=lambda p: -p.tokens)
        left, right, ls, rs = [], [], 0, 0
        for p in items:
            if ls <= rs:
                left.append(p)
                ls += p.tokens
            else:
                right.append(p)
                rs += p.tokens
        bins[b], sizes[b] = left, ls
        bins.append(right)
        sizes.append(rs)
    return [MicroBatch(sorted(b, key=lambda p: (p.unit, p.nodes)), rollouts)
            for b in bins]


def balance(costs, world_size):
    """Items of these costs spread over ``world_size`` ranks, largest first
    to the least loaded rank (LPT: the heaviest rank is within 4/3 of the
    best possible). Returns one list of item indices per rank."""
    world = integer(world_size, "world_size", 1)
    loads = [0.0] * world
    ranks = [[] for _ in range(world)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (loads[r], len(ranks[r]), r))
        ranks[r].append(i)
        loads[r] += costs[i]
    return [sorted(r) for r in ranks]


@dataclass
class Schedule:
    """``ranks[r]``: the micro-batches of data-parallel rank r;
    ``loss_tokens``: the loss tokens of the whole batch (divide a summed
    token loss by it on every rank for the token mean of the batch)."""

    ranks: List[List[MicroBatch]]
    token_budget: int
    cost_model: CostModel
    loss_tokens: int

    def rank_costs(self):
        return [sum(mb.cost(self.cost_model) for mb in r) for r in self.ranks]

    def imbalance(self):
        """Heaviest rank's cost over the mean (1.0: perfectly even)."""
        costs = self.rank_costs()
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean else 1.0

    def summary(self):
        return [{"micro_batches": len(r), "tokens": [mb.tokens for mb in r],
                 "cost": c} for r, c in zip(self.ranks, self.rank_costs())]


def schedule(rollouts, token_budget, world_size=1, cost=None,
             equal_counts=True):
    """Micro-batches of at most ``token_budget`` packed tokens for each of
    ``world_size`` data-parallel ranks: every unit split into pieces that
    fit (``split_unit``), the pieces spread over the ranks by ``cost`` (a
    CostModel; attention pairs and tokens), each rank's pieces packed into
    micro-batches (``micro_batches``); with ``equal_counts`` every rank gets
    as many micro-batches as the busiest one where its pieces allow (FSDP
    and DDP need the same number of steps on every rank)."""
    rollouts = list(sequence(rollouts, "rollouts"))
    if not rollouts:
        raise ValueError("dualkv: rollouts is empty")
    cost = cost or CostModel()
    pieces = list(itertools.chain.from_iterable(
        split_unit(u, token_budget, i) for i, u in enumerate(rollouts)))
    costs = [cost.cost(p.tokens, p.pairs, p.loss_tokens) for p in pieces]
    assignment = balance(costs, world_size)
    ranks = [micro_batches([pieces[i] for i in items], token_budget, rollouts)
             if items else [] for items in assignment]
    if equal_counts:
        most = max(len(r) for r in ranks)
        ranks = [micro_batches([p for mb in r for p in mb.pieces],
                               token_budget, rollouts, min_count=most)
                 if r and len(r) < most else r for r in ranks]
    return Schedule(ranks=ranks, token_budget=token_budget, cost_model=cost,
                    loss_tokens=sum(p.loss_tokens for p in pieces))


def activation_bytes_per_token(hidden, layers, heads, kv_heads, head_dim,
                               intermediate, dtype_bytes=2):
    """A rough count of the bytes autograd keeps per token for the backward
    of a pre-norm decoder (no activation checkpointing): per layer the
    residual stream and norms (fp32 inside), q, k, v before and after
    norm and rotary, the attention output and its log-sum-exp, and the
    MLP's gate, up and product. Measure it instead where you can (peak
    memory of two micro-batch sizes); this is a starting point."""
    qkv = (heads + 2 * kv_heads) * head_dim
    per_layer = dtype_bytes * (4 * hidden + 3 * qkv + 2 * heads * head_dim +
                               4 * intermediate) + 4 * (2 * hidden + heads)
    return layers * per_layer


def token_budget(free_bytes, bytes_per_token, reserve_bytes=0, fraction=0.9,
                 multiple=1):
    """The largest token budget whose activations fit: ``fraction`` of
    ``free_bytes`` less ``reserve_bytes`` (the loss step's chunk, the
    weights' gradients not yet allocated), divided by ``bytes_per_token``,
    rounded down to a ``multiple``."""
    usable = fraction * free_bytes - reserve_bytes
    if usable <= 0 or bytes_per_token <= 0:
        raise ValueError(f"dualkv: no token budget fits: {free_bytes} bytes "
                         f"free, {reserve_bytes} reserved, {bytes_per_token} "
                         "bytes a token")
    budget = int(usable // bytes_per_token)
    return max(multiple, budget - budget % multiple)
