"""DualKV for PyTorch: exact shared-prompt attention on packed RL micro-batches.

A micro-batch is G groups back to back; group g is a prompt of ``P_g`` tokens
followed by ``N_g`` responses, packed as ``[prompt | resp_1 | ... | resp_N]``
("THD" layout). Query i attends key j iff both are in the same group, j <= i,
and j is a prompt token or lies in i's own response (docs/architecture.md §1),
so every token gets exactly what N separate causal sequences
``[prompt | resp_n]`` would give, while the prompt is stored and processed
once.

    import dualkv
    plan = dualkv.Plan([(4096, [1024] * 16)])      # one group
    o, lse = dualkv.forward(q, k, v, plan)         # q [T,Hq,D], k/v [T,Hkv,D]

With autograd and torch.compile (``dualkv.ops`` registers the custom ops
``dualkv::forward`` and ``dualkv::backward``; torch is imported only then):

    o = dualkv.attention(q, k, v, plan)            # differentiable
    o.float().pow(2).sum().backward()              # q.grad, k.grad, v.grad

``dualkv.forward`` and ``dualkv.backward`` are the plain (non-autograd) calls
of the C API. The library (libdualkv.so) is found through ``$DUALKV_LIB``,
then a copy in ``dualkv/lib/``, then ``<repo>/build/`` (see ``dualkv._lib``).
"""

import ctypes
import re
import sys

from . import _lib, _version
from ._bounded import MAX_QUOTED, clip, shown
from ._checks import integer, scale_value as _scale_value, sequence
from ._checks import softcap_value as _softcap_value
from ._checks import window_value as _window_value
from .packing import PackedGroups, PackedTree, pack, pack_tree
from .plans import (check_tree, groups_from_key, is_tree_key,
                    key_from_position_ids, plan_key, tree_from_key, tree_key)

__version__ = _version.version()

__all__ = [
    "DualKVError", "Plan", "forward", "backward", "attention", "version",
    "cache_stats", "gpu_available", "library_path", "pack", "PackedGroups",
    "precompile", "pack_tree", "PackedTree", "rl", "ScoreMod", "score_mods",
]


def __getattr__(name):
    # dualkv.attention, dualkv.ops and dualkv.distributed import torch, so they
    # load on first use (and with them dualkv.ScoreMod, dualkv.score_mods):
    # `import dualkv` alone needs neither torch nor transformers.
    if name == "attention":
        from .ops import attention
        return attention
    if name == "ScoreMod":
        from .score_mod import ScoreMod
        return ScoreMod
    if name in ("ops", "distributed", "rl", "score_mod", "score_mods"):
        # import_module, not `from . import name`: the latter asks this
        # __getattr__ for the submodule first and would recurse forever.
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'dualkv' has no attribute {name!r}")


class DualKVError(RuntimeError):
    """A failure of the library other than a bad argument (CUDA, compile,
    no GPU, internal). ``code`` is the C API's dualkv_status."""

    def __init__(self, code, message):
        name = _lib.STATUS_NAMES.get(code, f"status {code}")
        super().__init__(f"dualkv: {name}: {message}")
        self.code = code


def _check(status):
    """Turns a C status into an exception carrying dualkv_last_error()."""
    if status == _lib.OK:
        return
    # The library bounds what it quotes; this bounds an older library's too.
    message = clip(_lib.last_error(), 4 * MAX_QUOTED)
    if status == _lib.ERROR_INVALID_ARGUMENT:
        raise ValueError(f"dualkv: {message}")
    raise DualKVError(status, message)


def version():
    """The loaded library's version, "major.minor.patch" (``__version__`` is
    the package's; both come from the top-level CMakeLists.txt)."""
    return _lib.lib().dualkv_version().decode()


def gpu_available():
    """True when the library finds a CUDA driver and at least one device."""
    return bool(_lib.lib().dualkv_gpu_available())


def library_path():
    """Path of the loaded libdualkv.so (loads it if needed)."""
    _lib.lib()
    return str(_lib.path())


def cache_stats():
    """The kernel cache counters of this process, as a dict: memory_hits,
    disk_hits, disk_misses, compiles, last_compile_ms, total_compile_ms,
    aot_hits."""
    stats = _lib.CacheStats()
    _check(_lib.lib().dualkv_cache_stats(ctypes.byref(stats)))
    return {name: getattr(stats, name) for name, _ in stats._fields_
            if name != "struct_size"}


def _precompile_dtype(dtype):
    """The C API's dtype from its name ("bf16", "fp16"), its alias or a torch
    dtype (torch.bfloat16, torch.float16; torch is not imported for this),
    as the library's vocabulary spells them."""
    name = str(dtype).replace("torch.", "")
    code = _lib.names()["dtypes"].get(name)
    if code is None:
        raise ValueError(f"dualkv: dtype {shown(dtype)} is neither bf16 nor "
                         "fp16")
    return code


# precompile's arch: "sm_" and the compute capability's digits, "a" for the
# arch-specific feature set (sm_90a). The library checks which are supported;
# this keeps what is no arch at all (a NUL, which C would end the string at,
# spaces, non-ASCII digits) from reaching it.
_ARCH_FORM = re.compile(r"sm_[0-9]{2,3}a?")


def _precompile_arch(arch):
    """precompile's arch as the C API's bytes, or None (the current GPU's);
    ValueError for anything but None or a string of the form sm_NN[a]."""
    if arch is None:
        return None
    if not isinstance(arch, str):
        raise ValueError(f"dualkv: arch must be a string like 'sm_90a' or "
                         f"None, got {type(arch).__name__} {shown(arch)}")
    if not _ARCH_FORM.fullmatch(arch):
        raise ValueError(f"dualkv: arch {shown(arch)} is not of the form "
                         "sm_NN or sm_NNa (e.g. 'sm_80', 'sm_90a'); None "
                         "takes the current GPU's")
    return arch.encode("ascii")


def precompile(head_dim, num_q_heads, num_kv_heads, dtype="bf16", arch=None,
               backward=True, deterministic=False, tiling=None, softcap=0.0,
               dlse=False, sinks=False, window=False, score_mod=None,
               v_head_dim=None):
    """Compiles, in parallel, every kernel a forward (and with ``backward`` a
    backward, ``deterministic`` or not) of this configuration needs and
    writes them into the kernel cache (``$DUALKV_CACHE_DIR``), so that later
    calls, in this process or another (a container built from this image),
    compile nothing. Shapes never matter: the kernels are shape-generic.

    ``dtype``: "bf16"/"fp16" or torch.bfloat16/torch.float16. ``arch``: e.g.
    "sm_90a": "sm_", the compute capability's digits and "a" for an
    arch-specific feature set (any other string is a ValueError before the
    library sees it; the library names the supported ones); None for the
    current GPU's (then a GPU is needed; with an arch neither a GPU nor torch
    is). ``tiling``: None or (block_m, block_n, warps, stages), as for the
    kernels' launches. The variants' kernels, as ``attention`` asks for them:
    ``softcap`` (each value its own kernels), ``dlse`` (a differentiated
    LSE, ``return_lse=True``), ``sinks``, ``window`` (true or any W >= 1: one
    set serves every W; its backward is the atomic algorithm's, so not with
    ``deterministic``), ``score_mod`` (a score modifier as ``attention``
    takes it: each text its own kernels; its inputs' values do not matter,
    a traced function needs torch). ``v_head_dim``: the value rows' width,
    None (or 0) for ``head_dim``'s; 128 with ``head_dim`` 192 (MLA, the
    only pair of unequal widths). Returns a dict: kernels, compiles,
    disk_hits, memory_hits, aot_hits, wall_ms."""
    ints = [integer(value, name, 0, 2**31 - 1) for name, value in
            (("head_dim", head_dim), ("num_q_heads", num_q_heads),
             ("num_kv_heads", num_kv_heads),
             ("v_head_dim", 0 if v_head_dim is None else v_head_dim))]
    arch_bytes = _precompile_arch(arch)
    code = _precompile_dtype(dtype)
    mod = _score_mod(score_mod)
    args = _lib.PrecompileArgs(
        head_dim=ints[0], num_q_heads=ints[1], num_kv_heads=ints[2],
        dtype=code, arch=arch_bytes,
        backward=int(bool(backward)), deterministic=int(bool(deterministic)),
        tiling=_tiling(tiling), softcap=_softcap_value(softcap),
        dlse=int(bool(dlse)), sinks=int(bool(sinks)),
        window=int(window if isinstance(window, bool)
                   else _window_value(window) > 0),
        score_mod=None if mod is None else mod.text.encode("utf-8"),
        v_head_dim=ints[3])
    report = _lib.PrecompileReport()
    _check(_lib.lib().dualkv_precompile(ctypes.byref(args),
                                        ctypes.byref(report)))
    return {name: getattr(report, name) for name, _ in report._fields_
            if name != "struct_size"}


class Plan:
    """The packed layout of one micro-batch (wraps the C ``dualkv_plan``).

    ``groups`` is a sequence of ``(prompt_len, [response_len, ...])``: prompt
    lengths >= 1, response lengths >= 0 (0 adds no tokens); ``Plan.from_tree``
    builds the plan of a forest (multi-turn and branching rollouts, every
    common prefix shared), of which groups are the depth-1 case. Build one plan per
    micro-batch and reuse it for every layer; it lives on the device of the
    first forward call that uses it (one plan per device).

    ``key`` is the plan's lengths as a flat tuple (``dualkv.plans.plan_key``)
    and ``descriptor`` the same as an int32 CPU tensor (None until torch is
    imported): that tensor is how ``dualkv.attention`` hands the plan to the
    custom ops, which cannot take a C handle.
    """

    def __init__(self, groups):
        # Strict: every length an integer in [0, 2^31 - 1] (ValueError naming
        # it otherwise); the C API checks the rest (a prompt of 0, ...).
        groups = groups_from_key(plan_key(groups))
        prompts = [p for p, _ in groups]
        counts = [len(rs) for _, rs in groups]
        resps = [r for _, rs in groups for r in rs]
        self._handle = None
        handle = ctypes.c_void_p()
        _check(_lib.lib().dualkv_plan_create(
            _int32_array(prompts), _int32_array(counts), _int32_array(resps),
            len(groups), ctypes.byref(handle)))
        self._adopt(handle, groups, None, plan_key(groups))

    @classmethod
    def from_tree(cls, lengths, parents):
        """The plan of a forest (docs/architecture.md §1): node n holds
        ``lengths[n] >= 0`` tokens and has the parent ``parents[n]`` (-1 for
        a root, else an earlier node; nodes listed and packed in pre-order).
        Query token i sees key token j iff j <= i and j's node is i's node
        or one of its ancestors. Raises ValueError naming the node and field
        at fault (``dualkv.plans.check_tree``)."""
        lengths, parents = check_tree(lengths, parents)
        plan = cls.__new__(cls)
        plan._handle = None
        handle = ctypes.c_void_p()
        _check(_lib.symbol("dualkv_plan_create_tree")(
            _int32_array(lengths), _int32_array(parents), len(lengths),
            ctypes.byref(handle)))
        plan._adopt(handle, None, (lengths, parents),
                    tree_key(lengths, parents))
        return plan

    @classmethod
    def from_position_ids(cls, position_ids):
        """The plan of a packed row from its rotary positions alone, as RL
        frameworks and collators hand them over (``[T]`` or ``[1, T]``: a
        list, array or tensor; a CUDA tensor costs one small transfer).
        Positions restarting at 0 start a new group (or sequence); falling
        back to the prompt's length starts a new response; falling back to
        any other earlier point of the current path splits the run there
        and starts a new branch of a prefix tree. Gives a groups plan when
        every tree has depth <= 1, else a tree plan with maximal nodes
        (``dualkv.plans.forest_from_position_ids``). What the positions
        cannot tell apart is taken as the smaller structure: a group of one
        response is one sequence, empty responses and nodes vanish, and a
        node with a single child is merged with it; the attention is the
        same. Raises ValueError for what is not packed this way
        (multi-dimensional rotary positions, several rows, a first position
        other than 0 as in left padding, positions that jump forward)."""
        return cls.from_key(key_from_position_ids(position_ids))

    @classmethod
    def from_key(cls, key):
        """The plan of a key (``plan.key``): groups or a tree."""
        if is_tree_key(key):
            return cls.from_tree(*tree_from_key(key))
        return cls(groups_from_key(key))

    def _adopt(self, handle, groups, tree, key):
        self._handle = handle
        self._destroy = _lib.lib().dualkv_plan_destroy
        #: ``[(prompt_len, [response lens])]`` (None for a tree plan).
        self.groups = groups
        #: ``(lengths, parents)`` of a tree plan (None for groups).
        self.tree = tree
        self.key = key
        # Devices (torch indices) whose copy of the segment table exists: set
        # by upload() and by every successful forward/backward call.
        self._devices = set()
        # Built now when torch is loaded, so that torch.compile finds a tensor
        # attribute and does not trace its creation (which would bake the
        # lengths into the graph); otherwise built by dualkv.ops on first use.
        torch = sys.modules.get("torch")
        self.descriptor = (None if torch is None else
                           torch.tensor(self.key, dtype=torch.int32))

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle:
            try:
                self._destroy(handle)
            except Exception:  # interpreter shutdown
                pass
            self._handle = None

    @property
    def num_tokens(self):
        """T, the total number of packed tokens."""
        return int(_lib.lib().dualkv_plan_num_tokens(self._handle))

    @property
    def num_segments(self):
        """Number of segments: each prompt and each non-empty response (each
        non-empty node of a tree)."""
        return int(_lib.lib().dualkv_plan_num_segments(self._handle))

    def segment_table(self):
        """The segment table as a list of ``(start, length, shared_start,
        shared_len)``: shared_* is the group's prompt for a response segment
        and (0, 0) for a prompt segment; in a tree, the segment's nearest
        ancestor range (adjacent ancestors merged; more ranges, when
        ``max_ancestor_ranges`` > 1, are in the plan's chain table)."""
        n = self.num_segments
        buf = (ctypes.c_int32 * (4 * n))()
        _check(_lib.lib().dualkv_plan_segment_table(self._handle, buf, 4 * n))
        return [tuple(buf[4 * i:4 * i + 4]) for i in range(n)]

    def upload(self, device=None):
        """Copies the segment table to a device now (otherwise the first
        forward does it). Call it before a CUDA graph capture. ``device``: a
        torch device or index, default the current CUDA device; without torch
        loaded, the current CUDA context's device."""
        torch = sys.modules.get("torch")
        if torch is None:
            _check(_lib.lib().dualkv_plan_upload(self._handle))
            return
        if isinstance(device, int):
            index = device
        elif device is not None and torch.device(device).index is not None:
            index = torch.device(device).index
        else:
            index = torch.cuda.current_device()
        with torch.cuda.device(index):
            _check(_lib.lib().dualkv_plan_upload(self._handle))
        self._devices.add(index)

    def is_uploaded(self, device_index):
        """True when this plan's segment table is known to be on that device
        (after upload() or a forward/backward there)."""
        return device_index in self._devices

    def chain_table(self):
        """The chain table as a list of ``(start, length, next, ranges)``
        rows (docs/forward-abi.md): row s < num_segments is segment s's
        nearest ancestor range, ``next`` the row of the next range up its
        path (-1 after the last), ``ranges`` how many there are from the
        row up."""
        n = int(_lib.symbol("dualkv_plan_num_chain_rows")(self._handle))
        buf = (ctypes.c_int32 * max(4 * n, 1))()
        _check(_lib.symbol("dualkv_plan_chain_table")(self._handle, buf,
                                                        4 * n))
        return [tuple(buf[4 * i:4 * i + 4]) for i in range(n)]

    @property
    def max_ancestor_ranges(self):
        """The most disjoint ancestor ranges any segment sees (0 or 1 for
        groups and chains of first children; more for branching trees)."""
        return int(_lib.symbol("dualkv_plan_max_ancestor_ranges")(
            self._handle))

    def __repr__(self):
        if self.tree is not None:
            return (f"dualkv.Plan(tree of {len(self.tree[0])} nodes, "
                    f"{self.num_tokens} tokens, {self.num_segments} segments)")
        return (f"dualkv.Plan({len(self.groups)} groups, "
                f"{self.num_tokens} tokens, {self.num_segments} segments)")


def _int32_array(values):
    for x in values:
        if not -2**31 <= x < 2**31:
            raise ValueError(f"dualkv: length {x} does not fit int32")
    return (ctypes.c_int32 * max(len(values), 1))(*values)


def _dtype_code(torch, dtype):
    """The C API's dtype of a torch dtype, or None (bf16 and fp16 only)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    return _lib.names()["dtypes"][str(dtype).replace("torch.", "")]


def _check_thd(torch, name, t, device):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"dualkv: {name} must be a torch.Tensor, "
                         f"not {type(t).__name__}")
    if not t.is_cuda:
        raise ValueError(f"dualkv: {name} is on {t.device}; "
                         "it must be a CUDA tensor")
    if device is not None and t.device != device:
        raise ValueError(f"dualkv: {name} is on {t.device} but q is on "
                         f"{device}")
    if t.dim() != 3:
        raise ValueError(f"dualkv: {name} must be 3-D [T, H, D], "
                         f"got shape {tuple(t.shape)}")
    if t.stride(2) != 1 and t.shape[2] > 1:
        raise ValueError(f"dualkv: {name}'s last dimension must be contiguous "
                         f"(stride {t.stride(2)})")


def _tiling(tiling):
    """The C API's dualkv_tiling_t of None (every field the default) or
    (block_m, block_n, warps, stages)."""
    if tiling is None:
        return _lib.Tiling()
    tiling = [integer(x, f"tiling[{i}]", 0, 2**31 - 1)
              for i, x in enumerate(sequence(tiling, "tiling"))]
    if len(tiling) != 4:
        raise ValueError("dualkv: tiling must be 4 ints (block_m, block_n, "
                         "warps, stages)")
    return _lib.Tiling(*tiling)


def _tensor(t):
    """The C API's dualkv_tensor_t of a [T, H, D] torch tensor."""
    return _lib.Tensor(t.data_ptr(), t.stride(0), t.stride(1))


def _check_lse(torch, name, lse, device, Hq, T):
    """lse must be float32 [Hq, T] on q's device, token dimension contiguous."""
    if not isinstance(lse, torch.Tensor) or not lse.is_cuda:
        raise ValueError(f"dualkv: {name} must be a CUDA tensor")
    if lse.device != device:
        raise ValueError(f"dualkv: {name} is on {lse.device} but q is on "
                         f"{device}")
    if lse.dtype != torch.float32 or tuple(lse.shape) != (Hq, T):
        raise ValueError(f"dualkv: {name} is {lse.dtype} {tuple(lse.shape)}; "
                         f"it must be torch.float32 [{Hq}, {T}]")
    if lse.stride(1) != 1 and T > 1:
        raise ValueError(f"dualkv: {name}'s token dimension must be "
                         f"contiguous (stride {lse.stride(1)})")


def _check_sinks(torch, name, t, device, Hq):
    """``t`` (sinks, or the backward's dsinks output) must be a float32 [Hq]
    CUDA tensor on q's device with unit stride: one fp32 logit per query
    head (docs/architecture.md §1, attention sinks)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"dualkv: {name} must be a torch.Tensor (float32 "
                         f"[{Hq}], one per query head) or None, not "
                         f"{type(t).__name__}")
    if not t.is_cuda:
        raise ValueError(f"dualkv: {name} is on {t.device}; it must be a "
                         "CUDA tensor")
    if t.device != device:
        raise ValueError(f"dualkv: {name} is on {t.device} but q is on "
                         f"{device}")
    if t.dtype != torch.float32 or tuple(t.shape) != (Hq,):
        raise ValueError(f"dualkv: {name} is {t.dtype} {tuple(t.shape)}; it "
                         f"must be torch.float32 [{Hq}] (one logit per query "
                         "head)")
    if t.stride(0) != 1 and Hq > 1:
        raise ValueError(f"dualkv: {name} must be contiguous (stride "
                         f"{t.stride(0)})")


def _float_pointer(t):
    """A ctypes float* to a float32 tensor's data, or None for None."""
    if t is None:
        return None
    return ctypes.cast(t.data_ptr(), ctypes.POINTER(ctypes.c_float))


def _score_mod(score_mod):
    """A ``score_mod=`` argument as a dualkv.ScoreMod or None
    (``dualkv.score_mod.resolve``: text, a path, a ScoreMod or a traced
    function); ValueError naming score_mod otherwise."""
    if score_mod is None:
        return None
    from .score_mod import resolve
    return resolve(score_mod)


def _check_like(torch, name, t, ref_name, ref, device, width=None):
    """``t`` must be a THD CUDA tensor of ``ref``'s dtype and shape; with
    ``width``, of rows that wide instead (an output [T, Hq, Dv] beside q
    [T, Hq, D])."""
    _check_thd(torch, name, t, device)
    shape = tuple(ref.shape)
    if width is not None and width != shape[2]:
        shape = shape[:2] + (width,)
        like = f"[T, H] of {ref_name}, v's head_dim {width}"
    else:
        like = ref_name
    if t.dtype != ref.dtype or tuple(t.shape) != shape:
        raise ValueError(f"dualkv: {name} is {t.dtype} {tuple(t.shape)}; it "
                         f"must be {ref.dtype} {shape} like {like}")


def _check_qkv_shapes(torch, q, k, v):
    """Dtypes and shapes of 3-D q, k, v, shared by the plain calls and the
    custom ops; returns (T, Hq, Hkv, D, Dv): v's head_dim Dv may differ from
    q's and k's D (MLA: 192 and 128; the library names the pairs it
    takes)."""
    if _dtype_code(torch, q.dtype) is None:
        raise ValueError(f"dualkv: q has dtype {q.dtype}; "
                         "use torch.bfloat16 or torch.float16")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"dualkv: {name} has dtype {t.dtype} but q has "
                             f"{q.dtype}")
    T, Hq, D = q.shape
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"dualkv: k has shape {tuple(k.shape)} but v has "
                         f"{tuple(v.shape)}: they must agree in tokens and "
                         f"heads ([T, Hkv, D] and [T, Hkv, Dv])")
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"dualkv: k has shape {tuple(k.shape)}; with q "
                         f"{tuple(q.shape)} it must be [{T}, Hkv, {D}]")
    Hkv = k.shape[1]
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"dualkv: q's heads ({Hq}) are not a multiple of "
                         f"k's heads ({Hkv})")
    return T, Hq, Hkv, D, v.shape[2]


def _check_qkv(torch, q, k, v, plan):
    """Checks q, k, v (and plan against them); returns (T, Hq, Hkv, D, Dv,
    code)."""
    if not isinstance(plan, Plan):
        raise ValueError(f"dualkv: plan must be a dualkv.Plan, "
                         f"not {type(plan).__name__}")
    _check_thd(torch, "q", q, None)
    device = q.device
    _check_thd(torch, "k", k, device)
    _check_thd(torch, "v", v, device)
    T, Hq, Hkv, D, Dv = _check_qkv_shapes(torch, q, k, v)
    code = _dtype_code(torch, q.dtype)
    if T != plan.num_tokens:
        raise ValueError(f"dualkv: q has {T} tokens but the plan has "
                         f"{plan.num_tokens} (plan.num_tokens)")
    return T, Hq, Hkv, D, Dv, code


def forward(q, k, v, plan, scale=None, out=None, lse=None, tiling=None,
            softcap=None, window=0, sinks=None, score_mod=None):
    """DualKV attention forward on the current CUDA stream.

    Args:
        q: [T, Hq, D] CUDA tensor, bf16 or fp16, last dim contiguous (other
            strides free, multiples of 8 elements, 16-byte aligned).
        k: [T, Hkv, D], v: [T, Hkv, Dv], same dtype and device; Hq % Hkv ==
            0 (GQA/MQA). Dv is D, or 128 with D 192 (MLA, DeepSeek-V3).
        plan: a ``Plan`` with ``plan.num_tokens == T``.
        scale: softmax scale, any finite nonzero real whose float32 value
            (the kernels') is finite and nonzero (negative runs as a positive
            scale on -q); None means 1/sqrt(D). Anything else, 0 included,
            is a ValueError naming the value.
        out: optional output [T, Hq, Dv] (q's dtype); allocated if None.
        lse: optional float32 [Hq, T] (token stride 1) for the natural-log
            log-sum-exp; allocated if None.
        tiling: optional (block_m, block_n, warps, stages), 0 = default.
        softcap: logit softcap c > 0: each logit scale * q.k becomes
            c * tanh(scale * q.k / c) before the softmax; None or 0: none.
        window: sliding window W >= 1: query token i sees key j only if it
            did before and lpos(i) - lpos(j) < W, lpos the position in the
            token's own logical sequence (a response token r of a group with
            prompt P has lpos P + r); 0 or None: none. On prefix trees the
            window runs along each root-to-node path.
        sinks: attention sinks (gpt-oss): None, or a float32 [Hq] CUDA
            tensor, one logit s_h per query head that joins every row's
            softmax denominator, lse = log(exp(s_h) + sum_j exp(S_ij)).
        score_mod: a score modifier applied to every logit before the
            softmax, as FlexAttention's: a
            ``dualkv.ScoreMod``, MLIR text or the path of a .mlir file, or
            a function ``fn(score, b, h, q_idx, kv_idx)`` (traced once;
            ``dualkv.score_mod``); None: none. Its inputs are used on q's
            device (copied there once, as float32).

    Returns:
        (o, lse), o [T, Hq, Dv]. D must be 64, 96, 128, 256 or 512 with
        Dv = D, or 192 with Dv = 128.

    Raises:
        ValueError naming the argument at fault (checked here first, then by
        the library); DualKVError for CUDA, compile or internal failures.
    """
    # Plain values first: they need neither torch nor the tensors.
    scale_value = _scale_value(scale)
    softcap_value = _softcap_value(softcap)
    window_value = _window_value(window)
    tiling_value = _tiling(tiling)
    mod = _score_mod(score_mod)
    import torch

    T, Hq, Hkv, D, Dv, code = _check_qkv(torch, q, k, v, plan)
    device = q.device
    if sinks is not None:
        _check_sinks(torch, "sinks", sinks, device, Hq)
    from .score_mod import CArguments
    # Kept alive until the call returns: the text and the input pointers.
    mod_args = CArguments(mod, device)
    if out is None:
        out = q.new_empty((T, Hq, Dv))
    else:
        _check_like(torch, "out", out, "q", q, device, width=Dv)
    if lse is None:
        lse = torch.empty((Hq, T), dtype=torch.float32, device=device)
    else:
        _check_lse(torch, "lse", lse, device, Hq, T)

    if scale_value < 0:
        # The kernels take a positive scale: scale * (q . k) is the same as
        # -scale * (-q . k), and negating bf16/fp16 is exact.
        q, scale_value = -q, -scale_value
    with torch.cuda.device(device):
        # current_stream() of the tensors' device; the library launches on it.
        stream = torch.cuda.current_stream(device).cuda_stream
        args = _lib.ForwardArgs(
            q=_tensor(q), k=_tensor(k), v=_tensor(v), o=_tensor(out),
            lse=ctypes.cast(lse.data_ptr(), ctypes.POINTER(ctypes.c_float)),
            lse_stride_h=lse.stride(0), num_tokens=T, num_q_heads=Hq,
            num_kv_heads=Hkv, head_dim=D, dtype=code, scale=scale_value,
            plan=plan._handle, stream=stream, tiling=tiling_value,
            softcap=softcap_value, sinks=_float_pointer(sinks),
            window=window_value, v_head_dim=Dv)
        mod_args.fill(args)
        _check(_lib.lib().dualkv_forward(ctypes.byref(args)))
    plan._devices.add(device.index)
    return out, lse


def backward(q, k, v, o, dout, lse, plan, scale=None, deterministic=False,
             dq=None, dk=None, dv=None, tiling=None, softcap=None,
             dlse=None, window=0, sinks=None, dsinks=None, score_mod=None):
    """DualKV attention backward on the current CUDA stream (no autograd:
    ``dualkv.attention`` is the differentiable call).

    Args:
        q, k, v: the forward's inputs ([T, Hq, D], [T, Hkv, D], [T, Hkv, Dv]).
        o, lse: the forward's outputs for these inputs and this scale (o
            [T, Hq, Dv]).
        dout: dL/dO, like o (same dtype and shape; last dim contiguous, other
            strides free).
        plan: the forward's ``Plan``.
        scale: the forward's softmax scale (as ``forward`` takes it); None
            means 1/sqrt(D).
        deterministic: True gives bitwise-reproducible dq/dk/dv (the split-dQ
            algorithm: fixed-order reductions, no fp32 atomics). On sm_90a
            that is also the default; elsewhere the default reduces with
            atomics.
        dq: optional output like q; dk, dv: optional outputs like k
            (allocated, contiguous, if None; always written fully).
        tiling: optional (block_m, block_n, warps, stages), 0 = default.
        softcap: the forward's logit softcap (None or 0: none).
        dlse: optional gradient of the loss with respect to lse, float32
            [Hq, T] (token stride 1); each row's Delta becomes
            rowsum(dout * o) - dlse.
        window: the forward's sliding window (0 or None: none). Refused by
            the library with ``deterministic`` and for branching trees.
        sinks: the forward's sinks (float32 [Hq]) or None. With sinks the
            backward also computes dL/dsinks_h = -sum_i exp(s_h - lse_i) *
            (rowsum(dout * o)_i - dlse_i) into ``dsinks``.
        dsinks: optional float32 [Hq] output for dL/dsinks (allocated if
            None; needs ``sinks``).
        score_mod: the forward's score modifier (the same one, with the same
            input values), or None. Its captured inputs are constants: no
            gradient for them.

    Returns:
        (dq, dk, dv), or (dq, dk, dv, dsinks) when ``sinks`` is given; dv
        like v. D must be 64, 96, 128, 256 or 512 with Dv = D, or 192 with
        Dv = 128 (at 512 on an arch of 227 KB of shared memory a CTA: sm_90,
        sm_90a, sm_100, sm_103, sm_110).

    The library's workspace is allocated here with torch (caching allocator,
    CUDA-graph pools). Raises ValueError naming the argument at fault,
    DualKVError for CUDA/compile/internal failures, OSError when the loaded
    library predates the backward.
    """
    # Plain values first: they need neither torch nor the tensors.
    scale_value = _scale_value(scale)
    softcap_value = _softcap_value(softcap)
    window_value = _window_value(window)
    tiling_value = _tiling(tiling)
    mod = _score_mod(score_mod)
    import torch

    T, Hq, Hkv, D, Dv, code = _check_qkv(torch, q, k, v, plan)
    device = q.device
    if sinks is None and dsinks is not None:
        raise ValueError("dualkv: dsinks is given but sinks is None: the "
                         "gradient of the sinks needs the forward's sinks")
    if sinks is not None:
        _check_sinks(torch, "sinks", sinks, device, Hq)
        if dsinks is None:
            dsinks = torch.empty(Hq, dtype=torch.float32, device=device)
        else:
            _check_sinks(torch, "dsinks", dsinks, device, Hq)
    _check_like(torch, "o", o, "q", q, device, width=Dv)
    _check_like(torch, "dout", dout, "o", o, device)
    _check_lse(torch, "lse", lse, device, Hq, T)
    if dlse is not None:
        _check_lse(torch, "dlse", dlse, device, Hq, T)
    if dq is None:
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        _check_like(torch, "dq", dq, "q", q, device)
    if dk is None:
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    else:
        _check_like(torch, "dk", dk, "k", k, device)
    if dv is None:
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    else:
        _check_like(torch, "dv", dv, "v", v, device)

    negated = scale_value < 0
    if negated:
        # As the forward: a positive scale on -q, whose gradient is -dq.
        q, scale_value = -q, -scale_value
    args = _lib.BackwardArgs(
        q=_tensor(q), k=_tensor(k), v=_tensor(v), o=_tensor(o),
        dout=_tensor(dout), dq=_tensor(dq), dk=_tensor(dk), dv=_tensor(dv),
        lse=ctypes.cast(lse.data_ptr(), ctypes.POINTER(ctypes.c_float)),
        lse_stride_h=lse.stride(0), num_tokens=T, num_q_heads=Hq,
        num_kv_heads=Hkv, head_dim=D, dtype=code, scale=scale_value,
        deterministic=1 if deterministic else 0, plan=plan._handle,
        tiling=tiling_value, softcap=softcap_value,
        sinks=_float_pointer(sinks), dsinks=_float_pointer(dsinks),
        window=window_value, v_head_dim=Dv)
    from .score_mod import CArguments
    # Kept alive until the calls return: the text and the input pointers.
    mod_args = CArguments(mod, device)
    mod_args.fill(args)
    if dlse is not None:
        args.dlse = ctypes.cast(dlse.data_ptr(),
                                ctypes.POINTER(ctypes.c_float))
        args.dlse_stride_h = dlse.stride(0)
    lib = _lib.lib()
    ws_bytes = ctypes.c_int64(0)
    with torch.cuda.device(device):
        # The size depends on the device's default algorithm (split-dQ on
        # sm_90a), so it is asked for with the tensors' device current.
        _check(lib.dualkv_backward_workspace_size(ctypes.byref(args),
                                                  ctypes.byref(ws_bytes)))
        # Allocated on the current stream, which the library launches on, so
        # the caching allocator's stream-ordered reuse is safe.
        workspace = torch.empty(ws_bytes.value, dtype=torch.uint8,
                                device=device)
        args.stream = torch.cuda.current_stream(device).cuda_stream
        args.workspace = workspace.data_ptr() if ws_bytes.value else None
        args.workspace_bytes = ws_bytes.value
        _check(lib.dualkv_backward(ctypes.byref(args)))
        if negated:
            dq.neg_()
    plan._devices.add(device.index)
    if sinks is not None:
        return dq, dk, dv, dsinks
    return dq, dk, dv
