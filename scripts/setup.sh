#!/usr/bin/env bash
# Creates a virtual environment (default .venv) and installs hf_gptoss_rl with its dev extras. Idempotent: a second
# run only re-checks. Version bounds come from pyproject.toml; a fresh environment gets the newest they allow.
#
#   TORCH_SPEC         on a CPU machine `torch==2.13.0` is the CPU build; on a GPU machine set the build you want
#                      (for example TORCH_SPEC="torch"), or TORCH_SPEC=skip to keep the torch already there.
#   TRANSFORMERS_SPEC  an extra requirement installed with the project, e.g. "transformers==5.17" (default: none).
#   VENV               the environment's directory (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
if [ "$TORCH_SPEC" != "skip" ]; then
  "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
fi
"$VENV/bin/python" -m pip install -q -e ".[dev]" ${TRANSFORMERS_SPEC:+"$TRANSFORMERS_SPEC"}
"$VENV/bin/python" -c "import torch, transformers, trl, kernels; print('torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__, '| kernels', kernels.__version__)"
