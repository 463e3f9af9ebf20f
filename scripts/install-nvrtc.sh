#!/usr/bin/env bash
# Installs NVRTC (the CUDA runtime compiler, libnvrtc.so.12) from PyPI into
# ~/.cache/fulmen/nvrtc, so that every kernel can be compiled for real GPUs on machines
# without one. Prints the folder to put on LD_LIBRARY_PATH. Does nothing when present.
set -euo pipefail
prefix="${FULMEN_NVRTC_DIR:-$HOME/.cache/fulmen/nvrtc}"
lib="$prefix/nvidia/cuda_nvrtc/lib"
if [ ! -e "$lib/libnvrtc.so.12" ]; then
  echo "installing NVRTC 12.9 from PyPI into $prefix" >&2
  python3 -m pip install --quiet --disable-pip-version-check --no-deps \
    --target "$prefix" "nvidia-cuda-nvrtc-cu12==12.9.*" >&2
fi
echo "$lib"
