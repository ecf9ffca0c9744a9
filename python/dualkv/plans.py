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
           "tree_from_key", "is_tree_key", "PlanCache"]

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
            cycle, y = [x], parents[x]
            while y != x:
                cycle.append(y)
                y = parents[y]
            chain = " -> ".join(str(c) for c in cycle + [x])
            raise ValueError(f"dualkv: node {x}: parent = {parents[x]} closes "
                             f"a cycle ({chain}); a tree's parents end at a "
                             "root (-1)")
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
