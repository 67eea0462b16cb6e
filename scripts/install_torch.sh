#!/usr/bin/env bash
# Install torch into the venv without ever pulling a multi-GB CUDA build onto a machine with no GPU.
# - torch already importable: keep it (a CUDA build on a GPU machine stays as it is).
# - a GPU present (nvidia-smi answers): the default build from the index (CUDA).
# - otherwise: the CPU build, $TORCH_CPU_SPEC (torch==2.13.0; on our machines pip finds it on disk).
set -euo pipefail
py="$1"
if "$py" -c 'import torch' 2>/dev/null; then
  echo "torch $("$py" -c 'import torch; print(torch.__version__)') already installed; keeping it"
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$py" -m pip install -q torch
else
  "$py" -m pip install -q "${TORCH_CPU_SPEC:-torch==2.13.0}"
fi
