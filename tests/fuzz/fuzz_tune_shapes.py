#!/usr/bin/env python3
"""Seeded fuzzing of dualkv-tune --shapes FILE --list-classes (no GPU, no compile).

Inputs are of two sorts. Structured ones are lists of shapes in the text format
("P N R" lines, commas, comments) or as JSON ([P, N, R] or {"P", "N", "R"}, bare
or under "shapes") whose values are drawn from good ones, edges (0, 1, 1024,
2^20 and one past), values past int32, int64 and uint64 (which used to wrap),
floats, booleans, strings, null, nested arrays, and entries of the wrong arity:
for these the expected outcome is computed here, independently of the tool: the
shape classes and their counts (power-of-two buckets, floors 512 / 1 / 64), or
exit 2 naming the first bad line or entry. Unstructured ones are byte flips and
truncations of those, random bytes, deep nesting (at and past the 32-level
limit, up to 200000), long words, and a folder, FIFO, /dev/zero link, sparse
file past 16 MiB or missing file in the file's place: for these the tool must
exit 0 or 2 in time, without a signal or abort, an exit 2 being one line
starting "dualkv-tune:" of bounded length.

The last line is a summary with the number of inputs tried. Standard library
only.
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
RANGES = {"P": (1, 1 << 20), "N": (0, 1024), "R": (0, 1 << 20)}
NAMES = ("P", "N", "R")
# A message quotes at most 4096 bytes of outside text, plus the path and the
# words around it.
MAX_MESSAGE = 8192
GOOD = {"P": [1, 2, 511, 512, 513, 1000, 1024, 4096, 8191, 65536, (1 << 20) - 1, 1 << 20],
        "N": [0, 1, 2, 3, 8, 16, 100, 512, 1023, 1024],
        "R": [0, 1, 63, 64, 65, 200, 256, 1024, 4097, (1 << 20) - 1, 1 << 20]}
BAD_INTS = [-1, -(1 << 31), (1 << 20) + 1, 1025, 1 << 31, (1 << 32) + 4, (1 << 63) - 1,
            1 << 63, (1 << 64) - 1, 1 << 64, -(1 << 63), -(1 << 63) - 1, 10 ** 30]
BAD_VALUES = [True, False, None, 1.5, 8.0, 1e300, -0.5, "8", "", [1], [], {}, {"P": 1}]


def bucket(x, floor):
    b = floor
    while b < x and b < (1 << 30):
        b *= 2
    return min(b, 1 << 30)


def class_of(p, n, r):
    return (bucket(p, 512), bucket(n, 1), bucket(r, 64))


def valid(name, v):
    lo, hi = RANGES[name]
    return type(v) is int and lo <= v <= hi


def draw_value(rng, name, bad):
    """A good value of `name`, or with probability `bad` a doubtful one."""
    x = rng.random()
    if x >= bad:
        return rng.choice(GOOD[name])
    if x < bad * 0.7:
        return rng.choice(BAD_INTS)  # some are good for some fields
    return rng.choice(BAD_VALUES)


def structured_json(rng):
    """(bytes, expected): expected is ('ok', {class: count}) or ('error', 'shapes[i]')."""
    entries, expected = [], None
    counts = {}
    bad = rng.choice([0.0, 0.0, 0.02, 0.1, 0.3])
    for i in range(rng.choice([0, 1, 1, 2, 3, 5, 8, 20])):
        form = rng.random() * (1.0 if bad else 0.9)
        values = {k: draw_value(rng, k, bad) for k in NAMES}
        if form < 0.45:
            entry = [values["P"], values["N"], values["R"]]
            arity_ok = True
        elif form < 0.9:
            entry = dict(values)
            if rng.random() < 0.1:
                entry["weight"] = 3  # other fields are ignored
            arity_ok = True
        elif form < 0.95:
            entry = [values["P"], values["N"], values["R"], 1][:rng.choice([0, 1, 2, 4])]
            arity_ok = False
        else:
            entry = dict(values)
            del entry[rng.choice(NAMES)]
            arity_ok = False
        entries.append(entry)
        if expected is None:
            if not arity_ok or not all(valid(k, values[k]) for k in NAMES):
                expected = ("error", "shapes[%d]: " % i)
            else:
                c = class_of(values["P"], values["N"], values["R"])
                counts[c] = counts.get(c, 0) + 1
    if expected is None:
        expected = ("ok", counts) if entries else ("error", ": no shapes")
    doc = {"shapes": entries} if rng.random() < 0.3 else entries
    return json.dumps(doc, indent=rng.choice([None, 1])).encode(), expected


def text_word(rng, name, bad):
    """(word, whether it is a good value of `name`): digits after an optional
    '-' in range; leading zeros are allowed."""
    x = rng.random()
    if x >= bad:
        word = "0" * rng.choice([0, 0, 0, 2]) + str(rng.choice(GOOD[name]))
    elif x < bad * 0.7:
        word = str(rng.choice(BAD_INTS))  # some are good for some fields
    else:
        word = rng.choice(["1.5", "+5", "0x10", "x", "-", "--1", "1e3", "nan", "8x", "-0"])
    return word, re.fullmatch(r"-?[0-9]+", word) is not None and valid(name, int(word))


def structured_text(rng):
    lines, expected, counts = [], None, {}
    bad = rng.choice([0.0, 0.0, 0.02, 0.1, 0.3])
    for number in range(1, rng.choice([1, 2, 3, 5, 10, 30]) + 1):
        kind = rng.random()
        if kind < 0.1:
            lines.append(rng.choice(["", "   ", "# a comment", "\t# 1 2 3"]))
            continue
        words, oks = [], []
        for name in NAMES:
            w, ok = text_word(rng, name, bad)
            words.append(w)
            oks.append(ok)
        if kind < 0.15 and bad:
            cut = rng.choice([1, 2, 4])
            words = (words + ["7"])[:cut]
            oks = [False]
        sep = rng.choice([" ", "  ", "\t", ", ", ","])
        line = sep.join(words)
        if rng.random() < 0.2:
            line += "  # note 1 2 3"
        lines.append(line)
        if expected is None:
            if all(oks):
                c = class_of(*(int(w) for w in words))
                counts[c] = counts.get(c, 0) + 1
            else:
                expected = ("error", "line %d: " % number)
    if expected is None:
        expected = ("ok", counts) if counts else ("error", ": no shapes")
    return ("\n".join(lines) + rng.choice(["", "\n"])).encode(), expected


def unstructured(rng, seed_bytes):
    kind = rng.random()
    if kind < 0.4:
        text = bytearray(seed_bytes)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if op < 0.4 and text:
                text[rng.randrange(len(text))] = rng.randrange(256)
            elif op < 0.7 and text:
                del text[rng.randrange(len(text)):]
            else:
                at = rng.randrange(len(text) + 1)
                text[at:at] = rng.choice([b"[", b"{", b"]", b"}", b",", b"\"", b"\\", b"#",
                                          b"\n", b"\x00", b"\xff", b"1e999", b"null",
                                          b"18446744073709551616", b"-9223372036854775809"])
        return bytes(text)
    if kind < 0.6:
        depth = rng.choice([31, 32, 33, 100, 5000, 200000])
        inner = rng.choice([b"", b"1", b'"x"', b"1024, 8, 256"])
        open_, close = rng.choice([(b"[", b"]"), (b'{"shapes":', b"}"), (b'{"P":', b"}")])
        prefix = rng.choice([b"", b"[[1024, 8, 256], "])
        return prefix + open_ * depth + inner + close * depth + (b"]" if prefix else b"")
    if kind < 0.75:
        word = rng.choice([b"x", b"9", b"-", b"["]) * rng.choice([100, 5000, 100000])
        return rng.choice([b"1024 8 ", b"[[1024, 8, \"", b""]) + word + b"\n"
    if kind < 0.9:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
    return json.dumps(rng.choice(BAD_VALUES + BAD_INTS)).encode()


def make_input(rng, work, n):
    """(path, expected or None); writes the file under work."""
    path = os.path.join(work, "shapes-%05d" % n)
    x = rng.random()
    if x < 0.04:
        os.mkdir(path)
        return path, None
    if x < 0.07:
        os.mkfifo(path)
        return path, None
    if x < 0.09:
        os.symlink("/dev/zero", path)
        return path, None
    if x < 0.11:
        with open(path, "wb") as f:
            f.truncate(rng.choice([(16 << 20) + 1, 3 << 30]))
        return path, None
    if x < 0.12:
        return path + ".missing", None
    data, expected = (structured_json if rng.random() < 0.5 else structured_text)(rng)
    if x < 0.7:
        with open(path, "wb") as f:
            f.write(data)
        return path, expected
    with open(path, "wb") as f:
        f.write(unstructured(rng, data))
    return path, None


def parse_listing(stdout):
    """{(P, N, R): count} from --list-classes output, or None if malformed."""
    lines = stdout.decode("utf-8", "replace").splitlines()
    if not lines or not re.match(r"^\d+ shape classes in ", lines[0]):
        return None
    counts = {}
    for line in lines[1:]:
        m = re.fullmatch(r"  P(\d+)_N(\d+)_R(\d+) \((\d+) shapes?\)", line)
        if not m:
            return None
        counts[(int(m[1]), int(m[2]), int(m[3]))] = int(m[4])
    if int(lines[0].split()[0]) != len(counts):
        return None
    if list(counts) != sorted(counts):
        return None
    return counts


def check(tune, path, expected, timeout):
    try:
        r = subprocess.run([tune, "--shapes", path, "--list-classes"], stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "hang (no exit after %ss)" % timeout, b"", None
    rc, err = r.returncode, r.stderr
    if rc < 0 or rc >= 128:
        return "crash (exit %d)" % rc, err, rc
    if rc not in (0, 2):
        return "exit %d" % rc, err, rc
    if FATAL.search(err):
        return "fatal error reported (exit %d)" % rc, err, rc
    if rc == 2:
        lines = err.splitlines()
        if len(lines) != 1 or not lines[0].startswith(b"dualkv-tune: "):
            return "exit 2 without exactly one 'dualkv-tune:' line", err, rc
        if len(err) > MAX_MESSAGE:
            return "a message of %d bytes" % len(err), err[:300], rc
    else:
        if err:
            return "exit 0 with a message", err, rc
        if parse_listing(r.stdout) is None:
            return "exit 0 with a malformed listing", r.stdout[:600], rc
    if expected is None:
        return None, b"", rc
    want, detail = expected
    if want == "ok":
        if rc != 0:
            return "refused good shapes (want classes %s)" % detail, err, rc
        got = parse_listing(r.stdout)
        if got != detail:
            return "classes %s, want %s" % (got, detail), r.stdout[:600], rc
    else:
        if rc != 2:
            return "accepted bad shapes (want exit 2 at '%s')" % detail, r.stdout[:600], rc
        if detail.encode() not in err:
            return "refusal does not name '%s'" % detail, err, rc
    return None, b"", rc


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", default="dualkv-tune")
    ap.add_argument("--work", required=True, help="folder for the inputs")
    ap.add_argument("--count", type=int, default=10**9)
    ap.add_argument("--seconds", type=float, default=40.0,
                    help="stop generating inputs after this long")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--timeout", type=float, default=20.0)
    args = ap.parse_args()

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    rng = random.Random(args.seed)
    start = time.monotonic()
    failures, tried, exits, checked = [], 0, {}, 0
    try:
        for n in range(args.count):
            if time.monotonic() - start > args.seconds:
                break
            path, expected = make_input(rng, args.work, n)
            reason, output, rc = check(args.tune, path, expected, args.timeout)
            tried += 1
            checked += expected is not None
            exits[rc] = exits.get(rc, 0) + 1
            if reason:
                failures.append((path, reason, output))
            else:
                # Kept only when it failed: the big sparse files add up.
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)
                elif os.path.lexists(path):
                    os.remove(path)
    finally:
        for path, reason, output in failures:
            print("FAIL: %s: %s --shapes %s --list-classes" % (reason, args.tune, path))
            for line in output.decode("utf-8", "replace").strip().splitlines()[:12]:
                print("    " + line[:300])
        print("fuzz dualkv-tune --shapes: %d inputs (seed %d, %.0f s; %d against an expected "
              "result; exit 0: %d, 2: %d), %d failures"
              % (tried, args.seed, time.monotonic() - start, checked, exits.get(0, 0),
                 exits.get(2, 0), len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
