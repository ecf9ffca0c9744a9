"""GPU tests of the RL pipeline, each against an independent reference:

- the transformers backend without ``dualkv_plan`` (the plan from the packed
  position_ids) gives bitwise the outputs and gradients it gives with the
  plan, for groups and for a prefix tree, and builds the plan once per
  forward, not once per layer;
- response-only chunked log-probs in bf16 against the full-logits path
  (every packed position through the LM head, then gathered) and a float64
  reference; the loss step's peak memory falls by at least the prompt
  positions' fp32 logits;
- the verl-layout adapter on a tiny Qwen3 against the same model run by
  transformers on verl's padded batch (fp32 reference; bf16 eager as the
  noise floor).

Runs as a script (unittest; exits 77, "skipped", without torch, a CUDA GPU,
transformers or libdualkv.so) or under pytest.
"""

import os
import random
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                ".."))

try:
    import torch
    HAVE_GPU = torch.cuda.is_available()
except ImportError:
    torch = None
    HAVE_GPU = False

try:
    import transformers
except ImportError:
    transformers = None


def _library():
    try:
        import dualkv
        dualkv.version()
        return dualkv
    except Exception:
        return None


dualkv = _library() if HAVE_GPU else None
SKIP = (None if HAVE_GPU and dualkv is not None else
        "needs torch, a CUDA GPU and libdualkv.so")
needs_transformers = unittest.skipIf(transformers is None,
                                     "needs transformers")

if not SKIP:
    from dualkv import rl
    from dualkv import transformers_backend


_WEIGHTS = {}


def tiny_qwen3(attn, dtype, seed=0):
    """A 2-layer Qwen3 (head_dim 64, GQA 4/2) with the attention
    implementation ``attn``; the same weights (seed) whatever the
    implementation and dtype."""
    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, max_position_embeddings=1024, attention_dropout=0.0,
        tie_word_embeddings=False, attn_implementation=attn)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config)
    if seed not in _WEIGHTS:
        _WEIGHTS[seed] = {k: v.detach().clone()
                          for k, v in model.state_dict().items()}
    model.load_state_dict(_WEIGHTS[seed])
    return model.to("cuda", dtype)


def random_groups(rng, count, vocab=128):
    return [([rng.randrange(1, vocab) for _ in range(rng.randint(3, 40))],
             [[rng.randrange(1, vocab) for _ in range(rng.randint(1, 30))]
              for _ in range(rng.randint(2, 5))]) for _ in range(count)]


@unittest.skipIf(SKIP, SKIP or "")
@needs_transformers
class BackendWithoutPlanTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        transformers_backend.register()
        cls.model = tiny_qwen3("dualkv", torch.bfloat16)

    def run_model(self, ids, pos, plan):
        model = self.model
        model.zero_grad(set_to_none=True)
        kwargs = {"dualkv_deterministic": True}
        if plan is not None:
            kwargs["dualkv_plan"] = plan
        logits = model(input_ids=ids, position_ids=pos, **kwargs).logits
        g = torch.Generator(device="cuda").manual_seed(1)
        weight = torch.randn(logits.shape, generator=g, device="cuda")
        (logits.float() * weight).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return logits.detach(), grads

    def check(self, layout, plan):
        t = layout.to_torch("cuda")
        ids, pos = t["input_ids"][None], t["position_ids"][None]
        with_plan = self.run_model(ids, pos, plan)
        calls = []
        original = dualkv.Plan.__dict__["from_position_ids"]

        def counted(cls, position_ids):
            calls.append(1)
            return original.__func__(cls, position_ids)

        dualkv.Plan.from_position_ids = classmethod(counted)
        try:
            without = self.run_model(ids, pos.clone(), None)
        finally:
            dualkv.Plan.from_position_ids = original
        # Two layers, one plan: built at the first, reused by the second.
        self.assertEqual(len(calls), 1)
        self.assertTrue(torch.equal(with_plan[0], without[0]))
        for name, g in with_plan[1].items():
            self.assertTrue(torch.equal(g, without[1][name]), name)
        return with_plan[0]

    def test_groups(self):
        rng = random.Random(0)
        for _ in range(3):
            packed = dualkv.pack(random_groups(rng, rng.randint(1, 3)))
            plan = packed.plan()
            self.assertEqual(dualkv.Plan.from_position_ids(
                packed.position_ids).key, plan.key)
            self.check(packed, plan)

    def test_tree(self):
        segments = [[5] * 17, [6] * 9, [7] * 12, [8] * 5, [9] * 20, [3] * 30,
                    [4] * 8, [2] * 11]
        parents = [-1, 0, 1, 1, 0, -1, 5, 5]
        tree = dualkv.pack_tree(segments, parents)
        plan = tree.plan()
        self.assertEqual(dualkv.Plan.from_position_ids(tree.position_ids).key,
                         plan.key)
        logits = self.check(tree, plan)
        # And the tree's answer is the separate paths' (eager, per path).
        leaf = 3
        ids = torch.tensor([tree.unpack_path(tree.input_ids, leaf)],
                           device="cuda")
        ref_model = tiny_qwen3("eager", torch.float32)
        with torch.no_grad():
            ref = ref_model(input_ids=ids).logits[0]
        got = tree.unpack_path(logits[0].float(), leaf)
        err = (got - ref).abs().max().item()
        with torch.no_grad():
            floor = (tiny_qwen3("eager", torch.bfloat16)(input_ids=ids)
                     .logits[0].float() - ref).abs().max().item()
        self.assertLessEqual(err, 2 * floor)

    def test_missing_plan_and_positions(self):
        q = torch.zeros(1, 4, 8, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.zeros(1, 2, 8, 64, device="cuda", dtype=torch.bfloat16)
        with self.assertRaisesRegex(ValueError, "or with the packed "
                                    "position_ids"):
            transformers_backend.dualkv_attention_forward(None, q, k, k, None)
        with self.assertRaisesRegex(ValueError, "holds 5 positions but the "
                                    "layer has 8"):
            transformers_backend.dualkv_attention_forward(
                None, q, k, k, None,
                position_ids=torch.arange(5, device="cuda")[None])


@unittest.skipIf(SKIP, SKIP or "")
class ChunkedLogProbsGpuTest(unittest.TestCase):
    def test_bf16_against_full_logits_and_float64(self):
        torch.manual_seed(0)
        H, V = 1024, 32768
        groups = [(3000, [700] * 3), (1000, [300] * 4)]
        packed = dualkv.pack([([1] * P, [[1] * R for R in Rs])
                              for P, Rs in groups])
        index = []
        for g, (_, Rs) in enumerate(groups):
            for n in range(len(Rs)):
                index += packed.logit_positions(g, n)
        T, M = packed.num_tokens, len(index)
        index = torch.tensor(index, device="cuda")
        h0 = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        w0 = (torch.randn(V, H, device="cuda") * 0.05).to(torch.bfloat16)
        targets = torch.randint(0, V, (M,), device="cuda")
        coef = torch.randn(M, device="cuda")

        def step(kind):
            h = h0.clone().requires_grad_(True)
            w = w0.clone().requires_grad_(True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            if kind == "full":          # every packed position, then gather
                logits = torch.nn.functional.linear(h, w).float()
                logp = torch.log_softmax(logits, -1)[index].gather(
                    1, targets[:, None])[:, 0]
                del logits
            elif kind == "response":    # gather, then one GEMM
                logits = torch.nn.functional.linear(h[index], w).float()
                logp = torch.log_softmax(logits, -1).gather(
                    1, targets[:, None])[:, 0]
                del logits
            else:
                logp = rl.response_logprobs(h, index, targets, w, chunk=1024)
            (logp * coef).sum().backward()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            return logp.detach(), h.grad, w.grad, peak

        full, response, chunked = (step(k) for k in
                                   ("full", "response", "chunked"))
        # float64 reference of the same bf16 inputs.
        h64 = h0.double().requires_grad_(True)
        w64 = w0.double().requires_grad_(True)
        z64 = torch.nn.functional.linear(h64[index], w64)
        logp64 = torch.log_softmax(z64, -1).gather(1, targets[:, None])[:, 0]
        (logp64 * coef.double()).sum().backward()
        zmax = z64.abs().max().item()
        # Log-probs: the two bf16 GEMMs may round a logit one bf16 ulp apart
        # (2^-7 relative), which moves log p by at most twice that.
        diff = (chunked[0] - full[0]).abs().max().item()
        print(f"\nchunked vs full-logits logp max |diff| {diff:.3e} "
              f"(bound {2 ** -6 * zmax:.3e}); peak MiB: full "
              f"{full[3] / 2**20:.0f}, response-only {response[3] / 2**20:.0f},"
              f" chunked {chunked[3] / 2**20:.0f}", flush=True)
        self.assertLessEqual(diff, 2 ** -6 * zmax)
        # Against float64: the bf16 rounding of the logits alone (half an
        # ulp, 2^-8 relative, on z_t and on lse).
        err = (chunked[0].double() - logp64.detach()).abs().max().item()
        self.assertLessEqual(err, 2 ** -7 * zmax)
        # Gradients: no further from float64 than twice the full path's.
        for i, ref in ((1, h64.grad), (2, w64.grad)):
            e_chunk = (chunked[i].double() - ref).norm() / ref.norm()
            e_full = (full[i].double() - ref).norm() / ref.norm()
            self.assertLessEqual(e_chunk.item(), 2 * e_full.item())
        # Memory: response-only saves at least the prompt positions' fp32
        # logits; chunks save more.
        prompt_logits = (T - M) * V * 4
        self.assertLessEqual(response[3], full[3] - prompt_logits)
        self.assertLess(chunked[3], response[3])


def verl_tensors(rng, groups, width_prompt, width_response, device):
    rows = [(p, r) for p, rs in groups for r in rs]
    B, S = len(rows), width_prompt + width_response
    ids = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.long)
    for b, (p, r) in enumerate(rows):
        ids[b, width_prompt - len(p):width_prompt] = torch.tensor(p)
        ids[b, width_prompt:width_prompt + len(r)] = torch.tensor(r)
        ids[b, width_prompt + len(r):] = 1          # pad / eos id
        mask[b, width_prompt - len(p):width_prompt + len(r)] = 1
    prompt_pos = (torch.cumsum(mask[:, :width_prompt], 1) - 1).clamp(min=0)
    pos = torch.cat([prompt_pos, prompt_pos[:, -1:] +
                     torch.arange(1, width_response + 1)], 1)
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": pos,
             "responses": ids[:, width_prompt:].clone()}
    return rows, {k: v.to(device) for k, v in batch.items()}


def verl_reference(model, batch, temperature):
    """verl's _forward_micro_batch without remove_padding."""
    R = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"],
                       use_cache=False).logits.float()
    logits = logits / temperature
    logits = logits[:, -R - 1:-1]
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(2, batch["responses"][..., None])[..., 0]
    entropy = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) *
                                             logits).sum(-1)
    return entropy, logp


@unittest.skipIf(SKIP, SKIP or "")
@needs_transformers
class VerlAdapterGpuTest(unittest.TestCase):
    def test_against_transformers_on_the_padded_batch(self):
        transformers_backend.register()
        rng = random.Random(3)
        groups = random_groups(rng, 3)
        rows, batch = verl_tensors(rng, groups, 48, 32, "cuda")
        # verl shuffles nothing inside a group but groups may interleave.
        perm = torch.randperm(len(rows))
        batch = {k: v[perm.to(v.device)] for k, v in batch.items()}
        response_mask = batch["attention_mask"][:, -32:].bool()
        model = tiny_qwen3("dualkv", torch.bfloat16)
        with torch.no_grad():
            entropy, logp = rl.verl.forward_micro_batch(
                model, batch, temperature=0.9, calculate_entropy=True)
        self.assertEqual(tuple(logp.shape), (len(rows), 32))
        self.assertEqual(logp[~response_mask].abs().sum().item(), 0.0)
        ref_e, ref_l = verl_reference(tiny_qwen3("eager", torch.float32),
                                      batch, 0.9)
        floor_e, floor_l = verl_reference(tiny_qwen3("eager", torch.bfloat16),
                                          batch, 0.9)
        m = response_mask
        for got, ref, floor in ((logp, ref_l, floor_l),
                                (entropy, ref_e, floor_e)):
            err = (got - ref)[m].abs().max().item()
            noise = (floor - ref)[m].abs().max().item()
            self.assertLessEqual(err, 2 * noise)


if __name__ == "__main__":
    if SKIP:
        print(f"skipped: {SKIP}")
        sys.exit(77)
    unittest.main()
