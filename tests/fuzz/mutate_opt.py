#!/usr/bin/env python3
"""Deterministic mutation fuzzing of dualkv-opt (ctest fuzz:dualkv-opt).

Takes the lit suite's .mlir files and the kernel template, cuts them into their
`// -----` cases, derives mutants with a seeded RNG (delete / duplicate / swap
tokens, flip numbers, change enum and attribute values, truncate, inject junk) and
runs dualkv-opt on every mutant: parse and verify only, then bind + tile, and for
mutants of the template the lowering too. A run must exit 0 or 1 (never a signal
or an abort), a failing run must say where (`file:line:col: error:` or `loc(`),
and nothing may print an LLVM fatal error or a stack dump. Failures are written
to --out for reproduction and listed; the last line is a summary for FileCheck.

Then specs (issue 31 D4): every kernel kind, schedule, arch and head_dim against a
set of tilings that fit and that do not (--combos of them, seeded), each bound by
dualkv-bind-spec and also written into a bound kernel's text by hand (the route
that crashed the lowering). A spec the spec check refuses must be a located error
of dualkv-bind-spec or the dualkv.kernel verifier; one it accepts must tile and
lower; wgmma and warp_specialized are refused on every arch but sm_90a; nothing
crashes. Standard library only.
"""
import argparse
import concurrent.futures
import os
import random
import re
import subprocess
import sys

TOKEN = re.compile(rb"""
    "(?:[^"\\\n]|\\.)*"            # string literal
  | 0x[0-9A-Fa-f]+                 # hex number
  | -?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?  # number
  | [%^#!@]?[A-Za-z_][\w.$-]*      # identifiers, SSA names, attribute/type aliases
  | //[^\n]*                       # comment
  | \s+                            # whitespace
  | .                              # any other single character
""", re.VERBOSE | re.DOTALL)

# Values that stress the verifiers: boundaries, overflow, the unsupported.
NUMBERS = [b"0", b"-1", b"1", b"2", b"3", b"7", b"15", b"16", b"17", b"31", b"32",
           b"48", b"63", b"64", b"65", b"96", b"127", b"128", b"255", b"256",
           b"257", b"512", b"1024", b"4096", b"2147483647", b"2147483648",
           b"4294967296", b"-2147483649", b"9223372036854775807",
           b"-9223372036854775808", b"99999999999999999999", b"0.0", b"-0.5",
           b"1.0e308", b"1e-320", b"0x7FF8000000000000"]
# Keywords the dialect gives meaning to, swapped for one another.
WORDS = [b"shared", b"response", b"none", b"bound", b"causal", b"all", b"full",
         b"tail", b"diagonal", b"fwd", b"bwd_pre", b"bwd", b"bwd_post", b"key",
         b"value", b"bf16", b"f16", b"f32", b"i32", b"index", b"true", b"false",
         b"part", b"kind", b"problem", b"tiling", b"arch", b"iter_args",
         b"attributes", b"P", b"N", b"num_q_heads", b"num_kv_heads", b"head_dim",
         b"dtype", b"scale", b"block_m", b"block_n", b"warps", b"stages",
         b"!dualkv.q_tile", b"!dualkv.kv_tile", b"!dualkv.scores", b"!dualkv.probs",
         b"!dualkv.acc", b"!dualkv.row_stats", b"dualkv.kernel", b"dualkv.kv_loop",
         b"dualkv.load_q", b"dualkv.load_kv", b"dualkv.qk", b"dualkv.mask",
         b"dualkv.online_softmax", b"dualkv.rescale", b"dualkv.pv",
         b"dualkv.store_output", b"dualkv.yield", b"dualkv.init_acc",
         b"dualkv.init_stats", b"arith.constant", b"\"sm_80\"", b"\"gfx90a\"", b"\"\"",
         b"%j", b"%q", b"%acc", b"%m", b"%l", b"^bb0", b"^bb1"]
JUNK = [b"{", b"}", b"(", b")", b"<", b">", b"[", b"]", b":", b",", b"=", b"\"",
        b"%", b"#", b"!", b"^", b"@", b"\\", b"\x00", b"\xff", b"\xc3\x28",
        "\u00e9".encode(), b"\t", b"\n", b"// -----\n", b"#dualkv.", b"!dualkv.",
        b"loc(", b"{-#", b"#-}", b"dense<", b"0x", b"..."]
# Same-category replacements keep the text parseable more often, so the mutants reach
# the verifiers and the passes instead of stopping in the lexer.
CATEGORIES = [
    [b"shared", b"response"],
    [b"none", b"bound", b"causal"],
    [b"all", b"full", b"tail", b"diagonal"],
    [b"fwd", b"bwd_pre", b"bwd", b"bwd_post"],
    [b"key", b"value"],
    [b"bf16", b"f16", b"f32", b"i32", b"index"],
    [b"true", b"false"],
    [b"!dualkv.q_tile", b"!dualkv.kv_tile", b"!dualkv.scores", b"!dualkv.probs",
     b"!dualkv.acc", b"!dualkv.row_stats"],
    [b"dualkv.load_q", b"dualkv.init_acc", b"dualkv.load_kv", b"dualkv.qk",
     b"dualkv.mask", b"dualkv.online_softmax", b"dualkv.rescale", b"dualkv.pv",
     b"dualkv.store_output", b"dualkv.yield", b"dualkv.init_stats",
     b"dualkv.kv_loop", b"dualkv.kernel", b"dualkv.attention_fwd",
     b"dualkv.attention_bwd"],
    [b"\"sm_80\"", b"\"sm_90a\"", b"\"sm_100\"", b"\"gfx90a\"", b"\"\"", b"\"sm_\""],
]
MUTATORS = ["delete", "duplicate", "swap", "number", "word", "truncate", "junk",
            "delete_line", "duplicate_line", "swap_lines", "delete_span",
            "enum", "enum", "enum", "ssa", "ssa", "move_line", "move_line", "number"]


def cases(path):
    """The `// -----` cases of a file, without RUN/CHECK comment lines."""
    with open(path, "rb") as f:
        text = f.read()
    out = []
    for chunk in re.split(rb"\n// -----\n", text):
        body = b"\n".join(l for l in chunk.split(b"\n") if not l.lstrip().startswith(b"//"))
        if body.strip():
            out.append(body + b"\n")
    return out


# UPSTREAM: MLIR's parser sizes its forward-reference table by an SSA use's result
# number, so `%0#2147483647` aborts with "LLVM ERROR: out of memory" in mlir-opt 22
# as well. Not a DualKV bug; mutants that spell such a use are not run.
UPSTREAM_OOM = re.compile(rb"#\s*\d{6,}")


def mutate(rng, text):
    tokens = TOKEN.findall(text)
    solid = [i for i, t in enumerate(tokens) if not t.isspace() and not t.startswith(b"//")]
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        kind = rng.choice(MUTATORS)
        if not solid:
            break
        i = rng.choice(solid)
        if kind == "delete":
            tokens[i] = b""
        elif kind == "duplicate":
            tokens[i] = tokens[i] + b" " + tokens[i]
        elif kind == "swap":
            j = rng.choice(solid)
            tokens[i], tokens[j] = tokens[j], tokens[i]
        elif kind == "number":
            # Not the result number of an SSA use (%x#N): see UPSTREAM below.
            nums = [k for k in solid if re.fullmatch(rb"-?\d[\w.+-]*", tokens[k])
                    and not (k and tokens[k - 1] == b"#")]
            tokens[rng.choice(nums) if nums else i] = rng.choice(NUMBERS)
        elif kind == "word":
            words = [k for k in solid if tokens[k].strip(b"<>%!\"") and
                     re.fullmatch(rb"[%!^\"]?[A-Za-z_][\w.$\"-]*", tokens[k])]
            tokens[rng.choice(words) if words else i] = rng.choice(WORDS)
        elif kind == "truncate":
            cut = rng.randrange(len(tokens) + 1)
            tokens = tokens[:cut]
            solid = [k for k in solid if k < cut]
        elif kind == "enum":
            spots = [(k, c) for k in solid for c in CATEGORIES if tokens[k] in c]
            if spots:
                k, c = rng.choice(spots)
                tokens[k] = rng.choice(c)
        elif kind == "ssa":
            # Use another value (often of another type, scope or later definition).
            names = sorted({t for t in tokens if re.fullmatch(rb"%[\w#]+", t)})
            uses = [k for k in solid if tokens[k] in names]
            if uses:
                tokens[rng.choice(uses)] = rng.choice(names)
        elif kind == "junk":
            tokens[i] = rng.choice([tokens[i] + rng.choice(JUNK), rng.choice(JUNK)])
        else:
            lines = b"".join(tokens).split(b"\n")
            a = rng.randrange(len(lines))
            if kind == "delete_line":
                del lines[a]
            elif kind == "duplicate_line":
                lines.insert(a, lines[a])
            elif kind == "move_line":
                lines.insert(rng.randrange(len(lines) + 1), lines.pop(a))
            elif kind == "swap_lines":
                b = rng.randrange(len(lines))
                lines[a], lines[b] = lines[b], lines[a]
            else:  # delete_span
                del lines[a:a + rng.randint(2, 6)]
            tokens = TOKEN.findall(b"\n".join(lines))
            solid = [k for k, t in enumerate(tokens)
                     if not t.isspace() and not t.startswith(b"//")]
    return b"".join(tokens)


LOCATED = re.compile(rb"^[^\n:]+:\d+:\d+: error:|loc\(", re.MULTILINE)
FATAL = re.compile(rb"LLVM ERROR|Stack dump|PLEASE submit a bug report|Assertion .* failed|"
                   rb"terminate called|Segmentation fault|UNREACHABLE")


def check(opt, path, flags, timeout):
    """Runs dualkv-opt; returns None if it behaved, else a one-line reason."""
    cmd = [opt, path, "--mlir-print-op-on-diagnostic=false", "-o", os.devnull] + flags
    try:
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "hang (no exit after %ss)" % timeout, b""
    if r.returncode < 0 or r.returncode >= 128:
        return "crash (exit %d)" % r.returncode, r.stderr
    if r.returncode not in (0, 1):
        return "exit %d" % r.returncode, r.stderr
    if FATAL.search(r.stderr):
        return "fatal error reported (exit %d)" % r.returncode, r.stderr
    if r.returncode == 1 and not LOCATED.search(r.stderr):
        return "failure without a located diagnostic", r.stderr
    return None, b""


# ---- spec combinations -------------------------------------------------------------

KINDS = ["fwd", "bwd_dq", "bwd", "bwd_kv", "bwd_pre", "bwd_post"]
SCHEDULES = ["auto", "mma_sync", "wgmma", "warp_specialized"]
ARCHS = ["sm_80", "sm_86", "sm_90", "sm_90a", "sm_120"]
HEAD_DIMS = [64, 96, 128, 256, 512]
# block_m:block_n:warps:stages. Defaults (None), the tilings the schedules are
# measured at, the crash (128:32:4:2 under wgmma), and ones no schedule or
# arch takes: too many accumulator registers, copies that do not split, shared
# memory beyond sm_80's 163 KB or the 99 KB archs', a ring of 3-4 stages, 8 key rows;
# head_dim 512's KV-major tiling (32 keys in 8 warps).
TILINGS = [None, (128, 32, 4, 2), (128, 64, 8, 1), (128, 64, 8, 2), (128, 64, 8, 3),
           (128, 128, 8, 2), (64, 32, 4, 1), (64, 64, 4, 1), (64, 32, 8, 1),
           (128, 32, 8, 1), (256, 256, 16, 2), (64, 16, 4, 1), (32, 32, 2, 1),
           (16, 16, 1, 1), (256, 32, 16, 2), (128, 16, 8, 4), (128, 8, 8, 2),
           (32, 32, 8, 1)]
WARPGROUP = ("wgmma", "warp_specialized")
TILING_TEXT = re.compile(rb"tiling <[^>]*>")
ARCH_TEXT = re.compile(rb'arch "[^"]*"')
SCHEDULE_TEXT = re.compile(rb"schedule <[a-z_]+>")


def spec_combos(rng, count):
    """`count` distinct (kind, schedule, arch, head_dim, tiling), seeded; the issue's
    reproductions always among them."""
    every = [(k, s, a, d, t) for k in KINDS for s in SCHEDULES for a in ARCHS
             for d in HEAD_DIMS for t in TILINGS]
    must = [(k, "wgmma", a, 128, (128, 32, 4, 2)) for k in ("fwd", "bwd_dq")
            for a in ("sm_80", "sm_90a")]
    rest = [c for c in every if c not in must]
    return must + rng.sample(rest, max(0, min(count, len(every)) - len(must)))


def bind_option(kind, schedule, arch, head_dim, tiling):
    opts = "arch=%s head-dim=%d schedule=%s" % (arch, head_dim, schedule)
    if tiling:
        opts += " block-m=%d block-n=%d warps=%d stages=%d" % tiling
    return "--dualkv-bind-spec=" + opts


def bound_kernels(opt, templates, out):
    """Per (kind, head_dim): the template bound on sm_80 with mma_sync's defaults,
    the text the hand-edited specs start from."""
    bound = {}
    for kind in KINDS:
        for d in HEAD_DIMS:
            r = subprocess.run([opt, os.path.join(templates, "attention_%s.mlir" % kind),
                                "--dualkv-bind-spec=arch=sm_80 head-dim=%d schedule=mma_sync" % d],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            if r.returncode == 0:
                bound[(kind, d)] = r.stdout
    return bound


def is_crash(failure):
    return failure[2].startswith(("crash", "hang", "fatal", "exit"))


def run_opt(opt, path, flags, out_path, timeout):
    """Runs dualkv-opt writing to out_path; returns (None or why it misbehaved, exit
    status, stderr), by check()'s rules."""
    cmd = [opt, path, "--mlir-print-op-on-diagnostic=false", "-o", out_path] + flags
    try:
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "hang (no exit after %ss)" % timeout, None, b""
    if r.returncode < 0 or r.returncode >= 128:
        return "crash (exit %d)" % r.returncode, r.returncode, r.stderr
    if r.returncode not in (0, 1):
        return "exit %d" % r.returncode, r.returncode, r.stderr
    if FATAL.search(r.stderr):
        return "fatal error reported (exit %d)" % r.returncode, r.returncode, r.stderr
    if r.returncode == 1 and not LOCATED.search(r.stderr):
        return "failure without a located diagnostic", 1, r.stderr
    return None, r.returncode, r.stderr


def run_combo(opt, templates, out, bound, n, combo, timeout):
    """Runs one spec both ways; returns (outcomes, failures)."""
    kind, schedule, arch, d, tiling = combo
    name = "%s %s %s d%d %s" % (kind, schedule, arch, d,
                                "default" if tiling is None else ":".join(map(str, tiling)))
    outcomes, failures = [], []
    lower = ["--dualkv-tile-regions", "--dualkv-lower-to-nvgpu"]

    def judge(path, flags, refusal):
        """flags bind (or, empty, only parse and verify) `path`; a spec accepted
        must then tile and lower. refusal: why the spec must be refused, or None."""
        bound_path = path + ".bound.mlir"
        reason, rc, stderr = run_opt(opt, path, flags, bound_path, timeout)
        if reason:
            failures.append((path, flags, "%s [%s]" % (reason, name), stderr))
            return
        if rc != 0:
            outcomes.append("refused")
            return
        if refusal:
            failures.append((path, flags, "accepted a spec that must be refused "
                             "(%s) [%s]" % (refusal, name), b""))
        reason, rc, stderr = run_opt(opt, bound_path, lower, os.devnull, timeout)
        if reason is None and rc != 0:
            reason = "the lowering refused a spec the verifier accepted"
        if reason:
            failures.append((bound_path, lower, "%s [%s]" % (reason, name), stderr))
        elif not refusal:
            outcomes.append("lowered")

    refusal = None
    if schedule in WARPGROUP and arch != "sm_90a":
        refusal = "%s needs sm_90a" % schedule
    elif schedule == "wgmma" and tiling == (128, 32, 4, 2):
        refusal = "wgmma gives a warp one m16 block, this tiling two"
    base = os.path.join(out, "spec-%04d" % n)
    # 1. Bound by dualkv-bind-spec (its check, then the kernel verifier's).
    bind_path = base + "-template.mlir"
    with open(os.path.join(templates, "attention_%s.mlir" % kind), "rb") as t:
        template = t.read()
    with open(bind_path, "wb") as f:
        f.write(template)
    judge(bind_path, [bind_option(kind, schedule, arch, d, tiling)], refusal)
    # 2. Written into a bound kernel by hand: only the verifier stands between the
    # text and the lowering. auto is no schedule a kernel records.
    text = bound.get((kind, d))
    if text is None or schedule == "auto":
        return outcomes, failures
    if tiling:
        text = TILING_TEXT.sub(b"tiling <block_m = %d, block_n = %d, warps = %d, stages = %d>"
                               % tiling, text, count=1)
    text = ARCH_TEXT.sub(b'arch "%s"' % arch.encode(), text, count=1)
    text = SCHEDULE_TEXT.sub(b"schedule <%s>" % schedule.encode(), text, count=1)
    edit_path = base + "-edited.mlir"
    with open(edit_path, "wb") as f:
        f.write(text)
    judge(edit_path, [], refusal)
    return outcomes, failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+", help=".mlir files or folders to take cases from")
    ap.add_argument("--template", required=True, help="the kernel template (also lowered)")
    ap.add_argument("--out", required=True, help="folder for the mutants")
    ap.add_argument("--opt", default="dualkv-opt")
    ap.add_argument("--count", type=int, default=400)
    ap.add_argument("--seed", type=int, default=20240601)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--templates", help="the templates folder (every kernel kind); "
                    "default: the --template's folder")
    ap.add_argument("--combos", type=int, default=240,
                    help="kind x schedule x arch x head_dim x tiling combinations tried")
    args = ap.parse_args()
    if args.templates is None:
        args.templates = os.path.dirname(os.path.abspath(args.template))

    files = []
    for p in args.inputs:
        if os.path.isdir(p):
            for root, _, names in sorted(os.walk(p)):
                files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".mlir")]
        else:
            files.append(p)
    pool = [c for f in files for c in cases(f)]
    template = cases(args.template)
    if not pool or not template:
        sys.exit("mutate_opt.py: no input cases")
    # The template after binding and tiling: mutants of it go through the lowering.
    tiled = subprocess.run([args.opt, args.template, "--dualkv-bind-spec=arch=sm_80 head-dim=64",
                            "--dualkv-tile-regions"], check=True, stdout=subprocess.PIPE).stdout
    template.append(tiled)

    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(args.seed)
    jobs = []
    for n in range(args.count):
        # A third of the mutants come from the template (as written or bound and
        # tiled): the pipeline's real input.
        from_template = n % 3 == 0
        seed_text = rng.choice(template if from_template else pool)
        path = os.path.join(args.out, "mutant-%04d.mlir" % n)
        text = mutate(rng, seed_text)
        while UPSTREAM_OOM.search(text):
            text = mutate(rng, seed_text)
        with open(path, "wb") as f:
            f.write(text)
        jobs.append((path, []))
        jobs.append((path, ["--dualkv-bind-spec", "--dualkv-tile-regions"]))
        if from_template:
            jobs.append((path, ["--dualkv-bind-spec=arch=sm_80 head-dim=64",
                                "--dualkv-tile-regions", "--dualkv-lower-to-nvgpu"]))
            jobs.append((path, ["--dualkv-tile-regions", "--dualkv-lower-to-nvgpu",
                                "--dualkv-to-llvm"]))

    failures = []
    combos = spec_combos(rng, args.combos)
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as ex:
        results = ex.map(lambda j: check(args.opt, j[0], j[1], args.timeout), jobs)
        for (path, flags), (reason, stderr) in zip(jobs, results):
            if reason:
                failures.append((path, flags, reason, stderr))
        bound = bound_kernels(args.opt, args.templates, args.out)
        outcomes = list(ex.map(
            lambda c: run_combo(args.opt, args.templates, args.out, bound, c[0], c[1],
                                args.timeout), enumerate(combos)))
    spec_failures = [f for o in outcomes for f in o[1]]
    unlocated = len(failures) - sum(1 for f in failures if is_crash(f))
    failures += spec_failures

    crashes = sum(1 for f in failures if is_crash(f))
    for path, flags, reason, stderr in failures:
        print("FAIL: %s: %s %s %s" % (reason, args.opt, path, " ".join(flags)))
        tail = stderr.decode("utf-8", "replace").strip().splitlines()
        for line in tail[:12]:
            print("    " + line)
    counts = {k: sum(o[0].count(k) for o in outcomes) for k in ("lowered", "refused")}
    print("specs: %d combinations, %d runs lowered, %d refused by the spec check, %d failures"
          % (len(combos), counts["lowered"], counts["refused"], len(spec_failures)))
    print("fuzz: %d inputs, %d runs, %d crashes, %d unlocated diagnostics"
          % (args.count, len(jobs), crashes, unlocated))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
