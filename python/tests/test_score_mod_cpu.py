"""Score modifiers on the CPU (no GPU, no library): the tracer's MLIR text
checked independently, by an interpreter of that text written here (each op
evaluated in numpy float32/int32/bool semantics, line by line), against the
traced function itself called on real torch tensors; the shipped modifiers
(dualkv.score_mods); ScoreMod's constructors, resolve(), the trace cache,
the inputs per device and the C arguments; and the errors, each naming what
is at fault.

The function is called with int64 index tensors (what every torch indexes
with; the values are far from int32's limits, so i32 and int64 agree).
Arithmetic-only modifiers must match bit for bit; those with transcendental
functions within rtol 1e-6 (numpy's and torch's tanh/exp/log differ by an
ulp or so).
"""

import math
import os
import re
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":
    # Run as a script (ctest): skipped (77) without pytest, torch or numpy.
    import importlib.util
    missing = [m for m in ("pytest", "torch", "numpy")
               if importlib.util.find_spec(m) is None]
    if missing:
        print("skipped: needs " + ", ".join(missing))
        sys.exit(77)

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from dualkv import _lib, score_mods  # noqa: E402
from dualkv.score_mod import (  # noqa: E402
    CArguments, ScoreMod, clear_cache, from_op, resolve)

# A hand-written ALiBi, as a user would write the text (test_score_mod.py
# runs it on the GPU against the traced one).
HAND_ALIBI = """\
func.func @score_mod(%score: f32, %head: i32, %q_idx: i32, %kv_idx: i32,
                     %slopes: memref<?xf32>) -> f32 {
  %h = arith.index_cast %head : i32 to index
  %slope = memref.load %slopes[%h] : memref<?xf32>
  %d = arith.subi %kv_idx, %q_idx : i32
  %df = arith.sitofp %d : i32 to f32
  %bias = arith.mulf %slope, %df : f32
  %r = arith.addf %score, %bias : f32
  return %r : f32
}
"""


# ------------------------------------------------------------ interpreter

_HEADER = re.compile(r"func\.func\s+@score_mod\s*\(([^()]*)\)\s*->\s*f32\s*\{",
                     re.S)


def _constant(literal, type_):
    if literal in ("true", "false"):
        return np.bool_(literal == "true")
    if type_ == "f32":
        if literal.startswith("0x"):
            return np.array([int(literal, 16)], dtype=np.uint32).view(
                np.float32)[0]
        assert "." in literal, literal  # MLIR's float literals need one
        return np.float32(float(literal))
    if type_ == "i32":
        return np.int32(int(literal))
    raise AssertionError(f"constant of type {type_}")


def _trunc_div(a, b):
    a, b = a.astype(np.int64), b.astype(np.int64)
    q = np.trunc(a / b).astype(np.int64)  # exact for int32 operands
    return q, a - b * q


_FLOAT = {"addf": np.add, "subf": np.subtract, "mulf": np.multiply,
          "divf": np.divide, "maximumf": np.maximum, "minimumf": np.minimum}
_INT = {"addi": np.add, "subi": np.subtract, "muli": np.multiply,
        "andi": np.bitwise_and, "ori": np.bitwise_or,
        "xori": np.bitwise_xor}
_MATH = {"exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2,
         "tanh": np.tanh, "sqrt": np.sqrt, "sin": np.sin, "cos": np.cos,
         "absf": np.abs, "absi": np.abs,
         "rsqrt": lambda x: np.float32(1) / np.sqrt(x)}
_CMP = {"olt": np.less, "slt": np.less, "ole": np.less_equal,
        "sle": np.less_equal, "ogt": np.greater, "sgt": np.greater,
        "oge": np.greater_equal, "sge": np.greater_equal, "oeq": np.equal,
        "eq": np.equal, "une": np.not_equal, "ne": np.not_equal}


def interpret(text, score, head, q_idx, kv_idx, inputs=()):
    """Evaluates the text of a modifier on arrays (float32 score, int32
    indices) with numpy's float32/int32/bool semantics; returns float32."""
    header = _HEADER.search(text)
    assert header, text
    names = [a.split(":")[0].strip() for a in header.group(1).split(",")]
    types = [a.split(":")[1].strip() for a in header.group(1).split(",")]
    assert types[:4] == ["f32", "i32", "i32", "i32"], types
    env = dict(zip(names[:4], (np.asarray(score, np.float32),
                               np.asarray(head, np.int32),
                               np.asarray(q_idx, np.int32),
                               np.asarray(kv_idx, np.int32))))
    memrefs = names[4:]
    assert all(t == "memref<?xf32>" for t in types[4:])
    assert len(memrefs) == len(inputs)
    for name, t in zip(memrefs, inputs):
        env[name] = np.asarray(t.detach().float().reshape(-1).numpy())
    body = text[header.end():].strip().splitlines()
    assert body[-1].strip() == "}", body[-1]
    result = None
    with np.errstate(all="ignore"):
        for line in body[:-1]:
            line = line.strip()
            if not line:
                continue
            m = re.fullmatch(r"return (%[\w.$]+) : f32", line)
            if m:
                result = env[m.group(1)]
                break
            m = re.fullmatch(r"(%[\w.$]+) = (\w+)\.(\w+) (.*)", line)
            assert m, line
            out, dialect, op, rest = m.groups()
            env[out] = _evaluate(env, dialect, op, rest)
    assert result is not None, text
    return np.broadcast_to(result, np.broadcast(score, head).shape).astype(
        np.float32)


def _evaluate(env, dialect, op, rest):
    def get(name):
        return env[name.strip()]

    if dialect == "memref":
        m = re.fullmatch(r"(%[\w.$]+)\[(%[\w.$]+)\] : memref<\?xf32>", rest)
        assert op == "load" and m, rest
        return get(m.group(1))[get(m.group(2))]
    if op == "constant":
        m = re.fullmatch(r"(\S+?)(?: : (\w+))?", rest)
        return _constant(m.group(1), m.group(2))
    operands, _, type_ = rest.rpartition(" : ")
    args = [a.strip() for a in operands.split(",")]
    if op in ("cmpf", "cmpi"):
        return _CMP[args[0]](get(args[1]), get(args[2]))
    if op == "select":
        return np.where(get(args[0]), get(args[1]), get(args[2]))
    if op in ("sitofp", "fptosi", "index_cast"):
        source, target = [t.strip() for t in type_.split(" to ")]
        x = get(operands)
        return x.astype({"f32": np.float32, "i32": np.int32,
                         "index": np.int64}[target])
    if dialect == "math":
        if op == "powf":
            return np.power(get(args[0]), get(args[1])).astype(np.float32)
        return _MATH[op](get(args[0]))
    if op == "negf":
        return -get(args[0])
    if op in _FLOAT:
        return _FLOAT[op](get(args[0]), get(args[1]))
    if op in _INT:
        a, b = get(args[0]), get(args[1])
        return _INT[op](a, b).astype(a.dtype)
    if op in ("divsi", "remsi"):
        q, r = _trunc_div(get(args[0]), get(args[1]))
        return (q if op == "divsi" else r).astype(np.int32)
    raise AssertionError(f"unknown op {dialect}.{op}")


# ------------------------------------------------------------ helpers

N = 4096
HQ = 4


def samples(seed=0, span=600):
    """Random arguments: score float32 (some large), h in [0, HQ), q_idx,
    kv_idx in [0, span) (kv_idx may exceed q_idx: the modifier is applied
    before the mask)."""
    gen = np.random.default_rng(seed)
    score = (gen.standard_normal(N) * gen.choice([0.1, 3, 40], N)).astype(
        np.float32)
    score[:4] = [0.0, -0.0, 1e-30, -75.0]
    h = gen.integers(0, HQ, N).astype(np.int32)
    q = gen.integers(0, span, N).astype(np.int32)
    kv = gen.integers(0, span, N).astype(np.int32)
    kv[: N // 2] = np.minimum(kv[: N // 2], q[: N // 2])
    return score, h, q, kv


def call(fn, score, h, q, kv):
    """fn itself on torch tensors (int64 indices), as float32 numpy."""
    t = [torch.from_numpy(score)] + [torch.from_numpy(x.astype(np.int64))
                                      for x in (h, q, kv)]
    out = fn(t[0], torch.zeros(N, dtype=torch.int64), *t[1:])
    if not isinstance(out, torch.Tensor):
        out = torch.full((N,), float(out))
    return np.broadcast_to(out.to(torch.float32).numpy(), (N,))


def check(fn, exact, seed=0, span=600):
    """Traces fn, interprets its text, compares with fn's own values; returns
    the ScoreMod."""
    mod = ScoreMod.trace(fn)
    args = samples(seed, span)
    got = interpret(mod.text, *args, inputs=mod.inputs)
    want = call(fn, *args)
    if exact:
        np.testing.assert_array_equal(got, want, err_msg=mod.text)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6,
                                   err_msg=mod.text)
    return mod


# ------------------------------------------------------------ shipped mods

def test_alibi_matches_the_function_bit_for_bit():
    slopes = score_mods.alibi_slopes(HQ)
    mod = check(score_mods.alibi(slopes), exact=True)
    assert len(mod.inputs) == 1 and mod.inputs[0] is slopes
    assert mod.text.count("memref<?xf32>") == 2  # the argument and the load
    # The hand-written text computes the same.
    args = samples(1)
    np.testing.assert_array_equal(
        interpret(HAND_ALIBI, *args, inputs=[slopes]),
        interpret(mod.text, *args, inputs=mod.inputs))


def test_alibi_slopes():
    assert torch.allclose(score_mods.alibi_slopes(8),
                          torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    s = score_mods.alibi_slopes(12)   # 8 of 2^(-8/8), 4 of 2^(-8/16)
    assert s.shape == (12,) and s.dtype == torch.float32
    assert torch.allclose(s[8:], torch.tensor([2.0 ** -(0.5 + i)
                                               for i in range(4)]))


@pytest.mark.parametrize("c", [30.0, 1.5, 50])
def test_softcap(c):
    mod = check(score_mods.softcap(c), exact=False)
    assert "math.tanh" in mod.text and not mod.inputs


def test_relative_bias_clamps_the_distance():
    table = torch.randn(HQ, 2 * 16 + 1)
    mod = check(score_mods.relative_bias(table, 16), exact=True)
    assert mod.inputs[0] is table
    # Distances beyond 16 read the edge entries.
    got = interpret(mod.text, np.zeros(2, np.float32), np.array([1, 2]),
                    np.array([0, 500]), np.array([400, 0]), mod.inputs)
    np.testing.assert_array_equal(got, [table[1, 32].item(),
                                        table[2, 0].item()])


def test_shipped_mods_refuse_bad_arguments():
    with pytest.raises(ValueError, match="slopes must be a torch.Tensor"):
        score_mods.alibi([0.5, 0.25])
    with pytest.raises(ValueError, match="slopes is .* it must be a 1-D"):
        score_mods.alibi(torch.zeros(2, 2))
    for bad in (0, -1.0, float("inf"), "3", True):
        with pytest.raises(ValueError, match="softcap c"):
            score_mods.softcap(bad)
    with pytest.raises(ValueError, match=r"it must be \[Hq, 9\]"):
        score_mods.relative_bias(torch.zeros(4, 8), 4)
    with pytest.raises(ValueError, match="max_distance"):
        score_mods.relative_bias(torch.zeros(4, 9), -1)


# ------------------------------------------------------------ the tracer

SCALE = 2.0


def scaled(score, b, h, q_idx, kv_idx):
    return score * SCALE


TABLE = torch.randn(HQ, 1025)
TEMPERATURE = torch.tensor(0.7)
IDS = torch.randint(-100, 100, (HQ,))


@pytest.mark.parametrize("fn", [
    lambda s, b, h, q, kv: torch.where(q >= kv, s, -float("inf")),
    lambda s, b, h, q, kv: torch.where(q - kv < 64, s, s - 100.0),
    lambda s, b, h, q, kv: (q - kv) * 3 + h - 7,
    lambda s, b, h, q, kv: s * 0.1 + 1e-3,
    lambda s, b, h, q, kv: s * 2 - 1 / 3 + h,
    lambda s, b, h, q, kv: 2.5 - s / 7.0,
    lambda s, b, h, q, kv: s + (kv - q) / 3,
    lambda s, b, h, q, kv: s + (kv - q) // 7,
    lambda s, b, h, q, kv: s + (q - kv) // -3 + (kv - q) % 5,
    lambda s, b, h, q, kv: s + (kv - q) % -6,
    lambda s, b, h, q, kv: s + 100 // (h + 1) - 33 % (h - 2 * h - 1),
    lambda s, b, h, q, kv: s + torch.div(kv - q, 4, rounding_mode="floor"),
    lambda s, b, h, q, kv: s + torch.div(kv - q, 4, rounding_mode="trunc"),
    lambda s, b, h, q, kv: torch.clamp(s, -5.0, 5.0),
    lambda s, b, h, q, kv: torch.clamp(s, min=0) + s.clamp(max=-1.0),
    lambda s, b, h, q, kv: torch.minimum(s, (q - kv).float()),
    lambda s, b, h, q, kv: torch.maximum(s, q - kv) + torch.minimum(q, kv),
    lambda s, b, h, q, kv: s + torch.clamp(kv - q, -10, 10) * 0.5,
    lambda s, b, h, q, kv: -s + abs(q - kv) - torch.abs(s),
    lambda s, b, h, q, kv: torch.where(
        ((q >= kv) & (q - kv < 64)) | (h == 0), s, s - 100.0),
    lambda s, b, h, q, kv: torch.where(~(q > kv) ^ (h != 1), s, 0.0),
    lambda s, b, h, q, kv: torch.where(s > 0, 1, 0) + (s <= 1) * 2.0,
    lambda s, b, h, q, kv: torch.where(torch.logical_and(q > kv, s < 3), s,
                                       torch.zeros(())),
    lambda s, b, h, q, kv: s ** 2 + s ** 3 - (q - kv) ** 2,
    lambda s, b, h, q, kv: s + TABLE[h, q - kv + 512],
    lambda s, b, h, q, kv: s + TABLE[h, -1] + TABLE[2, kv - q + 512],
    lambda s, b, h, q, kv: s * TEMPERATURE + TEMPERATURE * h,
    lambda s, b, h, q, kv: s + IDS[h] * 2 + (IDS[h] // 3),
    lambda s, b, h, q, kv: (h * 1000 + kv).float() * 0 + s.float(),
    lambda s, b, h, q, kv: s,
    lambda s, b, h, q, kv: 1.5,
    lambda s, b, h, q, kv: 7,
    lambda s, b, h, q, kv: q - kv,
    scaled,
])
def test_arithmetic_matches_bit_for_bit(fn):
    check(fn, exact=True, span=500)


@pytest.mark.parametrize("fn", [
    lambda s, b, h, q, kv: torch.sigmoid(s / 4) * torch.exp(
        -torch.abs(q - kv).float() / 100) + torch.sqrt(torch.abs(s))
    - torch.log(1 + s * s),
    lambda s, b, h, q, kv: s.tanh() * 2 + s.sigmoid() - (s / 50).exp(),
    lambda s, b, h, q, kv: torch.exp2(s / 10) + torch.log2(1 + torch.abs(s)),
    lambda s, b, h, q, kv: torch.sin(s) * torch.cos(s + h) + torch.rsqrt(
        1 + s * s),
    lambda s, b, h, q, kv: torch.pow(torch.abs(s) + 1, 1.7) / 100
    + torch.pow(torch.abs(s), 0.5) + 2 ** (s / 50),
    lambda s, b, h, q, kv: 30 * torch.tanh(
        (s + score_mods.alibi_slopes(HQ)[h] * (kv - q)) / 30),
])
def test_transcendental_within_rounding(fn):
    check(fn, exact=False)


def test_text_format():
    mod = ScoreMod.trace(lambda s, b, h, q, kv: s * 0.1 + 2.5)
    lines = mod.text.splitlines()
    assert lines[0] == ("func.func @score_mod(%score: f32, %head: i32, "
                        "%q_idx: i32, %kv_idx: i32) -> f32 {")
    assert lines[-1] == "}" and lines[-2].startswith("  return %")
    # 0.1 is not a float32: its float32 value, exactly, in hex form; 2.5 is.
    assert "arith.constant 0x3DCCCCCD : f32" in mod.text
    assert "arith.constant 2.5 : f32" in mod.text
    inf = ScoreMod.trace(lambda s, b, h, q, kv: torch.where(q < kv, -math.inf,
                                                            s))
    assert "0xFF800000 : f32" in inf.text
    # Dead code and unused captures are dropped; constants appear once.
    def unused(s, b, h, q, kv):
        TABLE[h, 0] * 2
        return s + 1.0 + 1.0
    text = ScoreMod.trace(unused).text
    assert "memref" not in text and text.count("arith.constant") == 1


def test_every_line_is_an_allowed_op():
    allowed = {"arith." + op for op in (
        "constant addf subf mulf divf negf maximumf minimumf cmpf select addi "
        "subi muli divsi remsi cmpi andi ori xori sitofp fptosi index_cast "
        "extsi trunci".split())}
    allowed |= {"math." + op for op in (
        "exp exp2 log log2 tanh sqrt rsqrt absf absi sin cos powf "
        "fma".split())} | {"memref.load"}
    fns = [score_mods.alibi(score_mods.alibi_slopes(4)),
           score_mods.relative_bias(torch.zeros(4, 9), 4),
           lambda s, b, h, q, kv: torch.where(
               (q // 3 % 2 == 0) | ~(kv > 4), torch.sigmoid(s) ** 1.3,
               torch.clamp(s, -1, 1).abs())]
    for fn in fns:
        text = ScoreMod.trace(fn).text
        for line in text.splitlines()[1:-2]:
            op = re.match(r"\s+%\w+ = ([\w.]+)", line).group(1)
            assert op in allowed, line


# ------------------------------------------------------------ errors

@pytest.mark.parametrize("fn", [
    lambda s, b, h, q, kv: s + b,
    lambda s, b, h, q, kv: s * (b == 0),
    lambda s, b, h, q, kv: s + TABLE[b, h],
    lambda s, b, h, q, kv: torch.where(b > 0, s, 0.0),
    lambda s, b, h, q, kv: s if b else s,
    lambda s, b, h, q, kv: b,
])
def test_using_b_is_refused(fn):
    with pytest.raises(ValueError, match="uses b, the batch index"):
        ScoreMod.trace(fn)


@pytest.mark.parametrize("fn,match", [
    (lambda s, b, h, q, kv: torch.erf(s), r"torch\.erf"),
    (lambda s, b, h, q, kv: torch.special.erfinv(s), "erfinv"),
    (lambda s, b, h, q, kv: s.floor(), "floor"),
    (lambda s, b, h, q, kv: s if q > kv else 0.0, "control flow"),
    (lambda s, b, h, q, kv: max(s, q), "control flow"),
    (lambda s, b, h, q, kv: math.tanh(s), "converts to float"),
    (lambda s, b, h, q, kv: s // 2, "'//' to a float"),
    (lambda s, b, h, q, kv: s % 2.0, "'%' to a float"),
    (lambda s, b, h, q, kv: s + TABLE[h], "with 1 indices"),
    (lambda s, b, h, q, kv: s + TABLE[h, 2000], "out of range"),
    (lambda s, b, h, q, kv: s + TABLE[h, s], "f32 value"),
    (lambda s, b, h, q, kv: s + TABLE[h, 1:3], "slice"),
    (lambda s, b, h, q, kv: s + TABLE, "as a value"),
    (lambda s, b, h, q, kv: s + "1", "str"),
    (lambda s, b, h, q, kv: torch.where(s, s, 0.0), "must be a boolean"),
    (lambda s, b, h, q, kv: s[0], "indexes a traced value"),
    (lambda s, b, h, q, kv: s * 2**40, None),   # fine: a float constant
    (lambda s, b, h, q, kv: q * 2**40, "does not fit int32"),
    (lambda s, h, q, kv: s, "must take"),
    (lambda s, b, h, q, kv: "x", "returns str"),
])
def test_unsupported_is_refused_by_name(fn, match):
    if match is None:
        ScoreMod.trace(fn)
        return
    with pytest.raises(ValueError, match=match):
        ScoreMod.trace(fn)


def test_too_many_captures():
    tables = [torch.zeros(4) for _ in range(9)]

    def fn(s, b, h, q, kv):
        for t in tables:
            s = s + t[h]
        return s

    with pytest.raises(ValueError, match="more than 8 tensors"):
        ScoreMod.trace(fn)


def test_integer_table_beyond_float32_is_refused():
    big = torch.tensor([0, 2**25])
    with pytest.raises(ValueError, match="2\\^24"):
        ScoreMod.trace(lambda s, b, h, q, kv: s + big[h])


@pytest.mark.parametrize("bad", [42, 1.5, b"text", [1, 2], torch.zeros(3)])
def test_resolve_refuses_what_is_no_modifier(bad):
    with pytest.raises(ValueError, match="score_mod must be"):
        resolve(bad)


def test_trace_refuses_a_non_callable():
    with pytest.raises(ValueError, match="must be callable"):
        ScoreMod.trace(3)


def test_bad_file_and_text():
    missing = os.path.join(tempfile.gettempdir(), "no-such-dualkv-mod.mlir")
    with pytest.raises(ValueError, match="neither MLIR text .* nor an "
                                         "existing file"):
        resolve(missing)
    with pytest.raises(ValueError, match="does not exist"):
        ScoreMod.from_file(missing)
    with pytest.raises(ValueError, match="path must be a str"):
        ScoreMod.from_file(3)
    with pytest.raises(ValueError, match="does not define func.func"):
        ScoreMod.from_text("func.func @other(%x: f32) -> f32 {}")
    with pytest.raises(ValueError, match="text must be a str"):
        ScoreMod.from_text(b"func.func")
    with pytest.raises(ValueError, match="arguments must be"):
        ScoreMod.from_text(HAND_ALIBI.replace("%head: i32", "%head: f32"),
                           [torch.zeros(4)])
    with pytest.raises(ValueError, match="takes 1 memref inputs but 0"):
        ScoreMod.from_text(HAND_ALIBI)
    with pytest.raises(ValueError, match="inputs\\[0\\] must be a "
                                         "torch.Tensor"):
        ScoreMod.from_text(HAND_ALIBI, [[0.5]])
    with pytest.raises(ValueError, match="NUL"):
        ScoreMod.from_text(HAND_ALIBI + "\0", [torch.zeros(4)])


# ------------------------------------------------------------ ScoreMod

def test_text_file_and_seven_scalars():
    slopes = torch.rand(HQ)
    assert resolve(ScoreMod.from_text(HAND_ALIBI, [slopes])).inputs == (
        slopes,)
    seven = HAND_ALIBI.replace(
        "%kv_idx: i32,", "%kv_idx: i32, %q_packed: i32, %kv_packed: i32, "
        "%region: i32,")
    assert ScoreMod.from_text(seven, [slopes]).text == seven
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "alibi.mlir")
        with open(path, "w") as f:
            f.write(HAND_ALIBI)
        mod = ScoreMod.from_file(path, [slopes])
        assert mod.text == HAND_ALIBI and mod.source == path
        # A str without a newline naming a file is that file; it takes no
        # inputs this way, so the signature's memref is a mismatch.
        with pytest.raises(ValueError, match="file .* takes 1 memref"):
            resolve(path)
        softcap_path = os.path.join(d, "softcap.mlir")
        text = ScoreMod.trace(score_mods.softcap(30.0)).text
        with open(softcap_path, "w") as f:
            f.write(text)
        assert resolve(softcap_path).text == text
        assert resolve(Path(softcap_path)).source == softcap_path
    softcap_text = ScoreMod.trace(score_mods.softcap(30.0)).text
    assert resolve(softcap_text).text == softcap_text


def test_trace_cache_and_rebinding():
    global SCALE
    clear_cache()
    first = ScoreMod.trace(scaled)
    assert ScoreMod.trace(scaled) is first
    assert resolve(scaled) is first
    SCALE = 3.0
    try:
        second = ScoreMod.trace(scaled)
        assert second is not first and "3.0 : f32" in second.text
    finally:
        SCALE = 2.0
    assert ScoreMod.trace(scaled).text == first.text
    # Lambdas of one code with equal closures share a trace; other values
    # do not.
    def make(c):
        return lambda s, b, h, q, kv: s * c
    assert ScoreMod.trace(make(2.0)) is ScoreMod.trace(make(2.0))
    assert ScoreMod.trace(make(2.0)) is not ScoreMod.trace(make(4.0))
    # A tensor in place changes nothing; another tensor traces again.
    slopes = torch.rand(HQ)
    fn = score_mods.alibi(slopes)
    mod = ScoreMod.trace(fn)
    slopes.mul_(2)
    assert ScoreMod.trace(fn) is mod


def test_inputs_per_device_follow_in_place_updates():
    table = torch.rand(HQ, 3, dtype=torch.float64)
    ids = torch.arange(HQ)
    mod = ScoreMod.trace(lambda s, b, h, q, kv: s + table[h, 1] + ids[h])
    assert mod.inputs == (table, ids)
    flat = mod.inputs_for("cpu")
    assert [t.dtype for t in flat] == [torch.float32] * 2
    assert torch.equal(flat[0], table.float().reshape(-1))
    assert mod.inputs_for("cpu")[0] is flat[0]        # cached copy
    table.add_(1)
    again = mod.inputs_for("cpu")[0]
    assert again is not flat[0] and torch.equal(again,
                                                table.float().reshape(-1))
    data, sizes = mod.flat_inputs("cpu")
    assert sizes == [12, 4] and torch.equal(
        data, torch.cat([table.float().reshape(-1), ids.float()]))
    assert mod.flat_inputs("cpu")[0] is data
    # An fp32 contiguous input is used as it is (a view).
    slopes = torch.rand(HQ)
    alibi = ScoreMod.trace(score_mods.alibi(slopes))
    view = alibi.inputs_for("cpu")[0]
    assert view.data_ptr() == slopes.data_ptr()
    # The custom ops' form splits back into views of one tensor.
    back = from_op(mod.text, data, sizes)
    assert [t.data_ptr() for t in back.inputs_for("cpu")] == [
        data.data_ptr(), data.data_ptr() + 48]
    assert from_op(None, None, None) is None


def test_c_arguments():
    slopes = torch.rand(HQ)
    mod = ScoreMod.from_text(HAND_ALIBI, [slopes])
    c = CArguments(mod, torch.device("cpu"))
    args = _lib.ForwardArgs()
    c.fill(args)
    assert args.score_mod == HAND_ALIBI.encode()
    assert args.num_score_mod_inputs == 1
    assert args.score_mod_inputs[0] == slopes.data_ptr()
    none = _lib.BackwardArgs()
    CArguments(None, torch.device("cpu")).fill(none)
    assert none.score_mod is None and none.num_score_mod_inputs == 0
    assert not none.score_mod_inputs
    # The fields come last, after window, in every struct.
    for struct in (_lib.ForwardArgs, _lib.BackwardArgs):
        names = [f[0] for f in struct._fields_]
        assert names[-4:] == ["window", "score_mod", "score_mod_inputs",
                              "num_score_mod_inputs"]
    assert [f[0] for f in _lib.PrecompileArgs._fields_][-2:] == [
        "window", "score_mod"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
