#!/usr/bin/env bash
# A focused subset of the tests under the oldest supported transformers (the '>=' bound on transformers in
# pyproject.toml): the kernel id's registration and remap guards, the attention integration (a tiny GPT-OSS
# forward and backward through the kernel against eager, generate, torch.compile), the kernel build, the experts
# registration and a trainer run with the project's kernel and experts.
#
# That transformers, with its own dependencies, is installed with `pip install --target` into
# .venv/overlays/transformers-<version> and put first on PYTHONPATH, over the environment scripts/setup.sh made;
# so only what transformers needs is installed again. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

version=$("$PY" - <<'PY'
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from packaging.requirements import Requirement

with open("pyproject.toml", "rb") as f:
    deps = [Requirement(d) for d in tomllib.load(f)["project"]["dependencies"]]
(transformers,) = [r for r in deps if r.name == "transformers"]
lower = [s.version for s in transformers.specifier if s.operator == ">="]
if len(lower) != 1:
    sys.exit(f"pyproject.toml: expected one '>=' bound on transformers, got {transformers}")
print(lower[0])
PY
)
overlay=".venv/overlays/transformers-$version"
installed() {
  PYTHONPATH="$overlay" "$PY" -c "
import sys, transformers
from packaging.version import Version
sys.exit(Version(transformers.__version__) != Version('$version'))" 2>/dev/null
}
if ! installed; then
  rm -rf "$overlay"
  "$PY" -m pip install -q --disable-pip-version-check --target "$overlay" "transformers==$version"
  installed || { echo "transformers==$version is not importable from $overlay" >&2; exit 1; }
fi
export PYTHONPATH="$overlay${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, transformers, trl, kernels; print('focused subset: torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__, '| kernels', kernels.__version__)"
exec "$PY" -m pytest -q -m "not slow" -k "not triton" "$@" \
  tests/test_attention_integration.py \
  kernels_hub/sink-flash-attn3/tests/test_build_and_publish.py \
  tests/test_experts.py::test_registered_and_selectable \
  tests/test_trainer.py::test_project_attention_kernel_and_experts_from_config
