"""MLA through the transformers backend (issue 30): query/key head_dim 192
(128 + 64 rotary columns) with value head_dim 128, as DeepSeek-V3 and Kimi K2
have it.

- The backend on transformers' layout: q, k [1, H, T, 192] and v [1, H, T, 128]
  as the strided view DeepSeek-V3 splits out of its kv_b_proj output give
  [1, T, H, 128], bitwise dualkv.attention's.
- A tiny random DeepSeek-V3 (transformers' DeepseekV3ForCausalLM;
  qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128; two dense layers,
  first_k_dense_replace covering them, so no MoE routing for rounding to flip)
  packed through attn_implementation="dualkv" in bf16, forward and backward
  (atomic and deterministic), against the same weights run by "eager" on the
  replicated sequences [prompt | response_n]: fp32 eager is the reference and
  bf16 eager's distance from it the noise floor (test_rl_gpu.py's method); the
  logits and every parameter's gradient must lie within twice that floor
  (plus 1e-3 of the gradient's scale, where bf16 eager happens to round
  close). The backend must receive unpadded value states (last dim 128: the
  model pads V to 192 only for flash attention implementations) and return
  128 columns; the same packed row under one plain causal plan (responses
  seeing their siblings) must fail the logits check.

Needs torch, a CUDA GPU and transformers with DeepseekV3Config (skipped
otherwise).
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dualkv  # noqa: E402

torch = pytest.importorskip("torch")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA GPU")
pytestmark = needs_gpu

D, DV, NOPE, ROPE = 192, 128, 128, 64

# Prompts and responses long enough to cross the kernels' 64-row tiles; an
# empty response; a group of one response.
GROUPS = [([(7 * i) % 96 + 1 for i in range(70)],
           [[(5 * i) % 96 + 1 for i in range(37)], [],
            [(11 * i) % 96 + 1 for i in range(9)],
            [(3 * i) % 96 + 1 for i in range(66)]]),
          ([4, 9, 2, 2, 31], [[8, 1, 44, 6, 7, 7, 90, 13]])]


def test_backend_layout_mla():
    """dualkv_attention_forward on DeepSeek-V3's layout: q and k contiguous
    [1, H, T, 192] (torch.cat of the nope and rope parts), v the strided
    [1, H, T, 128] view of torch.split over kv_b_proj's [1, T, H, 256]
    output; out [1, T, H, 128] equals dualkv.attention on the same views."""
    from dualkv.transformers_backend import dualkv_attention_forward
    groups = [(70, [37, 0, 9]), (5, [8])]
    plan = dualkv.Plan(groups)
    T, H = plan.num_tokens, 4
    torch.manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    q4 = torch.randn(1, H, T, D, **kw)
    kv = torch.randn(1, T, H, NOPE + DV, **kw).transpose(1, 2)
    k_nope, v4 = torch.split(kv, [NOPE, DV], dim=-1)
    k4 = torch.cat([k_nope, torch.randn(1, H, T, ROPE, **kw)], dim=-1)
    assert v4.shape == (1, H, T, DV) and not v4.is_contiguous()
    scale = D ** -0.5
    out, weights = dualkv_attention_forward(None, q4, k4, v4, None,
                                            scaling=scale, dualkv_plan=plan)
    assert weights is None and out.shape == (1, T, H, DV)
    q, k, v = (t[0].transpose(0, 1) for t in (q4, k4, v4))
    assert torch.equal(out[0], dualkv.attention(q, k, v, plan, scale=scale))


def tiny_deepseek_v3(transformers, attn):
    return transformers.DeepseekV3Config(
        vocab_size=97, hidden_size=256, intermediate_size=512,
        moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=DV,
        # Every layer dense: no expert is built, none routed.
        first_k_dense_replace=2, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1,
        max_position_embeddings=512, attention_dropout=0.0,
        tie_word_embeddings=False, pad_token_id=0,
        attn_implementation=attn)


def copies(packed, groups):
    """Per replicated sequence [prompt | response_n]: (g, n, token ids, the
    packed rows of its tokens, whether its prompt rows carry the loss: only
    in the group's first copy, where the packed batch has them once)."""
    for g, (prompt, responses) in enumerate(groups):
        p0, p1 = packed.token_range(g)
        for n, response in enumerate(responses):
            r0, r1 = packed.token_range(g, n)
            rows = list(range(p0, p1)) + list(range(r0, r1))
            yield g, n, prompt + response, rows, n == 0


def replicated_run(model, packed, groups, weight):
    """Each replicated sequence through ``model`` (batch 1, no padding):
    the logits per copy (float32) and the parameters' gradients of
    sum(logits * weight) over the rows the packed batch has once (a prompt's
    from its group's first copy, each response's from its own)."""
    model.zero_grad(set_to_none=True)
    logits = []
    for g, n, ids, rows, own_prompt in copies(packed, groups):
        ids = torch.tensor([ids], device="cuda")
        out = model(input_ids=ids).logits[0].float()
        P = len(groups[g][0])
        w = weight[rows].clone()
        if not own_prompt:
            w[:P] = 0
        (out * w).sum().backward()
        logits.append(out.detach())
    grads = {name: p.grad.float() for name, p in model.named_parameters()
             if p.grad is not None}
    return logits, grads


def packed_run(model, t, plan, weight, deterministic):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=t["input_ids"][None],
                position_ids=t["position_ids"][None], dualkv_plan=plan,
                dualkv_deterministic=deterministic).logits[0].float()
    (out * weight).sum().backward()
    grads = {name: p.grad.float() for name, p in model.named_parameters()
             if p.grad is not None}
    return out.detach(), grads


def logits_errors(logits, packed, groups, ref, floor):
    """(max |packed - fp32 eager|, max |bf16 eager - fp32 eager|) over every
    replicated sequence, the packed rows gathered into each."""
    err = noise = 0.0
    for (_, _, _, rows, _), r, f in zip(copies(packed, groups), ref, floor):
        err = max(err, (logits[rows] - r).abs().max().item())
        noise = max(noise, (f - r).abs().max().item())
    return err, noise


def packed_inputs(groups, vocab=97):
    """The packed groups, their tensors on the GPU and the random weight
    [T, vocab] of the loss sum(logits * weight)."""
    packed = dualkv.pack(groups)
    t = packed.to_torch("cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    weight = torch.randn(t["input_ids"].numel(), vocab, generator=g,
                         device="cuda")
    return packed, t, weight


def bf16_copies(ref_model, build):
    """bf16 copies of ``ref_model``'s weights in ``build("eager")`` (the
    noise floor) and ``build("dualkv")`` (the packed model), on the GPU."""
    state = ref_model.state_dict()
    copies = []
    for attn in ("eager", "dualkv"):
        model = build(attn).cuda().to(torch.bfloat16)
        model.load_state_dict(state)
        copies.append(model)
    return tuple(copies)


def assert_matches_replicated(packed_model, ref_model, floor_model, packed, t,
                              groups, weight, logits, grads):
    """The packed run's logits and gradients (packed_run) against fp32 eager
    (ref_model) on the replicated sequences, within twice bf16 eager's
    (floor_model) distance from it (plus 1e-3 of each gradient's scale);
    and the same packed row under one plain causal plan (responses seeing
    their siblings) failing the logits check, so the plan reaches the
    kernels."""
    ref_logits, ref_grads = replicated_run(ref_model, packed, groups, weight)
    floor_logits, floor_grads = replicated_run(floor_model, packed, groups,
                                               weight)
    err, noise = logits_errors(logits, packed, groups, ref_logits,
                               floor_logits)
    assert err <= 2 * noise, f"logits: max|err| {err:.3g} > 2 x {noise:.3g}"
    assert set(grads) == set(ref_grads) == set(floor_grads)
    bad = []
    for name, ref in ref_grads.items():
        e = (grads[name] - ref).abs().max().item()
        f = (floor_grads[name] - ref).abs().max().item()
        bound = 2 * f + 1e-3 * ref.abs().max().item()
        if not e <= bound:
            bad.append(f"{name}: max|err| {e:.3g} > {bound:.3g} "
                       f"(bf16 floor {f:.3g})")
    assert not bad, "; ".join(bad)
    T = t["input_ids"].numel()
    with torch.no_grad():
        causal = packed_model(input_ids=t["input_ids"][None],
                              position_ids=t["position_ids"][None],
                              dualkv_plan=dualkv.Plan([(T, [])])
                              ).logits[0].float()
    err, noise = logits_errors(causal, packed, groups, ref_logits,
                               floor_logits)
    assert err > 2 * noise, (err, noise)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deepseek_v3_matches_replicated_sequences(deterministic, monkeypatch):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV3Config"):
        pytest.skip(f"transformers {transformers.__version__} has no "
                    "DeepseekV3Config")
    from dualkv import transformers_backend
    transformers_backend.register()
    # What reaches the kernels: q/k/v last dims, the output's.
    seen = []
    attention = transformers_backend.attention

    def recording(q, k, v, plan, **kw):
        o = attention(q, k, v, plan, **kw)
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1], o.shape[-1]))
        return o

    monkeypatch.setattr(transformers_backend, "attention", recording)

    cls = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    ref_model = cls(tiny_deepseek_v3(transformers, "eager")).cuda().float()
    attn = ref_model.model.layers[0].self_attn
    assert (attn.qk_head_dim, attn.v_head_dim) == (D, DV)
    assert all(type(layer.mlp).__name__ == "DeepseekV3MLP"
               for layer in ref_model.model.layers)
    floor_model, packed_model = bf16_copies(
        ref_model, lambda attn: cls(tiny_deepseek_v3(transformers, attn)))

    packed, t, weight = packed_inputs(GROUPS)

    logits, grads = packed_run(packed_model, t, packed.plan(), weight,
                               deterministic)
    assert seen and all(s == (D, D, DV, DV) for s in seen), seen
    assert_matches_replicated(packed_model, ref_model, floor_model, packed,
                              t, GROUPS, weight, logits, grads)
