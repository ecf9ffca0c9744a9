#!/usr/bin/env bash
# Installs, builds and runs every test; GPU tests (label gpu) skip without a GPU.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/build.sh"
cd "$root/build"
ctest --output-on-failure -j2
