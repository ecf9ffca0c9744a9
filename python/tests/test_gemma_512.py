"""Head_dim 512 through the transformers backend (issue 30): Gemma 4's
global layers have query, key and value rows of 512.

A tiny random Gemma 2 (transformers' Gemma2ForCausalLM, whose layers
alternate between a sliding window and full attention, as Gemma 3 and 4 do)
with head_dim 512, packed through attn_implementation="dualkv" in bf16,
forward and backward, against the same weights run by "eager" on the
replicated sequences [prompt | response_n]: fp32 eager is the reference and
bf16 eager's distance from it the noise floor (test_deepseek_v3.py's method);
the logits and every parameter's gradient must lie within twice that floor
(plus 1e-3 of the gradient's scale). The sliding layers' window (8) is
shorter than the sequences, so both the windowed and the full kernels run at
512; the same packed row under one plain causal plan must fail the logits
check.

Needs torch, a CUDA GPU of compute capability 9.0 or later (the head_dim-512
backward needs 204 KB of shared memory a CTA) and transformers with Gemma 2
(skipped otherwise).
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dualkv  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_deepseek_v3 import (  # noqa: E402
    logits_errors, packed_run, replicated_run)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available()
    or torch.cuda.get_device_capability() < (9, 0),
    reason="needs a CUDA GPU of compute capability 9.0 or later")

D = 512
WINDOW = 8

# Prompts and responses longer than the window and than the kernels' 32-row
# tiles; an empty response; a group of one response.
GROUPS = [([(7 * i) % 96 + 1 for i in range(45)],
           [[(5 * i) % 96 + 1 for i in range(37)], [],
            [(11 * i) % 96 + 1 for i in range(9)]]),
          ([4, 9, 2, 2, 31], [[8, 1, 44, 6, 7, 7, 90, 13, 5, 5, 2]])]


def tiny_gemma(transformers, attn):
    return transformers.Gemma2Config(
        vocab_size=97, hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=D, max_position_embeddings=512, sliding_window=WINDOW,
        attn_logit_softcapping=None, final_logit_softcapping=None,
        query_pre_attn_scalar=D, attention_dropout=0.0,
        attn_implementation=attn)


def test_gemma_head_dim_512_matches_replicated_sequences(monkeypatch):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma2Config"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 2")
    from dualkv import transformers_backend
    transformers_backend.register()
    # What reaches the kernels: q/k/v last dims, the output's, the window.
    seen = []
    attention = transformers_backend.attention

    def recording(q, k, v, plan, **kw):
        o = attention(q, k, v, plan, **kw)
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1], o.shape[-1],
                     kw.get("window")))
        return o

    monkeypatch.setattr(transformers_backend, "attention", recording)

    cls = transformers.Gemma2ForCausalLM
    torch.manual_seed(0)
    ref_model = cls(tiny_gemma(transformers, "eager")).cuda().float()
    assert ref_model.model.layers[0].self_attn.head_dim == D
    state = ref_model.state_dict()
    floor_model = cls(tiny_gemma(transformers, "eager"))
    floor_model = floor_model.cuda().to(torch.bfloat16)
    floor_model.load_state_dict(state)
    packed_model = cls(tiny_gemma(transformers, "dualkv"))
    packed_model = packed_model.cuda().to(torch.bfloat16)
    packed_model.load_state_dict(state)

    packed = dualkv.pack(GROUPS)
    t = packed.to_torch("cuda")
    T = t["input_ids"].numel()
    g = torch.Generator(device="cuda").manual_seed(1)
    weight = torch.randn(T, 97, generator=g, device="cuda")

    logits, grads = packed_run(packed_model, t, packed.plan(), weight,
                               deterministic=False)
    assert seen and all(s[:4] == (D, D, D, D) for s in seen), seen
    # One sliding and one full layer.
    assert {s[4] for s in seen} == {WINDOW, 0}, seen
    ref_logits, ref_grads = replicated_run(ref_model, packed, GROUPS, weight)
    floor_logits, floor_grads = replicated_run(floor_model, packed, GROUPS,
                                               weight)

    err, noise = logits_errors(logits, packed, GROUPS, ref_logits,
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

    # The plan reaches the kernels: one plain causal sequence over the same
    # packed row (responses see their siblings) fails the logits check.
    with torch.no_grad():
        causal = packed_model(input_ids=t["input_ids"][None],
                              position_ids=t["position_ids"][None],
                              dualkv_plan=dualkv.Plan([(T, [])])
                              ).logits[0].float()
    err, noise = logits_errors(causal, packed, GROUPS, ref_logits,
                               floor_logits)
    assert err > 2 * noise, (err, noise)
