"""Score modifiers: user functions applied to every attention logit before the
softmax, as FlexAttention's ``score_mod`` (docs/architecture.md §1).

The kernels take a modifier as MLIR text of one function, which the compiler
inlines into the forward and differentiates for the backward::

    func.func @score_mod(%score: f32, %head: i32, %q_idx: i32, %kv_idx: i32,
                         [%q_packed: i32, %kv_packed: i32, %region: i32,]
                         [%t0: memref<?xf32>, ... up to 8]) -> f32 {
      ...
      return %r : f32
    }

``score`` is the logit scale * q.k (fp32), ``head`` the query head,
``q_idx``/``kv_idx`` the positions of the query and the key in the query's
logical sequence ([prompt | its own response], what Flex's q_idx/kv_idx are
on the N replicated sequences); the optional three are the packed positions
and the region (0: the key is in the shared prompt, 1: in the query's own
segment). The memref arguments are captured fp32 tensors, flattened.

``ScoreMod`` holds such a text and its captured tensors. It is built from
text (``ScoreMod.from_text``, ``ScoreMod.from_file``) or by tracing a
FlexAttention-style Python function ``fn(score, b, h, q_idx, kv_idx)``
(``ScoreMod.trace``)::

    slopes = torch.tensor([...])                        # [Hq]
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    o = dualkv.attention(q, k, v, plan, score_mod=alibi)

The tracer
----------
``fn`` is called once with proxies: ``score`` an f32 value, ``h``, ``q_idx``
and ``kv_idx`` i32 values, and ``b`` a value that may not be used at all
(DualKV's packed layout has no batch index: ValueError). Every operation on
a proxy becomes one MLIR op. Supported: ``+ - * / // % **``, unary ``-``,
``abs``, comparisons (giving i1), ``& | ^ ~`` on comparisons and on
integers; ``torch.where``, ``tanh``, ``exp``, ``exp2``, ``log``, ``log2``,
``sqrt``, ``rsqrt``, ``abs``, ``sin``, ``cos``, ``pow``, ``minimum``,
``maximum``, ``clamp``/``clip``, ``sigmoid`` (as 1 / (1 + exp(-x))),
``neg``, ``add``/``sub``/``mul``/``div`` (``rounding_mode`` "trunc" and
"floor" on integers), ``remainder``, ``floor_divide`` and the Tensor methods
of the same names, ``.float()``, ``.int()``, ``.long()``, ``.bool()`` and
``.to(dtype)``. Anything else on a proxy (another torch function, Python
``if``/``and``/``or``/``min``/``max`` on a traced value, ``math.*``) is a
ValueError naming it: use ``torch.where`` for data-dependent choices.

Types follow torch's promotion: integer and integer stay i32 (with i32
wrap-around, as torch's int32), anything with a float (a Python float
included) is computed in f32, ``/`` is always true division in f32, and
Python numbers become ``arith.constant`` (floats rounded to float32, as
torch does against a float32 tensor). Integer ``//`` and ``%`` are floor
division and Python's remainder, exactly as torch (``arith.divsi``/
``remsi`` and a correction); on floats they are refused (the kernels have no
floor). A divisor of 0 is undefined in the kernels (torch raises).
Float-to-integer conversions truncate toward zero and must be in int32's
range. Everything is computed in float32, also what ``fn`` would compute in
float64.

Captured tensors. Indexing a torch.Tensor from ``fn``'s closure or globals
with traced integers (``bias[h]``, ``table[h, kv_idx - q_idx + 512]``) makes
it a memref argument: its values are read by the kernels at run time, fully
indexed (one index per dimension), flattened with the strides of the
contiguous tensor. Each traced index is clamped to [0, size - 1] of its
dimension, so a kernel never reads outside the tensor: in-range indices give
exactly torch's element, an out-of-range one (an IndexError in torch) the
nearest edge's, and negative traced indices are not wrapped (a Python int
index is, as in torch, and must be in range). A one-element tensor used as a
value (``score * temperature``) is captured too. Tensors are stored in
float32: an integer tensor's values must be within +-2^24 (exact in
float32; checked when traced) and are converted back to i32 when loaded.
Captured tensors are constants for autograd: no gradient reaches them (a
bias table is not trained through DualKV). A tensor that ``fn`` computes
(``torch.exp(bias)[h]``) is computed once, at trace time.

When ``fn`` is traced. ``ScoreMod.trace(fn)`` (and every ``score_mod=fn``)
looks ``fn`` up in a cache keyed by its code and a fingerprint of what it
sees: its defaults, the values in its closure cells and the globals its code
names (numbers and strings by value, tensors by identity, shape and dtype,
anything else by identity; ``functools.partial`` and bound methods through
their function and arguments). ``fn`` is traced again when any of those
changes, and only then: in-place updates of a captured tensor's values need
no new trace (the kernels read them; a converted copy is refreshed when the
tensor's version counter moves). What helper functions called by ``fn``
capture themselves is not part of the fingerprint: rebinding it needs a new
function (or ``ScoreMod.trace`` of one). Callables of other kinds are traced
on every use.
"""

import collections
import ctypes
import functools
import numbers
import os
import re
import struct
import threading

from ._bounded import clip, shown

__all__ = ["ScoreMod", "resolve", "MAX_INPUTS"]

#: The most captured tensors (memref arguments) one modifier may take.
MAX_INPUTS = 8

# The scalar arguments of the function, as the C API names them.
_SCALARS = ("score", "head", "q_idx", "kv_idx")
_PACKED = ("q_packed", "kv_packed", "region")
_MEMREF = "memref<?xf32>"

_SIGNATURE = re.compile(
    r"func\.func\s+@score_mod\s*\(([^()]*)\)\s*->\s*f32\s*(?:attributes\s*"
    r"\{[^{}]*\}\s*)?\{")
_ARGUMENT = re.compile(r"\s*%[A-Za-z_][\w$.]*\s*:\s*(\S(?:.*\S)?)\s*")


def _torch():
    import torch
    return torch


# --------------------------------------------------------------- ScoreMod

class ScoreMod:
    """A score modifier ready for the kernels: ``text``, the MLIR text of
    ``func.func @score_mod`` (module docstring), and ``inputs``, the tensors
    of its memref arguments in order (as given or captured; each is passed
    to the kernels as a flattened contiguous float32 copy on q's device, made
    once per device and refreshed when the tensor changes in place, or the
    tensor itself when it already is one).

    Build one with ``from_text``, ``from_file`` or ``trace``; every
    ``score_mod=`` argument also takes the text, a path or the function
    (``dualkv.score_mod.resolve``)."""

    __slots__ = ("text", "inputs", "source", "_copies", "_flat", "_lock",
                 "__weakref__")

    def __init__(self, text, inputs=(), source=None):
        # Checked by from_text; kept for the constructors here.
        self.text = text
        self.inputs = tuple(inputs)
        #: What it was made from, for messages: "text", a path, fn's name.
        self.source = source or "text"
        self._copies = {}
        self._flat = {}
        self._lock = threading.Lock()

    @classmethod
    def from_text(cls, text, inputs=()):
        """The modifier of MLIR ``text`` (a str) with ``inputs``, one tensor
        per memref argument, in order (any real dtype and device: each is
        used as float32 on q's device). Checks the signature (the four
        scalars, or all seven, then at most 8 memrefs, one per input) and
        raises ValueError naming ``score_mod`` otherwise; the library parses
        and verifies the body."""
        if not isinstance(text, str):
            raise ValueError(f"dualkv: score_mod text must be a str, got "
                             f"{type(text).__name__} {shown(text)}")
        inputs = _check_inputs(inputs)
        _check_text(text, len(inputs))
        return cls(text, inputs, "text")

    @classmethod
    def from_file(cls, path, inputs=()):
        """The modifier of the MLIR text in the file ``path`` (UTF-8), as
        ``from_text``; ValueError naming the path when it is no readable
        file."""
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"dualkv: score_mod path must be a str or "
                             f"os.PathLike, got {type(path).__name__} "
                             f"{shown(path)}")
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ValueError(f"dualkv: score_mod file {shown(path, 200)} "
                             "does not exist or is not a file")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"dualkv: score_mod file {shown(path, 200)} "
                             f"cannot be read: {clip(str(e), 200)}") from None
        inputs = _check_inputs(inputs)
        _check_text(text, len(inputs), where=f"file {shown(path, 200)}")
        return cls(text, inputs, path)

    @classmethod
    def trace(cls, fn):
        """The modifier of a FlexAttention-style function ``fn(score, b, h,
        q_idx, kv_idx)``, traced once and cached (module docstring: what is
        supported, and when ``fn`` is traced again). ValueError naming what
        cannot be traced."""
        return _trace_cached(fn)

    @property
    def num_inputs(self):
        return len(self.inputs)

    def inputs_for(self, device):
        """The inputs as flattened contiguous float32 tensors on ``device``:
        a tensor that already is one is used as it is (in-place updates are
        seen), any other is copied once and again only when its version
        counter moves."""
        torch = _torch()
        device = torch.device(device)
        out = []
        with self._lock:
            for n, t in enumerate(self.inputs):
                if (t.device == device and t.dtype == torch.float32
                        and t.is_contiguous()):
                    out.append(t.detach().reshape(-1))
                    continue
                cached = self._copies.get((n, device))
                if cached is None or cached[0] != t._version:
                    copy = t.detach().to(device=device, dtype=torch.float32)
                    cached = (t._version, copy.contiguous().reshape(-1))
                    self._copies[(n, device)] = cached
                out.append(cached[1])
        return out

    def flat_inputs(self, device):
        """(data, sizes): the inputs on ``device`` as one float32 tensor
        (their concatenation; the single input itself when there is one) and
        each one's size, or (None, None) without inputs. This is how the
        custom ops carry them (their schemas cannot take an optional list of
        tensors); the concatenation is redone only when an input changed."""
        if not self.inputs:
            return None, None
        torch = _torch()
        parts = self.inputs_for(device)
        sizes = [p.numel() for p in parts]
        if len(parts) == 1:
            return parts[0], sizes
        # The sources are held here, so their ids are stable; their version
        # counters move with every in-place update.
        key = tuple((id(t), t._version) for t in self.inputs)
        cached = self._flat.get(torch.device(device))
        if cached is None or cached[0] != key:
            cached = (key, torch.cat(parts))
            self._flat[torch.device(device)] = cached
        return cached[1], sizes

    def __repr__(self):
        return (f"dualkv.ScoreMod(from {clip(self.source, 80)}, "
                f"{len(self.inputs)} inputs, {len(self.text)} characters)")


def _check_inputs(inputs):
    torch = None
    if inputs is None:
        return ()
    if isinstance(inputs, (str, bytes)) or not hasattr(inputs, "__iter__"):
        raise ValueError(f"dualkv: score_mod inputs must be a sequence of "
                         f"tensors, got {type(inputs).__name__}")
    inputs = list(inputs)
    if len(inputs) > MAX_INPUTS:
        raise ValueError(f"dualkv: score_mod takes at most {MAX_INPUTS} "
                         f"inputs (memref arguments), got {len(inputs)}")
    for n, t in enumerate(inputs):
        if torch is None:
            torch = _torch()
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"dualkv: score_mod inputs[{n}] must be a "
                             f"torch.Tensor, got {type(t).__name__}")
        if t.is_complex() or t.numel() < 1 or t.numel() >= 2**31:
            raise ValueError(f"dualkv: score_mod inputs[{n}] is "
                             f"{t.dtype} {tuple(t.shape)}; it must be a real "
                             "tensor of 1 to 2^31 - 1 elements")
    return inputs


def _check_text(text, num_inputs, where="text"):
    """The signature of a modifier's text: @score_mod(f32, i32 x3 [, i32
    x3], memref<?xf32> x num_inputs) -> f32."""
    if "\0" in text:
        raise ValueError(f"dualkv: score_mod {where} contains a NUL "
                         "character")
    match = _SIGNATURE.search(text)
    if match is None:
        raise ValueError(
            f"dualkv: score_mod {where} does not define "
            "func.func @score_mod(%score: f32, %head: i32, %q_idx: i32, "
            "%kv_idx: i32, ...) -> f32 {...}: "
            f"{shown(text.strip(), 120)}")
    args = [a for a in match.group(1).split(",")] if match.group(1).strip() \
        else []
    types = []
    for a in args:
        m = _ARGUMENT.fullmatch(a)
        if m is None:
            raise ValueError(f"dualkv: score_mod {where}: the argument "
                             f"{shown(a.strip())} is not '%name: type'")
        types.append(m.group(1).replace(" ", ""))
    scalars = 0
    while scalars < len(types) and types[scalars] != _MEMREF:
        scalars += 1
    memrefs = types[scalars:]
    expected = ["f32", "i32", "i32", "i32"]
    if scalars not in (4, 7) or types[:scalars] != (
            expected + ["i32"] * (scalars - 4)):
        raise ValueError(
            f"dualkv: score_mod {where}: the arguments must be (score: f32, "
            "head: i32, q_idx: i32, kv_idx: i32), optionally (q_packed, "
            "kv_packed, region: i32), then memref<?xf32> inputs; got "
            f"({clip(', '.join(types), 200)})")
    if any(t != _MEMREF for t in memrefs):
        raise ValueError(f"dualkv: score_mod {where}: arguments after the "
                         f"scalars must be {_MEMREF}; got "
                         f"({clip(', '.join(types), 200)})")
    if len(memrefs) > MAX_INPUTS:
        raise ValueError(f"dualkv: score_mod {where} takes {len(memrefs)} "
                         f"memref inputs; at most {MAX_INPUTS}")
    if len(memrefs) != num_inputs:
        raise ValueError(f"dualkv: score_mod {where} takes {len(memrefs)} "
                         f"memref inputs but {num_inputs} tensors were given")


def resolve(score_mod):
    """A ``score_mod=`` argument as a ScoreMod, or None for None: a
    ScoreMod as it is; a str is MLIR text, or the path of an existing file
    when it has no newline and names one; a callable is traced (cached,
    ``ScoreMod.trace``). Anything else, and a str that is neither text nor
    a file, is a ValueError naming score_mod."""
    if score_mod is None or isinstance(score_mod, ScoreMod):
        return score_mod
    if isinstance(score_mod, os.PathLike):
        return ScoreMod.from_file(score_mod)
    if isinstance(score_mod, str):
        if "\n" not in score_mod and os.path.isfile(score_mod):
            return ScoreMod.from_file(score_mod)
        if "func.func" not in score_mod:
            raise ValueError(
                f"dualkv: score_mod {shown(score_mod, 200)} is neither MLIR "
                "text (func.func @score_mod(...)) nor an existing file")
        return ScoreMod.from_text(score_mod)
    if callable(score_mod):
        return ScoreMod.trace(score_mod)
    raise ValueError(f"dualkv: score_mod must be None, a dualkv.ScoreMod, "
                     f"MLIR text, a .mlir path or a function (score, b, h, "
                     f"q_idx, kv_idx) -> score; got {type(score_mod).__name__} "
                     f"{shown(score_mod)}")


class CArguments:
    """The C API's three score_mod fields of one call, with what they point
    to kept alive as long as this object: ``text`` (bytes or None),
    ``inputs`` (a ctypes void* array or None) and ``count``."""

    __slots__ = ("text", "inputs", "count", "_tensors", "_array")

    def __init__(self, score_mod, device):
        self.text = None
        self.inputs = None
        self.count = 0
        self._tensors = ()
        self._array = None
        if score_mod is None:
            return
        self.text = score_mod.text.encode("utf-8")
        self._tensors = score_mod.inputs_for(device)
        self.count = len(self._tensors)
        if self.count:
            self._array = (ctypes.c_void_p * self.count)(
                *[t.data_ptr() for t in self._tensors])
            self.inputs = ctypes.cast(self._array,
                                      ctypes.POINTER(ctypes.c_void_p))

    def fill(self, args):
        """Sets the fields of a ForwardArgs or BackwardArgs."""
        args.score_mod = self.text
        args.score_mod_inputs = self.inputs
        args.num_score_mod_inputs = self.count


def from_op(text, data, sizes):
    """The ScoreMod the custom ops' (score_mod, data, sizes) arguments carry
    (``ScoreMod.flat_inputs``), or None for no text. The text was checked
    when its ScoreMod was built; the inputs are views of ``data``."""
    if text is None or text == "":
        return None
    if data is None:
        inputs = ()
    else:
        inputs = tuple(data.split(list(sizes))) if sizes else (data,)
    return ScoreMod(text, inputs, "the custom op's arguments")


# --------------------------------------------------------------- the tracer

_F32, _I32, _I1, _BATCH = "f32", "i32", "i1", "batch"
_RANK = {_I1: 0, _I32: 1, _F32: 2}


def _batch_error():
    return ValueError(
        "dualkv: the score modifier uses b, the batch index: DualKV's packed "
        "layout has no batch index (every sequence of a micro-batch is one "
        "packed row), so a modifier must not depend on b")


def _f32_value(x):
    """``x`` rounded to float32 (overflow to +-inf, as torch's cast)."""
    return ctypes.c_float(x).value


def _f32_literal(x):
    """An exact MLIR f32 literal of a float32 value: short decimals as they
    are, every other value (inf and nan too) in hex form."""
    text = repr(x)
    if re.fullmatch(r"-?[0-9]+\.[0-9]+", text) and len(text) <= 10:
        return text
    return "0x%08X" % struct.unpack(">I", struct.pack(">f", x))[0]


class _Trace:
    """The ops of one trace: SSA lines, constants (deduplicated) and the
    captured tensors."""

    def __init__(self):
        self.ops = []            # (result name, operand names, line)
        self.constants = {}      # (type, value key) -> _Value
        self.captures = []       # tensors, in order of first use
        self.captured = {}       # id(tensor) -> index
        self.count = 0

    def emit(self, type_, body, *operands):
        name = f"%v{self.count}"
        self.count += 1
        self.ops.append((name, [o.name for o in operands],
                         f"{name} = {body}"))
        return _Value(self, name, type_)

    def constant(self, type_, value):
        if type_ == _F32:
            value = _f32_value(float(value))
            key = struct.pack(">f", value)
            literal = f"{_f32_literal(value)} : f32"
        elif type_ == _I32:
            value = int(value)
            if not -2**31 <= value < 2**31:
                raise ValueError(f"dualkv: the score modifier's integer "
                                 f"constant {value} does not fit int32")
            key, literal = value, f"{value} : i32"
        else:
            value = bool(value)
            key, literal = value, "true" if value else "false"
        found = self.constants.get((type_, key))
        if found is None:
            found = self.emit(type_, f"arith.constant {literal}")
            self.constants[(type_, key)] = found
        return found

    def capture(self, tensor):
        """The memref argument of a captured tensor (its placeholder name,
        renamed when the text is written)."""
        torch = _torch()
        n = self.captured.get(id(tensor))
        if n is not None:
            return f"%in{n}"
        if tensor.is_complex() or tensor.numel() < 1 or \
                tensor.numel() >= 2**31:
            raise ValueError(f"dualkv: the score modifier indexes a tensor "
                             f"of {tensor.dtype} {tuple(tensor.shape)}; a "
                             "captured tensor must be real with 1 to 2^31 - 1 "
                             "elements")
        if not tensor.is_floating_point() and tensor.dtype != torch.bool:
            big = tensor.detach().abs().max().item()
            if big > 2**24:
                raise ValueError(
                    f"dualkv: the score modifier indexes an integer tensor "
                    f"({tensor.dtype} {tuple(tensor.shape)}) with a value of "
                    f"magnitude {big} > 2^24, which float32 (the inputs' "
                    "type) does not hold exactly")
        if len(self.captures) >= MAX_INPUTS:
            raise ValueError(f"dualkv: the score modifier captures more than "
                             f"{MAX_INPUTS} tensors (the most a modifier may "
                             "take)")
        self.captures.append(tensor)
        self.captured[id(tensor)] = len(self.captures) - 1
        return f"%in{len(self.captures) - 1}"

    def load(self, tensor, index):
        """``tensor[index]`` of a captured tensor, index a tuple of one
        traced or Python integer per dimension."""
        torch = _torch()
        shape = tuple(tensor.shape)
        if len(index) != len(shape) or (not shape and index):
            raise ValueError(
                f"dualkv: the score modifier indexes a tensor of shape "
                f"{list(shape)} with {len(index)} indices; index every "
                "dimension (one integer each), so that it gives one element")
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= size
        strides.reverse()
        fixed, offset = 0, None
        for d, (i, size, stride) in enumerate(zip(index, shape, strides)):
            if isinstance(i, _Value):
                if i.type == _BATCH:
                    raise _batch_error()
                if i.type != _I32:
                    raise ValueError(
                        f"dualkv: the score modifier indexes dimension {d} "
                        f"of a captured tensor with a {i.type} value; "
                        "indices must be integers (h, q_idx, kv_idx and "
                        "integer arithmetic on them)")
                if size == 1:
                    continue
                i = _clamp_int(self, i, 0, size - 1)
                if stride != 1:
                    i = _binary("mul", i, stride)
                offset = i if offset is None else _binary("add", offset, i)
            elif isinstance(i, numbers.Integral) and not isinstance(i, bool):
                i = int(i)
                if not -size <= i < size:
                    raise ValueError(
                        f"dualkv: the score modifier's index {i} is out of "
                        f"range for dimension {d} of size {size}")
                fixed += (i % size) * stride
            else:
                raise ValueError(
                    f"dualkv: the score modifier indexes a captured tensor "
                    f"with {type(i).__name__} {shown(i)}; only one integer "
                    "per dimension is supported (no slices, masks or "
                    "tensors)")
        if offset is None:
            offset = self.constant(_I32, fixed)
        elif fixed:
            offset = _binary("add", offset, fixed)
        memref = self.capture(tensor)
        position = self.emit("index", f"arith.index_cast {offset.name} : i32 "
                                      "to index", offset)
        name = f"%v{self.count}"
        self.count += 1
        self.ops.append((name, [position.name, memref],
                         f"{name} = memref.load {memref}[{position.name}] : "
                         f"{_MEMREF}"))
        value = _Value(self, name, _F32)
        if tensor.dtype == torch.bool:
            return _compare("ne", value, 0.0)
        if not tensor.is_floating_point():
            return _convert(value, _I32)
        return value

    def text(self, result):
        """The function's text: the ops ``result`` depends on, captured
        tensors renumbered in order of use. Returns (text, tensors)."""
        live = {result.name}
        kept = []
        for name, operands, line in reversed(self.ops):
            if name in live:
                kept.append(line)
                live.update(operands)
        kept.reverse()
        used = [n for n in range(len(self.captures)) if f"%in{n}" in live]
        rename = {f"%in{n}": f"%t{k}" for k, n in enumerate(used)}
        body = re.sub(r"%in[0-9]+\b", lambda m: rename[m.group(0)],
                      "\n".join(f"  {line}" for line in kept))
        params = ["%score: f32", "%head: i32", "%q_idx: i32", "%kv_idx: i32"]
        params += [f"%t{k}: {_MEMREF}" for k in range(len(used))]
        lines = [f"func.func @score_mod({', '.join(params)}) -> f32 {{"]
        if body:
            lines.append(body)
        lines.append(f"  return {result.name} : f32")
        lines.append("}")
        return "\n".join(lines) + "\n", [self.captures[n] for n in used]


def _trace_of(*values):
    for v in values:
        if isinstance(v, _Value):
            return v.trace
    raise AssertionError("no traced value")


def _operand(trace, x):
    """A traced value, or a Python/torch scalar as ("int"|"float"|"i1",
    value) until its type is known; ValueError for anything else."""
    if isinstance(x, _Value):
        if x.type == _BATCH:
            raise _batch_error()
        return x
    if isinstance(x, bool) or type(x).__name__ in ("bool_", "bool"):
        return (_I1, bool(x))
    if isinstance(x, numbers.Integral):
        return ("int", int(x))
    if isinstance(x, numbers.Real):
        return ("float", float(x))
    torch = _torch()
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(
                f"dualkv: the score modifier uses a tensor of shape "
                f"{list(x.shape)} as a value; index it with the modifier's "
                "arguments (e.g. bias[h]) to get one element")
        return trace.load(x, (0,) * x.dim())
    raise ValueError(f"dualkv: the score modifier combines a traced value "
                     f"with {type(x).__name__} {shown(x)}, which the tracer "
                     "cannot represent")


def _kind(x):
    """The type an operand has or, for a Python number, asks for."""
    if isinstance(x, _Value):
        return x.type
    return {"int": "int", "float": _F32, _I1: "pyi1"}[x[0]]


def _common(*operands):
    """torch's promotion: any float -> f32; else any integer -> i32; else
    i1 (Python numbers take the tensors' type within a category)."""
    kinds = [_kind(x) for x in operands]
    if _F32 in kinds:
        return _F32
    if _I32 in kinds or "int" in kinds:
        return _I32
    return _I1


def _as(trace, x, type_):
    """An operand as a traced value of ``type_`` (constants, or i1 -> i32
    -> f32 conversions)."""
    if not isinstance(x, _Value):
        return trace.constant(type_, x[1])
    return _convert(x, type_)


def _convert(x, type_):
    trace = x.trace
    if x.type == type_:
        return x
    if x.type == _I1:
        one, zero = (1.0, 0.0) if type_ == _F32 else (1, 0)
        return _select(x, trace.constant(type_, one),
                       trace.constant(type_, zero))
    if type_ == _I1:
        return _compare("ne", x, 0)
    if x.type == _I32 and type_ == _F32:
        return trace.emit(_F32, f"arith.sitofp {x.name} : i32 to f32", x)
    return trace.emit(_I32, f"arith.fptosi {x.name} : f32 to i32", x)


def _select(cond, a, b):
    return cond.trace.emit(a.type, f"arith.select {cond.name}, {a.name}, "
                                   f"{b.name} : {a.type}", cond, a, b)


_FLOAT_OPS = {"add": "arith.addf", "sub": "arith.subf", "mul": "arith.mulf",
              "div": "arith.divf", "min": "arith.minimumf",
              "max": "arith.maximumf"}
_INT_OPS = {"add": "arith.addi", "sub": "arith.subi", "mul": "arith.muli",
            "and": "arith.andi", "or": "arith.ori", "xor": "arith.xori",
            "divsi": "arith.divsi", "remsi": "arith.remsi"}


def _emit_binary(mlir, a, b):
    return a.trace.emit(a.type, f"{mlir} {a.name}, {b.name} : {a.type}",
                        a, b)


def _binary(op, a, b):
    """a <op> b with torch's promotion: add, sub, mul, div (true division),
    floordiv, mod (Python's remainder), and, or, xor, min, max."""
    trace = _trace_of(a, b)
    a, b = _operand(trace, a), _operand(trace, b)
    if op == "div":
        return _emit_binary("arith.divf", _as(trace, a, _F32),
                            _as(trace, b, _F32))
    type_ = _common(a, b)
    if op in ("and", "or", "xor"):
        if type_ == _F32:
            raise ValueError(f"dualkv: the score modifier applies "
                             f"'{ {'and': '&', 'or': '|', 'xor': '^'}[op]}' "
                             "to a float; it takes booleans (comparisons) "
                             "or integers")
        return _emit_binary(_INT_OPS[op], _as(trace, a, type_),
                            _as(trace, b, type_))
    if type_ == _I1:
        type_ = _I32  # arithmetic on booleans counts them as integers
    a, b = _as(trace, a, type_), _as(trace, b, type_)
    if op in ("min", "max"):
        if type_ == _F32:
            return _emit_binary(_FLOAT_OPS[op], a, b)
        pick = _compare("slt" if op == "min" else "sgt", a, b)
        return _select(pick, a, b)
    if op in ("floordiv", "mod"):
        if type_ == _F32:
            raise ValueError(
                f"dualkv: the score modifier applies "
                f"'{'//' if op == 'floordiv' else '%'}' to a float; the "
                "kernels have no floor: it is supported on integers only")
        # Floor division and Python's remainder from C's truncating ones:
        # where the remainder is nonzero and its sign differs from the
        # divisor's, q - 1 and r + b.
        q = _emit_binary("arith.divsi", a, b)
        r = _emit_binary("arith.remsi", a, b)
        zero = trace.constant(_I32, 0)
        nonzero = _compare("ne", r, zero)
        signs = _emit_binary("arith.xori", _compare("slt", r, zero),
                             _compare("slt", b, zero))
        fix = _emit_binary("arith.andi", nonzero, signs)
        if op == "floordiv":
            return _select(fix, _emit_binary(
                "arith.subi", q, trace.constant(_I32, 1)), q)
        return _select(fix, _emit_binary("arith.addi", r, b), r)
    table = _FLOAT_OPS if type_ == _F32 else _INT_OPS
    return _emit_binary(table[op], a, b)


_PREDICATES = {"lt": ("olt", "slt"), "le": ("ole", "sle"),
               "gt": ("ogt", "sgt"), "ge": ("oge", "sge"),
               "eq": ("oeq", "eq"), "ne": ("une", "ne"),
               "slt": (None, "slt"), "sgt": (None, "sgt")}


def _compare(op, a, b):
    """An i1 comparison as torch's (NaN compares unequal to everything)."""
    trace = _trace_of(a, b)
    a, b = _operand(trace, a), _operand(trace, b)
    type_ = _common(a, b)
    if type_ == _I1 and op not in ("eq", "ne"):
        type_ = _I32
    a, b = _as(trace, a, type_), _as(trace, b, type_)
    fpred, ipred = _PREDICATES[op]
    if type_ == _F32:
        body = f"arith.cmpf {fpred}, {a.name}, {b.name} : f32"
    else:
        body = f"arith.cmpi {ipred}, {a.name}, {b.name} : {type_}"
    return trace.emit(_I1, body, a, b)


def _clamp_int(trace, x, lo, hi):
    x = _select(_compare("slt", x, lo), trace.constant(_I32, lo), x)
    return _select(_compare("sgt", x, hi), trace.constant(_I32, hi), x)


_MATH = {"tanh": "math.tanh", "exp": "math.exp", "exp2": "math.exp2",
         "log": "math.log", "log2": "math.log2", "sqrt": "math.sqrt",
         "rsqrt": "math.rsqrt", "sin": "math.sin", "cos": "math.cos"}


def _unary(op, x):
    trace = _trace_of(x)
    x = _operand(trace, x)
    if op in _MATH:
        x = _as(trace, x, _F32)
        return trace.emit(_F32, f"{_MATH[op]} {x.name} : f32", x)
    if op == "neg":
        if x.type == _F32:
            return trace.emit(_F32, f"arith.negf {x.name} : f32", x)
        x = _convert(x, _I32)
        return _binary("sub", trace.constant(_I32, 0), x)
    if op == "abs":
        if x.type == _F32:
            return trace.emit(_F32, f"math.absf {x.name} : f32", x)
        if x.type == _I1:
            return x
        return trace.emit(_I32, f"math.absi {x.name} : i32", x)
    if op == "invert":
        if x.type == _F32:
            raise ValueError("dualkv: the score modifier applies '~' to a "
                             "float; it takes booleans or integers")
        ones = trace.constant(x.type, True if x.type == _I1 else -1)
        return _emit_binary("arith.xori", x, ones)
    if op == "sigmoid":
        one = trace.constant(_F32, 1.0)
        e = _unary("exp", _unary("neg", _as(trace, x, _F32)))
        return _binary("div", one, _binary("add", one, e))
    raise AssertionError(op)


def _power(a, b):
    """a ** b as torch computes it: exponents 2, 3, 0.5, -0.5, -1, -2 of a
    float by their exact special cases, a non-negative integer power of an
    integer by repeated multiplication, anything else with math.powf."""
    trace = _trace_of(a, b)
    a, b = _operand(trace, a), _operand(trace, b)
    if not isinstance(b, _Value) and isinstance(a, _Value):
        e = b[1]
        if _common(a, b) == _I32 and b[0] == "int":
            if e < 0:
                raise ValueError("dualkv: the score modifier raises an "
                                 "integer to a negative integer power "
                                 "(an error in torch)")
            if e > 64:
                raise ValueError(f"dualkv: the score modifier raises an "
                                 f"integer to the power {e}; at most 64")
            result = trace.constant(_I32, 1)
            x = _convert(a, _I32)
            for _ in range(e):
                result = _binary("mul", result, x)
            return result
        x = _as(trace, a, _F32)
        if e == 2:
            return _binary("mul", x, x)
        if e == 3:
            return _binary("mul", _binary("mul", x, x), x)
        if e == 0.5:
            return _unary("sqrt", x)
        if e == -0.5:
            return _unary("rsqrt", x)
        if e == -1:
            return _binary("div", 1.0, x)
        if e == -2:
            return _binary("div", 1.0, _binary("mul", x, x))
    if isinstance(b, _Value) and _common(a, b) == _I32:
        raise ValueError("dualkv: the score modifier raises an integer to a "
                         "traced integer power, which the tracer does not "
                         "support (use floats: torch.pow(x.float(), y))")
    x, y = _as(trace, a, _F32), _as(trace, b, _F32)
    return _emit_binary("math.powf", x, y)


def _where(cond, a, b):
    trace = _trace_of(cond, a, b)
    cond = _operand(trace, cond)
    if not isinstance(cond, _Value):
        return a if cond[1] else b
    if cond.type != _I1:
        raise ValueError(f"dualkv: torch.where's condition in the score "
                         f"modifier is {cond.type}; it must be a boolean "
                         "(a comparison)")
    a, b = _operand(trace, a), _operand(trace, b)
    type_ = _common(a, b)
    return _select(cond, _as(trace, a, type_), _as(trace, b, type_))


def _clamp(x, min=None, max=None):
    if min is None and max is None:
        raise ValueError("dualkv: torch.clamp in the score modifier needs "
                         "min or max")
    if min is not None:
        x = _binary("max", x, min)
    if max is not None:
        x = _binary("min", x, max)
    return x


def _to(x, *args, **kwargs):
    torch = _torch()
    dtype = kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
    if dtype is None:
        return x  # a device move: nothing to trace
    if dtype.is_floating_point:
        return _cast(x, _F32)
    if dtype == torch.bool:
        return _cast(x, _I1)
    if dtype in (torch.int32, torch.int64, torch.int16, torch.int8,
                 torch.uint8):
        return _cast(x, _I32)
    raise ValueError(f"dualkv: the score modifier converts a traced value "
                     f"to {dtype}, which the tracer does not support")


def _cast(x, type_):
    trace = _trace_of(x)
    x = _operand(trace, x)
    if not isinstance(x, _Value):
        return trace.constant(type_, x[1])
    return _convert(x, type_)


def _div(a, b, rounding_mode=None):
    if rounding_mode is None:
        return _binary("div", a, b)
    trace = _trace_of(a, b)
    if _common(_operand(trace, a), _operand(trace, b)) == _F32:
        raise ValueError(f"dualkv: the score modifier divides floats with "
                         f"rounding_mode={rounding_mode!r}; the kernels have "
                         "no floor or trunc: integers only")
    if rounding_mode == "floor":
        return _binary("floordiv", a, b)
    if rounding_mode == "trunc":
        a, b = _operand(trace, a), _operand(trace, b)
        return _emit_binary("arith.divsi", _as(trace, a, _I32),
                            _as(trace, b, _I32))
    raise ValueError(f"dualkv: unknown rounding_mode {shown(rounding_mode)}")


def _getitem(tensor, index):
    torch = _torch()
    if isinstance(tensor, _Value):
        raise ValueError("dualkv: the score modifier indexes a traced value; "
                         "only captured tensors can be indexed")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"dualkv: the score modifier indexes "
                         f"{type(tensor).__name__} with a traced value")
    if not isinstance(index, tuple):
        index = (index,)
    trace = _trace_of(*index)
    return trace.load(tensor, index)


def _swap(fn):
    return lambda a, b, *rest, **kw: fn(b, a, *rest, **kw)


def _named(op):
    return lambda a, b: _binary(op, a, b)


def _compared(op):
    return lambda a, b: _compare(op, a, b)


def _math(op):
    return lambda x: _unary(op, x)


def _add(a, b, alpha=1):
    return _binary("add", a, b if alpha == 1 else _binary("mul", b, alpha))


def _sub(a, b, alpha=1):
    return _binary("sub", a, b if alpha == 1 else _binary("mul", b, alpha))


# torch functions and Tensor methods by __name__ (as __torch_function__ and
# the proxies' methods see them); the first argument is the input.
_FUNCTIONS = {
    "add": _add, "__add__": _add, "__radd__": _swap(_add),
    "sub": _sub, "subtract": _sub, "__sub__": _sub, "__rsub__": _swap(_sub),
    "rsub": _swap(_sub),
    "mul": _named("mul"), "multiply": _named("mul"),
    "__mul__": _named("mul"), "__rmul__": _swap(_named("mul")),
    "div": _div, "divide": _div, "true_divide": _named("div"),
    "__truediv__": _named("div"), "__rtruediv__": _swap(_named("div")),
    "__div__": _named("div"), "__rdiv__": _swap(_named("div")),
    "floor_divide": _named("floordiv"), "__floordiv__": _named("floordiv"),
    "__rfloordiv__": _swap(_named("floordiv")),
    "remainder": _named("mod"), "__mod__": _named("mod"),
    "__rmod__": _swap(_named("mod")),
    "pow": _power, "__pow__": _power, "__rpow__": _swap(_power),
    "float_power": _power,
    "minimum": _named("min"), "fmin": _named("min"),
    "maximum": _named("max"), "fmax": _named("max"),
    "clamp": _clamp, "clip": _clamp,
    "clamp_min": lambda x, m: _clamp(x, min=m),
    "clamp_max": lambda x, m: _clamp(x, max=m),
    "where": _where,
    "lt": _compared("lt"), "__lt__": _compared("lt"), "less": _compared("lt"),
    "le": _compared("le"), "__le__": _compared("le"),
    "less_equal": _compared("le"),
    "gt": _compared("gt"), "__gt__": _compared("gt"),
    "greater": _compared("gt"),
    "ge": _compared("ge"), "__ge__": _compared("ge"),
    "greater_equal": _compared("ge"),
    "eq": _compared("eq"), "__eq__": _compared("eq"),
    "ne": _compared("ne"), "__ne__": _compared("ne"),
    "not_equal": _compared("ne"),
    "logical_and": lambda a, b: _binary("and", _cast(a, _I1), _cast(b, _I1)),
    "logical_or": lambda a, b: _binary("or", _cast(a, _I1), _cast(b, _I1)),
    "logical_xor": lambda a, b: _binary("xor", _cast(a, _I1), _cast(b, _I1)),
    "logical_not": lambda a: _unary("invert", _cast(a, _I1)),
    "bitwise_and": _named("and"), "__and__": _named("and"),
    "__rand__": _swap(_named("and")),
    "bitwise_or": _named("or"), "__or__": _named("or"),
    "__ror__": _swap(_named("or")),
    "bitwise_xor": _named("xor"), "__xor__": _named("xor"),
    "__rxor__": _swap(_named("xor")),
    "bitwise_not": lambda x: _unary("invert", x),
    "__invert__": lambda x: _unary("invert", x),
    "neg": _math("neg"), "negative": _math("neg"), "__neg__": _math("neg"),
    "abs": _math("abs"), "absolute": _math("abs"), "__abs__": _math("abs"),
    "sigmoid": _math("sigmoid"),
    "float": lambda x: _cast(x, _F32), "double": lambda x: _cast(x, _F32),
    "int": lambda x: _cast(x, _I32), "long": lambda x: _cast(x, _I32),
    "bool": lambda x: _cast(x, _I1), "to": _to,
    "__getitem__": _getitem,
}
_FUNCTIONS.update({op: _math(op) for op in _MATH})


def _torch_function(func, args, kwargs):
    name = getattr(func, "__name__", None) or str(func)
    handler = _FUNCTIONS.get(name)
    if handler is None:
        raise ValueError(
            f"dualkv: the score modifier calls torch.{name} (or "
            f"Tensor.{name}) on a traced value, which the tracer does not "
            f"support; supported: arithmetic, comparisons, "
            f"{', '.join(sorted(n for n in _FUNCTIONS if not n.startswith('_')))}")
    try:
        return handler(*args, **kwargs)
    except TypeError as e:
        raise ValueError(f"dualkv: the score modifier calls {name} with "
                         f"arguments the tracer does not take: "
                         f"{clip(str(e), 200)}") from None


class _Value:
    """A traced scalar: the SSA name of an f32, i32 or i1 value (or the
    batch index, which may not be used). Python operators, torch functions
    (through __torch_function__) and Tensor-like methods emit ops."""

    __slots__ = ("trace", "name", "type")

    def __init__(self, trace, name, type_):
        self.trace = trace
        self.name = name
        self.type = type_

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _torch_function(func, args, kwargs or {})

    def __repr__(self):
        if self.type == _BATCH:
            return "<dualkv traced b (unusable)>"
        return f"<dualkv traced {self.type} {self.name}>"

    __hash__ = object.__hash__

    def _refuse(self, what):
        if self.type == _BATCH:
            raise _batch_error()
        raise ValueError(
            f"dualkv: the score modifier {what} a traced value: tracing "
            "cannot follow Python control flow or conversions on the "
            "values (if, and/or/not, min/max, math.*, float(), int()); use "
            "torch.where, torch.minimum/maximum and torch functions")

    def __bool__(self):
        self._refuse("takes the truth of")

    def __float__(self):
        self._refuse("converts to float")

    def __int__(self):
        self._refuse("converts to int")

    def __index__(self):
        self._refuse("uses as a Python index")

    def __round__(self, *args):
        self._refuse("rounds")

    def __floor__(self):
        self._refuse("floors")

    def __ceil__(self):
        self._refuse("ceils")

    def __trunc__(self):
        self._refuse("truncates")

    def __len__(self):
        self._refuse("takes the len of")

    def __iter__(self):
        self._refuse("iterates over")

    def __getitem__(self, index):
        return _getitem(self, index)

    def __getattr__(self, name):
        # Only reached for what the class lacks: a Tensor method the tracer
        # does not support (x.floor(), x.erf(), x.shape).
        if name.startswith("_"):
            raise AttributeError(name)
        raise ValueError(
            f"dualkv: the score modifier uses Tensor.{name} on a traced "
            f"value, which the tracer does not support; supported: "
            f"arithmetic, comparisons, "
            f"{', '.join(sorted(n for n in _FUNCTIONS if n[0] != '_'))}")

    def where(self, condition, other):
        return _where(condition, self, other)


def _method(name):
    handler = _FUNCTIONS[name]

    def method(self, *args, **kwargs):
        return handler(self, *args, **kwargs)

    method.__name__ = name
    return method


for _name in _FUNCTIONS:
    if _name not in ("__getitem__", "where", "__hash__"):
        setattr(_Value, _name, _method(_name))
del _name


def _trace(fn):
    """(text, captured tensors) of ``fn`` traced once."""
    trace = _Trace()
    args = (_Value(trace, "%score", _F32), _Value(trace, None, _BATCH),
            _Value(trace, "%head", _I32), _Value(trace, "%q_idx", _I32),
            _Value(trace, "%kv_idx", _I32))
    name = _name_of(fn)
    try:
        out = fn(*args)
    except TypeError as e:
        raise ValueError(f"dualkv: tracing the score modifier {name} "
                         f"failed: {clip(str(e), 300)} (it must take (score, "
                         "b, h, q_idx, kv_idx) and use only what the tracer "
                         "supports: see dualkv.score_mod)") from e
    if isinstance(out, _Value) and out.type == _BATCH:
        raise _batch_error()
    if isinstance(out, _Value) and out.trace is not trace:
        raise ValueError(f"dualkv: the score modifier {name} returns a value "
                         "of another trace")
    try:
        result = _as(trace, _operand(trace, out), _F32)
    except ValueError:
        raise ValueError(f"dualkv: the score modifier {name} returns "
                         f"{type(out).__name__} {shown(out)}; it must return "
                         "the new score (computed from its arguments, or a "
                         "number)") from None
    return trace.text(result)


def _name_of(fn):
    return getattr(fn, "__qualname__", None) or type(fn).__name__


# ------------------------------------------------------------ trace cache

_CACHE_SIZE = 128
_cache = collections.OrderedDict()  # key -> (ScoreMod, objects kept alive)
_cache_lock = threading.Lock()


def _summary(value, keep, depth=0):
    """What of one value the trace may depend on, hashable."""
    torch = _torch()
    if value is None or isinstance(value, (bool, str, bytes)):
        return (type(value).__name__, value)
    if isinstance(value, numbers.Number):
        return (type(value).__name__, value)
    if isinstance(value, torch.Tensor):
        keep.append(value)
        return ("tensor", id(value), tuple(value.shape), str(value.dtype))
    if isinstance(value, (tuple, list)) and depth < 2 and len(value) <= 64:
        return (type(value).__name__,
                tuple(_summary(v, keep, depth + 1) for v in value))
    keep.append(value)
    return ("object", id(value))


def _fingerprint(fn, keep):
    """The cache key of a callable (module docstring), or None for a
    callable that is not a function, partial or bound method."""
    if isinstance(fn, functools.partial):
        inner = _fingerprint(fn.func, keep)
        if inner is None:
            return None
        return ("partial", inner, _summary(fn.args, keep),
                tuple(sorted((k, _summary(v, keep))
                             for k, v in fn.keywords.items())))
    self = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    if code is None:
        return None
    keep.append(code)
    cells = []
    for cell in getattr(func, "__closure__", None) or ():
        try:
            cells.append(_summary(cell.cell_contents, keep))
        except ValueError:  # an empty cell
            cells.append(("empty",))
    names = getattr(func, "__globals__", {})
    seen = tuple((n, _summary(names[n], keep)) for n in code.co_names
                 if n in names)
    defaults = _summary(tuple(getattr(func, "__defaults__", None) or ()),
                        keep)
    kwdefaults = tuple(sorted(
        (k, _summary(v, keep))
        for k, v in (getattr(func, "__kwdefaults__", None) or {}).items()))
    bound = () if self is None else _summary(self, keep)
    return (id(code), tuple(cells), seen, defaults, kwdefaults, bound)


def _trace_cached(fn):
    if isinstance(fn, ScoreMod):
        return fn
    if not callable(fn):
        raise ValueError(f"dualkv: score_mod must be callable to be traced, "
                         f"got {type(fn).__name__} {shown(fn)}")
    _torch()  # tracing needs torch (captured tensors, __torch_function__)
    keep = []
    key = _fingerprint(fn, keep)
    if key is not None:
        with _cache_lock:
            found = _cache.get(key)
            if found is not None:
                _cache.move_to_end(key)
                return found[0]
    text, captured = _trace(fn)
    mod = ScoreMod(text, captured, _name_of(fn))
    if key is not None:
        with _cache_lock:
            _cache[key] = (mod, keep)
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return mod


def clear_cache():
    """Forgets every traced modifier (the next use traces again)."""
    with _cache_lock:
        _cache.clear()
