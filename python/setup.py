"""Build hook of the dualkv package: ships libdualkv.so inside it (dualkv/lib/),
so that `pip install ./python` gives a package that needs no DUALKV_LIB.

The library copied is the first that exists of: $DUALKV_LIB, python/dualkv/lib/
libdualkv.so, <repo>/build/libdualkv.so. With none, the build stops and says to
build the library first (or set DUALKV_SKIP_LIB=1 to install the bare package,
which then needs DUALKV_LIB at run time). An editable install (`pip install -e`)
copies nothing: its dualkv/_lib.py finds <repo>/build/libdualkv.so itself.

The version is the top-level CMakeLists.txt's project(dualkv VERSION ...) (the
one place it is written); the installed dualkv/_version.py carries it.
Other metadata lives in pyproject.toml.
"""

import importlib.util
import os
import re
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.errors import FileError

HERE = Path(__file__).resolve().parent


def project_version():
    """project(dualkv VERSION ...) of <repo>/CMakeLists.txt, read with the
    package's own reader (dualkv/_version.py)."""
    spec = importlib.util.spec_from_file_location(
        "_dualkv_version", HERE / "dualkv" / "_version.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    version = module.from_cmake(HERE.parent / "CMakeLists.txt")
    if version is None:
        raise FileError(
            f"dualkv: no project(dualkv VERSION x.y.z) in "
            f"{HERE.parent / 'CMakeLists.txt'}; build the package from a "
            "DualKV checkout (pip install ./python)")
    return version


VERSION = project_version()


def library_candidates():
    """Where the library is looked for at build time, in order."""
    paths = []
    if os.environ.get("DUALKV_LIB"):
        paths.append(Path(os.environ["DUALKV_LIB"]))
    paths.append(HERE / "dualkv" / "lib" / "libdualkv.so")
    paths.append(HERE.parent / "build" / "libdualkv.so")
    return paths


class BuildPyWithLibrary(build_py):
    """build_py that also copies libdualkv.so to <build_lib>/dualkv/lib/."""

    def _library_target(self):
        return Path(self.build_lib) / "dualkv" / "lib" / "libdualkv.so"

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        # The installed package has no CMakeLists.txt beside it: write the
        # number into its copy of _version.py.
        version_py = Path(self.build_lib) / "dualkv" / "_version.py"
        text = version_py.read_text()
        text, n = re.subn(r"^VERSION = .*$", f"VERSION = {VERSION!r}", text,
                          count=1, flags=re.MULTILINE)
        if n != 1:
            raise FileError(f"dualkv: no 'VERSION = ' line in {version_py}")
        version_py.unlink()  # never write through a link to the source
        version_py.write_text(text)
        if os.environ.get("DUALKV_SKIP_LIB") == "1":
            return
        tried = library_candidates()
        found = next((p for p in tried if p.is_file()), None)
        if found is None:
            raise FileError(
                "dualkv: libdualkv.so not found (tried " +
                ", ".join(str(p) for p in tried) + "). Build it first "
                "(cmake -S . -B build && cmake --build build), or set "
                "DUALKV_LIB=/path/to/libdualkv.so, or DUALKV_SKIP_LIB=1 to "
                "install without it.")
        target = self._library_target()
        target.parent.mkdir(parents=True, exist_ok=True)
        if found.resolve() != target.resolve():
            shutil.copy2(found, target)
        print(f"dualkv: bundling {found}")

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        target = str(self._library_target())
        if target not in outputs and Path(target).is_file():
            outputs.append(target)
        return outputs


setup(version=VERSION, cmdclass={"build_py": BuildPyWithLibrary})
