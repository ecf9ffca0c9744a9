"""CPU tests of the PyTorch binding: the plan cache and keys, lazy imports and
lazy backward symbols, argument checks, and the custom ops' fake/meta
implementations and autograd wiring on meta tensors (shapes only, no GPU),
torch.compile(fullgraph=True) on meta tensors. torch.library.opcheck needs the
real kernels (its schema and autograd checks run the op and read values), so
it is in test_backward.py, on the GPU.

Runs as a script (unittest, a ctest) or under pytest. Parts that need torch
(>= 2.4, for torch.library.custom_op) or transformers skip without them; the
rest needs libdualkv.so (found as dualkv._lib describes, e.g. DUALKV_LIB).
"""

import ctypes
import math
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from decimal import Decimal
from fractions import Fraction
from unittest import mock

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, PYTHON_DIR)
import dualkv  # noqa: E402
from dualkv import _bounded, _checks, _lib  # noqa: E402
from dualkv.plans import PlanCache, groups_from_key, plan_key  # noqa: E402

try:
    import torch
    HAVE_TORCH = hasattr(torch, "library") and hasattr(torch.library,
                                                       "custom_op")
except ImportError:
    torch = None
    HAVE_TORCH = False

try:
    import transformers  # noqa: F401
    HAVE_TRANSFORMERS = True
except ImportError:
    HAVE_TRANSFORMERS = False

needs_torch = unittest.skipUnless(HAVE_TORCH, "needs torch >= 2.4")

GROUPS = [(5, [3, 0, 2]), (4, [1])]  # T = 15


class PlanKeyTest(unittest.TestCase):
    def test_round_trip(self):
        key = plan_key(GROUPS)
        self.assertEqual(key, (2, 5, 3, 3, 0, 2, 4, 1, 1))
        self.assertEqual(groups_from_key(key), [(5, [3, 0, 2]), (4, [1])])
        self.assertEqual(groups_from_key(plan_key([(7, [])])), [(7, [])])

    def test_malformed_keys_raise(self):
        for bad, what in [((), "empty"), ((-1,), "negative"),
                          ((1, 5), "ends inside group 0"),
                          ((1, 5, 2, 1), "response count"),
                          ((1, 5, 0, 9), "past its last group")]:
            with self.assertRaisesRegex(ValueError, what):
                groups_from_key(bad)

    def test_keys_and_plans_take_only_integers(self):
        # Keys and plan lengths: no float truncated, no str, bool, bytes,
        # Decimal, set, dict, None or inf accepted; always ValueError.
        for bad in [3.7, 2.0, "12", b"1", True, None, Decimal("1"), {1},
                    {1: 2}, float("inf"), float("nan"), -7, 2**31, 2**64]:
            for groups in [[(bad, [2])], [(3, [bad])], [(3, [2, bad])]]:
                with self.assertRaises(ValueError, msg=repr(groups)):
                    dualkv.Plan(groups)
                with self.assertRaises(ValueError, msg=repr(groups)):
                    plan_key(groups)
            with self.assertRaises(ValueError, msg=repr(bad)):
                groups_from_key((1, 4, 1, bad))
        for bad in [None, 5, "ab", {(1, (2,))}, [(1, 2, 3)], [(1,)], [None],
                    [(4, 2)], [(4, None)]]:
            with self.assertRaises(ValueError, msg=repr(bad)):
                dualkv.Plan(bad)
        for key in [(1, 4, 1, -7), (1, -4, 0), (True, 4, 0), (1.0, 4, 0),
                    ("1", "4", "0"), None, 5, (1, 4, 1, 2**31)]:
            with self.assertRaises(ValueError, msg=repr(key)):
                groups_from_key(key)
        self.assertEqual(dualkv.Plan([(3, [2])]).groups, [(3, [2])])

    def test_plan_key_attribute_rebuilds_the_same_plan(self):
        plan = dualkv.Plan(GROUPS)
        self.assertEqual(plan.key, plan_key(GROUPS))
        again = dualkv.Plan(groups_from_key(plan.key))
        self.assertEqual(again.segment_table(), plan.segment_table())
        self.assertEqual(again.num_tokens, 15)


class PlanCacheTest(unittest.TestCase):
    def test_lru_eviction_and_devices(self):
        cache = PlanCache(capacity=2)
        a, b, c = object(), object(), object()
        cache.put(0, (1, 4, 0), a)
        cache.put(0, (1, 5, 0), b)
        self.assertIs(cache.get(0, (1, 4, 0)), a)  # a is now most recent
        cache.put(0, (1, 6, 0), c)                 # evicts b
        self.assertIsNone(cache.get(0, (1, 5, 0)))
        self.assertIs(cache.get(0, (1, 4, 0)), a)
        self.assertIs(cache.get(0, (1, 6, 0)), c)
        self.assertIsNone(cache.get(1, (1, 4, 0)))  # other device, other entry
        self.assertEqual(len(cache), 2)
        self.assertEqual((cache.hits, cache.misses), (3, 2))
        cache.clear()
        self.assertEqual(len(cache), 0)

    def test_get_or_create_builds_once(self):
        cache = PlanCache(capacity=4)
        made = []

        def create(key):
            made.append(key)
            return dualkv.Plan(groups_from_key(key))

        key = plan_key(GROUPS)
        p1 = cache.get_or_create(0, key, create)
        p2 = cache.get_or_create(0, key, create)
        self.assertIs(p1, p2)
        self.assertEqual(made, [key])
        self.assertEqual(p1.num_tokens, 15)
        self.assertIn((0, key), cache)

    def test_capacity_must_be_positive(self):
        with self.assertRaisesRegex(ValueError, "capacity"):
            PlanCache(capacity=0)


class LibraryTest(unittest.TestCase):
    def test_argument_structs_match_the_library(self):
        # dualkv_names() reports the sizeof of every argument struct as the
        # library was compiled; the ctypes declarations must agree, or every
        # field after the first difference would be read from the wrong place.
        sizes = _lib.names()["struct_sizes"]
        self.assertEqual(set(sizes), set(_lib.STRUCTS))
        for name, struct in _lib.STRUCTS.items():
            self.assertEqual(ctypes.sizeof(struct), sizes[name], name)
        self.assertEqual(_lib.ForwardArgs().struct_size,
                         ctypes.sizeof(_lib.ForwardArgs))

    def test_names_are_the_library_spellings(self):
        names = _lib.names()
        self.assertEqual(names["dtypes"]["bf16"], _lib.BF16)
        self.assertEqual(names["dtypes"]["fp16"], _lib.FP16)
        self.assertEqual(names["dtypes"]["float16"], _lib.FP16)
        self.assertNotIn("f16", names["dtypes"])
        self.assertEqual(_lib.name_of("dtypes", _lib.FP16), "fp16")
        self.assertEqual(_lib.name_of("algorithms", 2), "split_dq")
        self.assertEqual(dualkv._precompile_dtype("fp16"), _lib.FP16)
        with self.assertRaisesRegex(ValueError, "neither bf16 nor fp16"):
            dualkv._precompile_dtype("f16")

    def test_a_null_argument_struct_is_refused_by_name(self):
        lib = _lib.lib()
        self.assertEqual(lib.dualkv_forward(None), _lib.ERROR_INVALID_ARGUMENT)
        self.assertIn("args is null", _lib.last_error())
        args = _lib.ForwardArgs(num_tokens=13, num_q_heads=8, num_kv_heads=2,
                                head_dim=128)
        self.assertEqual(lib.dualkv_forward(ctypes.byref(args)),
                         _lib.ERROR_INVALID_ARGUMENT)
        self.assertIn("plan is null", _lib.last_error())

    def test_tiling_takes_four_integers(self):
        zero = dualkv._tiling(None)
        self.assertEqual([zero.block_m, zero.block_n, zero.warps,
                          zero.stages], [0, 0, 0, 0])
        t = dualkv._tiling((64, 32, 4, 0))
        self.assertEqual([t.block_m, t.block_n, t.warps, t.stages],
                         [64, 32, 4, 0])
        for bad, message in [([1.5, 0, 0, 0], "tiling\\[0\\] must be an integer"),
                             ([64, True, 4, 1], "tiling\\[1\\] must be an integer"),
                             ([64, 32, -4, 1], "tiling\\[2\\] = -4 is out of range"),
                             ([64, 32, 4], "tiling must be 4 ints"),
                             ("abcd", "tiling must be a sequence"),
                             (7, "tiling must be a sequence")]:
            with self.assertRaisesRegex(ValueError, message, msg=repr(bad)):
                dualkv._tiling(bad)

    def test_a_bad_dualkv_lib_is_an_os_error_naming_it(self):
        for bad, message in [("/nonexistent/libdualkv.so", "is not a file"),
                             ("/etc/hostname", "")]:
            env = dict(os.environ, DUALKV_LIB=bad)
            r = subprocess.run(
                [sys.executable, "-c",
                 "import dualkv\ntry:\n    dualkv.version()\n"
                 "except OSError as e:\n    print('OSError:', e)"],
                cwd=PYTHON_DIR, env=env, capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("OSError:", r.stdout)
            self.assertIn(message, r.stdout)

    def test_submodules_load_by_attribute_and_by_from_import(self):
        # dualkv.ops / dualkv.distributed through the lazy __getattr__ and
        # `from dualkv import ...` (once a RecursionError): the module, or an
        # ImportError when torch is missing, never anything else.
        code = ("import sys; sys.path.insert(0, sys.argv[1]); import dualkv\n"
                "for name in ('ops', 'distributed'):\n"
                "    try:\n"
                "        getattr(dualkv, name)\n"
                "        exec('from dualkv import ' + name)\n"
                "    except ImportError:\n"
                "        pass\n"
                "print('ok')")
        run = subprocess.run([sys.executable, "-c", code, PYTHON_DIR],
                             capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr[-2000:])
        self.assertIn("ok", run.stdout)

    def test_import_needs_neither_torch_nor_transformers(self):
        code = ("import sys; sys.path.insert(0, sys.argv[1]); import dualkv; "
                "dualkv.Plan([(3, [1])]); "
                "bad = [m for m in ('torch', 'transformers') "
                "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
        run = subprocess.run([sys.executable, "-c", code, PYTHON_DIR],
                             capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)


def float32(x):
    """x as the C float it becomes in dualkv_forward_args_t (ctypes' cast:
    the reference the package's struct-based rounding is checked against)."""
    return ctypes.c_float(x).value


class ScaleTest(unittest.TestCase):
    """The softmax scale: None is the default, anything given must be a
    finite nonzero real whose float32 value is finite and nonzero; 0 (once
    run as 1/sqrt(D)), what rounds to 0 in float32 (the same, or -0 with q
    negated) and what overflows it are ValueErrors naming the value. No torch
    needed: forward and backward check it before anything else."""

    REFUSED = [
        (0, "scale must be nonzero, got 0 "), (0.0, "scale must be nonzero"),
        (-0.0, "scale must be nonzero, got -0.0"),
        (Fraction(0), "scale must be nonzero"),
        (1e-46, "scale 1e-46 rounds to 0 in float32"),
        (-1e-46, "scale -1e-46 rounds to 0 in float32"),
        (1e-300, "rounds to 0 in float32"), (2.0**-150, "rounds to 0"),
        (-(2.0**-150), "rounds to 0"), (5e-324, "rounds to 0"),
        (Fraction(1, 10**400), "rounds to 0"),
        (1e39, "scale 1e+39 overflows float32"), (-1e39, "overflows float32"),
        (3.4028235677973366e38, "overflows float32"),  # past FLT_MAX's half ulp
        (10**400, "overflows float32"), (-10**400, "overflows float32"),
        (float("inf"), "scale must be finite, got inf"),
        (float("-inf"), "must be finite"), (float("nan"), "must be finite"),
        ("1", "scale must be a real number, got str '1'"),
        (True, "must be a real number"), (Decimal("1"), "must be a real number"),
        (1j, "must be a real number"), ([1.0], "must be a real number"),
    ]
    ACCEPTED = [0.125, -0.125, 1, -2, 1 / math.sqrt(128), 2.0**-149,
                -(2.0**-149), 1e-45, 1.5 * 2.0**-150, 3.4028234663852886e38,
                -3.4028234663852886e38, Fraction(1, 8), 1e-40, 7e37]

    def test_refused_values_are_named(self):
        for bad, message in self.REFUSED:
            with self.assertRaises(ValueError, msg=repr(bad)) as err:
                _checks.scale_value(bad)
            self.assertIn(message, str(err.exception))
            self.assertTrue(str(err.exception).startswith("dualkv: scale"))

    def test_refused_exactly_when_float32_is_zero_or_infinite(self):
        for x in [2.0**e * m for e in range(-152, -146) for m in (1, 1.25, 1.5)] + \
                 [3.4028234663852886e38 * (1 + d) for d in (0, 1e-8, 2e-8, 3e-8, 1e-7)]:
            for value in (x, -x):
                single = float32(value)
                if single == 0.0 or math.isinf(single):
                    with self.assertRaises(ValueError, msg=repr(value)):
                        _checks.scale_value(value)
                else:
                    self.assertEqual(_checks.scale_value(value), single, repr(value))

    def test_accepted_values_are_their_float32_with_their_sign(self):
        self.assertEqual(_checks.scale_value(None), 0.0)  # the C API's default
        for good in self.ACCEPTED:
            value = _checks.scale_value(good)
            self.assertEqual(value, float32(float(good)), repr(good))
            self.assertNotEqual(value, 0.0)
            self.assertTrue(math.isfinite(value))
            self.assertEqual(math.copysign(1, value), math.copysign(1, good))

    def test_forward_and_backward_refuse_a_bad_scale_first(self):
        # Before torch is imported or any tensor looked at: the same
        # ValueError with or without torch.
        for bad, message in self.REFUSED:
            with self.assertRaises(ValueError, msg=repr(bad)) as err:
                dualkv.forward(None, None, None, None, scale=bad)
            self.assertIn(message, str(err.exception))
            with self.assertRaises(ValueError, msg=repr(bad)) as err:
                dualkv.backward(None, None, None, None, None, None, None,
                                scale=bad)
            self.assertIn(message, str(err.exception))


class WindowTest(unittest.TestCase):
    """The sliding window: None and 0 are none, any other value an integer
    W >= 1 up to the C API's int64; negatives, bools, floats and strings are
    ValueErrors naming the window. No torch needed: forward and backward
    check it before any tensor."""

    REFUSED = [(-1, "got -1"), (2**63, f"at most {2**63 - 1}"),
               (1.0, "got float 1.0"), (2.5, "got float 2.5"),
               (True, "got the bool True"), (False, "got the bool False"),
               ("4", "got str '4'"), (Fraction(4), "got Fraction"),
               (Decimal(4), "got Decimal"), ([4], "got list")]

    def test_accepted_values(self):
        self.assertEqual(_checks.window_value(None), 0)
        self.assertEqual(_checks.window_value(0), 0)
        for good in (1, 2, 4096, 2**63 - 1):
            self.assertEqual(_checks.window_value(good), good)

        class Index:  # numpy's integers and the like: __index__
            def __index__(self):
                return 7
        self.assertEqual(_checks.window_value(Index()), 7)

    def test_refused_values_are_named(self):
        for bad, message in self.REFUSED:
            with self.assertRaises(ValueError, msg=repr(bad)) as err:
                _checks.window_value(bad)
            self.assertTrue(str(err.exception).startswith("dualkv: window"),
                            str(err.exception))
            self.assertIn(message, str(err.exception))

    def test_forward_and_backward_refuse_a_bad_window_first(self):
        for bad, message in self.REFUSED:
            with self.assertRaisesRegex(ValueError, "window", msg=repr(bad)):
                dualkv.forward(None, None, None, None, window=bad)
            with self.assertRaisesRegex(ValueError, "window", msg=repr(bad)):
                dualkv.backward(None, None, None, None, None, None, None,
                                window=bad)

    def test_argument_structs_end_with_the_window(self):
        # dualkv_c.h appends `int64_t window` after sinks (forward) and after
        # dsinks (backward), then the score modifier's three fields and the
        # `int64_t v_head_dim`; the library's struct_sizes check the sizes
        # (LibraryTest), this the order.
        for struct, before in ((_lib.ForwardArgs, "sinks"),
                               (_lib.BackwardArgs, "dsinks")):
            names = [name for name, _ in struct._fields_]
            self.assertEqual(names[-6:], [before, "window", "score_mod",
                                          "score_mod_inputs",
                                          "num_score_mod_inputs",
                                          "v_head_dim"],
                             struct.__name__)
            self.assertIs(struct._fields_[-5][1], ctypes.c_int64)
            self.assertIs(struct._fields_[-1][1], ctypes.c_int64)
            self.assertEqual(getattr(struct, "window").offset % 8, 0)
        args = _lib.ForwardArgs(window=5)
        self.assertEqual(args.window, 5)
        self.assertFalse(args.sinks)  # a null pointer by default


class ArchTest(unittest.TestCase):
    """precompile's arch: None or "sm_" with 2 or 3 ASCII digits and an
    optional "a"; anything else (a NUL, which C would end the string at, so
    "sm_80\x00x" compiled sm_80) is a ValueError before the library is
    called. Well-formed archs go on to the library, which names the
    supported ones."""

    MALFORMED = ["sm_80\x00x", "sm_80\x00", "\x00", "", " sm_80", "sm_80 ",
                 "sm_80\n", "SM_80", "sm80", "sm_8", "sm_1000", "sm_90b",
                 "sm_90aa", "sm_\uff18\uff10", "sm_\u0668\u0660", "sm_\udc80",
                 "x" * 10**6, "compute_80"]

    def test_malformed_archs_never_reach_the_library(self):
        def no_library():
            raise AssertionError("the library was called")

        with mock.patch.object(_lib, "lib", no_library):
            for bad in self.MALFORMED:
                with self.assertRaises(ValueError, msg=repr(bad[:20])) as err:
                    dualkv.precompile(64, 4, 4, arch=bad, backward=False)
                message = str(err.exception)
                self.assertIn("is not of the form sm_NN or sm_NNa", message)
                self.assertLess(len(message), 300)
            for bad in [b"sm_80", 80, ["sm_80"]]:
                with self.assertRaisesRegex(ValueError, "arch must be a string"):
                    dualkv.precompile(64, 4, 4, arch=bad, backward=False)

    def test_well_formed_archs_reach_the_library(self):
        # An unsupported arch of the right form is the library's to refuse;
        # head_dim 80 makes sure that no supported one compiles anything.
        with self.assertRaisesRegex(ValueError, "arch 'sm_12' is not supported; "
                                    "supported: sm_80, "):
            dualkv.precompile(64, 4, 4, arch="sm_12", backward=False)
        for arch in ["sm_80", "sm_90a", "sm_100"]:
            with self.assertRaisesRegex(ValueError, "head_dim \\(80\\)"):
                dualkv.precompile(80, 4, 4, arch=arch, backward=False)


STUB_LIBRARY = r"""
const char *dualkv_version(void) { return "%(version)s"; }
const char *dualkv_names(void) { return "%(names)s"; }
%(others)s
"""


class LibraryLoadTest(unittest.TestCase):
    """What DUALKV_LIB may name: anything but libdualkv.so of this package's
    C API is an OSError naming the path and why; empty is unset."""

    def load(self, env_value):
        """The outcome of loading with DUALKV_LIB=env_value (None: unset) in
        a new process: the library's path, or 'OSError: <message>'."""
        env = dict(os.environ)
        env.pop("DUALKV_LIB", None)
        if env_value is not None:
            env["DUALKV_LIB"] = env_value
        code = ("import sys; sys.path.insert(0, sys.argv[1]); import dualkv\n"
                "from dualkv import _lib\n"
                "print([str(p) for p in _lib.candidates()])\n"
                "try:\n    print(dualkv.library_path(), dualkv.version())\n"
                "except OSError as e:\n    print('OSError:', e)\n")
        run = subprocess.run([sys.executable, "-c", code, PYTHON_DIR],
                             env=env, capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stderr[-2000:])
        return run.stdout

    def test_another_library_is_not_a_dualkv_library(self):
        # A shared library every Python has (_ctypes' extension module): it
        # used to be reported as a DualKV that "predates this package".
        import _ctypes
        path = getattr(_ctypes, "__file__", None)
        if path is None:
            self.skipTest("_ctypes is built into this Python")
        out = self.load(path)
        self.assertIn(f"OSError: dualkv: DUALKV_LIB={path} is not a DualKV "
                      "library: it has none of the C API's functions", out)
        self.assertNotIn("predates", out)

    def stub(self, folder, version, names, functions):
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            self.skipTest("no C compiler to build a stub library")
        source = os.path.join(folder, "stub.c")
        with open(source, "w") as f:
            f.write(STUB_LIBRARY % {
                "version": version, "names": names,
                "others": "\n".join(f"int {name}(void) {{ return 0; }}"
                                    for name in functions)})
        lib = os.path.join(folder, "libstub.so")
        subprocess.run([cc, "-shared", "-fPIC", "-o", lib, source], check=True)
        return lib

    def test_an_older_or_other_version_is_named(self):
        with tempfile.TemporaryDirectory() as tmp:
            older = self.stub(tmp, "0.1.0", "{}", ["dualkv_last_error"])
            out = self.load(older)
            self.assertIn(f"OSError: dualkv: DUALKV_LIB={older} is DualKV "
                          "0.1.0, whose C API lacks dualkv_gpu_available, ", out)
            self.assertIn("it predates this package", out)
            # Every function, but a vocabulary this package cannot read.
            everything = [n for n in ("dualkv_last_error",
                                      "dualkv_gpu_available",
                                      "dualkv_plan_create",
                                      "dualkv_plan_create_tree",
                                      "dualkv_plan_max_ancestor_ranges",
                                      "dualkv_plan_num_chain_rows",
                                      "dualkv_plan_chain_table",
                                      "dualkv_plan_destroy",
                                      "dualkv_plan_upload",
                                      "dualkv_plan_num_tokens",
                                      "dualkv_plan_num_segments",
                                      "dualkv_plan_segment_table",
                                      "dualkv_forward", "dualkv_backward",
                                      "dualkv_backward_workspace_size",
                                      "dualkv_cache_stats",
                                      "dualkv_precompile")]
            os.makedirs(os.path.join(tmp, "other"))
            other = self.stub(os.path.join(tmp, "other"), "9.0.0",
                              '{\\"dtypes\\": 1}', everything)
            out = self.load(other)
            self.assertIn(f"OSError: dualkv: DUALKV_LIB={other} is DualKV "
                          "9.0.0, whose dualkv_names() is not the vocabulary "
                          "this package", out)

    def test_empty_dualkv_lib_is_unset(self):
        # The same candidates and the same outcome (this checkout's
        # build/libdualkv.so, or the same "not found") as without it.
        unset = self.load(None)
        self.assertEqual(self.load(""), unset)
        self.assertNotIn("DUALKV_LIB=", unset)

    def test_empty_flags_are_unset(self):
        for value, expected in [(None, True), ("", True), ("0", False),
                                ("1", True), ("no", True)]:
            env = {} if value is None else {"DUALKV_PRECOMPILE": value}
            with mock.patch.dict(os.environ, env, clear=False):
                if value is None:
                    os.environ.pop("DUALKV_PRECOMPILE", None)
                self.assertEqual(_bounded.env_flag("DUALKV_PRECOMPILE", True),
                                 expected, repr(value))
                self.assertEqual(_bounded.env_value("DUALKV_PRECOMPILE"),
                                 value or None)


class BoundedMessageTest(unittest.TestCase):
    """Messages quote user input cut to a bounded length with the count of
    what was cut, and never fail on what they quote."""

    def test_long_and_deep_values_are_cut(self):
        for bad, shown in [("7" * 10**6, "more characters cut"),
                           (b"1" * 10**6, "more characters cut"),
                           ([1] * 10**6, "...")]:
            with self.assertRaises(ValueError) as err:
                dualkv.Plan([(bad, [1])])
            self.assertIn(shown, str(err.exception))
            self.assertLess(len(str(err.exception)), 300)
        deep = []
        for _ in range(10**5):  # repr() of it raises RecursionError
            deep = [deep]
        with self.assertRaisesRegex(ValueError, "must be an integer"):
            dualkv.Plan([(deep, [1])])
        with self.assertRaisesRegex(ValueError, "more characters cut"):
            dualkv.precompile(64, 4, 4, dtype="f" * 10**6, arch="sm_80")

    def test_clip(self):
        self.assertEqual(_bounded.clip("abc", 3), "abc")
        self.assertEqual(_bounded.clip("abcdef", 2),
                         "ab... (4 more characters cut)")


def meta(*shape, dtype=None, requires_grad=False):
    return torch.randn(*shape, dtype=dtype or torch.bfloat16, device="meta",
                       requires_grad=requires_grad)


@needs_torch
class ValidationTest(unittest.TestCase):
    """attention() checks on CPU/meta tensors: ValueError naming the
    argument, before anything reaches the library."""

    def setUp(self):
        self.plan = dualkv.Plan(GROUPS)
        T = self.plan.num_tokens
        self.q, self.k, self.v = meta(T, 4, 64), meta(T, 2, 64), meta(T, 2, 64)

    def check(self, pattern, *args, **kwargs):
        with self.assertRaisesRegex(ValueError, pattern):
            dualkv.attention(*args, **kwargs)

    def test_bad_arguments_name_the_argument(self):
        q, k, v, plan = self.q, self.k, self.v, self.plan
        cpu = torch.zeros(q.shape, dtype=q.dtype)
        self.check("q is on cpu", cpu, k, v, plan)
        self.check("k is on cpu", q, torch.zeros(k.shape, dtype=k.dtype), v,
                   plan)
        self.check("q has dtype torch.float32", q.float(), k.float(),
                   v.float(), plan)
        self.check("k has dtype", q, k.half(), v, plan)
        self.check("v has dtype", q, k, v.half(), plan)
        self.check("but v has", q, k, v[:, :1], plan)
        self.check("k has shape", q, k[:, :, :32], v[:, :, :32], plan)
        # v's head_dim may differ from q's and k's (MLA); its tokens and
        # heads may not.
        self.check("but v has", q, k, meta(q.shape[0] - 1, 2, 32), plan)
        self.check("not a multiple of k's heads", meta(15, 3, 64), k, v, plan)
        self.check("q must be 3-D", q[0], k, v, plan)
        self.check("q's last dimension must be contiguous",
                   meta(15, 64, 4).transpose(1, 2), k, v, plan)
        self.check("plan must be a dualkv.Plan", q, k, v, [(5, [3])])
        self.check("q must be a torch.Tensor", None, k, v, plan)
        self.check("scale must be nonzero", q, k, v, plan, scale=0.0)
        self.check("rounds to 0 in float32", q, k, v, plan, scale=1e-46)
        self.check("rounds to 0 in float32", q, k, v, plan, scale=-1e-46)
        self.check("overflows float32", q, k, v, plan, scale=1e39)
        self.check("scale must be a real number", q, k, v, plan, scale="1")
        self.check("scale must be a real number", q, k, v, plan, scale=True)
        self.check("scale must be finite", q, k, v, plan,
                   scale=float("inf"))
        self.check("scale must be finite", q, k, v, plan,
                   scale=float("nan"))
        self.check("plan has 15", q[:-1], k[:-1], v[:-1], plan)

    def test_bad_window_and_sinks_name_the_argument(self):
        q, k, v, plan = self.q, self.k, self.v, self.plan
        self.check("window must be an integer >= 0", q, k, v, plan, window=-1)
        self.check("window must be an integer", q, k, v, plan, window=2.0)
        self.check("window must be an integer", q, k, v, plan, window=True)
        self.check("sinks must be a torch.Tensor", q, k, v, plan,
                   sinks=[0.0] * 4)
        self.check(r"sinks has shape \(2,\); it must be \[4\]", q, k, v,
                   plan, sinks=torch.zeros(2, device="meta"))
        self.check(r"sinks has shape \(1, 4\)", q, k, v, plan,
                   sinks=torch.zeros(1, 4, device="meta"))
        self.check("sinks has dtype torch.int32", q, k, v, plan,
                   sinks=torch.zeros(4, dtype=torch.int32, device="meta"))
        self.check("sinks is on cpu but q is on meta", q, k, v, plan,
                   sinks=torch.zeros(4))

    def test_ops_refuse_cpu_tensors(self):
        T = self.plan.num_tokens
        q = torch.zeros(T, 4, 64, dtype=torch.bfloat16)
        k = torch.zeros(T, 2, 64, dtype=torch.bfloat16)
        desc = dualkv.ops.plan_descriptor(self.plan)
        with self.assertRaisesRegex(ValueError, "q is on cpu"):
            torch.ops.dualkv.forward(q, k, k, desc, 0.0, False)
        with self.assertRaisesRegex(ValueError, "q is on cpu"):
            dualkv.backward(q, k, k, q, q, torch.zeros(4, T), self.plan)
        with self.assertRaisesRegex(ValueError, "q is on cpu"):
            torch.ops.dualkv.forward(q, k, k, desc, 0.0, False, 0.0, 4,
                                     torch.zeros(4))
        with self.assertRaisesRegex(ValueError, "q is on cpu"):
            dualkv.forward(q, k, k, self.plan, window=3,
                           sinks=torch.zeros(4))

    def test_first_call_does_not_import_dynamo(self):
        # torch.library.custom_op's kernels import torch._dynamo on their
        # first call (seconds: benchmarks/torch_custom_op_first_call.py);
        # dualkv's ops must not. In a new process: the forward op's kernel
        # (reached with CPU tensors: its ValueError) and attention's autograd
        # forward+backward (meta tensors) leave torch._dynamo unimported.
        code = (
            "import sys; sys.path.insert(0, sys.argv[1]); import torch\n"
            "if 'torch._dynamo' in sys.modules: print('skip'); sys.exit(0)\n"
            "import dualkv\n"
            "plan = dualkv.Plan([(5, [3])])\n"
            "q = torch.zeros(8, 4, 64, dtype=torch.bfloat16)\n"
            "desc = dualkv.ops.plan_descriptor(plan)\n"
            "try:\n"
            "    torch.ops.dualkv.forward(q, q, q, desc, 0.0, False)\n"
            "except ValueError as e:\n"
            "    assert 'q is on cpu' in str(e), e\n"
            "m = [torch.randn(8, h, 64, dtype=torch.bfloat16, device='meta',\n"
            "                 requires_grad=True) for h in (4, 2, 2)]\n"
            "dualkv.attention(*m, plan).float().sum().backward()\n"
            "assert m[0].grad is not None\n"
            "print('dynamo' if 'torch._dynamo' in sys.modules else 'ok')\n")
        run = subprocess.run([sys.executable, "-c", code, PYTHON_DIR],
                             capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr[-2000:])
        if run.stdout.strip() == "skip":
            self.skipTest("this torch imports torch._dynamo with torch")
        self.assertEqual(run.stdout.strip(), "ok")

    def test_descriptor_must_be_an_int32_cpu_vector(self):
        bad = torch.tensor(self.plan.key, dtype=torch.int64)
        with self.assertRaisesRegex(ValueError, "int32 CPU tensor"):
            dualkv.ops.plan_for(bad, torch.device("cuda", 0))


@needs_torch
class FakeTest(unittest.TestCase):
    """The fake (meta) implementations give the real ops' shapes, dtypes and
    layouts, and autograd connects forward and backward."""

    def setUp(self):
        self.plan = dualkv.Plan(GROUPS)
        self.T = self.plan.num_tokens

    def test_descriptor(self):
        desc = dualkv.ops.plan_descriptor(self.plan)
        self.assertEqual(desc.dtype, torch.int32)
        self.assertEqual(desc.device.type, "cpu")
        self.assertEqual(tuple(desc.tolist()), self.plan.key)
        # Plans made once torch is loaded carry it from the start.
        self.assertIsNotNone(dualkv.Plan([(2, [2])]).descriptor)

    def test_meta_forward_shapes(self):
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v = (meta(self.T, 8, 128, dtype=dtype),
                       meta(self.T, 2, 128, dtype=dtype),
                       meta(self.T, 2, 128, dtype=dtype))
            o, lse = dualkv.attention(q, k, v, self.plan, return_lse=True)
            self.assertEqual((o.shape, o.dtype, o.device.type),
                             (q.shape, dtype, "meta"))
            self.assertTrue(o.is_contiguous())
            self.assertEqual((tuple(lse.shape), lse.dtype), ((8, self.T),
                                                              torch.float32))
            self.assertTrue(lse.is_contiguous())

    def test_meta_backward_shapes_gqa(self):
        q = meta(self.T, 8, 64, requires_grad=True)
        k = meta(self.T, 2, 64, requires_grad=True)
        v = meta(self.T, 2, 64, requires_grad=True)
        o, lse = dualkv.attention(q, k, v, self.plan, return_lse=True)
        self.assertTrue(o.requires_grad)
        self.assertTrue(lse.requires_grad)  # differentiable: dLSE
        # A non-contiguous dO (the transpose's gradient) is accepted.
        o.transpose(0, 1).float().sum().backward()
        for x in (q, k, v):
            self.assertEqual((x.grad.shape, x.grad.dtype), (x.shape, x.dtype))

    def test_meta_mla_shapes(self):
        # MLA: q and k rows of 192, v rows of 128; o, dO and dv are 128
        # wide, dq and dk 192.
        q = meta(self.T, 8, 192, requires_grad=True)
        k = meta(self.T, 2, 192, requires_grad=True)
        v = meta(self.T, 2, 128, requires_grad=True)
        o, lse = dualkv.attention(q, k, v, self.plan, return_lse=True)
        self.assertEqual(tuple(o.shape), (self.T, 8, 128))
        self.assertTrue(o.is_contiguous())
        self.assertEqual(tuple(lse.shape), (8, self.T))
        o.float().sum().backward()
        for x in (q, k, v):
            self.assertEqual((x.grad.shape, x.grad.dtype), (x.shape, x.dtype))
        desc = dualkv.ops.plan_descriptor(self.plan)
        dq, dk, dv = torch.ops.dualkv.backward(
            q.detach(), k.detach(), v.detach(), o.detach(), o.detach(),
            lse.detach(), desc, 0.0, False)
        self.assertEqual([tuple(t.shape) for t in (dq, dk, dv)],
                         [(self.T, 8, 192), (self.T, 2, 192),
                          (self.T, 2, 128)])

    def test_backward_op_fake_shapes(self):
        q, k = meta(self.T, 4, 64), meta(self.T, 1, 64)
        lse = torch.empty(4, self.T, device="meta")
        desc = dualkv.ops.plan_descriptor(self.plan)
        dq, dk, dv = torch.ops.dualkv.backward(q, k, k, q, q, lse, desc, 0.0,
                                               True)
        self.assertEqual([t.shape for t in (dq, dk, dv)],
                         [q.shape, k.shape, k.shape])
        self.assertEqual({t.dtype for t in (dq, dk, dv)}, {torch.bfloat16})

    def test_op_schemas_take_window_and_sinks_with_defaults(self):
        # The arguments added for the variants come last, with defaults, so
        # every earlier positional call of the ops still works.
        fwd = torch.ops.dualkv.forward.default._schema
        names = [a.name for a in fwd.arguments]
        mod = ["score_mod", "score_mod_data", "score_mod_sizes"]
        self.assertEqual(names, ["q", "k", "v", "plan", "scale",
                                 "deterministic", "softcap", "window",
                                 "sinks"] + mod)
        self.assertEqual(fwd.arguments[7].default_value, 0)
        for a in fwd.arguments[8:]:
            self.assertIsNone(a.default_value, a.name)
        bwd = torch.ops.dualkv.backward.default._schema
        self.assertEqual([a.name for a in bwd.arguments][-6:],
                         ["softcap", "dlse", "window"] + mod)
        self.assertEqual(len(bwd.returns), 3)
        sinks = torch.ops.dualkv.backward_sinks.default._schema
        self.assertEqual([a.name for a in sinks.arguments][-5:],
                         ["window", "sinks"] + mod)
        self.assertEqual(len(sinks.returns), 4)

    def test_meta_sinks_and_window_forward_backward(self):
        # The sinks' gradient comes back through autograd, in the sinks' own
        # dtype (attention runs them in float32); a window changes no shape.
        for sdtype in (torch.float32, torch.bfloat16):
            q = meta(self.T, 8, 64, requires_grad=True)
            k = meta(self.T, 2, 64, requires_grad=True)
            v = meta(self.T, 2, 64, requires_grad=True)
            sinks = torch.zeros(8, dtype=sdtype, device="meta",
                                requires_grad=True)
            o, lse = dualkv.attention(q, k, v, self.plan, window=3,
                                      sinks=sinks, return_lse=True)
            self.assertEqual((o.shape, tuple(lse.shape)),
                             (q.shape, (8, self.T)))
            (o.float().sum() + lse.sum()).backward()
            self.assertEqual((sinks.grad.shape, sinks.grad.dtype),
                             (sinks.shape, sdtype))
            for x in (q, k, v):
                self.assertEqual(x.grad.shape, x.shape)
        # Without sinks, no sinks gradient: the three-output backward.
        q = meta(self.T, 4, 64, requires_grad=True)
        k = meta(self.T, 4, 64, requires_grad=True)
        dualkv.attention(q, k, k, self.plan, window=1).float().sum().backward()
        self.assertEqual(q.grad.shape, q.shape)

    def test_meta_score_mod_forward_backward(self):
        # A score modifier crosses the ops as text, one float32 tensor and
        # its sizes (a traced function, its captured tensors moved to q's
        # device); autograd hands it to the backward and gives it no
        # gradient.
        from dualkv import score_mods
        slopes = score_mods.alibi_slopes(8)
        table = torch.zeros(8, 9)

        def two_inputs(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx) + table[h, 4]

        for mod in (score_mods.alibi(slopes), score_mods.softcap(20.0),
                    two_inputs):
            q = meta(self.T, 8, 64, requires_grad=True)
            k = meta(self.T, 2, 64, requires_grad=True)
            v = meta(self.T, 2, 64, requires_grad=True)
            sinks = torch.zeros(8, device="meta", requires_grad=True)
            o, lse = dualkv.attention(q, k, v, self.plan, score_mod=mod,
                                      sinks=sinks, return_lse=True)
            (o.float().sum() + lse.sum()).backward()
            for x in (q, k, v, sinks):
                self.assertEqual(x.grad.shape, x.shape)
        mod = dualkv.ScoreMod.trace(two_inputs)
        data, sizes = mod.flat_inputs(torch.device("meta"))
        self.assertEqual((data.device.type, sizes), ("meta", [8, 72]))
        with self.assertRaisesRegex(ValueError, "score_mod must be"):
            dualkv.attention(q, k, v, self.plan, score_mod=3)

    def test_backward_sinks_op_fake_shapes(self):
        q, k = meta(self.T, 4, 64), meta(self.T, 1, 64)
        lse = torch.empty(4, self.T, device="meta")
        sinks = torch.empty(4, device="meta")
        desc = dualkv.ops.plan_descriptor(self.plan)
        dq, dk, dv, dsinks = torch.ops.dualkv.backward_sinks(
            q, k, k, q, q, lse, desc, 0.0, False, 0.0, None, 5, sinks)
        self.assertEqual([t.shape for t in (dq, dk, dv, dsinks)],
                         [q.shape, k.shape, k.shape, sinks.shape])
        self.assertEqual(dsinks.dtype, torch.float32)

    def test_fake_tensor_mode(self):
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode() as mode:
            q = mode.from_tensor(meta(self.T, 4, 128, dtype=torch.float16))
            k = mode.from_tensor(meta(self.T, 4, 128, dtype=torch.float16))
            desc = mode.from_tensor(dualkv.ops.plan_descriptor(self.plan))
            o, lse = torch.ops.dualkv.forward(q, k, k, desc, 0.0, False)
            dq, dk, dv = torch.ops.dualkv.backward(q, k, k, o, o, lse, desc,
                                                   0.0, False)
        self.assertEqual((o.shape, o.dtype), (q.shape, torch.float16))
        self.assertEqual((lse.shape, lse.dtype), ((4, self.T), torch.float32))
        self.assertEqual((dk.shape, dv.dtype), (k.shape, torch.float16))

    def test_compile_fullgraph_and_no_recompile_for_a_new_plan(self):
        from torch._dynamo.testing import CompileCounterWithBackend
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")

        def step(q, k, v, plan):
            return dualkv.attention(q, k, v, plan).float().square().sum()

        compiled = torch.compile(step, backend=counter, fullgraph=True)
        for groups in ([(5, [3, 2])], [(4, [3, 3])], [(8, [1, 1])]):
            plan = dualkv.Plan(groups)  # same T (10) and descriptor length
            q = meta(10, 4, 64, requires_grad=True)
            k = meta(10, 2, 64, requires_grad=True)
            v = meta(10, 2, 64, requires_grad=True)
            compiled(q, k, v, plan).backward()
            self.assertEqual(q.grad.shape, q.shape)
            self.assertEqual(k.grad.shape, k.shape)
        # One graph for all three plans: their lengths are tensor data.
        self.assertEqual(counter.frame_count, 1)

    def test_compile_fullgraph_with_window_and_sinks(self):
        from torch._dynamo.testing import CompileCounterWithBackend
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")

        def step(q, k, v, sinks, plan):
            return dualkv.attention(q, k, v, plan, window=4,
                                    sinks=sinks).float().square().sum()

        compiled = torch.compile(step, backend=counter, fullgraph=True)
        for groups in ([(5, [3, 2])], [(4, [3, 3])]):
            plan = dualkv.Plan(groups)
            q = meta(10, 4, 64, requires_grad=True)
            k = meta(10, 2, 64, requires_grad=True)
            sinks = torch.zeros(4, device="meta", requires_grad=True)
            compiled(q, k, k, sinks, plan).backward()
            self.assertEqual(sinks.grad.shape, sinks.shape)
            self.assertEqual(q.grad.shape, q.shape)
        self.assertEqual(counter.frame_count, 1)


@needs_torch
class TransformersBackendTest(unittest.TestCase):
    def setUp(self):
        from dualkv import transformers_backend
        self.backend = transformers_backend
        self.plan = dualkv.Plan(GROUPS)
        self.T = self.plan.num_tokens

    def test_layout(self):
        q = meta(1, 8, self.T, 64)
        k = meta(1, 2, self.T, 64)
        out, weights = self.backend.dualkv_attention_forward(
            None, q, k, k, None, scaling=0.125, dualkv_plan=self.plan)
        self.assertEqual(tuple(out.shape), (1, self.T, 8, 64))
        self.assertIsNone(weights)

    def test_mla_layout(self):
        # DeepSeek-V3's layers hand value states of 128 beside query/key
        # states of 192 (unpadded: padding is for flash attention only).
        q = meta(1, 8, self.T, 192)
        k = meta(1, 2, self.T, 192)
        v = meta(1, 2, self.T, 128)
        out, weights = self.backend.dualkv_attention_forward(
            None, q, k, v, None, scaling=192 ** -0.5, dualkv_plan=self.plan)
        self.assertEqual(tuple(out.shape), (1, self.T, 8, 128))
        self.assertIsNone(weights)

    def test_refusals(self):
        fn = self.backend.dualkv_attention_forward
        q, k = meta(1, 4, self.T, 64), meta(1, 2, self.T, 64)
        with self.assertRaisesRegex(ValueError, "dualkv_plan"):
            fn(None, q, k, k, None)
        with self.assertRaisesRegex(ValueError, "batch size 2"):
            fn(None, meta(2, 4, self.T, 64), meta(2, 2, self.T, 64),
               meta(2, 2, self.T, 64), None, dualkv_plan=self.plan)
        with self.assertRaisesRegex(ValueError, "dropout"):
            fn(None, q, k, k, None, dropout=0.1, dualkv_plan=self.plan)
        with self.assertRaisesRegex(ValueError, "sliding_window.*window must "
                                    "be an integer >= 0"):
            fn(None, q, k, k, None, sliding_window=-2, dualkv_plan=self.plan)

    def variant_kwargs(self, module=None, **kwargs):
        """The keyword arguments the backend hands dualkv.attention for a
        layer called with these transformers kwargs."""
        seen = {}

        def fake_attention(q, k, v, plan, **kw):
            seen.update(kw)
            return q

        q, k = meta(1, 4, self.T, 64), meta(1, 2, self.T, 64)
        with mock.patch.object(self.backend, "attention", fake_attention):
            self.backend.dualkv_attention_forward(
                module, q, k, k, None, dualkv_plan=self.plan, **kwargs)
        return seen

    def test_variants_reach_attention(self):
        T = self.T
        # transformers' sliding_window W is DualKV's window W (no
        # off-by-one: both allow q - kv < W); W >= T is no window.
        self.assertEqual(self.variant_kwargs(sliding_window=4)["window"], 4)
        self.assertEqual(self.variant_kwargs(sliding_window=1)["window"], 1)
        self.assertEqual(self.variant_kwargs(sliding_window=T - 1)["window"],
                         T - 1)
        self.assertEqual(self.variant_kwargs(sliding_window=T)["window"], 0)
        self.assertEqual(self.variant_kwargs(sliding_window=None)["window"], 0)
        self.assertEqual(self.variant_kwargs()["window"], 0)
        # A module that carries its window but does not pass it.
        layer = mock.Mock(spec=["sliding_window"], sliding_window=3)
        self.assertEqual(self.variant_kwargs(layer)["window"], 3)
        # The keyword wins over the attribute (None on a full layer).
        self.assertEqual(self.variant_kwargs(layer, sliding_window=None)
                         ["window"], 0)
        # gpt-oss's s_aux (its sinks parameter) and Gemma 2's softcap.
        sinks = torch.zeros(4, device="meta")
        seen = self.variant_kwargs(s_aux=sinks, softcap=30.0)
        self.assertIs(seen["sinks"], sinks)
        self.assertEqual(seen["softcap"], 30.0)
        self.assertIsNone(self.variant_kwargs()["sinks"])

    def test_window_and_sinks_run_through_the_ops(self):
        q, k = meta(1, 4, self.T, 64), meta(1, 2, self.T, 64)
        sinks = torch.zeros(4, dtype=torch.bfloat16, device="meta")
        out, _ = self.backend.dualkv_attention_forward(
            None, q, k, k, None, scaling=0.125, sliding_window=4, s_aux=sinks,
            dualkv_plan=self.plan)
        self.assertEqual(tuple(out.shape), (1, self.T, 4, 64))

    def test_import_does_not_import_transformers(self):
        code = ("import sys; sys.path.insert(0, sys.argv[1]); "
                "import dualkv.transformers_backend; "
                "sys.exit(1 if 'transformers' in sys.modules else 0)")
        run = subprocess.run([sys.executable, "-c", code, PYTHON_DIR],
                             capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)

    @unittest.skipUnless(HAVE_TRANSFORMERS, "needs transformers")
    def test_register(self):
        from transformers import AttentionInterface
        name = self.backend.register()
        self.assertEqual(name, "dualkv")
        self.assertIs(AttentionInterface()["dualkv"],
                      self.backend.dualkv_attention_forward)


if __name__ == "__main__":
    unittest.main()
