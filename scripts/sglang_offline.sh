#!/usr/bin/env bash
# Install and run SGLang 0.5.17 on an air-gapped x86_64 CUDA 13 machine that
# already has Python 3.12, torch 2.11.0+cu130, triton 3.6 and the common
# scientific/HTTP stack (numpy, scipy, aiohttp, requests, huggingface-hub,
# safetensors, uvloop, psutil, pyyaml, regex, einops, setuptools, ...).
#
# SGLang goes into its own directory (PYTHONPATH=TARGET, /opt/sglang unless
# given) so that its pins (transformers==5.12.1, tokenizers<=0.23.0, ...)
# shadow the system versions only for the server process.  Only the packages
# that the server process imports for a GPT-OSS bf16 checkpoint with SGLang's
# default attention backend (fa3 on Hopper) or the triton one, pytorch or
# default sampling, no grammar backend and --skip-tokenizer-init are fetched;
# sglang's full Requires-Dist closure is not.
#
#   sglang_offline.sh download WHEELDIR          (on a machine with a package index)
#   sglang_offline.sh install WHEELDIR [TARGET]  (offline; no index needed)
#   sglang_offline.sh slim WHEELDIR OUTDIR       (wheels without the files install prunes and without FA3:
#                                                 ~150 MB instead of ~480 MB, for a link with an upload limit)
#   sglang_offline.sh check [TARGET]             (offline, needs the GPU)
#   sglang_offline.sh serve TARGET MODEL_DIR PORT [extra sglang args...]
#
# `install` also writes TARGET/bin/python (this machine's python with
# PYTHONPATH=TARGET and nothing else on it), so the server command is the same as
# for a virtual environment in that directory:
#   /opt/sglang/bin/python -m sglang.launch_server
#   sglang_offline.sh wrapper TARGET              (writes only TARGET/bin/python)
set -euo pipefail

PY=${PYTHON:-python3}
DEFAULT_TARGET=/opt/sglang  # the SGLang install location the docs and benchmarks/sglang_e2e.py name

# name==version  # why the server needs it (import found on the launch path)
PACKAGES=(
  "sglang==0.5.17"                   # the server
  "sglang-kernel==0.4.5"             # sgl_kernel: rmsnorm/rope/activation ops; triton_kernels MoE
  "flashinfer-python==0.6.15.post1"  # imported unconditionally on CUDA by srt/layers/quantization/fp8_utils.py;
                                     # sgl_kernel's rmsnorm then runs flashinfer's norm, JIT-built with nvcc from
                                     # flashinfer/data (kept) on first use and cached in ~/.cache/flashinfer
  "transformers==5.12.1"             # sglang's pin; config classes (GptOssConfig)
  "tokenizers==0.22.2"               # transformers 5.12.1 refuses to import with tokenizers>0.23.0
  "xgrammar==0.2.1"                  # srt/function_call/inkling_detector.py imports StructuralTag (server_args import chain)
  "apache-tvm-ffi==0.1.11"           # xgrammar's binding loader
  "torchao==0.17.0"                  # imported by srt/layers/quantization/*
  "compressed-tensors==0.20.1"       # imported by srt/layers/quantization/compressed_tensors
  "loguru==0.7.3"                    # compressed-tensors' logger
  "fastapi==0.140.0"                 # HTTP server (newer releases hard-require opentelemetry)
  "starlette==1.10.0"                # fastapi
  "python-multipart==0.0.34"         # fastapi form parsing used by http_server
  "uvicorn==0.54.0"                  # ASGI server
  "watchfiles==1.3.0"                # imported by uvicorn's config
  "pydantic==2.14.4"                 # request/response schemas
  "pydantic-core==2.50.5"            # pydantic
  "annotated-types==0.8.0"           # pydantic
  "typing-inspection==0.4.5"         # pydantic, fastapi
  "pyzmq==27.3.0"                    # IPC between tokenizer manager, scheduler and detokenizer
  "orjson==3.13.0"                   # HTTP JSON responses
  "msgspec==0.23.0"                  # IPC message encoding
  "setproctitle==1.3.8"              # names the scheduler/detokenizer processes
  "pybase64==1.5.1"                  # sglang/utils.py
  "partial-json-parser==0.2.1.1.post7"  # function-call parsers (server_args import chain)
  "openai==2.6.1"                    # OpenAI-compatible protocol types
  "distro==1.9.0"                    # openai
  "sniffio==1.3.1"                   # openai
  "gguf==0.19.0"                     # srt/model_loader imports it at module level
  "soundfile==0.13.1"                # srt/entrypoints/openai/realtime (imported by http_server)
  "cffi==2.1.1"                      # soundfile's binding
  "ipython==9.18.1"                  # sglang/utils.py: from IPython.display import HTML, display
  "traitlets==5.16.1"                # IPython
  "dill==0.4.1"                      # srt/sampling/custom_logit_processor.py
  "jsonschema==4.26.0"               # srt/entrypoints/openai/serving_chat.py
  "jsonschema-specifications==2025.9.1"  # jsonschema
  "referencing==0.37.0"              # jsonschema
  "rpds-py==2026.9.1"                # referencing
)

# Files that this launch never loads (removed by `install`).  Each must exist
# in the wheels above; a missing one means the wheel layout changed: stop.
PRUNE=(
  "sgl_kernel/sm100"                  # common_ops for sm100+; load_utils picks sm90/ on compute capability 9.0
  "sgl_kernel/flashmla_ops.abi3.so"   # FlashMLA (MLA models); sgl_kernel/flash_mla.py tolerates its absence
  "sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so"  # InfLLM-V2 attention, loaded lazily by infllm_v2/_loader.py
  "sgl_kernel/testing"                # kernel test helpers
  "sglang/multimodal_gen"             # diffusion/video generation runtime
  "sglang/test"                       # sglang's own test suite
  "sglang/srt/grpc/_core.cpython-312-x86_64-linux-gnu.so"    # native gRPC server, only with --grpc-port
  "sglang/srt/server/_core.cpython-312-x86_64-linux-gnu.so"  # Rust server, only with SGLANG_RUST_SERVER=1
  "xgrammar/lib/libxgrammar.a"        # static library for C++ builds; Python uses libxgrammar_bindings.so
  "xgrammar/include"                  # C++ headers
  "torchao/_C_cutlass_90a.abi3.so"    # torchao's CUTLASS quantized GEMMs; torchao tolerates its absence
  "test"                              # torchao's test suite (installed as a top-level package)
  "build_backend.py"                  # flashinfer's wheel-build helpers (top-level modules)
  "build_utils.py"
  "tools"                             # sglang's version-tag helper for building wheels
  "share"                             # IPython man page
  "bin"                               # console scripts with the build machine's interpreter path
)

# FA3 kernels (1.1 GB): SGLang's default attention backend for GPT-OSS on Hopper (`_gpt_oss_overrides` in
# sglang/srt/arg_groups/overrides.py picks fa3 on sm90, trtllm_mha on sm100, triton elsewhere). `install` keeps
# them; PRUNE_FA3=1 removes them for a server that is always started with --attention-backend triton.
FA3_LIBRARY="sgl_kernel/flash_ops.abi3.so"

# Modules the server process imports (checked by `check`).
MODULES=(
  sglang.launch_server sglang.srt.server_args sglang.srt.entrypoints.http_server
  sglang.srt.entrypoints.engine sglang.srt.managers.scheduler
  sglang.srt.managers.tokenizer_manager sglang.srt.managers.detokenizer_manager
  sglang.srt.model_executor.model_runner sglang.srt.models.gpt_oss
  sglang.srt.layers.attention.triton_backend sglang.srt.layers.sampler
  sglang.srt.layers.moe.fused_moe_triton sglang.srt.layers.moe.moe_runner.triton
  sglang.srt.lora.lora_manager sglang.srt.model_loader.loader triton_kernels
)

die() { echo "sglang_offline.sh: error: $*" >&2; exit 1; }

# CPython 3.12, manylinux x86_64 wheels only (lets `download`/`install` run anywhere).
TAGS=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)

cmd_download() {
  local dir=${1:?usage: download WHEELDIR}
  mkdir -p "$dir"
  local p
  for p in "${PACKAGES[@]}"; do
    "$PY" -m pip download -q --no-deps "${TAGS[@]}" -d "$dir" "$p" || die "could not download $p"
  done
  ls -l "$dir"
}

cmd_install() {
  local dir=${1:?usage: install WHEELDIR [TARGET]} target=${2:-$DEFAULT_TARGET}
  [[ -d $dir ]] || die "no wheel directory: $dir"
  local wheels=("$dir"/*.whl)
  [[ -e ${wheels[0]} ]] || die "no .whl files in $dir"
  [[ ${#wheels[@]} -eq ${#PACKAGES[@]} ]] \
    || die "$dir holds ${#wheels[@]} wheels, expected ${#PACKAGES[@]} (one per pinned package)"
  mkdir -p "$target"
  "$PY" -m pip install -q --no-index --no-deps --no-compile "${TAGS[@]}" --target "$target" "${wheels[@]}" \
    || die "pip install into $target failed"
  local f
  local prune=("${PRUNE[@]}")
  [[ ${PRUNE_FA3:-0} == 1 ]] && prune+=("$FA3_LIBRARY")
  for f in "${prune[@]}"; do
    # `slim` took these out of the wheels already (without FA3, servers run --attention-backend triton)
    [[ -e $dir/SLIM ]] && grep -qxF "$f" "$dir/SLIM" && continue
    [[ -e $target/$f ]] || die "expected $target/$f (wheel layout changed?)"
    rm -rf "${target:?}/$f"
  done
  find "$target" -name __pycache__ -type d -prune -exec rm -rf {} +
  write_python_wrapper "$target"
  du -sh "$target"
  echo "export PYTHONPATH=$(cd "$target" && pwd)"
  echo "server: $(cd "$target" && pwd)/bin/python -m sglang.launch_server ..."
}

# OUTDIR: the wheels of WHEELDIR without the PRUNE files and FA3 (members under those paths dropped; RECORD keeps
# their lines, which pip does not check), plus a SLIM file listing them, which tells `install` they are gone already.
cmd_slim() {
  local dir=${1:?usage: slim WHEELDIR OUTDIR} out=${2:?usage: slim WHEELDIR OUTDIR}
  mkdir -p "$out"
  "$PY" - "$dir" "$out" "${PRUNE[@]}" "$FA3_LIBRARY" <<'EOF'
import pathlib, sys, zipfile
src, out, drop = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3:]
found = set()
for wheel in sorted(src.glob("*.whl")):
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(out / wheel.name, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            hit = [d for d in drop if item.filename == d or item.filename.startswith(d.rstrip("/") + "/")]
            if hit:
                found.update(hit)
                continue
            zout.writestr(item, zin.read(item.filename))
missing = sorted(set(drop) - found - {"bin", "share"})  # those two come from the wheels' .data folders at install
if missing:
    sys.exit(f"slim: not in any wheel: {missing} (wheel layout changed?)")
(out / "SLIM").write_text("".join(f"{d}\n" for d in sorted(found)))
size = sum(p.stat().st_size for p in out.glob("*.whl"))
print(f"{len(list(out.glob('*.whl')))} wheels, {size / 2**20:.0f} MiB in {out}")
EOF
}

# TARGET/bin/python: the python that runs the server, with PYTHONPATH=TARGET.
write_python_wrapper() {
  local target python
  target=$(cd "$1" && pwd)
  python=$(command -v "$PY") || die "$PY not found"
  mkdir -p "$target/bin"
  printf '#!/bin/sh\n# written by sglang_offline.sh install: %s with the SGLang install in %s\n' "$python" "$target" \
    >"$target/bin/python"
  # SGLang's own environment: the caller's PYTHONPATH (a trainer environment, say) is replaced, not extended, so it
  # cannot shadow the versions SGLang pins
  printf 'unset PYTHONHOME\nPYTHONPATH="%s" exec "%s" "$@"\n' "$target" "$python" >>"$target/bin/python"
  chmod +x "$target/bin/python"
}

cmd_check() {
  local target=${1:-$DEFAULT_TARGET}
  [[ -d $target/sglang ]] || die "no sglang under $target"
  PYTHONPATH=$target "$PY" - "${MODULES[@]}" <<'EOF'
import importlib, importlib.metadata as md, sys, torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
for d in ("sglang", "sglang-kernel", "transformers", "tokenizers", "huggingface-hub", "regex", "triton", "fastapi", "pydantic"):
    print(f"{d}=={md.version(d)}")
bad = []
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception as e:  # report every failing module, not just the first
        bad.append(f"{m}: {type(e).__name__}: {e}")
if bad:
    sys.exit("import failures:\n  " + "\n  ".join(bad))
print(f"all {len(sys.argv) - 1} modules import")
# The first kernel the server runs: sgl_kernel.rmsnorm, which dispatches to flashinfer's norm, JIT-built with nvcc
# from flashinfer/data and cached in ~/.cache/flashinfer (so this also warms the server's first start).
import sgl_kernel
x = torch.randn(8, 2880, device="cuda", dtype=torch.bfloat16)
w = torch.rand(2880, device="cuda", dtype=torch.bfloat16) + 0.5
ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * w.float())
err = ((sgl_kernel.rmsnorm(x, w, 1e-5).float() - ref).abs().max() / ref.abs().max()).item()
assert err < 2e-2, f"sgl_kernel.rmsnorm: relative error {err:.3g}"
print(f"sgl_kernel.rmsnorm (flashinfer JIT) ok, relative error {err:.2g}")
EOF
}

cmd_serve() {
  local target=${1:?usage: serve TARGET MODEL_DIR PORT [args]} model=${2:?usage: serve TARGET MODEL_DIR PORT [args]}
  local port=${3:?usage: serve TARGET MODEL_DIR PORT [args]}
  shift 3
  [[ -f $model/config.json ]] || die "$model/config.json not found"
  compgen -G "$model/*.safetensors" >/dev/null || die "no *.safetensors in $model"
  # sglang/srt/models/gpt_oss.py reads config.swiglu_limit, which some transformers
  # releases do not write for GptOssConfig (HF's GptOssExperts hard-codes limit=7.0).
  "$PY" - "$model/config.json" <<'EOF2' || die "fix $model/config.json (see above)"
import json, sys
c = json.load(open(sys.argv[1]))
if "GptOssForCausalLM" in c.get("architectures", []) and "swiglu_limit" not in c:
    sys.exit(f'{sys.argv[1]}: GptOssForCausalLM config has no "swiglu_limit"; '
             'add "swiglu_limit": 7.0 (the value HF GptOssExperts uses)')
EOF2
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
  PYTHONPATH=$target exec "$PY" -m sglang.launch_server \
    --model-path "$model" --skip-tokenizer-init \
    --attention-backend triton --sampling-backend pytorch --grammar-backend none \
    --host 127.0.0.1 --port "$port" --mem-fraction-static "${MEM_FRACTION_STATIC:-0.3}" "$@"
}

sub=${1:-}
shift || true
case $sub in
  download) cmd_download "$@" ;;
  install) cmd_install "$@" ;;
  slim) cmd_slim "$@" ;;
  check) cmd_check "$@" ;;
  serve) cmd_serve "$@" ;;
  wrapper) mkdir -p "${1:?usage: wrapper TARGET}" && write_python_wrapper "$1" ;;
  *) die "usage: $0 {download WHEELDIR|slim WHEELDIR OUTDIR|install WHEELDIR [TARGET]|wrapper TARGET|check [TARGET]|serve TARGET MODEL_DIR PORT [args...]} (TARGET: $DEFAULT_TARGET)" ;;
esac
