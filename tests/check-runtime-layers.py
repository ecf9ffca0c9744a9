#!/usr/bin/env python3
"""The runtime's layers (docs/architecture.md §3), checked on its sources.

Every file under runtime/lib/<layer>/ and every public header belongs to a
layer; a file may include only headers of its own layer or of a layer below
it, and the include graph of the runtime has no cycle:

    support < driver < cache < selection < operations < capi
                  driver < plans < operations;  selection may read plans'
                  public header (shape classes); reference uses support alone.

Errors below the API are llvm::Error (support/Status.h): no file of
runtime/lib throws but support/Status.* (the C++ API's edge, throwIfError).

Usage: check-runtime-layers.py ROOT          check ROOT's runtime
       check-runtime-layers.py --self-test   show that a wrong include, a
                                             cycle and a throw fail
"""
import pathlib
import re
import shutil
import sys
import tempfile

# What each layer may include besides itself (and base/ and the compiler's
# public headers, which every layer may).
ALLOWED = {
    "support": set(),
    "driver": {"support"},
    "cache": {"support", "driver"},
    "plans": {"support", "driver"},
    "selection": {"support", "driver", "cache", "plans"},
    "operations": {"support", "driver", "cache", "plans", "selection"},
    "capi": {"support", "driver", "cache", "plans", "selection", "operations"},
    "reference": {"support"},
}
# The layer of each public header (runtime/include/dualkv/<name>).
PUBLIC = {
    "Error.h": "support",
    "Device.h": "driver",
    "Cache.h": "cache",
    "Aot.h": "cache",
    "Plan.h": "plans",
    "Tuning.h": "selection",
    "Precompile.h": "selection",
    "dualkv.h": "operations",
    "dualkv_c.h": "capi",
    "Reference.h": "reference",
}
# Headers below the runtime: any layer may include them.
BELOW = re.compile(
    r'^dualkv/(Export\.h|Version\.h|Names\.h|Bounded\.h|HeadDims\.h|Compiler/.*)$')
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
# The only files below the API that may throw: the edge helpers.
THROWERS = {"support/Status.h", "support/Status.cpp"}
# Comments, string and character literals (whose words are not code).
NOT_CODE = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|'
                      r"'(?:\\.|[^'\\\n])*'", re.S)
THROW = re.compile(r"\bthrow\b")


def throws(text):
    """The line numbers of `text` (C++) where code says `throw` (a throw
    expression or a rethrow; `catch` is fine)."""
    code = NOT_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return [code.count("\n", 0, m.start()) + 1 for m in THROW.finditer(code)]


def files_of(root):
    """(path, layer) of every runtime source and public header."""
    runtime = root / "runtime"
    for path in sorted((runtime / "include" / "dualkv").glob("*.h")):
        yield path, PUBLIC.get(path.name)
    for path in sorted((runtime / "lib").rglob("*")):
        if path.suffix in (".h", ".cpp"):
            rel = path.relative_to(runtime / "lib")
            yield path, rel.parts[0] if len(rel.parts) > 1 else None


def resolve(root, name):
    """(header path, layer) of an include, or (None, 'below') for base and
    the compiler, or (None, None) when it names nothing the runtime knows."""
    if BELOW.match(name):
        return None, "below"
    m = re.match(r"^dualkv/([^/]+\.h)$", name)
    if m:
        return root / "runtime/include/dualkv" / m.group(1), PUBLIC.get(m.group(1))
    parts = name.split("/")
    if len(parts) == 2 and parts[0] in ALLOWED:
        return root / "runtime/lib" / name, parts[0]
    return None, None


def check(root):
    errors = []
    graph = {}
    for path, layer in files_of(root):
        shown = path.relative_to(root)
        if layer not in ALLOWED:
            errors.append(f"{shown}: not in a layer (runtime/lib/<layer>/, or "
                          "a public header listed in this script)")
            continue
        graph[path] = []
        text = path.read_text()
        lib = root / "runtime/lib"
        if path.is_relative_to(lib) and \
                str(path.relative_to(lib)) not in THROWERS:
            for line in throws(text):
                errors.append(f"{shown}:{line}: throws; below the API errors "
                              "are llvm::Error (support/Status.h), thrown "
                              "only by throwIfError at the C++ API's edge")
        for name in INCLUDE.findall(text):
            header, to = resolve(root, name)
            if to == "below":
                continue
            if to is None:
                errors.append(f'{shown}: includes "{name}", which is no '
                              "layer's header (write <layer>/<file>.h)")
                continue
            if to != layer and to not in ALLOWED[layer]:
                errors.append(f'{shown}: the {layer} layer includes "{name}" '
                              f"of the {to} layer, above it or beside it")
            if header is not None and header.exists():
                graph[path].append(header)
    # Cycles: depth-first search over the include graph.
    state = {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                errors.append("include cycle: " + " -> ".join(
                    str(p.relative_to(root)) for p in cycle))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])
    return errors


def self_test(root):
    """A copy of the runtime in which the driver includes the cache must
    fail, and so must a cycle inside one layer and a throw outside
    support/Status.cpp."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = pathlib.Path(tmp)
        shutil.copytree(root / "runtime", copy / "runtime")
        assert not check(copy), "the unmodified copy should pass"
        driver = copy / "runtime/lib/driver/Module.h"
        driver.write_text('#include "cache/DiskCache.h"\n' + driver.read_text())
        upward = check(copy)
        assert any("the driver layer includes" in e for e in upward), upward
        driver.write_text(driver.read_text().split("\n", 1)[1])
        launch = copy / "runtime/lib/driver/CudaDriver.h"
        launch.write_text('#include "driver/Launch.h"\n' + launch.read_text())
        cycle = check(copy)
        assert any(e.startswith("include cycle:") for e in cycle), cycle
        launch.write_text(launch.read_text().split("\n", 1)[1])
        assert not check(copy), "the repaired copy should pass"
        # A throw in the cache fails; one in a comment, a string or a catch
        # does not.
        cache = copy / "runtime/lib/cache/CompileTable.cpp"
        original = cache.read_text()
        cache.write_text(original + '\n// throw here? "throw" no\n'
                         "void f() { try { g(); } catch (...) { h(); } }\n")
        assert not check(copy), check(copy)
        cache.write_text(original + "\nvoid f() { throw 1; }\n")
        thrown = check(copy)
        assert any("CompileTable.cpp" in e and "throws" in e
                   for e in thrown), thrown
        for e in thrown:
            print(f"layers: {e}")
    print("runtime layers: the self-test's wrong include, cycle and throw "
          "fail")


def main(argv):
    if argv[1:2] == ["--self-test"]:
        self_test(pathlib.Path(__file__).resolve().parents[1])
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    errors = check(pathlib.Path(argv[1]).resolve())
    for e in errors:
        print(f"layers: {e}", file=sys.stderr)
    if not errors:
        print("runtime layers: ok")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
