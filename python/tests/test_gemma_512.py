"""Head_dim 512 through the transformers backend (issue 30): Gemma 4's
global layers have query, key and value rows of 512.

A tiny random Gemma 2 (transformers' Gemma2ForCausalLM, whose layers
alternate between a sliding window and full attention, as Gemma 3 and 4 do)
with head_dim 512, packed through attn_implementation="dualkv" in bf16,
forward and backward, against the same weights run by "eager" on the
replicated sequences [prompt | response_n]: fp32 eager is the reference and
bf16 eager's distance from it the noise floor (test_deepseek_v3.py's method);
the logits and every parameter's gradient must lie within twice that floor
(plus 1e-3 of the gradient's scale; assert_matches_replicated). The sliding
layers' window (8) is
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
    assert_matches_replicated, bf16_copies, packed_inputs, packed_run)

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
    floor_model, packed_model = bf16_copies(
        ref_model, lambda attn: cls(tiny_gemma(transformers, attn)))

    packed, t, weight = packed_inputs(GROUPS)

    logits, grads = packed_run(packed_model, t, packed.plan(), weight,
                               deterministic=False)
    assert seen and all(s[:4] == (D, D, D, D) for s in seen), seen
    # One sliding and one full layer.
    assert {s[4] for s in seen} == {WINDOW, 0}, seen
    assert_matches_replicated(packed_model, ref_model, floor_model, packed,
                              t, GROUPS, weight, logits, grads)
