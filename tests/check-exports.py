#!/usr/bin/env python3
"""The shared libraries export exactly the public C and C++ API.

Usage: check-exports.py ROOT GENERATED LIB [LIB ...]

ROOT is the source tree, GENERATED the build's generated include folder
(dualkv/Version.h, dualkv/Export.h).

The public API is what the installed headers declare: the C functions of
dualkv/dualkv_c.h, and in namespace dualkv every function, class or struct
that a public header marks DUALKV_API. Each exported symbol of each LIB must
be one of those (or one of the linker's own, such as _init); and every public
function and class must be exported by the first LIB (libdualkv.so), so that
a header that stops being parsed cannot pass by declaring nothing.
"""
import pathlib
import re
import subprocess
import sys

HEADERS = [
    "runtime/include/dualkv/*.h",
    "compiler/include/dualkv/Compiler/Compiler.h",
    "compiler/include/dualkv/Compiler/KernelSpec.h",
    "compiler/include/dualkv/Compiler/KernelAbi.h",
    "compiler/include/dualkv/Compiler/Schedule.h",
    "compiler/include/dualkv/Compiler/ScoreMod.h",
    "base/include/dualkv/*.h",
]
LINKER = {"_init", "_fini", "_edata", "_end", "__bss_start"}


def public_names(root, generated):
    """(C functions, C++ functions, C++ classes) the headers declare."""
    c_funcs, funcs, classes = set(), set(), set()
    headers = [h for pattern in HEADERS for h in sorted(root.glob(pattern))]
    # Version.h declares dualkv::version(); Export.h only defines the macro.
    headers += [generated / "dualkv" / "Version.h"]
    for header in headers:
        text = header.read_text()
        # Comments out, declarations on one line.
        text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
        text = re.sub(r"//[^\n]*", " ", text)
        text = " ".join(text.split())
        for m in re.finditer(r"\b(?:class|struct) DUALKV_API (\w+)", text):
            classes.add(m.group(1))
        for m in re.finditer(r"DUALKV_API ([^;{]*?)\b(\w+)\s*\(", text):
            if header.name == "dualkv_c.h":
                c_funcs.add(m.group(2))
            else:
                funcs.add(m.group(2))
    return c_funcs, funcs, classes


def exports(lib):
    out = subprocess.run(["nm", "-D", "--defined-only", lib], check=True,
                         capture_output=True, text=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    demangled = subprocess.run(["c++filt"], input="\n".join(names),
                               check=True, capture_output=True,
                               text=True).stdout.splitlines()
    return list(zip(names, demangled))


def owners(demangled):
    """The names inside namespace dualkv (or dualkv::reference) that
    `demangled` belongs to: its class, then its own name."""
    m = re.match(r"^(?:typeinfo for |typeinfo name for |vtable for )?"
                 r"(?:[\w:<>, *&]+ )?dualkv::(?:reference::)?([\w:~]+)",
                 demangled)
    if not m:
        return []
    parts = [p.lstrip("~") for p in m.group(1).split("::") if p]
    return [parts[0], parts[-1]]


def check(root, generated, libs):
    c_funcs, funcs, classes = public_names(root, generated)
    if not (c_funcs and funcs and classes):
        return ["the public headers declared nothing: the parser is broken"]
    errors = []
    seen = set()
    for i, lib in enumerate(libs):
        for name, demangled in exports(lib):
            if name in LINKER:
                continue
            if name in c_funcs:
                seen.add(name)
                continue
            names = owners(demangled)
            if names and (names[0] in classes or names[-1] in funcs):
                seen.update(names)
                continue
            errors.append(f"{pathlib.Path(lib).name} exports {demangled}, "
                          "which no public header declares DUALKV_API")
        if i == 0:
            missing = (c_funcs | funcs | classes) - seen
            errors += [f"{pathlib.Path(lib).name} does not export the public "
                       f"{m}" for m in sorted(missing)]
    return errors


def main(argv):
    if len(argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    errors = check(pathlib.Path(argv[1]), pathlib.Path(argv[2]), argv[3:])
    for e in errors:
        print(f"exports: {e}", file=sys.stderr)
    if not errors:
        print(f"exports: {len(argv) - 3} libraries export the public API "
              "and nothing else")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
