#!/usr/bin/env bash
# The test command (README "Two commands"; CI runs exactly this through .ci/run):
# 1. scripts/setup.sh, then lint and format checks (ruff, configured in pyproject.toml);
# 2. the whole suite in .venv (on a fresh clone: the newest versions pyproject.toml allows);
# 3. scripts/test_oldest_transformers.sh: a focused subset under the oldest supported transformers.
# Arguments go to the whole-suite pytest run. SKIP_OLDEST=1 skips step 3. Exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh || exit $?
.venv/bin/ruff check . && .venv/bin/ruff format --check .
lint=$?
.venv/bin/python -m pytest "$@"
status=$?
[ "$status" -ne 0 ] || status=$lint
if [ "${SKIP_OLDEST:-0}" != "1" ]; then
  bash scripts/test_oldest_transformers.sh
  oldest=$?
  [ "$status" -ne 0 ] || status=$oldest
fi
exit "$status"
