#!/usr/bin/env bash
# Installs the dependencies (idempotent) and configures and builds DualKV in build/.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/install-deps.sh"
cmake -S "$root" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release
start=$(date +%s)
cmake --build "$root/build"
echo "build: $(($(date +%s) - start)) s"
