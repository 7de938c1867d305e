#!/usr/bin/env bash
# The test command (README "Two commands"; CI runs exactly this through .ci/run).
#
# 1. scripts/setup.sh, then the full suite in .venv: on a fresh clone, the newest versions pyproject.toml allows.
# 2. A focused subset under the oldest supported transformers (the lower bound in pyproject.toml) in a second
#    environment, .venv-oldest: registration of the kernel id, the attention integration (a tiny GPT-OSS forward and
#    backward through the kernel against eager), the kernel build, the experts registration and two trainer steps.
#
# Arguments go to the full-suite pytest run. SKIP_OLDEST=1 skips step 2. Exits non-zero if either step failed.
set -uo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh || exit $?
.venv/bin/python -m pytest "$@"
status=$?

if [ "${SKIP_OLDEST:-0}" != "1" ]; then
  oldest=$(.venv/bin/python - <<'PY'
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
print(f"transformers=={lower[0]}")
PY
  ) || exit 1
  echo "== focused subset under $oldest (.venv-oldest)"
  if VENV=.venv-oldest TRANSFORMERS_SPEC="$oldest" bash scripts/setup.sh; then
    .venv-oldest/bin/python -m pytest -q -m "not slow" \
      tests/test_attention_integration.py \
      kernels_hub/sink-flash-attn3/tests/test_build_and_publish.py \
      tests/test_experts.py::test_registered_and_selectable \
      tests/test_trainer.py::test_on_policy_steps_with_tool_calls \
      tests/test_trainer.py::test_project_attention_kernel_and_experts_from_config
    oldest_status=$?
  else
    oldest_status=1
  fi
  [ "$status" -ne 0 ] || status=$oldest_status
fi
exit "$status"
