"""Plan keys and the plan cache behind the custom ops (torch not needed).

A ``dualkv.Plan`` wraps a C handle, which no tracer can carry. The custom ops
(``dualkv.ops``) therefore take the plan's *lengths* instead, as a small int32
CPU tensor, the plan's ``descriptor``; the op's implementation turns it back
into a Plan through this cache. The key of a plan is the flat tuple

    (G, P_0, N_0, R_0_1 .. R_0_N0, P_1, N_1, R_1_1 .. , ...)

(G groups; group g: prompt length P_g, N_g responses of lengths R_g_n); a tree
plan's key is

    (-1, M, L_0, parent_0, .., L_{M-1}, parent_{M-1})

(M nodes in pre-order, each its length and parent index, -1 for a root). The
cache maps (device index, key) to a Plan, least recently used first out. A
plan the user built and passed to ``dualkv.attention`` eagerly is the one
stored, so ``plan.upload()`` before a CUDA graph capture is honoured.
"""

import threading
from collections import OrderedDict

from ._checks import INT32_MAX, integer, sequence

__all__ = ["plan_key", "groups_from_key", "tree_key", "check_tree",
           "tree_from_key", "is_tree_key", "PlanCache", "position_runs",
           "forest_from_position_ids", "key_from_position_ids"]

#: The first entry of a tree plan's key (a group count is never negative).
TREE_KEY = -1


def plan_key(groups):
    """The flat key of ``groups`` (a sequence of ``(prompt_len, [response
    lens])``), as a tuple of ints. Raises ValueError naming the entry at fault
    (a length that is not an integer in [0, 2^31 - 1], a group that is not a
    pair)."""
    return tuple(_flat_lengths(groups))


def _flat_lengths(groups):
    groups = sequence(groups, "groups")
    key = [len(groups)]
    for g, item in enumerate(groups):
        item = sequence(item, f"groups[{g}]")
        if len(item) != 2:
            raise ValueError(f"dualkv: groups[{g}] must be a pair (prompt_len, "
                             f"[response lengths]), got {len(item)} items")
        prompt_len, responses = item
        key.append(integer(prompt_len, f"groups[{g}] prompt length", 0,
                           INT32_MAX))
        responses = sequence(responses, f"groups[{g}] responses")
        key.append(len(responses))
        key.extend(integer(r, f"groups[{g}] response {n} length", 0, INT32_MAX)
                   for n, r in enumerate(responses))
    return key


def groups_from_key(key):
    """Inverse of ``plan_key``. Raises ValueError if ``key`` is malformed: not
    a sequence of integers, a negative or too large length or count, or
    values missing or left over."""
    key = [integer(x, f"plan descriptor[{i}]")
           for i, x in enumerate(sequence(key, "plan descriptor"))]
    if not key or key[0] < 0:
        raise ValueError("dualkv: plan descriptor is empty or has a negative "
                         "group count")
    groups, at = [], 1
    for g in range(key[0]):
        if at + 2 > len(key):
            raise ValueError(f"dualkv: plan descriptor ends inside group {g}")
        prompt_len, count = key[at], key[at + 1]
        at += 2
        if not 0 <= prompt_len <= INT32_MAX:
            raise ValueError(f"dualkv: plan descriptor has a bad prompt length "
                             f"{prompt_len} in group {g}")
        if count < 0 or at + count > len(key):
            raise ValueError(f"dualkv: plan descriptor has a bad response "
                             f"count {count} in group {g}")
        responses = key[at:at + count]
        for n, r in enumerate(responses):
            if not 0 <= r <= INT32_MAX:
                raise ValueError(f"dualkv: plan descriptor has a bad length {r} "
                                 f"for response {n} of group {g}")
        groups.append((prompt_len, responses))
        at += count
    if at != len(key):
        raise ValueError(f"dualkv: plan descriptor has {len(key) - at} "
                         "values past its last group")
    return groups


def check_tree(lengths, parents):
    """Validates a forest given as node lengths and parent indices (-1 for a
    root) in pre-order, as ``dualkv.Plan.from_tree`` and the C++ ``Plan``
    do, and returns them as two lists of ints. Raises ValueError naming the
    node and field at fault: a length or parent that is not an integer, a
    negative length, a parent out of range, a cycle, a parent after its
    child or not on the path of the node before it (not pre-order), no
    tokens at all, more than 2^31 - 1 tokens. O(nodes)."""
    lengths = sequence(lengths, "lengths")
    parents = sequence(parents, "parents")
    if not lengths:
        raise ValueError("dualkv: the tree has no nodes: a batch needs at "
                         "least one node")
    if len(parents) != len(lengths):
        raise ValueError(f"dualkv: the tree has {len(lengths)} lengths but "
                         f"{len(parents)} parents; give one of each per node")
    n = len(lengths)
    lengths = [integer(x, f"node {i}: length") for i, x in enumerate(lengths)]
    parents = [integer(x, f"node {i}: parent") for i, x in enumerate(parents)]
    for i in range(n):
        if lengths[i] < 0:
            raise ValueError(f"dualkv: node {i}: length = {lengths[i]} is "
                             "negative")
        if not -1 <= parents[i] < n:
            raise ValueError(f"dualkv: node {i}: parent = {parents[i]} is out "
                             f"of range (-1 for a root, else a node index "
                             f"below {n})")
    state = [0] * n  # 0 unseen, 1 on the current walk, 2 done
    for i in range(n):
        walk, x = [], i
        while x >= 0 and state[x] == 0:
            state[x] = 1
            walk.append(x)
            x = parents[x]
        if x >= 0 and state[x] == 1:
            raise ValueError(f"dualkv: node {x}: parent = {parents[x]} closes "
                             f"a cycle ({_cycle_text(parents, x)}); a tree's "
                             "parents end at a root (-1)")
        for y in walk:
            state[y] = 2
    path = []
    for i in range(n):
        p = parents[i]
        if p >= i:
            raise ValueError(f"dualkv: node {i}: parent = {p} comes after its "
                             "child; list every parent before its children "
                             "(pre-order)")
        while path and path[-1] != p:
            path.pop()
        if p >= 0 and not path:
            raise ValueError(f"dualkv: node {i}: parent = {p} is not node "
                             f"{i - 1} or one of its ancestors, so node {p}'s "
                             "subtree would not be contiguous; list the nodes "
                             "in pre-order (each subtree right after its "
                             "root)")
        path.append(i)
    tokens = 0
    for i, length in enumerate(lengths):
        tokens += length
        if tokens > INT32_MAX:
            raise ValueError(f"dualkv: node {i} brings the batch to {tokens} "
                             f"tokens, more than the kernels' int32 limit "
                             f"({INT32_MAX})")
    if tokens == 0:
        raise ValueError(f"dualkv: the tree's {n} nodes hold no tokens; a "
                         "batch needs at least one")
    return lengths, parents


#: The most nodes of a cycle a message names (a 10^6-node cycle spelled out
#: was a 9.9 MB message).
CYCLE_NODES_SHOWN = 32


def _cycle_text(parents, x):
    """The cycle through node ``x`` as "x -> parent -> ... -> x": its first
    CYCLE_NODES_SHOWN nodes and the count of the others cut."""
    shown, y, length = [x], parents[x], 1
    while y != x:
        if len(shown) < CYCLE_NODES_SHOWN:
            shown.append(y)
        length += 1
        y = parents[y]
    text = " -> ".join(str(c) for c in shown)
    if length > len(shown):
        text += f" -> ... ({length - len(shown)} more nodes cut)"
    return f"{text} -> {x}"


def tree_key(lengths, parents):
    """The flat key of a tree plan (after ``check_tree``)."""
    lengths, parents = check_tree(lengths, parents)
    key = [TREE_KEY, len(lengths)]
    for length, parent in zip(lengths, parents):
        key += [length, parent]
    return tuple(key)


def is_tree_key(key):
    """True for a tree plan's key (its first entry is -1)."""
    return len(key) > 0 and key[0] == TREE_KEY


def tree_from_key(key):
    """Inverse of ``tree_key``: (lengths, parents). Raises ValueError for a
    malformed key (and for an invalid tree, by name)."""
    key = [integer(x, f"plan descriptor[{i}]")
           for i, x in enumerate(sequence(key, "plan descriptor"))]
    if len(key) < 2 or key[0] != TREE_KEY or key[1] < 1:
        raise ValueError("dualkv: a tree plan descriptor starts with -1 and "
                         "a node count >= 1")
    if len(key) != 2 + 2 * key[1]:
        raise ValueError(f"dualkv: a tree plan descriptor of {key[1]} nodes "
                         f"has {len(key)} values, not {2 + 2 * key[1]}")
    return check_tree(key[2::2], key[3::2])


class PlanCache:
    """A thread-safe LRU map (device index, key) -> Plan.

    ``capacity`` bounds the number of plans kept alive (each holds a segment
    table on the host and, once used, on its device).
    """

    def __init__(self, capacity=64):
        capacity = integer(capacity, "PlanCache capacity")
        if capacity < 1:
            raise ValueError("dualkv: PlanCache capacity must be >= 1")
        self.capacity = capacity
        self._plans = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, device, key):
        """The cached plan or None; a hit becomes the most recent entry."""
        with self._lock:
            plan = self._plans.get((device, key))
            if plan is None:
                self.misses += 1
                return None
            self.hits += 1
            self._plans.move_to_end((device, key))
            return plan

    def put(self, device, key, plan):
        """Stores ``plan`` (replacing any entry of the same key) and evicts the
        least recently used entries beyond the capacity."""
        with self._lock:
            self._plans[(device, key)] = plan
            self._plans.move_to_end((device, key))
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)

    def get_or_create(self, device, key, create):
        """The cached plan, or ``create(key)`` stored and returned."""
        plan = self.get(device, key)
        if plan is None:
            plan = create(key)
            with self._lock:
                # Another thread may have stored one meanwhile: keep the first.
                plan = self._plans.setdefault((device, key), plan)
                self._plans.move_to_end((device, key))
                while len(self._plans) > self.capacity:
                    self._plans.popitem(last=False)
        return plan

    def clear(self):
        """Drops every entry (plans still referenced elsewhere stay alive)."""
        with self._lock:
            self._plans.clear()
            self.hits = 0
            self.misses = 0

    def __len__(self):
        with self._lock:
            return len(self._plans)

    def __contains__(self, device_and_key):
        with self._lock:
            return device_and_key in self._plans


def position_runs(position_ids):
    """The maximal runs of ``position_ids`` that count up by one, as a list
    of ``(first_position, length)``; the packed row ``position_ids`` is a
    sequence of ints, a 1-D tensor or array, or a ``[1, T]`` one. A tensor on
    a GPU is read with one small transfer (the run starts), not token by
    token. Raises ValueError for what is not one packed row (see
    ``key_from_position_ids``)."""
    shape = _shape(position_ids)
    if shape is not None:
        if len(shape) == 2 and shape[0] == 1:
            position_ids = position_ids[0]
        elif len(shape) >= 3 or (len(shape) == 2 and shape[0] != 1):
            raise ValueError(
                f"dualkv: position_ids has shape {tuple(shape)}; a plan is "
                "built from one packed row ([T] or [1, T]). Multi-dimensional "
                "rotary positions (e.g. Qwen2-VL's [3, 1, T] mrope) and "
                "batches of several rows are not packed this way: pack the "
                "rows into one (dualkv.pack) or pass dualkv_plan")
        if len(shape) == 0:
            raise ValueError("dualkv: position_ids is a scalar; give one "
                             "packed row of positions")
    if hasattr(position_ids, "dtype") and hasattr(position_ids, "device") \
            and hasattr(position_ids, "is_floating_point"):
        return _tensor_runs(position_ids)
    values = sequence(position_ids, "position_ids")
    if values and isinstance(values[0], (list, tuple)) or (
            values and _shape(values[0]) not in (None, ())):
        if len(values) != 1:
            raise ValueError(
                f"dualkv: position_ids has {len(values)} rows; a plan is "
                "built from one packed row ([T] or [1, T]): pack the rows "
                "into one (dualkv.pack) or pass dualkv_plan")
        values = sequence(values[0], "position_ids[0]")
    values = [integer(x, f"position_ids[{i}]") for i, x in enumerate(values)]
    if not values:
        raise ValueError("dualkv: position_ids is empty: a batch needs at "
                         "least one token")
    runs = []
    for i, p in enumerate(values):
        if runs and p == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return [tuple(r) for r in runs]


def _shape(x):
    shape = getattr(x, "shape", None)
    return None if shape is None else tuple(int(s) for s in shape)


def _tensor_runs(pos):
    import torch
    if pos.is_floating_point() or pos.is_complex() or pos.dtype == torch.bool:
        raise ValueError(f"dualkv: position_ids must hold integers, got "
                         f"{pos.dtype}")
    T = pos.shape[0]
    if T == 0:
        raise ValueError("dualkv: position_ids is empty: a batch needs at "
                         "least one token")
    pos = pos.long()
    breaks = torch.nonzero(pos[1:] - pos[:-1] != 1).flatten() + 1
    starts = torch.cat([breaks.new_zeros(1), breaks])
    # One transfer: the run starts' token indices and positions together.
    both = torch.stack([starts, pos[starts]]).tolist()
    bounds = both[0] + [T]
    return [(both[1][r], bounds[r + 1] - bounds[r])
            for r in range(len(both[0]))]


class _Node:
    __slots__ = ("start", "length", "children")

    def __init__(self, start, length):
        self.start, self.length, self.children = start, length, []


def forest_from_position_ids(position_ids):
    """The forest whose pre-order packing has these rotary positions, as
    ``(lengths, parents)`` in pre-order: a run that starts at position 0 is
    a new root; one that starts at p > 0 falls back to position p of the
    current root-to-node path and becomes a child of the node holding
    position p - 1, which is split there when p - 1 is not its last position.
    Nodes are maximal (a node with a single child whose positions go on from
    its own is one node) and never empty. Raises ValueError for what is not
    packed this way: a first position other than 0 (left padding, a row cut
    from a longer one), positions that skip forward, negative positions, a
    row that is not 1-D."""
    runs = position_runs(position_ids)
    roots, path, token = [], [], 0
    for first, length in runs:
        if first < 0:
            raise ValueError(f"dualkv: position_ids[{token}] = {first} is "
                             "negative")
        if first == 0:
            node = _Node(0, length)
            roots.append(node)
            path = [node]
        elif not path:
            raise ValueError(
                f"dualkv: position_ids starts at {first}, not 0: left "
                "padding, or a row cut out of a longer sequence, is not a "
                "packed layout (every sequence, prompt or tree root starts "
                "at position 0)")
        else:
            end = path[-1].start + path[-1].length   # the next position
            if first > end:
                raise ValueError(
                    f"dualkv: position_ids jumps from {end - 1} to {first} at "
                    f"token {token}: packed positions go on by one, restart "
                    "at 0 (a new sequence) or fall back to an earlier "
                    "position of the current sequence (a new response or "
                    "branch)")
            while path[-1].start > first - 1:
                path.pop()
            parent = path[-1]
            cut = first - parent.start           # tokens that stay in parent
            if cut < parent.length:
                tail = _Node(first, parent.length - cut)
                tail.children, parent.children = parent.children, [tail]
                parent.length = cut
            node = _Node(first, length)
            parent.children.append(node)
            path.append(node)
        token += length
    lengths, parents = [], []
    stack = [(r, -1) for r in reversed(roots)]
    while stack:
        node, parent = stack.pop()
        index = len(lengths)
        lengths.append(node.length)
        parents.append(parent)
        stack.extend((c, index) for c in reversed(node.children))
    if token > INT32_MAX:
        raise ValueError(f"dualkv: position_ids has {token} tokens, more "
                         f"than the kernels' int32 limit ({INT32_MAX})")
    return lengths, parents


def key_from_position_ids(position_ids):
    """The plan key (``plan_key`` or ``tree_key``) of a packed row of rotary
    positions (``forest_from_position_ids``): the groups key when every tree
    has depth at most 1 (a prompt and its responses; a lone sequence is a
    prompt with no responses), else the tree key."""
    lengths, parents = forest_from_position_ids(position_ids)
    groups, depth_ok = [], True
    for i, p in enumerate(parents):
        if p == -1:
            groups.append((lengths[i], []))
        elif parents[p] == -1:
            groups[-1][1].append(lengths[i])
        else:
            depth_ok = False
            break
    if depth_ok:
        return plan_key(groups)
    return tree_key(lengths, parents)
