"""The package's version: ``project(dualkv VERSION x.y.z)`` in the repository's
top-level CMakeLists.txt, the one place it is written (the C and C++ headers,
the libraries and this package all take it from there).

In a source checkout (``PYTHONPATH=python``, ``pip install -e``) it is read
from CMakeLists.txt; ``pip install ./python`` writes the number into the
installed copy of this file (``VERSION`` below, by setup.py).
"""

import re
from pathlib import Path

VERSION = None  # set in installed copies by setup.py

_PROJECT = re.compile(r"^\s*project\(\s*dualkv\s+VERSION\s+([0-9]+\.[0-9]+\.[0-9]+)",
                      re.MULTILINE | re.IGNORECASE)


def from_cmake(cmakelists):
    """The version in a CMakeLists.txt's ``project(dualkv VERSION ...)``, or
    None when the file or the line is missing."""
    try:
        text = Path(cmakelists).read_text()
    except OSError:
        return None
    match = _PROJECT.search(text)
    return match.group(1) if match else None


def version():
    """The package's version, "major.minor.patch" ("unknown" when neither the
    installed number nor the checkout's CMakeLists.txt is there)."""
    if VERSION:
        return VERSION
    root = Path(__file__).resolve().parent.parent.parent
    return from_cmake(root / "CMakeLists.txt") or "unknown"
