"""torch.library custom ops ``dualkv::forward`` / ``dualkv::backward`` and the
differentiable ``dualkv.attention`` built on them.

    import dualkv
    plan = dualkv.Plan([(4096, [1024] * 16)])
    o = dualkv.attention(q, k, v, plan)            # q [T,Hq,D], k/v [T,Hkv,D]
                                                   # (v [T,Hkv,128] at D 192)
    loss = o.float().square().mean(); loss.backward()

How the plan crosses the op boundary. A ``dualkv.Plan`` wraps a C handle,
which neither the dispatcher nor a tracer can carry. The ops take the plan's
lengths instead, as ``plan.descriptor``: a small int32 *CPU* tensor
``(G, P_0, N_0, R_0_1.., P_1, ...)`` (``dualkv.plans.plan_key``), or a prefix
tree's ``(-1, M, L_0, parent_0, ...)`` (``dualkv.plans.tree_key``). The op's
implementation reads it on the host (no device sync) and looks the Plan up in
``PLAN_CACHE``, keyed by (device, lengths), building one on a miss;
``attention`` called eagerly stores the caller's own Plan there first, so a
``plan.upload()`` before CUDA graph capture is honoured.

Why a tensor and not an int id or a list of ints: torch.compile specialises
on Python ints and lists, so an id or the lengths as ints would recompile the
graph for every new micro-batch (and fall back to eager after the recompile
limit). A tensor's *values* are not guarded on: a new plan reuses the
compiled graph; only the descriptor's length (groups + responses, or nodes) is a shape,
which automatic dynamic shapes make symbolic after one recompile, like T.
The price: inductor's own CUDA graphs (mode="reduce-overhead") skip graphs
with CPU tensor inputs, which is also what keeps a replay from silently using
a stale plan. Capture by hand with torch.cuda.graph when the plan is fixed.

CUDA graphs and streams: both ops launch on torch.cuda.current_stream() of
the tensors' device, allocate outputs and the backward workspace with torch
(graph-pool aware) and never synchronise. A plan must be on the device before
capture: call ``plan.upload(device)`` or run one eager step; capturing with a
plan that never ran there raises ValueError instead of failing inside CUDA.

The log-sum-exp output is differentiable: its gradient enters the backward
as ``dlse`` (Delta - dLSE). Attention sinks (``sinks=``, an fp32 [Hq] tensor)
are an input of ``dualkv::forward``; their gradient comes from a third op,
``dualkv::backward_sinks``, which is ``dualkv::backward`` with one more
output (dsinks), so that ``dualkv::backward`` keeps its three outputs for
its callers. Importing this module registers the ops; ``dualkv.attention``
does it on first use.

Score modifiers (``score_mod=``) cross the op boundary as their text
(``str?``) and their inputs as one float32 tensor with each input's size
(``ScoreMod.flat_inputs``: a schema inferred from annotations cannot take an
optional list of tensors); the implementations split it back into views.
They are constants for autograd (no gradient). Under torch.compile the
modifier is resolved (traced, its inputs moved) outside the graph, which is
a graph break there: pass the same function or ScoreMod every step.
"""

import functools
import sys
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import Plan, _check_qkv_shapes, _checks, backward, forward
from . import score_mod as _score_mods
from ._bounded import env_flag
from .plans import PlanCache

__all__ = ["attention", "PLAN_CACHE", "plan_descriptor", "plan_for"]

#: (device index, plan key) -> Plan, for the ops' implementations.
PLAN_CACHE = PlanCache(capacity=64)


def plan_descriptor(plan):
    """``plan.descriptor``, built (int32 CPU tensor of ``plan.key``) if the
    plan was made before torch was imported."""
    if plan.descriptor is None:
        plan.descriptor = torch.tensor(plan.key, dtype=torch.int32)
    return plan.descriptor


def plan_for(descriptor, device):
    """The Plan of a descriptor tensor on a CUDA device (from PLAN_CACHE,
    built on a miss). Raises ValueError for a malformed descriptor, or when a
    CUDA graph is being captured and the plan has never been on ``device``."""
    if (not isinstance(descriptor, Tensor) or descriptor.device.type != "cpu"
            or descriptor.dtype != torch.int32 or descriptor.dim() != 1):
        raise ValueError("dualkv: plan must be a plan's descriptor, a 1-D "
                         "int32 CPU tensor (dualkv.Plan(...).descriptor)")
    key = tuple(descriptor.tolist())
    index = device.index
    plan = PLAN_CACHE.get_or_create(index, key,
                                    Plan.from_key)
    if not plan.is_uploaded(index) and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            f"dualkv: the plan {plan!r} has never been used on cuda:{index} "
            "and a CUDA graph is being captured; call plan.upload(device) or "
            "run one step eagerly before the capture")
    return plan


def _scale_or_none(scale):
    # 0.0 stands for "default" (1/sqrt(D)) in the ops' schemas, as in the C
    # API; attention() never passes it for a given scale (scale_value refuses
    # 0 and what rounds to 0), and any other value is checked by forward().
    return None if scale == 0.0 else scale


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, plan: Tensor, scale: float,
                  deterministic: bool, softcap: float = 0.0, window: int = 0,
                  sinks: Optional[Tensor] = None,
                  score_mod: Optional[str] = None,
                  score_mod_data: Optional[Tensor] = None,
                  score_mod_sizes: Optional[List[int]] = None
                  ) -> Tuple[Tensor, Tensor]:
    """(o, lse) of DualKV attention. ``plan``: a plan's descriptor; ``scale``
    0.0 means 1/sqrt(D); ``deterministic`` is only carried to the backward;
    ``softcap`` 0.0 means none; ``window`` 0 means none; ``sinks`` None or
    fp32 [Hq]; ``score_mod`` None or a modifier's text, whose inputs are
    ``score_mod_data`` split into ``score_mod_sizes``."""
    _require_cuda(q, "q")
    p = plan_for(plan, q.device)
    return forward(q, k, v, p, scale=_scale_or_none(scale),
                   softcap=softcap or None, window=window, sinks=sinks,
                   score_mod=_score_mods.from_op(score_mod, score_mod_data,
                                                 score_mod_sizes))


def _forward_fake(q, k, v, plan, scale, deterministic, softcap=0.0, window=0,
                  sinks=None, score_mod=None, score_mod_data=None,
                  score_mod_sizes=None):
    _check_dims(q, k, v)
    T, Hq, _ = q.shape
    # Same layouts as dualkv.forward allocates: contiguous o [T, Hq, Dv] (v's
    # head_dim), lse [Hq, T].
    return (q.new_empty((T, Hq, v.shape[2])),
            q.new_empty((Hq, T), dtype=torch.float32))


def _backward_impl(q: Tensor, k: Tensor, v: Tensor, o: Tensor, dout: Tensor,
                   lse: Tensor, plan: Tensor, scale: float,
                   deterministic: bool, softcap: float = 0.0,
                   dlse: Optional[Tensor] = None, window: int = 0,
                   score_mod: Optional[str] = None,
                   score_mod_data: Optional[Tensor] = None,
                   score_mod_sizes: Optional[List[int]] = None
                   ) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of DualKV attention, given the forward's o and lse (and
    the gradient of lse, when the caller differentiates it). With sinks the
    forward's lse already holds them: dq, dk, dv need nothing more (their
    gradient is ``backward_sinks``')."""
    _require_cuda(q, "q")
    p = plan_for(plan, q.device)
    return backward(q, k, v, o, dout, lse, p, scale=_scale_or_none(scale),
                    deterministic=deterministic, softcap=softcap or None,
                    dlse=dlse, window=window,
                    score_mod=_score_mods.from_op(score_mod, score_mod_data,
                                                  score_mod_sizes))


def _backward_fake(q, k, v, o, dout, lse, plan, scale, deterministic,
                   softcap=0.0, dlse=None, window=0, score_mod=None,
                   score_mod_data=None, score_mod_sizes=None):
    _check_dims(q, k, v)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _backward_sinks_impl(q: Tensor, k: Tensor, v: Tensor, o: Tensor,
                         dout: Tensor, lse: Tensor, plan: Tensor,
                         scale: float, deterministic: bool, softcap: float,
                         dlse: Optional[Tensor], window: int, sinks: Tensor,
                         score_mod: Optional[str] = None,
                         score_mod_data: Optional[Tensor] = None,
                         score_mod_sizes: Optional[List[int]] = None
                         ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks) of DualKV attention with sinks (fp32 [Hq]):
    ``backward`` and dL/dsinks_h = -sum_i exp(s_h - lse_i) * Delta'_i from
    the same launch."""
    _require_cuda(q, "q")
    p = plan_for(plan, q.device)
    return backward(q, k, v, o, dout, lse, p, scale=_scale_or_none(scale),
                    deterministic=deterministic, softcap=softcap or None,
                    dlse=dlse, window=window, sinks=sinks,
                    score_mod=_score_mods.from_op(score_mod, score_mod_data,
                                                  score_mod_sizes))


def _backward_sinks_fake(q, k, v, o, dout, lse, plan, scale, deterministic,
                         softcap, dlse, window, sinks, score_mod=None,
                         score_mod_data=None, score_mod_sizes=None):
    _check_dims(q, k, v)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            sinks.new_empty(sinks.shape, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    (q, k, v, plan, scale, deterministic, softcap, window, sinks, score_mod,
     score_mod_data, score_mod_sizes) = _padded(inputs, 12)
    o, lse = output
    # lse is differentiable (return_lse=True: a context-parallel merge uses
    # it). Without materialized grads autograd hands the backward None for
    # an output no loss reached, instead of a zero [Hq, T] fp32 tensor on
    # every step; the backward takes None for either.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, o, lse, plan, sinks, score_mod_data)
    ctx.num_inputs = len(inputs)
    ctx.score_mod = score_mod
    ctx.score_mod_sizes = score_mod_sizes
    ctx.scale = scale
    ctx.deterministic = deterministic
    ctx.softcap = softcap
    ctx.window = window


def _backward_formula(ctx, dout, dlse):
    # Either is None when no loss reached that output (grads are not
    # materialized); dLSE enters the kernels as Delta - dLSE. One gradient
    # per input of dualkv::forward: q, k, v, then None for plan, scale,
    # deterministic, softcap and window, then dsinks (None without sinks),
    # then None for the score modifier's text, inputs and sizes (constants).
    q, k, v, o, lse, plan, sinks, score_mod_data = ctx.saved_tensors
    if dout is None and dlse is None:
        return (None,) * ctx.num_inputs
    if dout is None:
        dout = torch.zeros_like(o)
    if dlse is not None:
        dlse = dlse.float().contiguous()
    # Gradients may arrive with any layout (an expanded tensor from .sum(), a
    # transpose): the kernel wants the last dimension contiguous and aligned
    # row strides, and a no-op .contiguous() costs nothing otherwise.
    args = (q, k, v, o, dout.contiguous(), lse, plan, ctx.scale,
            ctx.deterministic, ctx.softcap, dlse, ctx.window)
    mod = {}
    if ctx.score_mod is not None:
        mod = dict(score_mod=ctx.score_mod, score_mod_data=score_mod_data,
                   score_mod_sizes=ctx.score_mod_sizes)
    if sinks is None:
        dq, dk, dv = torch.ops.dualkv.backward(*args, **mod)
        dsinks = None
    else:
        dq, dk, dv, dsinks = torch.ops.dualkv.backward_sinks(*args, sinks,
                                                             **mod)
    grads = (dq, dk, dv, None, None, None, None, None, dsinks, None, None,
             None)
    return grads[:ctx.num_inputs]


def _padded(inputs, n):
    """The op's inputs with the defaults of those a caller left out (None
    for every optional argument after ``window``)."""
    return tuple(inputs) + (None,) * (n - len(inputs))


def _outside_dynamo(fn):
    """``fn``, kept out of Dynamo's frame tracing as torch.library.custom_op
    keeps the kernels it registers, but without importing torch._dynamo.

    custom_op wraps each kernel in ``torch._disable_dynamo``, whose first
    call imports torch._dynamo (seconds: benchmarks/torch_custom_op_first_call.py);
    every process paid that on its first ``dualkv.attention``. Until
    something else has imported torch._dynamo no torch.compile can be running,
    so there is nothing to keep ``fn`` out of; once it is imported, ``fn``
    runs under ``torch._dynamo.disable`` as custom_op's kernels do."""
    disabled = None

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            dynamo = sys.modules.get("torch._dynamo")
            if dynamo is None or not hasattr(dynamo, "disable"):
                return fn(*args, **kwargs)
            disabled = dynamo.disable(fn, recursive=True)
        return disabled(*args, **kwargs)

    return kernel


def _define(lib, name, impl, fake):
    """Registers ``dualkv::<name>`` as torch.library.custom_op(name,
    mutates_args=()) with register_fake would: the schema inferred from
    ``impl``'s annotations, tagged pt2_compliant, ``impl`` the kernel of
    every device (CompositeExplicitAutograd: a CPU tensor reaches it and gets
    its ValueError), ``fake`` the fake/meta implementation."""
    infer_schema = getattr(torch.library, "infer_schema", None)
    if infer_schema is None:  # torch 2.4
        from torch._library.infer_schema import infer_schema
    schema = infer_schema(impl, mutates_args=())
    lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    lib.impl(name, _outside_dynamo(impl), "CompositeExplicitAutograd")
    torch.library.register_fake(f"dualkv::{name}", fake, lib=lib)


# The ops are registered with torch.library's lower-level API (Library.define,
# register_fake, register_autograd) instead of the torch.library.custom_op
# decorator, only to keep torch._dynamo's import out of the first call (see
# _outside_dynamo); the dispatcher, torch.compile and opcheck see the same ops.
_LIB = torch.library.Library("dualkv", "FRAGMENT")
_define(_LIB, "forward", _forward_impl, _forward_fake)
_define(_LIB, "backward", _backward_impl, _backward_fake)
_define(_LIB, "backward_sinks", _backward_sinks_impl, _backward_sinks_fake)
torch.library.register_autograd("dualkv::forward", _backward_formula,
                                setup_context=_setup_context, lib=_LIB)


def _require_cuda(t, name):
    if t.device.type != "cuda":
        raise ValueError(f"dualkv: {name} is on {t.device}; it must be a "
                         "CUDA tensor")


def _check_dims(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"dualkv: {name} must be 3-D [T, H, D], got "
                             f"shape {tuple(t.shape)}")


def _check_sinks(sinks, q):
    """attention()'s ``sinks``: None, or a floating-point [Hq] tensor on q's
    device (a learned parameter; any float dtype, run in float32). Returns
    the float32 contiguous tensor the op takes (differentiable casts: the
    gradient reaches the caller's tensor in its own dtype)."""
    if sinks is None:
        return None
    Hq = q.shape[1]
    if not isinstance(sinks, Tensor):
        raise ValueError(f"dualkv: sinks must be a torch.Tensor (one logit "
                         f"per query head, [{Hq}]) or None, not "
                         f"{type(sinks).__name__}")
    if sinks.device != q.device:
        raise ValueError(f"dualkv: sinks is on {sinks.device} but q is on "
                         f"{q.device}")
    if not sinks.is_floating_point():
        raise ValueError(f"dualkv: sinks has dtype {sinks.dtype}; it must be "
                         "a floating-point tensor (run in float32)")
    if tuple(sinks.shape) != (Hq,):
        raise ValueError(f"dualkv: sinks has shape {tuple(sinks.shape)}; it "
                         f"must be [{Hq}] (one logit per query head)")
    return sinks.to(torch.float32).contiguous()


def _check_inputs(q, k, v, plan):
    """Argument checks that hold under torch.compile as well (no call into
    the library): types, devices, dtypes, shapes, last-dim contiguity. The
    token count against the plan is checked by the op's implementation."""
    if not isinstance(plan, Plan):
        raise ValueError(f"dualkv: plan must be a dualkv.Plan, not "
                         f"{type(plan).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"dualkv: {name} must be a torch.Tensor, not "
                             f"{type(t).__name__}")
        # meta tensors carry shapes only (shape inference, tests).
        if t.device.type not in ("cuda", "meta"):
            raise ValueError(f"dualkv: {name} is on {t.device}; it must be a "
                             "CUDA tensor")
        if t.device != q.device:
            raise ValueError(f"dualkv: {name} is on {t.device} but q is on "
                             f"{q.device}")
        if t.dim() != 3:
            raise ValueError(f"dualkv: {name} must be 3-D [T, H, D], got "
                             f"shape {tuple(t.shape)}")
        if t.stride(2) != 1 and t.shape[2] > 1:
            raise ValueError(f"dualkv: {name}'s last dimension must be "
                             f"contiguous (stride {t.stride(2)})")
    _check_qkv_shapes(torch, q, k, v)


_PRECOMPILED = set()


def _precompile_backward(q, k, v, deterministic):
    """Before the first forward of a configuration that autograd will
    differentiate, compiles (or reads from the disk cache) its forward and
    backward kernels together, in parallel (dualkv.precompile): the first
    step then waits for one parallel compile instead of the forward's and the
    backward's in turn. Once per (device, head_dim, heads, dtype, mode);
    DUALKV_PRECOMPILE=0 turns it off. A failure is left for the calls, which
    report it."""
    if not env_flag("DUALKV_PRECOMPILE", True):
        return
    key = (q.device.index, q.shape[2], v.shape[2], q.shape[1], k.shape[1],
           q.dtype, bool(deterministic))
    if key in _PRECOMPILED:
        return
    _PRECOMPILED.add(key)
    from . import precompile
    try:
        with torch.cuda.device(q.device):
            precompile(head_dim=q.shape[2], num_q_heads=q.shape[1],
                       num_kv_heads=k.shape[1], dtype=q.dtype,
                       backward=True, deterministic=bool(deterministic),
                       v_head_dim=v.shape[2])
    except (OSError, RuntimeError, ValueError):
        pass


def attention(q, k, v, plan, scale=None, deterministic=False,
              return_lse=False, softcap=None, window=0, sinks=None,
              score_mod=None):
    """Differentiable DualKV attention (docs/architecture.md §1) on packed
    THD tensors.

    Args:
        q: [T, Hq, D] CUDA tensor, bf16 or fp16, last dim contiguous (other
            strides free: slices of a fused qkv projection work).
        k: [T, Hkv, D], v: [T, Hkv, Dv], same dtype and device; Hq % Hkv
            == 0 (GQA/MQA). Dv is D, or 128 with D 192 (MLA, DeepSeek-V3:
            128 + 64 rotary query/key columns, 128 value columns).
        plan: the ``dualkv.Plan`` of the packed micro-batch (T tokens).
        scale: softmax scale, as ``dualkv.forward`` takes it: a finite
            nonzero real whose float32 value is finite and nonzero (negative
            too); None means 1/sqrt(D).
        deterministic: True makes dk/dv bitwise reproducible (fixed-order
            reduction of the prompt gradients in the backward).
        return_lse: also return the natural-log LSE, fp32 [Hq, T]; it is
            differentiable (its gradient enters the backward as
            Delta - dLSE), so a context-parallel merge of partial results
            trains through it.
        softcap: logit softcap c > 0 (Gemma 2's ``attn_logit_softcapping``):
            each logit scale * q.k becomes c * tanh(scale * q.k / c) before
            the softmax, forward and backward; None (or 0) means none. Each
            value of c is a kernel of its own, compiled once.
        window: sliding window W >= 1 (Mistral, Gemma 2/3 sliding layers,
            gpt-oss): query token i sees key j only if it did before and
            lpos(i) - lpos(j) < W, lpos the position in the token's own
            logical sequence (a response token r of a group with prompt P
            has lpos P + r), so each response still gets exactly what its
            own sequence [prompt | response] would; 0 or None means none.
            The library refuses a window with ``deterministic`` and for
            branching prefix trees (ValueError naming it).
        sinks: attention sinks (gpt-oss): None, or a floating-point [Hq]
            tensor on q's device (a learned parameter, run in float32): one
            logit s_h per query head that joins every row's softmax
            denominator, lse_i = log(exp(s_h) + sum_j exp(S_ij)).
            Differentiable: autograd gives its gradient, dL/ds_h =
            -sum_i exp(s_h - lse_i) * (rowsum(dO * O)_i - dLSE_i).
        score_mod: a score modifier (FlexAttention's ``score_mod``):
            each logit scale * q.k becomes fn(score, b, h, q_idx, kv_idx)
            before the softmax, q_idx and kv_idx the positions in the
            query's logical sequence [prompt | its response] (as on the N
            replicated sequences), forward and backward. A function (traced
            once into MLIR and cached; it must not use b, the batch index),
            a ``dualkv.ScoreMod``, MLIR text or a .mlir path
            (``dualkv.score_mod``); ``dualkv.score_mods`` has ALiBi, a
            softcap and a relative-position bias. Tensors it captures
            (``slopes[h]``) are read on q's device as float32 and get no
            gradient. None means none.

    Returns:
        o [T, Hq, Dv] (contiguous), or (o, lse) with return_lse.

    Backward through ``o`` gives dq, dk, dv (like q, k, v; D 64, 96, 128,
    256 or 512 with Dv = D, or D 192 with Dv 128; D 512 on sm_90 to sm_110
    only, the archs with the 204 KB of shared memory a CTA it needs) and, with
    ``sinks``, the sinks' gradient. Runs on the
    current CUDA stream; works under torch.compile(fullgraph=True) and in
    CUDA graphs (see the module docstring for the plan and for capture).
    Raises ValueError naming the argument at fault.
    """
    _check_inputs(q, k, v, plan)
    # The float32 value the kernels take (0.0 only for None); ValueError for
    # 0 and for what is 0 or infinite in float32.
    scale_value = _checks.scale_value(scale)
    softcap_value = _checks.softcap_value(softcap)
    window_value = _checks.window_value(window)
    sinks = _check_sinks(sinks, q)
    mod_args = ()
    if score_mod is not None:
        prepare = _prepare_score_mod
        if torch.compiler.is_compiling():
            prepare = torch.compiler.disable(prepare)
        mod_args = prepare(score_mod, q.device)
    if scale_value < 0:
        # The kernels take a positive scale: scale * (q . k) = -scale * (-q . k);
        # autograd carries the sign back into dq.
        q, scale_value = -q, -scale_value
    if not torch.compiler.is_compiling():
        # Eager: the token count is checked here with a clear message (under
        # torch.compile the op's implementation checks it at run time) ...
        if q.shape[0] != plan.num_tokens:
            raise ValueError(f"dualkv: q has {q.shape[0]} tokens but the plan "
                             f"has {plan.num_tokens} (plan.num_tokens)")
    if not torch.compiler.is_compiling() and q.device.type == "cuda":
        # ... and the caller's plan object (maybe uploaded) is the one the op
        # finds, unless an equal plan already there is uploaded and it is not.
        index = q.device.index
        cached = PLAN_CACHE.get(index, plan.key)
        if cached is not plan and (cached is None or plan.is_uploaded(index)
                                   or not cached.is_uploaded(index)):
            PLAN_CACHE.put(index, plan.key, plan)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                        or v.requires_grad):
            _precompile_backward(q, k, v, deterministic)
    o, lse = torch.ops.dualkv.forward(q, k, v, plan_descriptor(plan),
                                      scale_value, bool(deterministic),
                                      softcap_value, window_value, sinks,
                                      *mod_args)
    return (o, lse) if return_lse else o


def _prepare_score_mod(score_mod, device):
    """The forward op's (score_mod, score_mod_data, score_mod_sizes) of a
    ``score_mod=`` argument: the text, the inputs on ``device`` as one
    float32 tensor (None without inputs) and their sizes."""
    mod = _score_mods.resolve(score_mod)
    data, sizes = mod.flat_inputs(device)
    return mod.text, data, sizes
