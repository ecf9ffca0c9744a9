#!/usr/bin/env bash
# Installs DualKV's build dependencies from Debian's packages; safe to run again.
set -euo pipefail

packages=(
  libmlir-22-dev mlir-22-tools llvm-22-dev llvm-22-tools
  libfmt-dev nlohmann-json3-dev catch2 ninja-build lld cmake
  libzstd-dev zlib1g-dev xz-utils python3
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$p")
done

if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: all packages present"
fi

# lit ships with llvm-22-tools as a script; make sure it is runnable.
if [[ ! -x /usr/lib/llvm-22/build/utils/lit/lit.py && ! -x /usr/lib/llvm-22/bin/lit ]]; then
  echo "install-deps: warning: lit not found under /usr/lib/llvm-22" >&2
fi

if [[ ! -x /usr/local/cuda/bin/ptxas ]]; then
  echo "install-deps: CUDA 13 toolkit expected at /usr/local/cuda (ptxas not found)" >&2
  exit 1
fi
