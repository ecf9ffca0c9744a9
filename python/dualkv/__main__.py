"""``python -m dualkv --version``: the package's version and the library it
loads (path and version). Needs neither torch nor a GPU."""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m dualkv",
        description="DualKV's Python package: which version, which library.")
    parser.add_argument("--version", action="store_true",
                        help="print the package version and the library it "
                             "loads (path and version)")
    args = parser.parse_args(argv)
    if not args.version:
        parser.print_help()
        return 0

    from . import _lib, _version
    print(f"dualkv {_version.version()}")
    try:
        lib = _lib.lib()
    except OSError as e:
        print(f"library: not loaded: {e}")
        return 1
    print(f"library: {_lib.path()} (version {lib.dualkv_version().decode()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
