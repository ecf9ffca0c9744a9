#!/usr/bin/env python3
"""Attention forward and forward+backward: DualKV (packed) against
FlexAttention (packed, block mask) and FA2 and cuDNN (replicated SDPA) on the
standard configs of benchmarks/README.md (Qwen3-8B heads: Hq=32, Hkv=8,
D=128, bf16, one group each), plus P=65536 for DualKV alone, then the
other target shapes: head_dim 64 (32:8) and 256 (16:8) at P=8192, N=16, R=1024,
and 4 groups of P=2048, N=8, R 64..4096 in one launch (--set targets).
--set causal: plain causal attention at equal work, every peer on the same
sequences: prompt-only plans (one L-token prompt, no responses) for DualKV and
Flex, one causal sequence each for cuDNN and FA2 (their kernels at their best),
at L = 16384 for head_dim 64, 128 and 256 and at 2 x 8192 for head_dim 128.
A value head_dim apart from the query/key head_dim (MLA, DeepSeek-V3's 192/128,
32 heads without GQA): P8192_N16_R1024_D192V128 (targets) and
causal_L16384_D192V128 (causal); v and dO are [T, Hkv, DV] and [T, Hq, DV].
Useful FLOPs: 2·(D + DV)·Hq·pairs forward (Q·Kᵀ, P·V) and (8·D + 6·DV)·Hq·pairs
forward+backward (the backward 6·D + 4·DV: S recompute 2D, dP 2DV, dV 2DV,
dK 2D, dQ 2D): 4·D·Hq·pairs and 3.5x that where D = DV.

The headline peer is FlexAttention at its fastest: torch.compile(
flex_attention, dynamic=False) on contiguous [1, H, T, D] tensors, a kernel
specialised per shape ("Flex (dynamic=False)"); every "x vs Flex" ratio is
against it. "Flex (dynamic=True)", one compile for every shape (what an RL
loop with changing shapes runs), is a second column with a secondary ratio,
never the headline. Both run in the same process by default.

--softcap C: logit softcap (Gemma 2's attn_logit_softcapping): every logit
s = scale * q.k becomes C * tanh(s / C) before the softmax, forward and
backward. DualKV runs with softcap=C; both Flex columns with the score_mod
C * tanh(score / C) (Flex's score is already scaled) and the same block mask;
FA2 and cuDNN (SDPA, no softcap) are skipped, with a line saying so. FLOPs are
counted as without it (the tanh adds no matmul work).

--window W: sliding window (Mistral, Gemma 2/3's and gpt-oss's sliding
layers): query i sees key j only if it did before and lpos(i) - lpos(j) < W,
lpos the position in the token's own sequence [prompt | response]. DualKV
runs with window=W; both Flex columns add lpos[q] - lpos[kv] < W to the
mask_mod, lpos read from a per-token tensor built from the packing (so the
block mask skips the blocks outside the window, as DualKV skips its tiles).
Useful FLOPs count only the pairs the window allows. FA2 and cuDNN (SDPA, no
window) are skipped; DualKV det. is n/a where the library refuses a window
with the deterministic backward.

--sinks: attention sinks (gpt-oss): one fp32 logit per query head in every
row's softmax denominator, a learned parameter (its gradient is computed).
DualKV runs with sinks=s; Flex cannot add a denominator term through
score_mod, so --flex-sinks picks its form: "lse" (default) runs
flex_attention(return_lse=True) and rescales, o * sigmoid(lse - s), compiled
together with it; "column" appends one zero key/value token that every query
sees and whose score a score_mod replaces by s_h. FA2 and cuDNN are skipped.

    python3 benchmarks/bench_attention.py --lib build/libdualkv.so [--out DIR]
    python3 benchmarks/bench_attention.py --quick          # smoke run
    python3 benchmarks/bench_attention.py --mode fwd       # forward only
    python3 benchmarks/bench_attention.py --set standard   # or targets, causal
    python3 benchmarks/bench_attention.py --methods DualKV,flex-static
    python3 benchmarks/bench_attention.py --softcap 50     # Gemma 2's cap
    python3 benchmarks/bench_attention.py --window 4096    # sliding window
    python3 benchmarks/bench_attention.py --sinks --window 128  # gpt-oss

Writes DIR/attention.{md,json} (rewritten after every config: a run cut
short keeps what it finished) and DIR/attention_speedup.png (forward only:
forward.*, forward_speedup.png); DIR defaults to
benchmarks/results/<today>/<commit> (with variants a subfolder naming them:
softcap<C>, window<W>, sinks, joined by "_", e.g. window128_sinks). See
benchmarks/README.md for what is measured.
"""

import argparse
import gc
import math
import random
import struct
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# Qwen3-8B attention: (Hq, Hkv, D) of every config that names no other.
DEFAULT_HEADS = (32, 8, 128)
VAR_SEED = 1234     # P8192_N16_Rvar's response lengths
GROUPS_SEED = 1235  # G4_P2048_N8_Rvar's response lengths
# Configs too large for the replicated peers' time or memory; the others run
# only where --all-methods-everywhere says so.
DUALKV_ONLY = {"P65536_N16_R1024"}
# The two FlexAttention columns: the headline peer (a kernel specialised per
# shape: Flex at its fastest) and the one an RL loop with changing shapes runs
# (one compile for every shape; a secondary ratio, never the headline).
FLEX_STATIC = "Flex (dynamic=False)"
FLEX_DYNAMIC = "Flex (dynamic=True)"
HEADLINE_PEER = FLEX_STATIC
METHODS = ("DualKV", "DualKV det.", FLEX_STATIC, FLEX_DYNAMIC,
           "FA2 replicated", "cuDNN replicated", "ME replicated")
# --methods names besides the methods' own names and their prefixes
# (case-insensitive); "FlexAttention" was the single Flex column's name.
METHOD_ALIASES = {
    "flex-static": (FLEX_STATIC,),
    "flex-dynamic": (FLEX_DYNAMIC,),
    "flexattention": (FLEX_STATIC, FLEX_DYNAMIC),
}
# Methods with no logit softcap (SDPA has none): skipped under --softcap.
NO_SOFTCAP = ("FA2 replicated", "cuDNN replicated", "ME replicated")
# Nor a sliding window or attention sinks: skipped under --window, --sinks.
NO_WINDOW = NO_SINKS = NO_SOFTCAP
# The forms of attention sinks in Flex (--flex-sinks), the first the default.
FLEX_SINK_FORMS = ("lse", "column")


def window_arg(text):
    """--window's value: an integer W >= 1 (argparse.ArgumentTypeError
    otherwise)."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the window must be >= 1 (leave --window out for "
            "none)")
    return value


def variant_tag(softcap=None, window=None, sinks=False, score_mod=None):
    """The default output subfolder of a run with variants ("" for none):
    softcap<C>, window<W>, sinks and score_mod_<name>, joined by "_" (e.g.
    window128_sinks; softcap50 alone, as before the window and sinks)."""
    parts = []
    if score_mod:
        parts.append(f"score_mod_{score_mod}")
    if softcap:
        parts.append(softcap_tag(softcap))
    if window:
        parts.append(f"window{window}")
    if sinks:
        parts.append("sinks")
    return "_".join(parts)


SCORE_MODS = ("alibi", "softcap", "relative_bias")


def score_mod_tensors(torch, name, hq, device):
    """The tensors of shipped score modifier `name` for hq heads (fp32, on
    `device`): ALiBi's slopes 2^(-8 (h + 1) / hq); the relative bias's
    [hq][257] table (seeded normal values / 4); none for the softcap."""
    if name == "alibi":
        h = torch.arange(1, hq + 1, dtype=torch.float32, device=device)
        return [torch.exp2(-8.0 * h / hq)]
    if name == "relative_bias":
        g = torch.Generator(device="cpu").manual_seed(2026120720)
        table = torch.randn(hq, 257, generator=g) / 4
        return [table.to(device)]
    return []


def flex_score_mod(torch, name, tensors, lpos):
    """Flex's score_mod for shipped modifier `name`, written as a Flex user
    would on the packed layout: q_idx and kv_idx are packed, so the
    distances take the logical positions lpos[...] (the same ones DualKV's
    q_idx and kv_idx are)."""
    if name == "softcap":
        def softcap50(score, b, h, q_idx, kv_idx):
            return 50.0 * torch.tanh(score / 50.0)
        return softcap50
    if name == "alibi":
        slopes = tensors[0]

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (lpos[kv_idx] - lpos[q_idx])
        return alibi
    table = tensors[0]

    def relative_bias(score, b, h, q_idx, kv_idx):
        d = torch.clamp(lpos[kv_idx] - lpos[q_idx], -128, 128) + 128
        return score + table[h, d]
    return relative_bias


def capped_sum(lo, hi, cap):
    """sum of min(x, cap) for x in lo..hi (0 when hi < lo)."""
    if hi < lo:
        return 0
    if hi <= cap:
        return (lo + hi) * (hi - lo + 1) // 2
    if lo > cap:
        return (hi - lo + 1) * cap
    return (lo + cap) * (cap - lo + 1) // 2 + (hi - cap) * cap


def windowed_pairs(P, Rs, window):
    """Allowed (query, key) pairs of one group under a sliding window W:
    the query at lpos x (0-based) of its sequence [prompt | response] sees
    the keys at lpos max(0, x - W + 1) .. x, min(x + 1, W) of them; the
    prompt's queries once, each response's queries over lpos P .. P + R - 1.
    Without a window (None or 0): common.useful_pairs."""
    if not window:
        return common.useful_pairs(P, Rs)
    return capped_sum(1, P, window) + sum(
        capped_sum(P + 1, P + R, window) for R in Rs)


def softcap_arg(text):
    """--softcap's value: a positive finite float, rounded to float32 (the
    value DualKV's kernels get, so that Flex's score_mod uses the same c).
    Raises argparse.ArgumentTypeError otherwise."""
    try:
        value = float(text)
        value = struct.unpack("f", struct.pack("f", value))[0]
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a float32 number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"{text!r}: the softcap must be a positive finite number "
            "(leave --softcap out for none)")
    return value


def softcap_tag(softcap):
    """"softcap<C>" (the default output subfolder under --softcap C), e.g.
    softcap50, softcap0.5."""
    return f"softcap{softcap:g}"


def softcap_score_mod(torch, softcap):
    """Flex's score_mod for the logit softcap c: score -> c * tanh(score /
    c) (Flex's score is already scale * q.k: the function DualKV applies).
    A closure over a Python float, FlexAttention's own softcap form
    (attention-gym's generate_tanh_softcap); Flex makes one function per
    run and passes the same object on every call, so dynamo's guards on it
    hold across configs (a recompile comes only from a new shape, as without
    a score_mod)."""
    cap = float(softcap)

    def softcap_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return softcap_mod


def flex_with_sinks(torch, flex_attention):
    """Attention sinks on top of Flex ("lse" form): Flex's score_mod cannot
    add a term to the softmax denominator, but its LSE gives it after the
    fact (return_lse, or return_aux's lse since torch 2.9). With l = lse
    (natural log, without the sink) and s_h the sink,
    the rows' weights shrink by exp(l) / (exp(l) + exp(s_h)) =
    sigmoid(l - s_h): o_sink = o * sigmoid(l - s_h). One function, compiled
    as a whole (the rescaling fuses into one elementwise kernel, forward and
    backward); autograd reaches the sinks and, through Flex's LSE gradient,
    q and k."""

    # return_lse=True until torch 2.9, return_aux=AuxRequest(lse=True) since
    # (return_lse deprecated then and slated for removal).
    import inspect
    request = None
    try:
        from torch.nn.attention.flex_attention import AuxRequest
        if "return_aux" in inspect.signature(flex_attention).parameters:
            request = AuxRequest(lse=True)
    except ImportError:
        pass

    def flex_sinks(q, k, v, sinks, **kw):
        if request is not None:
            o, aux = flex_attention(q, k, v, return_aux=request, **kw)
            lse = aux.lse
        else:
            o, lse = flex_attention(q, k, v, return_lse=True, **kw)
        w = torch.sigmoid(lse - sinks[None, :, None])  # [1, Hq, T] fp32
        return (o.float() * w[..., None]).to(o.dtype)

    return flex_sinks


def sink_column_score_mod(torch, inner, T, sinks):
    """Flex's score_mod of the "column" form of attention sinks: the score
    of key T (the appended zero token) becomes sinks[h], every other score
    inner(score) (the softcap; None: itself). ``sinks`` is a captured tensor,
    whose gradient Flex computes when it requires one. One function per
    config (it captures that config's T and sinks): Flex (dynamic=True)
    recompiles for each, in its first call, outside the timing."""

    def sink_column(score, b, h, q_idx, kv_idx):
        if inner is not None:
            score = inner(score, b, h, q_idx, kv_idx)
        return torch.where(kv_idx == T, sinks[h], score)

    return sink_column


class Segment:
    """One packed segment: group g's prompt (n = -1) or its response n."""

    def __init__(self, group, n, start, length):
        self.group, self.n, self.start, self.length = group, n, start, length
        self.is_prompt = n < 0


class Sequence:
    """One replicated sequence [prompt_g | response_{g,n}]: where its two
    pieces lie in the packed layout."""

    def __init__(self, group, n, prompt_start, P, resp_start, R):
        self.group, self.n = group, n
        self.prompt_start, self.P = prompt_start, P
        self.resp_start, self.R = resp_start, R


class Config:
    """One benchmark configuration: groups [(P, [R_1 .. R_N]), ...] packed
    back to back ([prompt_0 | r_0_1 .. | prompt_1 | ...],
    docs/architecture.md §1),
    heads (hq query, hkv key/value), head_dim d (queries and keys) and the
    value head_dim dv (values, outputs and dO; None: d, every shape but
    MLA's 192/128), the --set it belongs to, and the seed of its drawn
    lengths (None: none drawn). Pure Python: the layout and the FLOP
    accounting need no torch."""

    def __init__(self, name, groups, hq=DEFAULT_HEADS[0],
                 hkv=DEFAULT_HEADS[1], d=DEFAULT_HEADS[2], set_name="standard",
                 seed=None, dv=None):
        self.name, self.set_name, self.seed = name, set_name, seed
        self.groups = [(int(P), [int(R) for R in Rs]) for P, Rs in groups]
        self.hq, self.hkv, self.d = hq, hkv, d
        self.dv = d if dv is None else dv
        if hq % hkv:
            raise ValueError(f"{name}: Hq {hq} is not a multiple of Hkv {hkv}")
        self.G = len(self.groups)
        self.T = sum(P + sum(Rs) for P, Rs in self.groups)
        # Segments in packed order, and the replicated sequences (group by
        # group, response by response: the order of the replicated peers'
        # copies).
        self.segments, self.sequences = [], []
        off = 0
        for g, (P, Rs) in enumerate(self.groups):
            prompt_start = off
            self.segments.append(Segment(g, -1, off, P))
            off += P
            if not Rs:
                # A prompt-only group: the replicated peers run the prompt
                # as one causal sequence of its own (plain causal attention).
                self.sequences.append(Sequence(g, 0, prompt_start, P, off, 0))
            for n, R in enumerate(Rs):
                self.segments.append(Segment(g, n, off, R))
                self.sequences.append(Sequence(g, n, prompt_start, P, off, R))
                off += R
        assert off == self.T

    def useful_pairs(self, window=None):
        """Allowed (query, key) pairs, summed over the groups (with a
        sliding window: those inside it, windowed_pairs)."""
        return sum(windowed_pairs(P, Rs, window) for P, Rs in self.groups)

    def replicated_pairs(self):
        """Pairs a causal kernel computes on every group's N sequences."""
        return sum(common.replicated_pairs(P, Rs) for P, Rs in self.groups)

    def useful_flops(self, window=None):
        """Useful forward FLOPs: 2 * (D + DV) * Hq * pairs (Q K^T over D,
        P V over DV), summed over groups (with a sliding window: only the
        pairs inside it); 4 * D * Hq * pairs where DV = D."""
        return 2 * (self.d + self.dv) * self.hq * self.useful_pairs(window)

    def useful_flops_fwd_bwd(self, window=None):
        """Useful forward+backward FLOPs: (2 (D + DV) + 6 D + 4 DV) * Hq *
        pairs, the backward's 6 D + 4 DV per pair and head being S = Q K^T
        recomputed (2 D), dP = dO V^T (2 DV), dV = P^T dO (2 DV), dK = dS^T Q
        (2 D) and dQ = dS K (2 D). Where DV = D that is 14 D = 3.5 x the
        forward's 4 D: then exactly the former common.FWD_BWD_FACTOR *
        useful_flops (the same value and type as before DV)."""
        if self.dv == self.d:
            return common.FWD_BWD_FACTOR * self.useful_flops(window)
        return ((8 * self.d + 6 * self.dv) * self.hq
                * self.useful_pairs(window))

    def dims(self):
        """"D", or "D/DV" where the value head_dim differs (192/128)."""
        return head_dims_text(self.d, self.dv)

    def describe(self):
        """"G=.. T=.. Hq:Hkv=..:.. D=.." for the progress lines (D=192/128
        with a value head_dim of its own)."""
        return (f"G={self.G} T={self.T} Hq:Hkv={self.hq}:{self.hkv} "
                f"D={self.dims()}")


def head_dims_text(d, dv=None):
    """"D", or "D/DV" where the value head_dim dv differs from d."""
    return f"{d}" if dv is None or dv == d else f"{d}/{dv}"


def standard_configs():
    """The standard configs of benchmarks/README.md (Qwen3-8B heads, one group each),
    then DualKV's own P=65536: the set "standard", in its historical order."""
    configs = [Config(f"P{P}_N16_R1024", [(P, [1024] * 16)])
               for P in (4096, 8192, 16384, 32768)]
    configs.append(Config("P8192_N32_R2048", [(8192, [2048] * 32)]))
    rng = random.Random(VAR_SEED)
    configs.append(Config("P8192_N16_Rvar",
                          [(8192, [rng.randint(64, 4096) for _ in range(16)])],
                          seed=VAR_SEED))
    configs.append(Config("P65536_N16_R1024", [(65536, [1024] * 16)]))
    return configs


def target_configs():
    """The target shapes besides the standard ones (the set
    "targets"): head_dim 64 and 96 (Hq 32, Hkv 8), head_dim 256 (Hq 16,
    Hkv 8), MLA's head_dim 192 with value head_dim 128 (DeepSeek-V3: Hq
    32, Hkv 32, no GQA) and head_dim 512 (Gemma 4's global layers: Hq 16,
    Hkv 8 and Hq 8, Hkv 4) at P=8192, N=16, R=1024; and 4 groups in one
    launch, each P=2048 with 8 responses of lengths drawn from 64..4096
    (seed GROUPS_SEED), Qwen3-8B heads."""
    configs = [
        Config("P8192_N16_R1024_D64", [(8192, [1024] * 16)], hq=32, hkv=8,
               d=64, set_name="targets"),
        Config("P8192_N16_R1024_D96", [(8192, [1024] * 16)], hq=32, hkv=8,
               d=96, set_name="targets"),
        Config("P8192_N16_R1024_D256", [(8192, [1024] * 16)], hq=16, hkv=8,
               d=256, set_name="targets"),
        Config("P8192_N16_R1024_D192V128", [(8192, [1024] * 16)], hq=32,
               hkv=32, d=192, dv=128, set_name="targets"),
        # Gemma 4's global layers: head_dim 512 at 16:8 and 8:4 heads.
        Config("P8192_N16_R1024_D512", [(8192, [1024] * 16)], hq=16, hkv=8,
               d=512, set_name="targets"),
        Config("P8192_N16_R1024_D512_Hq8", [(8192, [1024] * 16)], hq=8,
               hkv=4, d=512, set_name="targets"),
    ]
    rng = random.Random(GROUPS_SEED)
    configs.append(Config(
        "G4_P2048_N8_Rvar",
        [(2048, [rng.randint(64, 4096) for _ in range(8)]) for _ in range(4)],
        set_name="targets", seed=GROUPS_SEED))
    return configs


def causal_configs():
    """Plain causal attention at equal work (the set "causal", not part of
    "all"): prompt-only groups, which the replicated peers run as one causal
    sequence each, so cuDNN and FA2 run plain causal attention on exactly the
    pairs DualKV computes. L = 16384 at head_dim 64, 96, 128 and 256 (Hq 32, Hkv
    8), at MLA's head_dim 192 with value head_dim 128 (Hq 32, Hkv 32) and at
    head_dim 512 (Hq 16, Hkv 8), and
    two sequences of 8192 at head_dim 128."""
    configs = [Config(f"causal_L16384_D{d}", [(16384, [])], hq=32, hkv=8, d=d,
                      set_name="causal") for d in (64, 96, 128, 256)]
    configs.append(Config("causal_L16384_D192V128", [(16384, [])], hq=32,
                          hkv=32, d=192, dv=128, set_name="causal"))
    configs.append(Config("causal_L16384_D512", [(16384, [])], hq=16, hkv=8,
                          d=512, set_name="causal"))
    configs.append(Config("causal_2x8192_D128", [(8192, [])] * 2, hq=32,
                          hkv=8, d=128, set_name="causal"))
    return configs


def model_configs():
    """Shapes of the models the variants serve that no other set has (the
    set "models", not part of "all"): gpt-oss (Hq 64, Hkv 8, head_dim 64:
    sinks, 128-token windows) at P=8192, N=16, R=1024. Gemma 3's sliding
    layers are P8192_N16_R1024_D256's shape (Hq 16, Hkv 8, head_dim 256)."""
    return [Config("P8192_N16_R1024_gptoss", [(8192, [1024] * 16)], hq=64,
                   hkv=8, d=64, set_name="models")]


CONFIG_SETS = ("standard", "targets", "causal", "models", "all")
# --quick: a smoke run of each set (the new ones cover several groups per
# launch, per-config heads and head_dim 256).
QUICK_CONFIGS = ("P4096_N16_R1024", "P16384_N16_R1024",
                 "P8192_N16_R1024_D256", "G4_P2048_N8_Rvar")


def all_configs():
    """Every config, the standard ones first, then the targets, then plain
    causal attention and the models' shapes (which --set all leaves out)."""
    return (standard_configs() + target_configs() + causal_configs()
            + model_configs())


def select_configs(set_name="all", quick=False, names=None):
    """The configs to run, in all_configs() order: those named (any set),
    else those of the set (the quick ones only with quick). Raises
    ValueError on an unknown name."""
    configs = all_configs()
    if names:
        unknown = set(names) - {c.name for c in configs}
        if unknown:
            raise ValueError("unknown config(s): "
                             + ", ".join(sorted(unknown)))
        return [c for c in configs if c.name in names]
    configs = [c for c in configs if set_name == c.set_name
               or (set_name == "all"
                   and c.set_name not in ("causal", "models"))]
    if quick:
        configs = [c for c in configs if c.name in QUICK_CONFIGS]
    return configs


class Case:
    """One config's inputs, shared by every method (packed THD layout: q
    [T, Hq, D], k [T, Hkv, D], v [T, Hkv, DV], dO [T, Hq, DV]; DV = D but
    for MLA's 192/128), and DualKV's results for the spot checks."""

    def __init__(self, torch, config, dtype, with_grad, sinks=False):
        self.config = config
        self.name, self.groups = config.name, config.groups
        self.hq, self.hkv, self.d = config.hq, config.hkv, config.d
        self.dv = config.dv  # v's, o's and dO's head_dim
        self.T = config.T
        self.segments, self.seqs = config.segments, config.sequences
        self.with_grad = with_grad
        dev = "cuda"
        self.q = torch.randn(self.T, self.hq, self.d, device=dev, dtype=dtype)
        self.k = torch.randn(self.T, self.hkv, self.d, device=dev, dtype=dtype)
        self.v = torch.randn(self.T, self.hkv, self.dv, device=dev,
                             dtype=dtype)
        # dL/dO of the packed loss (every token's output counted once).
        self.dout = (torch.randn(self.T, self.hq, self.dv, device=dev,
                                 dtype=dtype) if with_grad else None)
        # --sinks: fp32 [Hq] sink logits (a learned parameter: every
        # method differentiates them with gradients on).
        self.sinks = (torch.randn(self.hq, device=dev, dtype=torch.float32)
                      if sinks else None)
        self.o_ref = None      # DualKV's output
        self.grads_ref = None  # DualKV's (dq, dk, dv[, dsinks])

    def input_bytes(self):
        ts = [self.q, self.k, self.v] + ([self.dout] if self.with_grad else [])
        return sum(t.numel() * t.element_size() for t in ts)

    def sequence_index(self, torch, s):
        """Packed token indices of replicated sequence s (of self.seqs):
        [prompt_g | resp_{g,n}]."""
        seq = self.seqs[s]
        dev = self.q.device
        return torch.cat([
            torch.arange(seq.prompt_start, seq.prompt_start + seq.P,
                         device=dev),
            torch.arange(seq.resp_start, seq.resp_start + seq.R, device=dev)])


def leaves(case):
    """q, k, v (and the sinks, with --sinks) as autograd leaves sharing the
    case's storage."""
    ts = (case.q, case.k, case.v) + ((case.sinks,) if case.sinks is not None
                                     else ())
    return tuple(t.detach().requires_grad_() for t in ts)


GRAD_NAMES = ("dq", "dk", "dv", "dsinks")


def rel_max_diff(x, ref):
    """max |x - ref| / max |ref| (fp32)."""
    ref = ref.float()
    return ((x.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
            ).item()


# ----------------------------------------------------------------- methods
# prepare(case, info) does the per-micro-batch work (plan, replication, block
# mask) and returns {"fwd": f, "fwd_bwd": g}: f() runs the forward and
# returns its output; g() runs forward and backward and returns
# (output, grads). A method with no backward for the config returns
# {"fwd": f, "fwd_bwd_unavailable": reason} instead (its forward is timed,
# its forward+backward reported "n/a"); one with nothing to run raises
# NotAvailable. check(case, out, grads, info) adds spot-check numbers.

class NotAvailable(Exception):
    """prepare(): the method has nothing to measure on this config (status
    "n/a: <reason>", not a failure)."""


class DualKV:
    """dualkv.attention (autograd) on the packed layout; falls back to
    dualkv.forward + dualkv.backward when the autograd function does not
    load. Where the library has no backward for the config (none of the
    shipped ones since the head_dim 256 backward), only the forward is
    timed. softcap (None: none): the logit softcap c of every call, forward
    and backward (softcap=c); window (None: none): the sliding window W
    (window=W); with --sinks the case's fp32 sinks (sinks=s, differentiated
    with the inputs)."""

    def __init__(self, torch, dualkv, name, deterministic, softcap=None,
                 window=None, score_mod=None):
        self.torch, self.dualkv = torch, dualkv
        self.name, self.deterministic = name, deterministic
        # --score-mod: the shipped modifier's text (examples/score_mods).
        self.score_mod = score_mod
        self.softcap = softcap
        self.window = window
        # softcap=... and window=... only when set: without them the calls
        # are exactly those of a run that predates the options.
        self.softcap_kw = {"softcap": softcap} if softcap else {}
        if window:
            self.softcap_kw["window"] = window

    def backward_refusal(self, case, plan):
        """None when the library has a backward for this config's shape,
        else its reason, asked without a GPU call:
        dualkv_backward_workspace_size checks the shape as the backward
        does. Probing through the binding's
        internals; if the probe itself is unavailable, None (the backward
        then speaks for itself)."""
        import ctypes
        dualkv = self.dualkv
        # v_head_dim only where it differs (0 = head_dim: the field's
        # default, so the equal-width probe is the one before DV).
        split = {"v_head_dim": case.dv} if case.dv != case.d else {}
        try:
            lib = dualkv._lib
            args = lib.BackwardArgs(
                plan=plan._handle, num_tokens=case.T, num_q_heads=case.hq,
                num_kv_heads=case.hkv, head_dim=case.d,
                deterministic=1 if self.deterministic else 0,
                **self.softcap_kw,  # softcap and window: the ctypes fields
                **split)
            nbytes = ctypes.c_int64(0)
            status = lib.lib().dualkv_backward_workspace_size(
                ctypes.byref(args), ctypes.byref(nbytes))
            dualkv._check(status)
        except ValueError as e:  # the library refuses this shape
            return str(e)
        except Exception:  # no probe (an older binding or library)
            return None
        return None

    def prepare(self, case, info):
        torch, dualkv = self.torch, self.dualkv
        plan = dualkv.Plan(case.groups)
        plan.upload()
        info["num_segments"] = plan.num_segments
        info["softcap"] = self.softcap
        info["window"] = self.window
        # {"softcap": c, "window": W} (those set), and the sinks with --sinks
        sc = dict(self.softcap_kw)
        if self.score_mod:
            path = (Path(__file__).resolve().parent.parent / "examples"
                    / "score_mods" / f"{self.score_mod}.mlir")
            sc["score_mod"] = dualkv.ScoreMod.from_file(
                str(path), score_mod_tensors(torch, self.score_mod, case.hq,
                                             case.q.device))
            info["score_mod"] = f"examples/score_mods/{self.score_mod}.mlir"
        if case.sinks is not None:
            info["sinks"] = "fp32 [Hq], sinks= (dsinks with the gradients)"
        if not case.with_grad:
            q, k, v = case.q, case.k, case.v
            if case.sinks is not None:
                sc["sinks"] = case.sinks
            return {"fwd": lambda: dualkv.forward(q, k, v, plan, **sc)[0]}
        refusal = self.backward_refusal(case, plan)
        if self.score_mod and self.deterministic:
            raise NotAvailable("the deterministic backward does not yet "
                               "support a score modifier")
        if refusal and self.deterministic:
            raise NotAvailable(f"no DualKV backward ({refusal}); the "
                               "deterministic mode changes only the backward")
        det = self.deterministic
        inputs = leaves(case)  # q, k, v[, sinks]
        q, k, v = inputs[:3]
        if case.sinks is not None:
            sc["sinks"] = inputs[3]
        try:
            attention = dualkv.attention
            info["api"] = "dualkv.attention (autograd)"

            def fwd():
                return attention(q, k, v, plan, deterministic=det, **sc)

            def fwd_bwd():
                o = attention(q, k, v, plan, deterministic=det, **sc)
                return o, torch.autograd.grad(o, inputs, case.dout)
        except Exception as e:  # an older binding, or torch without custom ops
            info["api"] = ("dualkv.forward + dualkv.backward (attention: "
                           f"{common.short_error(e)})")
            if "sinks" in sc:
                sc["sinks"] = case.sinks

            def fwd():
                return dualkv.forward(q.detach(), k.detach(), v.detach(),
                                      plan, **sc)[0]

            def fwd_bwd():
                o, lse = dualkv.forward(q.detach(), k.detach(), v.detach(),
                                        plan, **sc)
                # (dq, dk, dv), and dsinks with sinks
                return o, dualkv.backward(q.detach(), k.detach(), v.detach(),
                                          o, case.dout, lse, plan,
                                          deterministic=det, **sc)
        if refusal:
            # The forward of the training call (autograd on) is still timed.
            return {"fwd": fwd,
                    "fwd_bwd_unavailable": f"no DualKV backward ({refusal})"}
        return {"fwd": fwd, "fwd_bwd": fwd_bwd}

    def check(self, case, out, grads, info):
        torch = self.torch
        info["finite"] = bool(torch.isfinite(out).all().item()) and all(
            bool(torch.isfinite(g).all().item()) for g in grads or ())
        if not info["finite"]:
            print(f"  {self.name}: NaN/Inf in the output or the gradients",
                  flush=True)
        if not self.deterministic:
            case.o_ref = out.detach()
            case.grads_ref = tuple(g.detach() for g in grads) if grads else None
        elif grads and case.grads_ref is not None:
            info["rel_diff_vs_dualkv"] = {
                n: rel_max_diff(g, r)
                for n, g, r in zip(GRAD_NAMES, grads, case.grads_ref)}
            # On sm_90a the default is the split-dQ algorithm too: equal.
            info["bitwise_equal_to_default"] = all(
                torch.equal(g, r) for g, r in zip(grads, case.grads_ref))


def refusal_text(error, caught):
    """Why a backend refused: the error's first line, then the warnings it
    gave on the way (torch's SDPA says there why its kernel does not
    apply; "No available kernel" alone would not)."""
    said = []
    for w in caught:
        text = " ".join(str(w.message).split())
        if text and text not in said:
            said.append(text)
    return (common.short_error(error)
            + (" (" + "; ".join(said) + ")" if said else ""))[:500]


def split_dims_refusal(torch, case, kv_heads, run, grad):
    """A value head_dim apart from head_dim (case.dv != case.d): runs run(q,
    k, v) once on small inputs of the case's head dims (q [1, Hq, 128, D],
    k [1, kv_heads, 128, D], v [1, kv_heads, 128, DV], the case's dtype) and,
    with gradients (case.with_grad), grad(o, (q, k, v), dO), on the GPU
    outside any timing. Returns None when both run, else (step, reason):
    step "fwd" (nothing runs) or "bwd" (the forward runs, not the backward),
    reason the backend's own words. A peer that refuses such shapes then
    shows n/a with the reason instead of a failure, and never another
    kernel under its label (run and grad pin the method's backend)."""
    import warnings
    dev, dtype, backward = case.q.device, case.q.dtype, case.with_grad

    def make(h, d):
        return torch.randn(1, h, 128, d, device=dev, dtype=dtype,
                           requires_grad=backward)

    q, k, v = make(case.hq, case.d), make(kv_heads, case.d), make(kv_heads,
                                                                  case.dv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            o = run(q, k, v)
            torch.cuda.synchronize()
        except Exception as e:
            return "fwd", refusal_text(e, caught)
        if not backward:
            return None
        del caught[:]
        try:
            grad(o, (q, k, v), torch.randn_like(o))
            torch.cuda.synchronize()
        except Exception as e:
            return "bwd", refusal_text(e, caught)
    return None


class Replicated:
    """SDPA on every group's N sequences [prompt_g | resp_{g,n}] (causal),
    K/V expanded to Hq heads. Every sequence of one (P, R): one batched call
    of all of them. Otherwise one call per sequence, all inside one timed
    region (padding would add work, and SDPA has no public varlen entry
    point). Backward: the replicated copies are the leaves; dO of copy n of
    group g is the packed dO of its tokens, with the prompt rows zeroed for
    n >= 1 (the packed loss counts each prompt output once), so the
    gradients sum to DualKV's. A value head_dim apart from head_dim (v and
    dO [.., DV]): split_dims_refusal asks the backend first, under the same
    sdpa_kernel(backend), so a backend that refuses such shapes is n/a with
    its reason (never another backend under this label)."""

    def __init__(self, torch, name, backend):
        self.torch, self.name, self.backend = torch, name, backend

    def prepare(self, case, info):
        torch = self.torch
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel
        rep = case.hq // case.hkv
        backend = self.backend
        bwd_refusal = None
        if case.dv != case.d:
            def sdpa(q, k, v):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v,
                                                          is_causal=True)

            def sdpa_grad(o, inputs, do):
                with sdpa_kernel(backend):
                    return torch.autograd.grad(o, inputs, do)

            refused = split_dims_refusal(torch, case, case.hq, sdpa,
                                         sdpa_grad)
            where = (f"head_dim {case.d} with value head_dim {case.dv} "
                     f"under sdpa_kernel({backend})")
            if refused and refused[0] == "fwd":
                raise NotAvailable(f"SDPA refuses {where}: {refused[1]}")
            if refused:
                bwd_refusal = (f"SDPA has no backward for {where}: "
                               f"{refused[1]}")

        def replicate(seq_ids):
            """Sequences seq_ids (of case.seqs, one length S) -> [B, Hq, S, D]
            views of BSHD copies (v [B, Hq, S, DV]) (and dO with the prompt rows of every copy
            n >= 1 of its group zeroed)."""
            idx = torch.stack([case.sequence_index(torch, s)
                               for s in seq_ids])  # [B, S]
            q = case.q[idx]
            k = case.k[idx].repeat_interleave(rep, dim=-2)
            v = case.v[idx].repeat_interleave(rep, dim=-2)
            qkv = [t.transpose(-3, -2) for t in (q, k, v)]
            if not case.with_grad:
                return qkv, None
            qkv = [t.detach().requires_grad_() for t in qkv]
            do = case.dout[idx]
            for b, s in enumerate(seq_ids):
                if case.seqs[s].n >= 1:
                    do[b, :case.seqs[s].P] = 0
            return qkv, do.transpose(-3, -2)

        dims = head_dims_text(case.d, case.dv)  # D, or D/DV (q, k / v)
        if len({(s.P, s.R) for s in case.seqs}) == 1:
            seqs = [replicate(range(len(case.seqs)))]  # one batch [B, ...]
            S = case.seqs[0].P + case.seqs[0].R
            info["layout"] = (f"batched [{len(case.seqs)}, {case.hq}, {S}, "
                              f"{dims}]")
        else:
            seqs = [replicate([s]) for s in range(len(case.seqs))]
            info["layout"] = (f"{len(case.seqs)} calls of [1, {case.hq}, "
                              f"S_n, {dims}]")

        def fwd():
            with sdpa_kernel(backend):
                return [F.scaled_dot_product_attention(*qkv, is_causal=True)
                        for qkv, _ in seqs]

        def fwd_bwd():
            outs = fwd()
            with sdpa_kernel(backend):
                grads = torch.autograd.grad(
                    outs, [t for qkv, _ in seqs for t in qkv],
                    [do for _, do in seqs])
            return outs, grads

        if bwd_refusal:
            return {"fwd": fwd, "fwd_bwd_unavailable": bwd_refusal}
        return {"fwd": fwd, "fwd_bwd": fwd_bwd}

    def check(self, case, out, grads, info):
        """out/grads per call: [B, Hq, S, D] (o and dv [.., DV]), the calls'
        rows in case.seqs order (one batch of all, or one call each)."""
        torch = self.torch
        if case.o_ref is None:
            return
        per_seq = []  # (o, dq, dk, dv) of sequence s as [Hq, S, D|DV]
        for c, o in enumerate(out):
            for b in range(o.shape[0]):
                g = (tuple(x[b] for x in grads[3 * c:3 * c + 3])
                     if grads else (None,) * 3)
                per_seq.append((o[b],) + g)
        assert len(per_seq) == len(case.seqs)
        worst = 0.0
        for s, (o, _, _, _) in enumerate(per_seq):
            ref = case.o_ref[case.sequence_index(torch, s)]
            worst = max(worst, (o.transpose(0, 1).float() - ref.float())
                        .abs().max().item())
        info["max_abs_diff_vs_dualkv"] = worst
        if not grads or case.grads_ref is None:
            return
        dq_ref, dk_ref, dv_ref = case.grads_ref
        hq, hkv = case.hq, case.hkv
        diffs = {"dq": 0.0, "dk": 0.0, "dv": 0.0}
        prompt_sums = {}  # group -> (prompt_start, P, sum dk, sum dv) fp32
        for s, (_, dq, dk, dv) in enumerate(per_seq):
            seq = case.seqs[s]
            P = seq.P
            idx = case.sequence_index(torch, s)
            dq = dq.transpose(0, 1)  # [S, Hq, D]
            # dK of K expanded to Hq heads, summed back over each GQA group
            dk, dv = (x.float().unflatten(0, (hkv, hq // hkv)).sum(1)
                      .transpose(0, 1) for x in (dk, dv))  # [S, Hkv, D|DV]
            # the prompt's dq from copy 0 of its group only (dO zeroed in
            # the others)
            rows = slice(0, None) if seq.n == 0 else slice(P, None)
            diffs["dq"] = max(diffs["dq"], (dq[rows].float() - dq_ref[idx[rows]]
                                            .float()).abs().max().item())
            for name, g, ref in (("dk", dk, dk_ref), ("dv", dv, dv_ref)):
                if g.shape[0] > P:
                    diffs[name] = max(diffs[name], (g[P:] - ref[idx[P:]]
                                                    .float()).abs().max().item())
            if seq.group not in prompt_sums:
                prompt_sums[seq.group] = (seq.prompt_start, P,
                                          torch.zeros_like(dk[:P]),
                                          torch.zeros_like(dv[:P]))
            prompt_sums[seq.group][2].add_(dk[:P])
            prompt_sums[seq.group][3].add_(dv[:P])
        # the prompt's dK/dV: the sum over its group's copies
        for start, P, pdk, pdv in prompt_sums.values():
            rows = slice(start, start + P)
            diffs["dk"] = max(diffs["dk"], (pdk - dk_ref[rows].float())
                              .abs().max().item())
            diffs["dv"] = max(diffs["dv"], (pdv - dv_ref[rows].float())
                              .abs().max().item())
        info["rel_diff_vs_dualkv"] = {
            n: diffs[n] / r.float().abs().max().clamp_min(1e-30).item()
            for n, r in (("dq", dq_ref), ("dk", dk_ref), ("dv", dv_ref))}


class Flex:
    """torch.compile(flex_attention, dynamic=...) on the packed sequence as
    contiguous [1, H, T, D] tensors (copied once from the packed [T, H, D]
    inputs in prepare(), outside the timing: transposed views are slower, and
    a model that runs Flex keeps this layout), with a block mask whose
    mask_mod is allowed(i, j) of docs/architecture.md §1, read from per-token
    group-id, segment-id and is-prompt tensors; GQA on. dynamic=False: a kernel
    specialised per shape (the headline peer); dynamic=True: one compile for
    every shape (what an RL loop with changing shapes runs). softcap c (None:
    none): score_mod c * tanh(score / c) (softcap_score_mod), the same block
    mask; one score_mod function for the run, shared by both columns and
    passed to every call like the block mask (a keyword argument of the
    compiled flex_attention). window W (None: none): the mask_mod also asks
    lpos[q_idx] - lpos[kv_idx] < W, lpos per token from the packing. With
    --sinks, sinks_form "lse" compiles flex_attention(return_lse=True) and
    the rescaling o * sigmoid(lse - s) as one function (flex_with_sinks);
    "column" appends one zero key/value token every query sees, whose score
    the score_mod replaces by s_h (sink_column_score_mod). A value head_dim
    apart from head_dim: v [1, Hkv, T, DV] (and dO, o [1, Hq, T, DV]); an
    eager flex_attention on small inputs of those dims asks first
    (split_dims_refusal), so a torch whose Flex refuses them shows n/a with
    its reason."""

    _mask_builder = None  # torch.compile(create_block_mask), shared
    _score_mods = {}      # softcap -> its score_mod: one function per run

    def __init__(self, torch, name, dynamic, softcap=None, window=None,
                 sinks_form=None, score_mod=None):
        self.torch, self.name, self.dynamic = torch, name, dynamic
        self.score_mod_name = score_mod  # --score-mod: built in prepare()
        self.softcap = softcap
        self.window = window
        self.sinks_form = sinks_form  # None without --sinks
        self.score_mod = None
        if softcap:
            if softcap not in Flex._score_mods:
                Flex._score_mods[softcap] = softcap_score_mod(torch, softcap)
            self.score_mod = Flex._score_mods[softcap]
        from torch.nn.attention.flex_attention import (create_block_mask,
                                                       flex_attention)
        self.create_block_mask = create_block_mask
        self.flex_eager = flex_attention  # split_dims_refusal's probe
        if sinks_form == "lse":
            self.flex = torch.compile(flex_with_sinks(torch, flex_attention),
                                      dynamic=dynamic)
        else:
            self.flex = torch.compile(flex_attention, dynamic=dynamic)
        # One compiled mask builder for both Flex columns (the mask does not
        # depend on how flex_attention is compiled).
        if Flex._mask_builder is None:
            Flex._mask_builder = torch.compile(create_block_mask)
        self.build = Flex._mask_builder

    def prepare(self, case, info):
        torch = self.torch
        dev = case.q.device
        info["compile"] = (f"torch.compile(flex_attention, "
                           f"dynamic={self.dynamic})")
        info["softcap"] = self.softcap
        info["window"] = self.window
        sinks = case.sinks
        column = sinks is not None and self.sinks_form == "column"
        bwd_refusal = None
        if case.dv != case.d:
            flex_eager = self.flex_eager

            def probe(q, k, v):
                return flex_eager(q, k, v, enable_gqa=True)

            refused = split_dims_refusal(torch, case, case.hkv, probe,
                                         torch.autograd.grad)
            where = f"head_dim {case.d} with value head_dim {case.dv}"
            if refused and refused[0] == "fwd":
                raise NotAvailable(f"flex_attention refuses {where}: "
                                   f"{refused[1]}")
            if refused:
                bwd_refusal = (f"flex_attention has no backward for {where}: "
                               f"{refused[1]}")
        # The keyword arguments of every flex call: the block mask (built
        # below), GQA, and the softcap's score_mod where there is one (no
        # score_mod keyword without: the calls of a run without --softcap).
        kw = {"enable_gqa": True}
        if self.score_mod is not None:
            kw["score_mod"] = self.score_mod
            info["score_mod"] = (f"{self.softcap:g} * torch.tanh(score / "
                                 f"{self.softcap:g})")
        # Per-token ids, from the segments in packed order: segment ids
        # unique over the batch; group ids and is-prompt per segment; lpos,
        # the position in the token's own sequence [prompt | response].
        lengths = torch.tensor([sg.length for sg in case.segments],
                               device=dev)

        def per_token(values):
            return torch.repeat_interleave(
                torch.tensor(values, device=dev, dtype=torch.int32), lengths)

        seg_id = per_token(list(range(len(case.segments))))
        group_id = per_token([sg.group for sg in case.segments])
        is_prompt = per_token([int(sg.is_prompt) for sg in case.segments]) != 0
        # lpos = (index in the segment) + (the prompt's length for a response)
        seg_start = per_token([sg.start for sg in case.segments])
        prompt_len = per_token([0 if sg.is_prompt else case.groups[sg.group][0]
                                for sg in case.segments])
        lpos = (torch.arange(case.T, device=dev, dtype=torch.int32)
                - seg_start + prompt_len)
        if self.score_mod_name:
            kw["score_mod"] = flex_score_mod(
                torch, self.score_mod_name,
                score_mod_tensors(torch, self.score_mod_name, case.hq, dev),
                lpos)
            info["score_mod"] = (f"{self.score_mod_name} (flex_score_mod: "
                                 "lpos of the packed q_idx, kv_idx)")
        KV = case.T
        if column:
            # One more key/value token, index T, that every query sees (the
            # sink); the per-token tables get an entry for it.
            KV = case.T + 1
            pad = lambda t, x: torch.cat([t, t.new_full((1,), x)])  # noqa
            seg_id, group_id = pad(seg_id, -1), pad(group_id, -1)
            is_prompt, lpos = pad(is_prompt, False), pad(lpos, 0)
        window = self.window

        def allowed(b, h, q_idx, kv_idx):
            same_group = group_id[q_idx] == group_id[kv_idx]
            causal = kv_idx <= q_idx
            visible = is_prompt[kv_idx] | (seg_id[q_idx] == seg_id[kv_idx])
            return same_group & causal & visible

        mask_mod = allowed
        if window:
            info["mask_mod"] = "allowed(i, j) & (lpos[i] - lpos[j] < W)"

            def windowed(b, h, q_idx, kv_idx):
                near = lpos[q_idx] - lpos[kv_idx] < window
                return allowed(b, h, q_idx, kv_idx) & near

            mask_mod = windowed
        if column:
            inner, T = mask_mod, case.T

            def with_sink(b, h, q_idx, kv_idx):
                return (kv_idx == T) | inner(b, h, q_idx, kv_idx)

            mask_mod = with_sink
            info["sinks_form"] = ("column: one zero key/value token at index "
                                  "T every query sees, score_mod puts s_h "
                                  "in its score")
        elif sinks is not None:
            info["sinks_form"] = ("lse: flex_attention(return_lse=True), then "
                                  "o * sigmoid(lse - s), compiled together")

        def build():
            return self.build(mask_mod, None, None, case.T, KV, device=dev)

        # The block mask: built here, once per config, never in the timing.
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            block_mask = build()
            info["block_mask_builder"] = "torch.compile(create_block_mask)"
        except Exception as e:  # fall back to the eager builder
            info["block_mask_compile_error"] = common.short_error(e)
            build = lambda: self.create_block_mask(  # noqa: E731
                mask_mod, None, None, case.T, KV, device=dev)
            t0 = time.perf_counter()
            block_mask = build()
            info["block_mask_builder"] = "create_block_mask (eager)"
        torch.cuda.synchronize()
        info["block_mask_first_ms"] = (time.perf_counter() - t0) * 1e3
        steady = []
        for _ in range(3):
            t0 = time.perf_counter()
            block_mask = build()
            torch.cuda.synchronize()
            steady.append((time.perf_counter() - t0) * 1e3)
        info["block_mask_ms"] = sorted(steady)[1]
        try:
            info["block_mask_sparsity_pct"] = float(block_mask.sparsity())
        except Exception:
            pass

        # [T, H, D] -> contiguous [1, H, T, D] copies (v and dO [.., DV]),
        # made once here: the timed calls see Flex's own layout and no
        # transposes (forward or backward). The copies stand in for the
        # packed inputs in peak GiB (run_method counts the inputs once).
        def bhtd(t):
            return t.transpose(0, 1).unsqueeze(0).contiguous()

        ts = (case.q, case.k, case.v) + ((case.dout,) if case.with_grad
                                          else ())
        copies = [bhtd(t) for t in ts]
        if column:
            # K and V with the sink's zero token at index T, made here like
            # the copies (a model would write its projections into them).
            copies[1], copies[2] = (torch.cat([t, t.new_zeros(
                t.shape[:2] + (1, t.shape[3]))], dim=2) for t in copies[1:3])
            info["layout"] = ("contiguous [1, H, T, D] q, [1, H, T + 1, D] k "
                              "and v (the sink token last)")
        else:
            info["layout"] = "contiguous [1, H, T, D] copies"
        if case.dv != case.d:
            info["layout"] += f" (D {case.d}; v, o and dO: DV {case.dv})"
        info["input_copy_bytes"] = sum(t.numel() * t.element_size()
                                       for t in copies)
        flex = self.flex
        kw["block_mask"] = block_mask
        if not case.with_grad:
            qf, kf, vf = copies[:3]
            if sinks is not None and not column:
                return {"fwd": lambda: flex(qf, kf, vf, sinks, **kw)}
            if column:
                kw["score_mod"] = sink_column_score_mod(
                    torch, self.score_mod, case.T, sinks)
            return {"fwd": lambda: flex(qf, kf, vf, **kw)}
        # The contiguous copies are the autograd leaves: the backward's
        # gradients come out in [1, H, T, D], with no transpose to undo.
        q, k, v = (t.requires_grad_() for t in copies[:3])
        dout = copies[3]
        inputs = (q, k, v)
        if sinks is not None:
            s = sinks.detach().clone().requires_grad_()
            inputs = (q, k, v, s)
            if column:
                kw["score_mod"] = sink_column_score_mod(
                    torch, self.score_mod, case.T, s)

        def fwd():
            if sinks is not None and not column:
                return flex(q, k, v, s, **kw)
            return flex(q, k, v, **kw)

        def fwd_bwd():
            o = fwd()
            return o, torch.autograd.grad(o, inputs, dout)

        if bwd_refusal:
            return {"fwd": fwd, "fwd_bwd_unavailable": bwd_refusal}
        return {"fwd": fwd, "fwd_bwd": fwd_bwd}

    def check(self, case, out, grads, info):
        """out, grads: [1, H, T, D] (o and dv [.., DV]); compared in DualKV's [T, H, D] (the
        transposes are here, outside the timing)."""
        if case.o_ref is None:
            return
        o = out[0].transpose(0, 1)  # [T, Hq, D]
        info["max_abs_diff_vs_dualkv"] = (
            (o.float() - case.o_ref.float()).abs().max().item())
        if grads and case.grads_ref is not None:
            # [1, H, T(+1), D] -> [T, H, D] (the sink column's token cut);
            # dsinks [Hq] as it is.
            def thd(g):
                if g.dim() == 1:
                    return g
                return g[0, :, :case.T].transpose(0, 1)

            info["rel_diff_vs_dualkv"] = {
                n: rel_max_diff(thd(g), r)
                for n, g, r in zip(GRAD_NAMES, grads, case.grads_ref)}


# ------------------------------------------------------------------ driver

def run_method(torch, method, case, warmup, reps, spot_checks):
    """Prepares, runs once (peak memory, spot check), then times the forward
    and, with gradients, forward+backward (where the method has a backward
    for the config: else fwd_bwd_status says "n/a: <reason>" and the first
    call and peak memory are the forward's)."""
    info = {"status": "ok"}
    run = out = grads = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        t0 = time.perf_counter()
        run = method.prepare(case, info)
        torch.cuda.synchronize()
        info["prepare_ms"] = (time.perf_counter() - t0) * 1e3
        step = "fwd_bwd" if case.with_grad and "fwd_bwd" in run else "fwd"
        if case.with_grad and step == "fwd":
            info["fwd_bwd_status"] = "n/a: " + run.get(
                "fwd_bwd_unavailable", "no backward")
            print(f"  {method.name}: fwd+bwd {info['fwd_bwd_status']}",
                  flush=True)
        t0 = time.perf_counter()
        result = run[step]()
        torch.cuda.synchronize()
        info["first_call_ms"] = (time.perf_counter() - t0) * 1e3
        # Everything the method allocated for one step, plus the shared
        # packed inputs it reads (q, k, v and, with gradients, dO). A method
        # that runs on its own copies of the inputs (Flex's contiguous
        # [1, H, T, D]) has them in the first term already: counted once.
        info["peak_gib"] = (torch.cuda.max_memory_allocated() - base
                            + case.input_bytes()
                            - info.get("input_copy_bytes", 0)) / 2**30
        if step != ("fwd_bwd" if case.with_grad else "fwd"):
            info["peak_gib_of"] = step
        out, grads = result if step == "fwd_bwd" else (result, None)
        result = None
        if spot_checks:
            try:
                method.check(case, out, grads, info)
            except Exception as e:  # a check must not lose the timing
                info["spot_check_error"] = common.short_error(e)
        out = grads = None
        if step == "fwd_bwd":
            info["fwd_bwd"] = common.time_cuda(torch, run["fwd_bwd"], warmup,
                                               reps)
        info["fwd"] = common.time_cuda(torch, run["fwd"], warmup, reps)
    except NotAvailable as e:
        info = {"status": "n/a: " + str(e), **{
            k: v for k, v in info.items() if k != "status"}}
        print(f"  {method.name}: {info['status']}", flush=True)
    except Exception as e:
        info = {"status": "failed: " + common.short_error(e), **{
            k: v for k, v in info.items() if k != "status"}}
        print(f"  {method.name}: {info['status']}", flush=True)
    finally:
        run = out = grads = result = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return info


def fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else "—"


def ms_of(info, step):
    return info.get(step, {}).get("median_ms")


def speedup_cell(info, key, with_grad):
    """"fwd / fwd+bwd" (or "fwd") of info[key] (peer time / method time)."""
    vs = info.get(key, {})
    cell = fmt(vs.get("fwd"), ".2f")
    return cell + (" / " + fmt(vs.get("fwd_bwd"), ".2f") if with_grad else "")


def table_rows(results, methods, with_grad, width):
    rows = []
    for r in results:
        for m in methods:
            info = r["methods"].get(m)
            if info is None:
                continue
            if info["status"] != "ok":
                rows.append([r["name"], m, info["status"]]
                            + [""] * (width - 3))
                continue
            fwd = [fmt(ms_of(info, "fwd"), ".3f")]
            tflops = [fmt(info.get("fwd_tflops"), ".0f")]
            if with_grad:
                # "n/a": no backward for this config (fwd_bwd_status says why)
                na = "n/a" if "fwd_bwd_status" in info else None
                fwd.append(na or fmt(ms_of(info, "fwd_bwd"), ".3f"))
                tflops.append(na or fmt(info.get("fwd_bwd_tflops"), ".0f"))
            rows.append([r["name"], m] + fwd + tflops
                        + [fmt(info.get("peak_gib"), ".2f"),
                           speedup_cell(info, "speedup_vs_flex", with_grad),
                           speedup_cell(info, "speedup_vs_flex_dynamic",
                                        with_grad)])
    return rows


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    out = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths))]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths))
            for row in rows]
    return "\n".join(out)


def plot(results, path, with_grad):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pts = [r for r in results
           if r["G"] == 1 and (r["Hq"], r["Hkv"], r["D"]) == DEFAULT_HEADS
           and r.get("DV", r["D"]) == r["D"]
           and r["N"] == 16 and set(r["Rs"]) == {1024}]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    steps = (("fwd_bwd", "-", "fwd+bwd"), ("fwd", ":", "fwd")) if with_grad \
        else (("fwd", "-", "fwd"),)
    # The headline peer and the replicated ones (Flex dynamic=True is in the
    # tables, not here).
    for peer, marker in ((HEADLINE_PEER, "o"), ("FA2 replicated", "s"),
                         ("cuDNN replicated", "^")):
        for step, line, label in steps:
            xs, ys = [], []
            for r in pts:
                dk = r["methods"].get("DualKV", {})
                other = r["methods"].get(peer, {})
                if (dk.get("status") == "ok" and other.get("status") == "ok"
                        and ms_of(other, step) and ms_of(dk, step)):
                    xs.append(r["P"])
                    ys.append(ms_of(other, step) / ms_of(dk, step))
            if xs:
                ax.plot(xs, ys, marker + line, label=f"vs {peer}, {label}")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length P (one group, N = 16, R = 1024)")
    ax.set_ylabel("DualKV speedup (peer time / DualKV time)")
    ax.set_title("DualKV " + ("forward+backward" if with_grad else "forward")
                 + ", Qwen3-8B heads, bf16")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def select_methods(spec):
    """Methods named by --methods (comma-separated names, prefixes, or
    METHOD_ALIASES; case-insensitive), in METHODS order. Raises ValueError
    on a name that selects nothing."""
    chosen = set()
    for key in (k.strip() for k in spec.split(",")):
        if not key:
            continue
        hits = METHOD_ALIASES.get(key.lower()) or [
            m for m in METHODS if m.lower().startswith(key.lower())]
        if not hits:
            raise ValueError(f"--methods: {key!r} names no method")
        chosen.update(hits)
    return [m for m in METHODS if m in chosen]


def self_check():
    """--self-check: the pure-Python parts, no torch or GPU. Useful FLOPs:
    at DV = D exactly the former 4·D·Hq·pairs and 3.5x that (value and
    type) for every config; at 192/128 the formula computed here apart;
    the MLA configs' shapes and sets, their "192/128" cells and JSON "DV".
    Returns the number of failed checks (each printed)."""
    failures = []

    def check(ok, what):
        if not ok:
            failures.append(what)
            print("FAIL: " + what)

    configs = all_configs()
    for c in configs:
        for window in (None, 128):
            pairs = c.useful_pairs(window)
            if c.dv == c.d:
                old = 4 * c.d * c.hq * pairs  # the count before DV
                new, new_fb = c.useful_flops(window), c.useful_flops_fwd_bwd(
                    window)
                check(new == old and type(new) is type(old),
                      f"{c.name} window {window}: fwd {new!r} != {old!r}")
                old_fb = common.FWD_BWD_FACTOR * old
                check(new_fb == old_fb and type(new_fb) is type(old_fb),
                      f"{c.name} window {window}: fwd+bwd {new_fb!r} != "
                      f"{old_fb!r}")
                check(new_fb == 14 * c.d * c.hq * pairs,
                      f"{c.name}: fwd+bwd != 14·D·Hq·pairs")
    by_name = {c.name: c for c in configs}
    for name, set_name, groups in (
            ("P8192_N16_R1024_D192V128", "targets", [(8192, [1024] * 16)]),
            ("causal_L16384_D192V128", "causal", [(16384, [])])):
        c = by_name.get(name)
        check(c is not None, f"{name} missing")
        if c is None:
            continue
        check((c.hq, c.hkv, c.d, c.dv, c.set_name, c.groups)
              == (32, 32, 192, 128, set_name, groups), f"{name}'s shape")
        check(name in [x.name for x in select_configs(set_name)],
              f"{name} not in --set {set_name}")
        pairs = c.useful_pairs()
        # Forward Q·Kᵀ (2·192) and P·V (2·128); backward S again (2·192),
        # dP = dO·Vᵀ (2·128), dV = Pᵀ·dO (2·128), dK = dSᵀ·Q (2·192),
        # dQ = dS·K (2·192); per pair and query head.
        fwd = (2 * 192 + 2 * 128) * 32 * pairs
        bwd = (2 * 192 + 2 * 128 + 2 * 128 + 2 * 192 + 2 * 192) * 32 * pairs
        check(c.useful_flops() == fwd, f"{name}: fwd {c.useful_flops()} "
              f"!= {fwd}")
        check(c.useful_flops_fwd_bwd() == fwd + bwd,
              f"{name}: fwd+bwd {c.useful_flops_fwd_bwd()} != {fwd + bwd}")
        rec = result_record(c)
        check(rec["D"] == 192 and rec["DV"] == 128, f"{name}: JSON D/DV")
        check(rec["useful_flops_fwd_bwd"] == fwd + bwd,
              f"{name}: JSON fwd+bwd FLOPs")
        check(heads_cell(rec) == "32:32 / 192/128",
              f"{name}: cell {heads_cell(rec)!r}")
    check([c.name for c in select_configs("all")] == [
        c.name for c in configs if c.set_name in ("standard", "targets")],
        "--set all is standard + targets")
    rec = result_record(by_name["P8192_N16_R1024_D96"])
    check(rec["DV"] == 96 and heads_cell(rec) == "32:8 / 96",
          "P8192_N16_R1024_D96's cell")
    check(heads_cell({"Hq": 32, "Hkv": 8, "D": 128}) == "32:8 / 128",
          "a result from before DV")
    print(f"self-check: {len(configs)} configs, "
          f"{'ok' if not failures else f'{len(failures)} failed'}")
    return len(failures)


def heads_dims(config):
    """"D 128", or "D 192, DV 128" where the value head_dim differs (the
    help's config lists)."""
    if config.dv == config.d:
        return f"D {config.d}"
    return f"D {config.d}, DV {config.dv}"


def parse_args(argv=None, defaults=None):
    epilog = (
        "Config sets (--set): standard = "
        + ", ".join(c.name for c in standard_configs())
        + " (Hq 32, Hkv 8, D 128, one group each); targets = "
        + ", ".join(f"{c.name} (Hq {c.hq}, Hkv {c.hkv}, {heads_dims(c)}, "
                    f"{c.G} group{'s' if c.G > 1 else ''})"
                    for c in target_configs())
        + "; causal = "
        + ", ".join(f"{c.name} (Hq {c.hq}, Hkv {c.hkv}, {heads_dims(c)})"
                    for c in causal_configs())
        + " (plain causal attention at equal work: prompt-only plans for "
        "DualKV and Flex, one causal sequence of each prompt for cuDNN and "
        "FA2, so the replicated columns are those kernels at their best)"
        + "; models = "
        + ", ".join(f"{c.name} (Hq {c.hq}, Hkv {c.hkv}, {heads_dims(c)})"
                    for c in model_configs())
        + " (gpt-oss's shape)"
        + ". DV: the value head_dim (v, o, dO) where it differs from D "
        "(MLA, DeepSeek-V3's 192/128); useful FLOPs 2·(D + DV)·Hq·pairs "
        "forward, (8·D + 6·DV)·Hq·pairs forward+backward (4·D and 14·D "
        "where DV = D)"
        + "; all = standard and targets, standard first (default). "
        "--configs takes any of "
        "these names, whatever --set says. --quick: "
        + ", ".join(QUICK_CONFIGS) + " (those of the chosen set). Where "
        "the library has no backward for a config, with --mode fwdbwd its "
        "DualKV forward is timed and its forward+backward reported n/a "
        "(DualKV det.: n/a). Methods: " + ", ".join(METHODS)
        + " (all by default; --methods takes names or prefixes, case-insensitive: DualKV selects both "
        f"DualKV rows, Flex both Flex columns; flex-static = {FLEX_STATIC}, "
        f"flex-dynamic = {FLEX_DYNAMIC}). Configs in "
        + ", ".join(sorted(DUALKV_ONLY))
        + " run DualKV alone unless --all-methods-everywhere. --softcap C: "
        "every logit s = scale * q.k becomes C * tanh(s / C) before the "
        "softmax (Gemma 2's attn_logit_softcapping), forward and backward: "
        "DualKV with softcap=C, both Flex columns with the score_mod C * "
        "tanh(score / C) and the same block mask; "
        + " and ".join(NO_SOFTCAP) + " (SDPA has no softcap) are skipped, "
        "with a line saying so; useful FLOPs as without it; the default "
        "--out gets a softcap<C> subfolder. --window W: DualKV with "
        "window=W, Flex with lpos[q] - lpos[kv] < W in its mask_mod, SDPA "
        "skipped, useful FLOPs those inside the window (subfolder "
        "window<W>). --sinks: DualKV with sinks=s, Flex per --flex-sinks "
        "(lse rescaling or a sink key column), SDPA skipped (subfolder "
        "sinks). Run time on an "
        "H200 (estimate; each run's report says its own): --set all about "
        "3-5 min with --mode fwd, 5-8 min with fwdbwd (each config compiles "
        "Flex once or twice, 5-9 s a compile); --set targets alone about "
        "1-2 min. Under a 10-minute cap, split fwdbwd into --set standard "
        "and --set targets with two --out folders; the report is rewritten "
        "after every config either way.")
    ap = argparse.ArgumentParser(
        description="\n\n".join(__doc__.split("\n\n")[:2]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.fill(epilog, 79, break_on_hyphens=False))
    ap.add_argument("--lib", help="path of libdualkv.so (else DUALKV_LIB or "
                    "the default lookup)")
    ap.add_argument("--out", help="output folder (default "
                    "benchmarks/results/<today>/<commit>)")
    ap.add_argument("--mode", choices=("fwdbwd", "fwd"), default="fwdbwd",
                    help="fwdbwd: forward and forward+backward (default); "
                    "fwd: forward only, no gradients (the former "
                    "bench_forward.py)")
    ap.add_argument("--set", choices=CONFIG_SETS, default="all",
                    dest="config_set",
                    help="which configs: standard (benchmarks/README.md's, Qwen3-8B "
                    "heads, one group each, and P=65536 for DualKV), targets "
                    "(head_dim 64, 96, 256 and 192 with value head_dim 128 "
                    "at P=8192 N=16 R=1024, 4 groups of P=2048 N=8 R "
                    "64..4096), causal (plain causal attention at equal "
                    "work, L=16384 at head_dim 64, 96, 128, 256 and 192/128, "
                    "and 2 x 8192 at 128), or all "
                    "(default: standard first, then targets; not causal)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: only " + ", ".join(QUICK_CONFIGS)
                    + " (those in --set), 5 timed runs, 2 warm-ups")
    ap.add_argument("--configs", help="comma-separated config names to run "
                    "(any set; overrides --set and --quick's choice)")
    ap.add_argument("--methods", help="comma-separated method names, "
                    "prefixes or aliases (default: all; e.g. DualKV,Flex "
                    "or DualKV,flex-static). The x-vs-Flex ratios need "
                    f"{FLEX_STATIC} (headline) and {FLEX_DYNAMIC} "
                    "(secondary) in the run")
    ap.add_argument("--reps", type=int, help="timed runs (default 10; 5 quick)")
    ap.add_argument("--warmup", type=int, help="untimed runs (default 3)")
    ap.add_argument("--all-methods-everywhere", action="store_true",
                    help="run the peers on the DualKV-only configs too")
    ap.add_argument("--no-spot-checks", action="store_true",
                    help="skip comparing the peers' outputs and gradients "
                    "with DualKV's")
    ap.add_argument("--softcap", type=softcap_arg, default=None, metavar="C",
                    help="logit softcap C > 0 (default: none): every logit "
                    "s = scale * q.k becomes C * tanh(s / C) before the "
                    "softmax, forward and backward (Gemma 2's "
                    "attn_logit_softcapping, 50.0 there). DualKV runs with "
                    "softcap=C, both Flex columns with score_mod C * "
                    "tanh(score / C) and the same block mask; FA2 and cuDNN "
                    "(SDPA: no softcap) are skipped. C is rounded to float32 "
                    "(DualKV's value). Default --out: "
                    "benchmarks/results/<today>/<commit>/softcap<C>")
    ap.add_argument("--window", type=window_arg, default=None, metavar="W",
                    help="sliding window W >= 1 (default: none): query i "
                    "sees key j only if lpos(i) - lpos(j) < W, lpos the "
                    "position in the token's own sequence [prompt | "
                    "response]. DualKV runs with window=W, both Flex columns "
                    "with that condition in the mask_mod (lpos per token "
                    "from the packing); FA2 and cuDNN (SDPA: no window) are "
                    "skipped; useful FLOPs count the pairs inside the window "
                    "only. Default --out: .../window<W>")
    ap.add_argument("--score-mod", choices=SCORE_MODS, default=None,
                    help="a shipped score modifier (examples/score_mods): "
                    "alibi (ALiBi slopes 2^(-8(h+1)/Hq)), softcap (50 "
                    "tanh(score / 50), as text: compare with --softcap 50), "
                    "relative_bias (a seeded [Hq][257] table). DualKV runs "
                    "the .mlir text (dualkv.ScoreMod.from_file), both Flex "
                    "columns the same function as a score_mod over the "
                    "logical positions lpos[q_idx], lpos[kv_idx]; FA2 and "
                    "cuDNN are skipped. Default --out: .../score_mod_<name>")
    ap.add_argument("--sinks", action="store_true",
                    help="attention sinks (gpt-oss): one fp32 logit per "
                    "query head in every row's softmax denominator, "
                    "differentiated like the inputs. DualKV runs with "
                    "sinks=s; Flex as --flex-sinks says; FA2 and cuDNN are "
                    "skipped. Default --out: .../sinks")
    ap.add_argument("--flex-sinks", choices=FLEX_SINK_FORMS,
                    default=FLEX_SINK_FORMS[0],
                    help="how Flex runs --sinks: lse (default): "
                    "flex_attention(return_lse=True) and o * sigmoid(lse - "
                    "s), compiled as one function; column: one zero "
                    "key/value token every query sees, its score set to s_h "
                    "by a score_mod")
    ap.add_argument("--self-check", action="store_true",
                    help="check the pure-Python parts (useful FLOPs with "
                    "and without a value head_dim, the configs) without "
                    "torch or a GPU, then exit (1 on a failure)")
    if defaults:
        ap.set_defaults(**defaults)
    args = ap.parse_args(argv)
    try:
        args.config_list = select_configs(
            args.config_set, args.quick,
            [c.strip() for c in args.configs.split(",") if c.strip()]
            if args.configs else None)
    except ValueError as e:
        ap.error(str(e))
    if args.methods:
        try:
            select_methods(args.methods)
        except ValueError as e:
            ap.error(str(e))
    return args


def result_record(config, softcap=None, window=None, sinks=False):
    """The JSON record of one config, before its methods run (softcap: the
    run's --softcap, None for none; the FLOPs do not depend on it; window:
    --window, None for none: the useful pairs and FLOPs are those inside it;
    sinks: --sinks). "DV": the value head_dim (= "D" but for MLA's
    192/128); the FLOPs are Config.useful_flops and
    Config.useful_flops_fwd_bwd."""
    flops = config.useful_flops(window)
    res = {"name": config.name, "set": config.set_name, "G": config.G,
           "groups": [[P, Rs] for P, Rs in config.groups],
           "softcap": softcap, "window": window, "sinks": bool(sinks)}
    if config.G == 1:  # P, N, Rs: one group only
        P, Rs = config.groups[0]
        res.update(P=P, N=len(Rs), Rs=Rs)
    if config.seed is not None:
        res["seed"] = config.seed
    res.update({"Hq": config.hq, "Hkv": config.hkv, "D": config.d,
                "DV": config.dv,
                "T": config.T, "useful_pairs": config.useful_pairs(window),
                "replicated_pairs": config.replicated_pairs(),
                "useful_flops": flops,
                "useful_flops_fwd_bwd": config.useful_flops_fwd_bwd(window),
                "methods": {}})
    return res


def heads_cell(r):
    """"Hq:Hkv / D" of a result ("32:32 / 192/128" where the value head_dim
    DV differs; results without "DV" predate it: DV = D)."""
    return f"{r['Hq']}:{r['Hkv']} / {head_dims_text(r['D'], r.get('DV'))}"


def build_tables(results, order, with_grad):
    """(header, rows, detail_header, detail_rows, notes) of the results."""
    # The headline ratio, against Flex (dynamic=False), then the secondary
    # one, against Flex (dynamic=True).
    if with_grad:
        header = ["config", "method", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s",
                  "fwd+bwd TFLOP/s", "peak GiB",
                  "× vs Flex dynamic=False (fwd / fwd+bwd)",
                  "× vs Flex dynamic=True (fwd / fwd+bwd)"]
    else:
        header = ["config", "method", "ms", "useful TFLOP/s", "peak GiB",
                  "× vs Flex dynamic=False", "× vs Flex dynamic=True"]
    rows = table_rows(results, order, with_grad, len(header))
    # fwd+bwd cells that say n/a, and why.
    notes = [f"{r['name']}, {m}: fwd+bwd {info['fwd_bwd_status']} (its fwd "
             "ms is the forward of the training call; its peak GiB, the "
             "forward's)"
             for r in results for m in order
             for info in [r["methods"].get(m, {})] if "fwd_bwd_status" in info]

    # Details: spot checks and Flex's per-shape costs.
    def grad_diffs(info):
        d = info.get("rel_diff_vs_dualkv")
        return " / ".join(fmt(d.get(n), ".2g") for n in GRAD_NAMES
                          if n in d) if d else "—"

    # Flex columns in the details: "dynamic=False / dynamic=True". The mask
    # is built the same way for both (one compiled builder): its times are
    # those of the first Flex column that ran.
    detail_header = ["config", "Hq:Hkv / D", "groups", "T", "useful pairs",
                     "replicated pairs",
                     "DualKV−Flex max abs Δ(O) (dyn. False / True)",
                     "DualKV−FA2 max abs Δ(O)",
                     "Flex mask build ms (first / steady)",
                     "Flex first call ms (dyn. False / True)",
                     "DualKV first call ms"]
    if with_grad:
        detail_header += ["rel Δ dq/dk/dv[/dsinks] vs DualKV: Flex dyn. "
                          "False",
                          "Flex dyn. True", "FA2", "cuDNN", "DualKV det."]
    detail_rows = []
    for r in results:
        m = r["methods"]
        fx, fy, fa, dk = (m.get(FLEX_STATIC, {}), m.get(FLEX_DYNAMIC, {}),
                          m.get("FA2 replicated", {}), m.get("DualKV", {}))
        mask = fx if "block_mask_ms" in fx else fy
        row = [
            r["name"], heads_cell(r), r["G"], r["T"], r["useful_pairs"],
            r["replicated_pairs"],
            f"{fmt(fx.get('max_abs_diff_vs_dualkv'), '.3g')} / "
            f"{fmt(fy.get('max_abs_diff_vs_dualkv'), '.3g')}",
            fmt(fa.get("max_abs_diff_vs_dualkv"), ".3g"),
            f"{fmt(mask.get('block_mask_first_ms'), '.1f')} / "
            f"{fmt(mask.get('block_mask_ms'), '.1f')}",
            f"{fmt(fx.get('first_call_ms'), '.0f')} / "
            f"{fmt(fy.get('first_call_ms'), '.0f')}",
            fmt(dk.get("first_call_ms"), ".0f")]
        if with_grad:
            det = m.get("DualKV det.", {})
            row += [grad_diffs(fx), grad_diffs(fy), grad_diffs(fa),
                    grad_diffs(m.get("cuDNN replicated", {})),
                    grad_diffs(det) + (" (bitwise equal)" if det.get(
                        "bitwise_equal_to_default") else "")]
        detail_rows.append(row)
    return header, rows, detail_header, detail_rows, notes


def drawn_lengths(results):
    """Markdown lines listing the drawn response lengths of each config."""
    lines = []
    for r in results:
        if "seed" not in r:
            continue
        if r["G"] == 1:
            lines.append(f"- {r['name']} (seed {r['seed']}): R_n = "
                         + ", ".join(str(x) for x in r["groups"][0][1]))
        else:
            lines.append(f"- {r['name']} (seed {r['seed']}): " + "; ".join(
                f"group {g}: P = {P}, R_n = " + ", ".join(str(x) for x in Rs)
                for g, (P, Rs) in enumerate(r["groups"])))
    return lines


def softcap_line(meta):
    """The report's "- logit softcap: ..." line."""
    softcap = meta.get("softcap")
    if not softcap:
        return "- logit softcap: none"
    # The methods skipped (SDPA's) are on skipped_line's line.
    return (f"- logit softcap: {softcap:g} (--softcap {softcap:g}): every "
            f"logit s = scale·q·k becomes {softcap:g}·tanh(s / {softcap:g}) "
            "before the softmax, forward and backward; DualKV with softcap="
            f"{softcap:g}, Flex with score_mod {softcap:g} * tanh(score / "
            f"{softcap:g}) and the same block mask; useful FLOPs as without "
            "it")


def window_line(meta):
    """The report's "- sliding window: ..." line."""
    window = meta.get("window")
    if not window:
        return "- sliding window: none"
    return (f"- sliding window: {window} (--window {window}): query i sees "
            f"key j only if lpos(i) − lpos(j) < {window}, lpos the position "
            "in the token's own sequence [prompt | response]; DualKV with "
            f"window={window}, Flex with that condition in its mask_mod "
            "(lpos per token from the packing); useful pairs and FLOPs are "
            "those inside the window")


def sinks_line(meta):
    """The report's "- attention sinks: ..." line."""
    if not meta.get("sinks"):
        return "- attention sinks: none"
    form = meta.get("flex_sinks")
    how = ("flex_attention(return_lse=True) and o·sigmoid(lse − s), "
           "compiled as one function" if form == "lse" else
           "one zero key/value token every query sees, its score set to s_h "
           "by a score_mod")
    return ("- attention sinks: one fp32 logit s_h per query head in every "
            "row's denominator (torch.randn), differentiated with the inputs "
            f"(dsinks); DualKV with sinks=s, Flex --flex-sinks {form}: {how}")


def skipped_line(meta):
    """The methods the variants skipped, and why, or None."""
    skipped = meta.get("methods_skipped", {})
    if not skipped:
        return None
    return "- skipped: " + "; ".join(f"{m} ({why})"
                                     for m, why in skipped.items())


def write_report(out_dir, stem, meta, env, results, order, with_grad,
                 elapsed, planned):
    """Writes DIR/<stem>.json and .md for the results so far (planned:
    configs in the run; fewer results: a partial report, rewritten after
    every config so that a run cut short keeps what it finished). Returns
    build_tables' tuple."""
    header, rows, detail_header, detail_rows, notes = build_tables(
        results, order, with_grad)
    partial = len(results) < planned
    data = {"environment": env, **meta, "partial": partial,
            "configs_done": len(results), "configs_planned": planned,
            "results": results}
    common.write_json(out_dir / f"{stem}.json", data)
    reps, warmup = meta["reps"], meta["warmup"]
    what = "forward and forward+backward" if with_grad else "forward"
    Hq, Hkv, D = DEFAULT_HEADS
    softcap = meta.get("softcap")
    window = meta.get("window")
    md = [
        f"# DualKV {what} vs. peers"
        + (f", logit softcap {softcap:g}" if softcap else "")
        + (f", sliding window {window}" if window else "")
        + (", attention sinks" if meta.get("sinks") else ""),
        "",
    ]
    if partial:
        md += [f"**Partial: {len(results)} of {planned} configs** (the run "
               "is going on, or was cut short).", ""]
    md += [
        common.env_markdown(env),
        f"- benchmark wall time: {elapsed:.0f} s"
        + (" (so far)" if partial else ""),
        f"- configs: {meta['config_selection']}",
        softcap_line(meta),
        window_line(meta),
        sinks_line(meta),
    ] + ([skipped_line(meta)] if skipped_line(meta) else []) + [
        "",
        f"Heads: Qwen3-8B's Hq={Hq}, Hkv={Hkv}, D={D} unless the details "
        "table's Hq:Hkv / D says otherwise (the _D64, _D96, _D256 and "
        "_D192V128 configs; D/DV: a value head_dim DV apart from D, MLA's "
        "192/128); "
        "bf16; one group per launch except G<k>_… (k groups back to back in "
        f"one launch); median of {reps} timed runs after "
        f"{warmup} warm-ups (CUDA events). Useful TFLOP/s = 4·D·Hq·useful "
        "pairs / time for the forward, 3.5× that for forward+backward, pairs "
        "summed over the groups (same numerator for every method); with a "
        "value head_dim DV apart from D, 2·(D + DV)·Hq·pairs forward (Q·Kᵀ, "
        "P·V) and (8·D + 6·DV)·Hq·pairs forward+backward (backward: S "
        "recomputed 2·D, dP 2·DV, dV 2·DV, dK 2·D, dQ 2·D). "
        "Replicated peers run every group's N sequences [prompt | response]. "
        "Peak GiB: torch.cuda.max_memory_allocated over the method's "
        "preparation and one " + ("forward+backward" if with_grad
                                  else "forward")
        + ", including the packed inputs (q, k, v" + (", dO" if with_grad
                                                       else "")
        + ") and everything the method allocated (replicated copies, block "
        "mask, outputs, gradients, workspace; Flex's contiguous copies of "
        "the inputs replace the packed ones, counted once). "
        "× vs Flex dynamic=False = Flex (dynamic=False) time / method time: "
        "the headline, FlexAttention at its fastest, torch.compile("
        "flex_attention, dynamic=False) on contiguous [1, H, T, D] tensors, "
        "a kernel specialised per shape, block mask built outside the "
        "timing. × vs Flex dynamic=True: the same against torch.compile("
        "dynamic=True), one compile for every shape: what an RL loop with "
        "changing shapes runs (secondary; its kernels are slower)." + (
            " fwd ms is the forward of the training call (autograd on), "
            "without the backward. DualKV det.: deterministic backward "
            "(the split-dQ algorithm: fixed-order reductions; on sm_90a "
            "also DualKV's default, elsewhere the default reduces with fp32 "
            "atomics); its forward is DualKV's. n/a: the method has no "
            "backward for the config." if with_grad else ""),
        "",
        markdown_table(header, rows),
        "",
    ]
    if notes:
        md += ["- " + n for n in notes] + [""]
    md += [
        "## Spot checks and per-shape costs",
        "",
        "Δ(O): max |O − O_DualKV| over every token. rel Δ: max |g − "
        "g_DualKV| / max |g_DualKV| for dq / dk / dv (replicated peers: "
        "each prompt's dK/dV summed over its group's copies and over each "
        "GQA group; bf16 gradients: expect about 1e-2 or less; no DualKV "
        "backward: no gradient check)." if with_grad else
        "Δ(O): max |O − O_DualKV| over every token (bf16: expect about 1e-2 "
        "or less).",
        "",
        markdown_table(detail_header, detail_rows),
        "",
    ]
    lengths = drawn_lengths(results)
    if lengths:
        md += ["Drawn response lengths (random.Random(seed).randint(64, "
               "4096)):", ""] + lengths + [""]
    (out_dir / f"{stem}.md").write_text("\n".join(md))
    return header, rows, detail_header, detail_rows, notes


def main(argv=None, defaults=None):
    args = parse_args(argv, defaults)
    if args.self_check:
        return 1 if self_check() else 0
    started = time.perf_counter()
    with_grad = args.mode == "fwdbwd"
    stem = "attention" if with_grad else "forward"

    dualkv = common.setup_dualkv(args.lib)
    import torch
    from torch.nn.attention import SDPBackend

    # Flex (dynamic=False) recompiles per shape, and both Flex columns'
    # compiles land on flex_attention's one code object; raise dynamo's
    # limits (never lower them) so that every config is measured on its
    # compiled kernel, not on the fallback after 8 shapes, which
    # materialises the full score matrix (the shape stream cost is
    # compile_cost.py's subject). Old and new names;
    # those this torch lacks are skipped.
    import torch._dynamo
    dynamo_limits = {}
    for knob, value in (("recompile_limit", 64), ("cache_size_limit", 64),
                        ("accumulated_recompile_limit", 1024),
                        ("accumulated_cache_size_limit", 1024)):
        if hasattr(torch._dynamo.config, knob):
            now = getattr(torch._dynamo.config, knob)
            setattr(torch._dynamo.config, knob, max(now, value))
            dynamo_limits[knob] = getattr(torch._dynamo.config, knob)

    softcap = args.softcap  # None: no softcap
    score_mod = args.score_mod  # None: no score modifier
    window = args.window    # None: no window
    sinks = args.sinks      # False: no sinks
    flex_sinks = args.flex_sinks if sinks else None
    # A variant run's default folder is a subfolder of the plain run's
    # (softcap<C>, window<W>, sinks, joined by "_"), so that the runs never
    # overwrite each other.
    tag = variant_tag(softcap, window, sinks, score_mod)
    out_dir = Path(args.out) if args.out else common.default_out(
        *([tag] if tag else []))
    out_dir.mkdir(parents=True, exist_ok=True)
    reps = args.reps or (5 if args.quick else 10)
    warmup = args.warmup or (2 if args.quick else 3)
    configs = args.config_list
    selection = (f"--configs {args.configs}" if args.configs else
                 f"--set {args.config_set}" + (" --quick" if args.quick
                                               else ""))

    torch.cuda.init()
    env = common.environment(torch, dualkv)
    print(f"# {env['gpu']}, torch {env['torch']}, dualkv {env['dualkv']} "
          f"({env['dualkv_lib']}), mode {args.mode}, logit softcap "
          + (f"{softcap:g}" if softcap else "none") + ", sliding window "
          + (f"{window}" if window else "none") + ", sinks "
          + (f"yes (Flex: {flex_sinks})" if sinks else "none")
          + "; x vs Flex = against "
          f"{HEADLINE_PEER} (headline), {FLEX_DYNAMIC} (secondary); dynamo "
          f"limits {dynamo_limits}", flush=True)
    print(f"# {selection}: {len(configs)} configs: "
          + ", ".join(c.name for c in configs), flush=True)

    builders = {
        "DualKV": lambda: DualKV(torch, dualkv, "DualKV", False, softcap,
                                 window, score_mod),
        "DualKV det.": lambda: DualKV(torch, dualkv, "DualKV det.", True,
                                      softcap, window, score_mod),
        FLEX_STATIC: lambda: Flex(torch, FLEX_STATIC, False, softcap, window,
                                  flex_sinks, score_mod),
        FLEX_DYNAMIC: lambda: Flex(torch, FLEX_DYNAMIC, True, softcap, window,
                                   flex_sinks, score_mod),
        "FA2 replicated": lambda: Replicated(torch, "FA2 replicated",
                                             SDPBackend.FLASH_ATTENTION),
        "cuDNN replicated": lambda: Replicated(torch, "cuDNN replicated",
                                               SDPBackend.CUDNN_ATTENTION),
        "ME replicated": lambda: Replicated(torch, "ME replicated",
                                            SDPBackend.EFFICIENT_ATTENTION),
    }
    order = select_methods(args.methods) if args.methods else list(METHODS)
    if not with_grad and "DualKV det." in order:
        order.remove("DualKV det.")  # it changes only the backward
    # SDPA (FA2, cuDNN) has no logit softcap: under --softcap those methods
    # would compute another function, so they do not run (one line says so,
    # and the report's softcap line and JSON's methods_skipped).
    # Likewise for --window and --sinks (SDPA has neither).
    methods_skipped = {}
    for on, flag, lacking, what in (
            (softcap, f"--softcap {softcap:g}" if softcap else "", NO_SOFTCAP,
             "SDPA has no logit softcap"),
            (window, f"--window {window}", NO_WINDOW,
             "SDPA has no sliding window"),
            (sinks, "--sinks", NO_SINKS, "SDPA has no attention sinks"),
            (score_mod, f"--score-mod {score_mod}", NO_SINKS,
             "SDPA has no score modifier")):
        if not on:
            continue
        gone = [m for m in lacking if m in order]
        for m in gone:
            order.remove(m)
            methods_skipped[m] = what
        if gone:
            print(f"# {flag}: skipping " + ", ".join(gone) + f" ({what})",
                  flush=True)
    methods, init_errors = {}, {}
    for m in order:
        try:
            methods[m] = builders[m]()
        except Exception as e:
            init_errors[m] = "failed: " + common.short_error(e)

    meta = {"mode": args.mode, "config_selection": selection,
            "configs": [c.name for c in configs], "dtype": "bf16",
            # per config: each result's Hq, Hkv, D (these are the default)
            "default_heads": dict(zip(("Hq", "Hkv", "D"), DEFAULT_HEADS)),
            "reps": reps, "warmup": warmup, "var_seed": VAR_SEED,
            "groups_seed": GROUPS_SEED, "headline_peer": HEADLINE_PEER,
            "speedup_keys": {"speedup_vs_flex": HEADLINE_PEER,
                             "speedup_vs_flex_dynamic": FLEX_DYNAMIC},
            "dynamo_limits": dynamo_limits,
            # None: no softcap; else every logit s became c * tanh(s / c)
            "softcap": softcap,
            # None: no window; else lpos(i) - lpos(j) < window
            "window": window,
            # with sinks, how Flex ran them (--flex-sinks)
            "sinks": bool(sinks), "flex_sinks": flex_sinks,
            "methods_skipped": methods_skipped}
    results = []
    for config in configs:
        name = config.name
        print(f"{name}: {config.describe()}  "
              f"[{time.perf_counter() - started:.0f} s]", flush=True)
        torch.manual_seed(0)
        case = Case(torch, config, torch.bfloat16, with_grad, sinks)
        flops = config.useful_flops(window)
        flops_fwd_bwd = config.useful_flops_fwd_bwd(window)
        res = result_record(config, softcap, window, sinks)
        for m in order:
            if m in init_errors:
                res["methods"][m] = {"status": init_errors[m]}
                continue
            if (name in DUALKV_ONLY and not m.startswith("DualKV")
                    and not args.all_methods_everywhere):
                res["methods"][m] = {
                    "status": "skipped: DualKV-only config (the replicated "
                    "peers would need minutes and ~100 GiB here)"}
                continue
            info = run_method(torch, methods[m], case, warmup, reps,
                              not args.no_spot_checks)
            if info["status"] == "ok":
                info["fwd_tflops"] = flops / (ms_of(info, "fwd") * 1e-3) / 1e12
                line = (f"  {m:20s} fwd {ms_of(info, 'fwd'):9.3f} ms "
                        f"{info['fwd_tflops']:5.0f} TFLOP/s")
                if with_grad and ms_of(info, "fwd_bwd"):
                    info["fwd_bwd_tflops"] = (flops_fwd_bwd
                                              / (ms_of(info, "fwd_bwd") * 1e-3)
                                              / 1e12)
                    line += (f" | fwd+bwd {ms_of(info, 'fwd_bwd'):9.3f} ms "
                             f"{info['fwd_bwd_tflops']:5.0f} TFLOP/s")
                elif with_grad:
                    line += " | fwd+bwd n/a"
                print(line + f" | peak {info['peak_gib']:.2f} GiB", flush=True)
            res["methods"][m] = info
        # speedup_vs_flex: the headline, against Flex (dynamic=False);
        # speedup_vs_flex_dynamic: against Flex (dynamic=True), secondary.
        for key, peer in (("speedup_vs_flex", HEADLINE_PEER),
                          ("speedup_vs_flex_dynamic", FLEX_DYNAMIC)):
            flex = res["methods"].get(peer, {})
            if flex.get("status") != "ok":
                continue
            for info in res["methods"].values():
                if info.get("status") == "ok":
                    info[key] = {s: ms_of(flex, s) / ms_of(info, s)
                                 for s in ("fwd", "fwd_bwd")
                                 if ms_of(info, s) and ms_of(flex, s)}
        results.append(res)
        del case
        gc.collect()
        torch.cuda.empty_cache()
        if len(results) < len(configs):
            # A report of what is done so far, rewritten after every config.
            try:
                write_report(out_dir, stem, meta, env, results, order,
                             with_grad, time.perf_counter() - started,
                             len(configs))
            except Exception as e:  # the final report will try again
                print(f"partial report not written: {common.short_error(e)}",
                      flush=True)

    # Clocks again, now that the GPU has been busy (the first read is often
    # taken at idle clocks).
    after = common.environment(torch, dualkv)
    for key in ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu"):
        if key in after:
            env[key + " (end of run)"] = after[key]
    elapsed = time.perf_counter() - started
    env["benchmark wall time (s)"] = round(elapsed, 1)
    header, rows, detail_header, detail_rows, notes = write_report(
        out_dir, stem, meta, env, results, order, with_grad, elapsed,
        len(configs))
    print()
    print(text_table(header, rows))
    for n in notes:
        print("  " + n)
    print()
    print(text_table(detail_header, detail_rows))

    png = out_dir / f"{stem}_speedup.png"
    try:
        plot(results, png, with_grad)
    except Exception as e:  # matplotlib missing, or nothing to plot
        png = None
        print(f"plot skipped: {common.short_error(e)}")
    print(f"\nwrote {out_dir}/{stem}.md, {stem}.json"
          + (f", {png.name}" if png else "") + f" in {elapsed:.0f} s")
    # n/a (no backward for a config) and skipped are not failures.
    failed = [(r["name"], m) for r in results for m, i in r["methods"].items()
              if m.startswith("DualKV") and i["status"].startswith("failed")]
    if failed:
        print("DualKV failed on: " + ", ".join(f"{c} ({m})"
                                               for c, m in failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
