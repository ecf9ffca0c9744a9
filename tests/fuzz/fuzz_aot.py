#!/usr/bin/env python3
"""Seeded fuzzing of dualkv-aot's command line and spec files.

Each input is a random argument vector (known flags with good, junk, huge,
negative, empty and non-ASCII values, unknown flags, missing values) and, for
about half of them, a spec file: a mutant of a valid one (fields dropped,
retyped, set to boundary values, bytes flipped or truncated), random JSON, deep
nesting, or a folder, FIFO or device in its place; some also pass a fuzzed
--tuning-db. Kernels are compiled with --no-cubin, so no ptxas is needed.

A run passes when it exits 0, 1 or 2 within the timeout, with no signal and no
abort ("terminate called", "LLVM ERROR", "Stack dump", ...), and a nonzero exit
says why on stderr in a line starting "dualkv-aot:". The last line is a summary
with the number of inputs tried. Standard library only.

About one input in eight is an oracle case instead: a valid command with one
head_dim, value head_dim or heads (on the command line, or in a spec file with
the integers written in some form) whose verdict is known independently
(ORACLE_* below).
One that no kernel supports or no launch takes must be refused with exit 2 and
one "dualkv-aot:" line before anything is written; one that is fine must
compile (exit 0).
"""
import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

FATAL = re.compile(rb"LLVM ERROR|Stack dump|PLEASE submit a bug report|Assertion .* failed|"
                   rb"terminate called|Segmentation fault|UNREACHABLE|Traceback")

# Archs the fuzzer draws from: those with a measured GPU schedule (sm_100 and
# later are compile-tested by tests/lit/Tools/aot-ptxas-newer-archs.test).
ARCHS = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_90a"]
JUNK = ["", " ", "-1", "0", "1", "2", "3", "7", "8", "16", "17", "32", "33", "64", "65",
        "127", "128", "129", "256", "512", "1024", "4096", "65536", "2147483647",
        "2147483648", "-2147483649", "9223372036854775808", "1e3", "0x10", "1.5",
        "nan", "inf", "abc", "sm_", "sm_80,", ",", "::", "32:", ":8", "32:0", "0:0",
        "32:7", "bf16", "fp16", "f32", "fwd", "bwd", "bwd_kv", "bwd_dq", "bwd_pre",
        "bwd_post", "bwd_x", "\u00e9", "$(id)", "';id;'", "a b", "--out", "-h", "96",
        "6:4", "4:8", "65536:1", "65535:1", "4294967300:4", "65532:4"]
FLAGS = {
    "--kind": ["fwd", "bwd", "bwd_pre", "bwd_post", "bwd_kv", "bwd_dq"],
    "--P": ["0", "1", "64", "8192"],
    "--N": ["0", "1", "16"],
    "--head-dim": ["64", "128", "192", "256", "512"],
    "--v-head-dim": ["0", "64", "128", "192"],
    "--heads": ["32:8", "8:8", "4:1", "8:2", "1:1"],
    "--dtype": ["bf16", "fp16", "f16"],
    "--arch": ARCHS + ["sm_80,sm_90a"],
    "--block-m": ["0", "64", "128"],
    "--block-n": ["0", "16", "32", "64", "128"],
    "--warps": ["0", "4", "8"],
    "--stages": ["0", "1", "2", "3"],
    "--emit-registration": ["reg", "_x1", "9lives", "a-b", ""],
    "--tuned": None,
    "--no-cubin": None,
}
VALID_SPEC = {"kind": "fwd", "P": 0, "N": 0, "head_dim": 64, "heads": "4:4",
              "dtype": "bf16", "arch": "sm_80",
              "tiling": {"block_m": 64, "block_n": 32, "warps": 4, "stages": 2}}
VALUES = [None, True, False, 0, 1, -1, 64, 128, 256, 4097, 2**31, 2**63, -2**63, 2**64,
          2**64 - 1, 2**32 + 64, 64.0, 96, 1.5, 1e308, "", "x", "fwd", "bwd", "bf16", "sm_80",
          "sm_75", "4:4", "0:0", "6:4", "4:8", "65536:1", "4294967300:4", "+4:4", " 4:4",
          "4:4:4", "0x4:4", "tuned",
          "default", [], [1], ["sm_80", "sm_90a"], ["sm_80", 5], {}, {"block_m": 64},
          {"block_m": "64"}, {"warps": -1}, {"x": 1}, "\u00e9\u0000"]


def tuning_db(rng):
    entry = {"kind": "fwd", "P": 0, "N": 0, "head_dim": 64, "num_q_heads": 4,
             "num_kv_heads": 4, "dtype": "bf16", "arch": "sm_80",
             "tiling": {"block_m": 64, "block_n": 64, "warps": 4, "stages": 2}}
    doc = {"schema": "dualkv-tuning", "version": 2, "entries": [entry]}
    if rng.random() < 0.5:
        target = rng.choice([doc, entry, entry["tiling"]])
        key = rng.choice(list(target))
        target[key] = rng.choice(VALUES)
    text = json.dumps(doc)
    if rng.random() < 0.2:
        text = text[:rng.randrange(len(text))]
    return text.encode()


def mutate_json(rng, value, depth=0):
    """A random edit of a spec (or of a list of them)."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        value = dict(value)
        key = rng.choice(list(value))
        op = rng.random()
        if op < 0.2:
            del value[key]
        elif op < 0.7:
            value[key] = rng.choice(VALUES)
        elif op < 0.8:
            value[rng.choice(["colour", "Kind", "", "tiling "])] = 1
        else:
            value[key] = mutate_json(rng, value[key], depth + 1)
        return value
    if isinstance(value, list) and value and rng.random() < 0.8:
        value = list(value)
        i = rng.randrange(len(value))
        value[i] = mutate_json(rng, value[i], depth + 1)
        return value
    return rng.choice(VALUES)


def spec_bytes(rng):
    kind = rng.random()
    if kind < 0.55:
        specs = [dict(VALID_SPEC) for _ in range(rng.randint(1, 2))]
        for _ in range(rng.randint(1, 3)):
            specs = mutate_json(rng, specs)
        return json.dumps(specs).encode()
    if kind < 0.7:
        text = bytearray(json.dumps([VALID_SPEC]).encode())
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if op < 0.4 and text:
                text[rng.randrange(len(text))] = rng.randrange(256)
            elif op < 0.7 and text:
                del text[rng.randrange(len(text)):]
            else:
                at = rng.randrange(len(text) + 1)
                text[at:at] = rng.choice([b"[", b"{", b"]", b"}", b",", b"\"", b"\\",
                                          b"\x00", b"\xff", b"1e999", b"null"])
        return bytes(text)
    if kind < 0.8:
        depth = rng.choice([10, 31, 32, 33, 100, 5000, 200000])
        inner = rng.choice([b"", b"1", b'"x"'])
        open_, close = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
        return open_ * depth + inner + close * depth
    if kind < 0.9:
        return json.dumps(rng.choice(VALUES)).encode()
    return bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))


def make_input(rng, work, n):
    """(argv, description) of input n; writes its files under work."""
    argv = []
    for _ in range(rng.randint(0, 6)):
        flag = rng.choice(list(FLAGS) + ["--bogus", "-x", "--out", "--spec-file",
                                         "--tuning-db", "--dump-ir"])
        choices = FLAGS.get(flag)
        if flag in FLAGS and choices is None:
            argv.append(flag)
            continue
        argv.append(flag)
        if rng.random() < 0.05:
            continue  # a flag without its value (when it is last)
        if choices and rng.random() < 0.6:
            argv.append(rng.choice(choices))
        else:
            argv.append(rng.choice(JUNK))
    spec = os.path.join(work, "spec-%05d.json" % n)
    if rng.random() < 0.5:
        shape = rng.random()
        if shape < 0.9:
            with open(spec, "wb") as f:
                f.write(spec_bytes(rng))
        elif shape < 0.94:
            os.mkdir(spec)
        elif shape < 0.97:
            os.mkfifo(spec)
        else:
            os.symlink("/dev/zero", spec)
        argv += ["--spec-file", spec]
    if rng.random() < 0.15:
        db = os.path.join(work, "db-%05d.json" % n)
        with open(db, "wb") as f:
            f.write(tuning_db(rng))
        argv += ["--tuning-db", db]
        if rng.random() < 0.7:
            argv.append("--tuned")
    if rng.random() < 0.97:
        argv += ["--out", os.path.join(work, "out")]
    # Compiles are the slow part: PTX only, one arch unless asked.
    if "--no-cubin" not in argv and rng.random() < 0.9:
        argv.append("--no-cubin")
    return argv


# The oracle: head_dim, value head_dim and heads values whose verdict is known
# without the tool. A head shape is supported when the value head_dim is the
# head_dim and that is 64, 96, 128, 256 or 512, or when they are MLA's 192 and 128;
# --v-head-dim 0 (and leaving it out) means the --head-dim's. Heads HQ:HKV are
# launchable when both are integers >= 1, HQ a multiple of HKV and HQ <= 65535
# (a grid dimension); for a backward kind also HQ + HKV <= 65535.
ORACLE_HEAD_DIMS = [64, 96, 128, 192, 256, 512, 0, -64, 80, 1024, 4096,
                    2**32 + 64, 2**63 - 1]
# None: not given.
ORACLE_V_HEAD_DIMS = [None, None, 128, 64, 192, 0, 80, -128]
ORACLE_HEADS = [(4, 4), (8, 2), (65535, 1), (65530, 5), (0, 0), (4, 0), (0, 4), (6, 4),
                (4, 8), (65536, 1), (65532, 4), (131072, 2), (2**32 + 4, 4), (4, 2**32 + 4)]


def head_dim_ok(d):
    """Whether --head-dim d parses: a query/key width of some shape."""
    return d in (64, 96, 128, 192, 256, 512)


def v_head_dim_ok(v):
    """Whether --v-head-dim v parses (0: the --head-dim's)."""
    return v in (0, 64, 96, 128, 256, 512)


def shape_ok(d, v):
    """Whether (head_dim d, value head_dim v) is a head shape; v None or 0:
    d."""
    v = v or d
    return (d == v and d in (64, 96, 128, 256, 512)) or (d, v) == (192, 128)


def heads_ok(hq, hkv, backward):
    return (hq >= 1 and hkv >= 1 and hq % hkv == 0 and hq <= 65535
            and (not backward or hq + hkv <= 65535))


def spell_integer(rng, n):
    """n as a spec file writes it: sometimes in a form that is no JSON integer
    (a float, a string) and so is refused whatever its value."""
    form = rng.random()
    if form < 0.7:
        return str(n), True
    if form < 0.85:
        return "%d.0" % n, False
    return json.dumps(str(n)), False


def oracle_input(rng, work, n):
    """(argv, expected exit, what each line of the refusal names) of an oracle
    case."""
    out = os.path.join(work, "out")
    kind = rng.choice(["fwd", "fwd", "bwd_pre"])
    backward = kind != "fwd"
    d = rng.choice(ORACLE_HEAD_DIMS if rng.random() < 0.4 else [64])
    v = rng.choice(ORACLE_V_HEAD_DIMS) if rng.random() < 0.4 else None
    if rng.random() < 0.1:
        d, v = 192, 128
    hq, hkv = rng.choice(ORACLE_HEADS if rng.random() < 0.7 else [(4, 4)])
    heads = "%d:%d" % (hq, hkv)
    base = ["--no-cubin", "--arch", "sm_80", "--out", out]
    if rng.random() < 0.5:
        argv = ["--kind", kind, "--head-dim", str(d)]
        if v is not None:
            argv += ["--v-head-dim", str(v)]
        argv += ["--heads", heads] + base
        # llvm::cl reports each bad flag on a line of its own; the head shape
        # and then the backward's HQ + HKV are checked once the flags are
        # parsed, the first problem ending the run.
        names = [] if head_dim_ok(d) else ["--head-dim"]
        if v is not None and not v_head_dim_ok(v):
            names.append("--v-head-dim")
        if not heads_ok(hq, hkv, False):
            names.append("--heads")
        if not names and not shape_ok(d, v):
            names.append("--head-dim %d" % d)
        if not names and not heads_ok(hq, hkv, backward):
            names.append("--heads")
        return argv, (2 if names else 0), names
    dim_text, dim_typed = spell_integer(rng, d)
    heads_forms = [(json.dumps(heads), True)]
    if rng.random() < 0.3:
        heads_forms = [(json.dumps(rng.choice(["+", " ", "0x", ""]) + heads +
                                   rng.choice([" ", ":1", ""])), None),
                       (str(hq), False)]
    heads_text, heads_typed = rng.choice(heads_forms)
    if heads_typed is None:  # a prefix or suffix: refused unless it added none
        heads_typed = json.loads(heads_text) == heads
    v_field, v_good = "", True
    if v is not None:
        v_text, v_typed = spell_integer(rng, v)
        v_field = ', "v_head_dim": %s' % v_text
        # A spec's value head_dim is a width: 0 is refused there.
        v_good = v_typed and v in (64, 96, 128, 256, 512)
    text = '[{"kind": "%s", "head_dim": %s%s, "heads": %s}]' % (
        kind, dim_text, v_field, heads_text)
    spec = os.path.join(work, "oracle-%05d.json" % n)
    with open(spec, "w") as f:
        f.write(text)
    dim_good = dim_typed and head_dim_ok(d)
    pair_good = shape_ok(d, v)
    ok = (dim_good and v_good and pair_good and heads_typed
          and heads_ok(hq, hkv, backward))
    # The first bad field of a spec ends the reading: head_dim, v_head_dim,
    # their pair, then heads.
    names = ["spec[0].head_dim" if not dim_good else
             "spec[0].v_head_dim" if not v_good else
             "spec[0]: head_dim" if not pair_good else "spec[0].heads"]
    return ["--spec-file", spec] + base, (0 if ok else 2), names


def check_oracle(aot, argv, expected, names, out, timeout):
    """The oracle's verdict on one case, or None when the tool agreed."""
    try:
        r = subprocess.run([aot] + argv, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           timeout=timeout, cwd=os.path.dirname(out))
    except subprocess.TimeoutExpired:
        return "hang (no exit after %ss)" % timeout, b"", None
    rc = r.returncode
    if rc != expected:
        return "oracle: exit %d, expected %d" % (rc, expected), r.stderr, rc
    if expected == 2:
        lines = [l for l in r.stderr.splitlines() if l.startswith(b"dualkv-aot: ")]
        if len(lines) != len(names) or not all(
                n.encode() in l for n, l in zip(names, lines)):
            return ("oracle: the refusal is not one dualkv-aot line naming each of %s"
                    % ", ".join(names), r.stderr, rc)
        if os.path.exists(out):
            return "oracle: refused, yet --out was created", r.stderr, rc
    return None, b"", rc


def check(aot, argv, timeout, work):
    # In the work folder: a junk --out or --dump-ir value is a relative path.
    try:
        r = subprocess.run([aot] + argv, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           timeout=timeout, cwd=work)
    except subprocess.TimeoutExpired:
        return "hang (no exit after %ss)" % timeout, b"", None
    rc = r.returncode
    if rc < 0 or rc >= 128:
        return "crash (exit %d)" % rc, r.stderr, rc
    if rc not in (0, 1, 2):
        return "exit %d" % rc, r.stderr, rc
    if FATAL.search(r.stderr):
        return "fatal error reported (exit %d)" % rc, r.stderr, rc
    if rc != 0 and not re.search(rb"^dualkv-aot: \S", r.stderr, re.MULTILINE):
        return "exit %d without a message" % rc, r.stderr, rc
    return None, b"", rc


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aot", default="dualkv-aot")
    ap.add_argument("--work", required=True, help="folder for the inputs")
    ap.add_argument("--count", type=int, default=10**9)
    ap.add_argument("--seconds", type=float, default=50.0,
                    help="stop generating inputs after this long")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()

    args.work = os.path.abspath(args.work)
    args.aot = shutil.which(args.aot) or args.aot
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    rng = random.Random(args.seed)
    start = time.monotonic()
    failures, tried, exits = [], 0, {}
    oracle = {0: 0, 2: 0}  # oracle cases by expected exit
    for n in range(args.count):
        if time.monotonic() - start > args.seconds:
            break
        if rng.random() < 0.125:
            argv, expected, names = oracle_input(rng, args.work, n)
            oracle[expected] += 1
            reason, stderr, rc = check_oracle(args.aot, argv, expected, names,
                                              os.path.join(args.work, "out"),
                                              args.timeout)
        else:
            argv = make_input(rng, args.work, n)
            reason, stderr, rc = check(args.aot, argv, args.timeout, args.work)
        tried += 1
        exits[rc] = exits.get(rc, 0) + 1
        if reason:
            failures.append((argv, reason, stderr))
        shutil.rmtree(os.path.join(args.work, "out"), ignore_errors=True)
    for argv, reason, stderr in failures:
        print("FAIL: %s: %s %s" % (reason, args.aot, " ".join(repr(a) for a in argv)))
        for line in stderr.decode("utf-8", "replace").strip().splitlines()[:12]:
            print("    " + line)
    print("fuzz dualkv-aot: %d inputs (seed %d, %.0f s; exit 0: %d, 1: %d, 2: %d; "
          "oracle: %d to refuse, %d to compile), %d failures"
          % (tried, args.seed, time.monotonic() - start, exits.get(0, 0), exits.get(1, 0),
             exits.get(2, 0), oracle[2], oracle[0], len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
