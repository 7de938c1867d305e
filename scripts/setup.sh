#!/usr/bin/env bash
# Creates .venv and installs hf_gptoss_rl with its dev extras. Idempotent: a second run only re-checks.
# On a CPU machine `torch==2.13.0` is the CPU build; on a GPU machine set TORCH_SPEC to the build you want
# (for example TORCH_SPEC="torch" or TORCH_SPEC=skip to keep the torch already in the environment).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ "$TORCH_SPEC" != "skip" ]; then
  .venv/bin/python -m pip install -q "$TORCH_SPEC"
fi
.venv/bin/python -m pip install -q -e ".[dev]"
.venv/bin/python -c "import torch, transformers, trl, kernels; print('torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__, '| kernels', kernels.__version__)"
