#!/usr/bin/env bash
# Carries FlashAttention-4 (CuTe DSL, flash-attn-4 4.0.0b36) to the offline GPU image (python 3.12) as wheels.
# One `run` call carries at most 64 MiB, so the wheels live in numbered part folders .fa4/p1, .fa4/p2, ...
# (each <= FA4_PART_MIB) and the ~88 MiB nvidia-cutlass-dsl-libs-cu13 wheel is cut with `split`.
#
#   scripts/fa4_carry.sh prepare   # dev machine (PyPI): download the pinned wheels, split and pack into .fa4/pN
#   scripts/fa4_carry.sh stash N   # device, repo copy carrying .fa4/pN: copy .fa4/pN/* into $FA4_STASH_DIR
#   scripts/fa4_carry.sh install   # device, after stashing every part: reassemble, check sha256, pip install
#                                  # into $FA4_SITE, write $FA4_SITE/env.sh (source it), try the import
#   scripts/fa4_carry.sh check     # device: import flash_attn.cute and ask transformers whether FA4 is usable
#
# Environment: FA4_DIR (default <repo>/.fa4), FA4_STASH_DIR (/tmp/fa4), FA4_SITE (/tmp/site_fa4),
# PYTHON (python3), FA4_PART_MIB (60), FA4_CHUNK_MIB (48), FA4_IMPORT_CHECK (1; 0 skips the import at install),
# PREPARE_PYTHON (python with pip for `prepare`; default $PYTHON), FA4_PIP_EXTRA (extra `pip install` options,
# e.g. "--python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all:" to test-install off the image).
#
# Closure (Requires-Dist read from each wheel): flash-attn-4 -> nvidia-cutlass-dsl, apache-tvm-ffi<0.2,
# torch-c-dlpack-ext, quack-kernels; nvidia-cutlass-dsl -> libs-base -> libs-core. einops, torch,
# typing-extensions, cuda-bindings and protobuf are on the image already. nvidia-cutlass-dsl also names
# libs-cu12 (another ~88 MiB) unconditionally, but the DSL picks whichever _cutlass_ir.cu{N} flavour is
# installed and the driver supports (CUDA 13.0 there), so only libs-cu13 is carried (installs use --no-deps).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FA4_DIR=${FA4_DIR:-$REPO/.fa4}
FA4_STASH_DIR=${FA4_STASH_DIR:-/tmp/fa4}
FA4_SITE=${FA4_SITE:-/tmp/site_fa4}
PYTHON=${PYTHON:-python3}
FA4_PART_MIB=${FA4_PART_MIB:-60}
FA4_CHUNK_MIB=${FA4_CHUNK_MIB:-48}
FA4_IMPORT_CHECK=${FA4_IMPORT_CHECK:-1}
MANIFEST=fa4.manifest  # in every part: "<sha256> <bytes> <wheel>" per wheel, then "part <pN> <file>" per file

# Pinned with PyPI's sha256 so `prepare` reproduces the same bytes (pip checks them: --require-hashes).
REQUIREMENTS="
flash-attn-4==4.0.0b36 --hash=sha256:b6f0e2a264334cb1b59289ddd309c7c76d3a8d184268316b43403e51ba8795d2
nvidia-cutlass-dsl==4.8.1 --hash=sha256:43ed46b21d151aa643c6765457c7310827b938c1cf45d5109a0152de4ef06227
nvidia-cutlass-dsl-libs-base==4.8.1 --hash=sha256:ac2fd8c7fa3d6ded00917fa7cba8686061005da8c4703c6a29e03c1504543909
nvidia-cutlass-dsl-libs-core==4.8.1 --hash=sha256:bacc6760e3286db447d45720d32ae58ac2e6cecade1152345ef784b2d5e44431
nvidia-cutlass-dsl-libs-cu13==4.8.1 --hash=sha256:50191a381d8cc1393373ae0bc879b0aefa9a256c23c22d4fa1c2fe3dfe57bc90
quack-kernels==0.6.5 --hash=sha256:df1ddd31366c82eb9692fe087c671209189dcbde53c909c81a865d4ee66b158d
apache-tvm-ffi==0.1.15.post2 --hash=sha256:059eed9bfc94bcd41650fb8eefde74040a1bc7e7b1a6f0a8ff897b02b118875b
torch-c-dlpack-ext==0.1.5 --hash=sha256:e6f9da4bb9af70e27facc777458be62e10dbbbddda7672d16138db0553c5a524
"
# Wheels for the device: cp312, manylinux x86_64.
PLATFORM_ARGS=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)

die() { echo "fa4_carry: error: $*" >&2; exit 1; }
log() { echo "fa4_carry: $*"; }
fsize() { stat -c %s "$1"; }

cmd_prepare() {
  local pip_python=${PREPARE_PYTHON:-$PYTHON}
  tmp=$(mktemp -d)  # global: the EXIT trap removes it
  trap 'rm -rf "$tmp"' EXIT
  printf '%s\n' "$REQUIREMENTS" | sed '/^$/d' > "$tmp/requirements.txt"
  log "downloading $(wc -l < "$tmp/requirements.txt") pinned wheels with $pip_python"
  "$pip_python" -m pip download -q --no-deps --require-hashes "${PLATFORM_ARGS[@]}" \
    -r "$tmp/requirements.txt" -d "$tmp/wheels" || die "pip download failed (PyPI reachable?)"

  local chunk=$((FA4_CHUNK_MIB * 1024 * 1024)) cap=$((FA4_PART_MIB * 1024 * 1024))
  [ "$chunk" -le "$cap" ] || die "FA4_CHUNK_MIB ($FA4_CHUNK_MIB) must be <= FA4_PART_MIB ($FA4_PART_MIB)"
  mkdir -p "$tmp/files"
  : > "$tmp/wheels.txt"
  local w name
  for w in "$tmp"/wheels/*.whl; do
    name=$(basename "$w")
    echo "$(sha256sum "$w" | cut -d' ' -f1) $(fsize "$w") $name" >> "$tmp/wheels.txt"
    if [ "$(fsize "$w")" -gt "$chunk" ]; then
      split -b "$chunk" -d -a 2 "$w" "$tmp/files/$name.part-"
    else
      cp "$w" "$tmp/files/"
    fi
  done

  # First-fit decreasing into parts of at most FA4_PART_MIB.
  local -a used=()
  local f size i placed
  : > "$tmp/parts.txt"
  while read -r size f; do
    placed=
    for i in "${!used[@]}"; do
      if [ $((used[i] + size)) -le "$cap" ]; then used[i]=$((used[i] + size)); placed=$i; break; fi
    done
    if [ -z "$placed" ]; then used+=("$size"); placed=$((${#used[@]} - 1)); fi
    echo "part p$((placed + 1)) $f" >> "$tmp/parts.txt"
  done < <(for f in "$tmp"/files/*; do echo "$(fsize "$f") $(basename "$f")"; done | sort -rn)

  rm -rf "$FA4_DIR"
  mkdir -p "$FA4_DIR"
  local p
  while read -r _ p f; do
    mkdir -p "$FA4_DIR/$p"
    mv "$tmp/files/$f" "$FA4_DIR/$p/"
  done < "$tmp/parts.txt"
  for p in "$FA4_DIR"/p*; do
    cat "$tmp/wheels.txt" "$tmp/parts.txt" > "$p/$MANIFEST"
  done
  cat "$tmp/wheels.txt" "$tmp/parts.txt" > "$FA4_DIR/$MANIFEST"
  log "wrote $FA4_DIR ($(awk '{s += $2} END {print s}' "$tmp/wheels.txt") bytes of wheels):"
  for p in "$FA4_DIR"/p*; do
    log "  $(basename "$p"): $(du -sb "$p" | cut -f1) bytes, $(find "$p" -type f ! -name "$MANIFEST" | wc -l) files"
  done
  log "device: for each N, a run carrying .fa4/pN runs '$0 stash N'; the last one then runs '$0 install'"
}

cmd_stash() {
  local n=${1:-}
  [[ "$n" =~ ^[0-9]+$ ]] || die "usage: stash N (N = part number, see $FA4_DIR/p*)"
  local src="$FA4_DIR/p$n"
  [ -d "$src" ] || die "$src missing: carry .fa4/p$n in this run (carry: [\".fa4/p$n\"])"
  mkdir -p "$FA4_STASH_DIR"
  cp -f "$src"/* "$FA4_STASH_DIR/"
  log "stashed part p$n ($(du -sb "$src" | cut -f1) bytes) into $FA4_STASH_DIR"
  local missing
  missing=$(parts_missing)
  if [ -n "$missing" ]; then
    log "still to stash: $missing (next run must start while this machine is warm: /tmp does not survive)"
  else
    log "all parts stashed; run '$0 install'"
  fi
}

# Parts whose files are not in the stash yet (read from the stashed manifest).
parts_missing() {
  [ -f "$FA4_STASH_DIR/$MANIFEST" ] || return 0
  local p f
  while read -r _ p f; do
    [ -f "$FA4_STASH_DIR/$f" ] || echo "$p"
  done < <(grep '^part ' "$FA4_STASH_DIR/$MANIFEST") | sort -u | paste -sd' '
}

cmd_install() {
  local stash=$FA4_STASH_DIR
  [ -f "$stash/$MANIFEST" ] || die "no $stash/$MANIFEST: stash the parts first ('$0 stash N' for every N)"
  local missing
  missing=$(parts_missing)
  [ -z "$missing" ] || die "parts not stashed in $stash: $missing (the machine went cold in between? stash them again)"

  local sha size name got
  local -a wheels=()
  while read -r sha size name; do
    if [ ! -f "$stash/$name" ] || [ "$(sha256sum "$stash/$name" | cut -d' ' -f1)" != "$sha" ]; then
      compgen -G "$stash/$name.part-*" > /dev/null || die "$name: neither the wheel nor its .part-* chunks are in $stash"
      cat "$stash/$name".part-* > "$stash/$name.tmp"
      mv "$stash/$name.tmp" "$stash/$name"
      log "reassembled $name"
    fi
    got=$(sha256sum "$stash/$name" | cut -d' ' -f1)
    [ "$got" = "$sha" ] || die "$name: sha256 $got != $sha (corrupt or stale parts; stash all parts again)"
    [ "$(fsize "$stash/$name")" = "$size" ] || die "$name: size mismatch"
    wheels+=("$stash/$name")
  done < <(grep -v '^part ' "$stash/$MANIFEST")
  log "${#wheels[@]} wheels verified (sha256)"

  # One pip call: with --target, pip stages every wheel together, so the wheels that share
  # nvidia_cutlass_dsl/ merge; separate calls would skip the already-existing folder.
  local -a extra=()
  read -ra extra <<< "${FA4_PIP_EXTRA:-}"
  rm -rf "$FA4_SITE"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
    "${extra[@]}" --target "$FA4_SITE" "${wheels[@]}" || die "pip install into $FA4_SITE failed"
  local dsl="$FA4_SITE/nvidia_cutlass_dsl/dsl_packages"
  [ -d "$dsl/cutlass" ] || die "$dsl/cutlass missing after install"
  # --target does not process .pth files, so the DSL's own .pth (adds dsl_packages) is replaced by PYTHONPATH.
  # The on-disk kernel cache lets each new process (full_step.py runs one per variant and S) skip the
  # CuTe DSL compile of kernels an earlier process built; compile time only ever lands in warm-up.
  cat > "$FA4_SITE/env.sh" <<EOF
export PYTHONPATH="$FA4_SITE:$dsl\${PYTHONPATH:+:\$PYTHONPATH}"
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=\${FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED:-1}
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=\${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-$FA4_SITE/.cute_cache}
EOF
  log "installed into $FA4_SITE; use it with:"
  echo "source $FA4_SITE/env.sh   # or:"
  echo "export PYTHONPATH=\"$FA4_SITE:$dsl\${PYTHONPATH:+:\$PYTHONPATH}\""
  if [ "$FA4_IMPORT_CHECK" = 1 ]; then cmd_check; fi
}

cmd_check() {
  [ -f "$FA4_SITE/env.sh" ] || die "$FA4_SITE/env.sh missing: run '$0 install' first"
  # shellcheck disable=SC1091
  source "$FA4_SITE/env.sh"
  "$PYTHON" - <<'EOF' || die "flash_attn.cute did not import (see the traceback above)"
import importlib.metadata as md
import torch
from flash_attn.cute import flash_attn_func  # noqa: F401
import cutlass
print("fa4_carry: flash_attn.cute imports;", ", ".join(
    f"{d} {md.version(d)}" for d in ("flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels", "apache-tvm-ffi")),
    "| cutlass", getattr(cutlass, "__file__", "?"), "| torch", torch.__version__, "cuda", torch.cuda.is_available())
try:
    from transformers.utils import is_flash_attn_4_available
    print("fa4_carry: transformers is_flash_attn_4_available():", is_flash_attn_4_available())
except ImportError as e:
    print("fa4_carry: transformers has no is_flash_attn_4_available:", e)
if torch.cuda.is_available():
    # Small causal GQA fwd+bwd with learnable_sink against an fp32 reference: fails fast, before a benchmark.
    import time
    g = torch.Generator(device="cuda").manual_seed(0)
    B, S, Hq, Hkv, D = 1, 512, 8, 2, 64
    q, k, v = (torch.randn(B, S, h, D, device="cuda", generator=g).bfloat16().requires_grad_()
               for h in (Hq, Hkv, Hkv))
    sink = torch.randn(Hq, device="cuda", generator=g).requires_grad_()
    t0 = time.perf_counter()
    out = flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v, sink))
    torch.cuda.synchronize()
    qf, kf, vf, sf = (t.detach().float().requires_grad_() for t in (q, k, v, sink))
    kr, vr = (t.repeat_interleave(Hq // Hkv, dim=2) for t in (kf, vf))
    logits = torch.einsum("bqhd,bkhd->bhqk", qf, kr) * D**-0.5
    logits = logits.masked_fill(torch.ones(S, S, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    full = torch.cat([logits, sf.view(1, Hq, 1, 1).expand(B, Hq, S, 1)], dim=-1)
    ref = torch.einsum("bhqk,bkhd->bqhd", full.softmax(-1)[..., :S], vr)
    ref_grads = torch.autograd.grad(ref.square().sum(), (qf, kf, vf, sf))
    errs = [((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
            for a, b in zip((out, *grads), (ref, *ref_grads))]
    print(f"fa4_carry: GPU fwd+bwd with learnable_sink ran in {time.perf_counter() - t0:.1f} s (compile included); "
          "max rel err out/dq/dk/dv/dsink " + " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) < 5e-2, f"FA4 disagrees with the fp32 reference: {errs}"
else:
    print("fa4_carry: no CUDA here: GPU smoke test skipped")
EOF
}

case "${1:-}" in
  prepare) cmd_prepare ;;
  stash) shift; cmd_stash "$@" ;;
  install) cmd_install ;;
  check) cmd_check ;;
  *) echo "usage: $0 prepare | stash N | install | check   (see the header of $0)" >&2; exit 2 ;;
esac
