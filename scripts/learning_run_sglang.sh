#!/usr/bin/env bash
# The learning run against real SGLang (benchmarks/learning_run.py --rollout-backend sglang), all arms at once on
# one GPU: the warm-up runs once (--save-warm-start), then one process per arm, each with its own SGLang server
# (started one at a time), runs every seed from those exact weights and rewrites its report after each run; at the
# end one report is merged from theirs. A run cut short leaves the parts' reports of the runs that finished, and
# `--merge` renders them (marked partial).
#
#   scripts/learning_run_sglang.sh OUT [learning_run.py flags for every process...]
#
#   OUT/warm/                 the warm start (weights, practised problems, digest)
#   OUT/part_<arm>_seeds_<seeds>/  each process's report (learning_run_sglang.{json,md,png}); .log: its output
#   OUT/merged/               the merged report
#
# Environment: PYTHON (the trainer's python, default python3), SERVER_CMD (default
# "/opt/sglang/bin/python -m sglang.launch_server"), ARMS (default all three), SEEDS (default 0,1,2),
# PROCESS_PER_SEED (1: one process and server per arm and seed, all at once; default 0: the seeds one after another),
# MEM_FRACTION (each server's --mem-fraction-static, default 0.1), SERVER_ARGS (flags for every server, set empty
# for none; default:
# Triton attention, no prefill CUDA graph, decode graphs up to batch 64).
# Exits non-zero when the warm-up, any arm or the merge failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/learning_run_sglang.sh OUT [learning_run.py flags...]}
shift
PYTHON=${PYTHON:-python3}
SERVER_CMD=${SERVER_CMD:-/opt/sglang/bin/python -m sglang.launch_server}
ARMS=${ARMS:-sink_kernel,frozen_sinks,sink_dropping}
SEEDS=${SEEDS:-0,1,2}
MEM_FRACTION=${MEM_FRACTION:-0.1}
SERVER_ARGS=${SERVER_ARGS---attention-backend triton --disable-prefill-cuda-graph --cuda-graph-max-bs-decode 64}
mkdir -p "$OUT"

"$PYTHON" benchmarks/learning_run.py --rollout-backend sglang --save-warm-start "$OUT/warm" "$@" \
  >"$OUT/warm.log" 2>&1 || { echo "warm-up failed (see $OUT/warm.log)" >&2; tail -20 "$OUT/warm.log" >&2; exit 1; }
tail -1 "$OUT/warm.log"

IFS=, read -ra arms <<<"$ARMS"
IFS=, read -ra seeds <<<"$SEEDS"
groups=("$SEEDS")  # the seeds each process of an arm runs, one after another
[ "${PROCESS_PER_SEED:-0}" = 1 ] && groups=("${seeds[@]}")
jobs=$((${#arms[@]} * ${#groups[@]}))
note="$jobs processes ran at the same time on one GPU (arms x seed groups: ${arms[*]} x ${groups[*]}), one SGLang \
server (--mem-fraction-static $MEM_FRACTION) each; their step times include that sharing."
pids=() names=()
for group in "${groups[@]}"; do
  for arm in "${arms[@]}"; do
    name="${arm}_seeds_${group//,/_}"
    "$PYTHON" benchmarks/learning_run.py --rollout-backend sglang --warm-start "$OUT/warm" --arms "$arm" \
      --seeds "$group" --server-cmd "$SERVER_CMD" --server-args "$SERVER_ARGS" --mem-fraction-static "$MEM_FRACTION" \
      --server-start-lock "$OUT/server_start.lock" --note "$note" --out "$OUT/part_$name" "$@" \
      >"$OUT/part_$name.log" 2>&1 &
    pids+=($!) names+=("$name")
  done
done
status=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { echo "${names[$i]} failed (see $OUT/part_${names[$i]}.log)" >&2; status=1; }
done
parts=("$OUT"/part_*/learning_run_sglang.json)
if [ -e "${parts[0]}" ]; then
  "$PYTHON" benchmarks/learning_run.py --merge "${parts[@]}" --rollout-backend sglang --arms "$ARMS" \
    --seeds "$SEEDS" --out "$OUT/merged" || status=1
else
  echo "no arm wrote a report" >&2
  status=1
fi
exit "$status"
