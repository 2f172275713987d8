#!/usr/bin/env bash
# deps.sh: installs what keel needs to build and test, only what is missing; safe to run again.
set -euo pipefail
# hipcc, rocm-device-libs, libamdhip64-dev: Debian's HIP 5.2.3, the pinned compiler of gate 5's gfx records (keel audit).
debs=(build-essential cmake pkg-config libcjson-dev libpcre2-dev libcmocka-dev clang libomp-dev python3 python3-pip
      hipcc rocm-device-libs libamdhip64-dev)
missing=()
for p in "${debs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "deps: installing ${missing[*]}"
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# Python side of the tests: numpy for fixtures, MLX's CPU build for the differential quantizer test.
py=$(command -v python3)
if ! "$py" -c 'import numpy, mlx.core' >/dev/null 2>&1; then
  echo "deps: installing numpy and mlx[cpu] from PyPI"
  "$py" -m pip install -q --disable-pip-version-check numpy "mlx[cpu]" 2>&1 | grep -v 'WARNING: Running pip as' || true
fi
