#!/usr/bin/env bash
# Install torch 2.13.0 into the given Python's environment, choosing the CPU build
# wherever there is no CUDA device, so set-up never pulls a multi-GB CUDA build it
# cannot use. Then write a pip constraints file that pins the torch it installed
# (argument 2), so resolving the package and its extras keeps that build: without
# it, pip 26 replaces a CPU torch with the newest CUDA build the range admits.
set -euo pipefail
source "$(dirname "$0")/installer.sh"  # `install`: pip install, run by uv where it can be had
py=${1:-python3}
constraints=${2:-}
version=2.13.0
if "$py" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$version' else 1)" 2>/dev/null; then
  :
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "install_torch: CUDA device found, installing torch==$version from PyPI"
  install "$py" "torch==$version"
# A wheel on local disk (pip's find-links) is used first; it must be a CPU build.
elif install "$py" --no-deps --no-index "torch==$version+cpu" >/dev/null 2>&1; then
  echo "install_torch: no CUDA device, installed the local CPU build of torch==$version"
  install "$py" -q "torch==$version+cpu"   # its pure-Python dependencies
else
  echo "install_torch: no CUDA device, installing the CPU build of torch==$version"
  install "$py" "torch==$version" --index-url https://download.pytorch.org/whl/cpu \
    --extra-index-url https://pypi.org/simple
fi
if [ -n "$constraints" ]; then
  "$py" -W ignore -c "import torch; print('torch==' + torch.__version__)" > "$constraints"
  # A CPU build runs Triton only in its interpreter (the GPU kernels' tests): the smallest release
  # that compiles them exactly (641 MB installed against 999 MB for 3.9). A CUDA build of torch
  # brings the Triton it was built with.
  if "$py" -W ignore -c "import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)"; then
    echo "triton==3.6.0" >> "$constraints"
  fi
  echo "install_torch: pinned $(tr '\n' ' ' < "$constraints")in $constraints"
fi
