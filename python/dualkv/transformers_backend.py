"""A Hugging Face transformers attention backend named "dualkv".

    import dualkv, dualkv.transformers_backend
    dualkv.transformers_backend.register()          # once per process
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="dualkv",
                                                 torch_dtype=torch.bfloat16).cuda()
    packed = dualkv.pack(groups)                     # [prompt | r1 | ... | rN] ...
    t = packed.to_torch("cuda")
    out = model(input_ids=t["input_ids"][None], position_ids=t["position_ids"][None],
                dualkv_plan=packed.plan())

Prefix trees (multi-turn, branching rollouts) go the same way:
``tree = dualkv.pack_tree(segments, parents)``, ``tree.to_torch("cuda")`` and
``dualkv_plan=tree.plan()``; their ``position_ids`` continue along each
root-to-leaf path, and ``tree.logit_positions(n)`` / ``tree.unpack_path(x, leaf)``
read the logits back per node or per trajectory.

Without ``dualkv_plan`` the plan comes from the packed ``position_ids``
(``dualkv.Plan.from_position_ids``), which transformers' models pass to every
attention call: RL frameworks and collators that already hand a packed row
and its positions to the model need no new keyword. The plan is built once
per forward, at the first layer (one small device-to-host copy), and reused
by every later layer of that forward: it is remembered for that position_ids
tensor (same object, unmodified; per thread). Eager only: under torch.compile,
pass ``dualkv_plan``.

The packed micro-batch is one sequence (batch size 1) of T tokens; the plan
travels as the ``dualkv_plan`` keyword, which transformers' model forwards
pass down to every attention call (``**kwargs``). ``position_ids`` must be the
packed ones (each response continues its prompt's positions; each tree node its
ancestors') for the rotary
embedding to be right. The plan alone defines who attends to whom:
transformers builds no mask for an attention implementation it does not know,
and any ``attention_mask`` that still arrives (older versions build a plain
causal one) is ignored. Head dims 64, 96, 128, 256 and 512 (Gemma 4's global
layers; their backward on sm_90 to sm_110 only, which have the 204 KB of
shared memory a CTA it needs), and MLA's query/key head dim 192 with value
head dim 128 (DeepSeek-V3: the value states arrive unpadded, [B, H, T, 128],
and the output is [1, T, H, 128]), forward and backward.

Attention variants, as transformers hands them to an attention interface:

- ``sliding_window`` (Mistral's ``config.sliding_window``, Gemma 2/3's and
  gpt-oss's sliding layers): ``window=W`` of ``dualkv.attention``, the same
  W (see ``sliding_window_of``); a window of at least T tokens is no window.
  The library refuses a window with the deterministic backward
  (``dualkv_deterministic=True``), by name.
- ``softcap`` (Gemma 2's ``attn_logit_softcapping``): ``softcap=c``.
- ``s_aux`` (gpt-oss's per-head ``sinks`` parameter): ``sinks=``, run in
  float32; autograd trains it.

Refused with ValueError, by name: dropout, batch size > 1 (pack instead).

Importing this module does not import transformers; ``register()`` does.
"""

import threading
import weakref

from . import Plan, _checks
from .ops import attention

__all__ = ["NAME", "dualkv_attention_forward", "register",
           "plan_from_position_ids", "sliding_window_of"]

#: The attn_implementation name registered by register().
NAME = "dualkv"


def dualkv_attention_forward(module, query, key, value, attention_mask,
                             scaling=None, dropout=0.0, **kwargs):
    """transformers' AttentionInterface signature.

    query [1, Hq, T, D], key/value [1, Hkv, T, D] (not repeated for GQA:
    DualKV reads kv head h // (Hq / Hkv) itself). Returns (attn_output
    [1, T, Hq, D], None); attention weights are never materialised.
    Takes the plan from ``dualkv_plan=`` (a dualkv.Plan of T tokens) or,
    without it, from the packed ``position_ids`` transformers passes along
    (``plan_from_position_ids``).
    """
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"dualkv: query/key/value must be 4-D [B, H, T, D], "
                         f"got {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}")
    if query.shape[0] != 1:
        raise ValueError(f"dualkv: query has batch size {query.shape[0]}; the "
                         "dualkv backend takes one packed sequence (batch "
                         "size 1): pack the groups with dualkv.pack")
    if dropout:
        raise ValueError(f"dualkv: dropout={dropout} is not supported by the "
                         "dualkv backend (set the model's attention_dropout "
                         "to 0)")
    T = query.shape[2]
    plan = kwargs.get("dualkv_plan")
    if plan is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise ValueError("dualkv: the dualkv attention backend needs the "
                             "packed micro-batch's plan: call the model with "
                             "dualkv_plan=plan (a dualkv.Plan) or with the "
                             "packed position_ids")
        plan = plan_from_position_ids(position_ids)
        if plan.num_tokens != T:
            raise ValueError(f"dualkv: position_ids holds {plan.num_tokens} "
                             f"positions but the layer has {T} tokens")
    window = sliding_window_of(module, kwargs)
    # No pair of a T-token batch is W >= T apart: that window is no window
    # (and keeps the plain kernels, which trees and the deterministic
    # backward take).
    if window >= T:
        window = 0
    # gpt-oss's sinks, one logit per query head (None: none); attention()
    # runs them in float32 and autograd carries their gradient back.
    sinks = kwargs.get("s_aux")
    # Gemma 2's attn_logit_softcapping (None: none).
    softcap = kwargs.get("softcap")
    # [1, H, T, D] -> [T, H, D]: a view (strides (D, T*D, 1) for the usual
    # [B, T, H, D].transpose(1, 2) layout); the kernels take free row strides.
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    o = attention(q, k, v, plan, scale=scaling,
                  deterministic=bool(kwargs.get("dualkv_deterministic",
                                                False)),
                  softcap=softcap, window=window, sinks=sinks)
    return o.unsqueeze(0), None


def sliding_window_of(module, kwargs):
    """The window W (0: none) of a layer, as transformers gives it to an
    attention interface: the ``sliding_window`` keyword (Gemma 2/3, gpt-oss
    and Qwen2 pass their layer's ``self.sliding_window``, None on full
    layers; Mistral its ``config.sliding_window``), else the attention
    module's own ``sliding_window`` attribute for a model that sets it but
    does not pass it. None and 0 mean none.

    No off-by-one: transformers' mask for a sliding layer is
    ``sliding_window_overlay`` in transformers/masking_utils.py,
    ``kv_idx > q_idx - sliding_window``, on top of the causal mask, i.e. key
    kv_idx is seen iff q_idx - kv_idx < sliding_window, with q_idx and kv_idx
    positions in the sequence; its flash-attention path passes
    ``window_size=(sliding_window - 1, sliding_window - 1)``
    (transformers/modeling_flash_attention_utils.py; flash-attn's bounds are
    inclusive), the same set (q_idx - kv_idx <= sliding_window - 1). Older
    versions' flash path passed ``(sliding_window, sliding_window)``, one
    key more than their own eager/sdpa masks; DualKV follows the masks, which
    the eager reference of the tests applies. DualKV's window is
    lpos(i) - lpos(j) < W with lpos the position in the token's own
    sequence [prompt | response], which is that sequence's q_idx and kv_idx
    when it runs alone: W = sliding_window."""
    if "sliding_window" in kwargs:
        window = kwargs["sliding_window"]
    else:
        window = getattr(module, "sliding_window", None)
    if window is None:
        return 0
    try:
        return _checks.window_value(window)
    except ValueError as e:
        reason = str(e).removeprefix("dualkv: ")
        raise ValueError(f"dualkv: the layer's sliding_window: {reason}"
                         ) from None


_LAST = threading.local()


def plan_from_position_ids(position_ids):
    """``dualkv.Plan.from_position_ids(position_ids)``, remembered for this
    tensor (per thread, the last one): the layers of one forward receive the
    same position_ids object, so only the first builds the plan and reads
    the positions from the device. A new tensor, or the same one modified in
    place (its version counter moved), builds a new plan."""
    ref = getattr(_LAST, "ref", None)
    version = getattr(position_ids, "_version", None)
    if (ref is not None and ref() is position_ids
            and _LAST.version == version):
        return _LAST.plan
    plan = Plan.from_position_ids(position_ids)
    try:
        _LAST.ref = weakref.ref(position_ids)
    except TypeError:  # not weak-referenceable (a list): not cached
        _LAST.ref = None
    _LAST.version, _LAST.plan = version, plan
    return plan


def register(name=NAME):
    """Registers the backend with transformers.AttentionInterface under
    ``name`` (then use attn_implementation=name). Returns the name."""
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError("dualkv: the transformers backend needs "
                          "transformers >= 4.48 (AttentionInterface)") from e
    AttentionInterface.register(name, dualkv_attention_forward)
    return name
