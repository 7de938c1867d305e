"""Verification: what the server serves against what the trainer sent.

Three checks, each of which fails on a server that did not load what it was sent:

- **Names** (before anything is sent, every mode): SGLang's loaders skip a tensor name their model does not have
  and still answer ``success`` (``GptOssForCausalLM.load_weights`` in ``sglang/srt/models/gpt_oss.py``: ``if name
  not in params_dict: continue``). Every name must be one the server loads: a name of the checkpoint it was launched
  from (`checkpoint_tensor_names`), or one that SGLang's loader maps onto a parameter the server reports
  (`sglang_param_name`).
- **Changes** (``checksum``): ``/weights_checker`` hashes every served parameter (``WeightChecker._compute_checksum``
  in ``sglang/srt/utils/weight_checker.py``). Every served parameter fed by a tensor that changed since the previous
  sync must have changed (`unchanged_after_sync`); the trainer decides "changed" on the values rounded to bfloat16
  (`SentFingerprints`), the coarsest precision SGLang serves unquantized weights in, so a change that rounds away on
  a bf16 server is never required to show.
- **Log-probs** (``logprobs``): the servers score a probe sequence (`probe_verdict`).

SGLang returns parameter values (``/get_weights_by_name``) only for models that implement ``get_weights_by_name``
(Llama, OPT, Granite, ...; not ``GptOssForCausalLM``, 0.5.17 to 0.5.23), and its hashes come from a Triton kernel on
GPU (``tensor_hash`` in ``sglang/srt/managers/mm_utils.py``), so for GPT-OSS the served values cannot be compared
with the trainer's bit for bit; the checks above compare what can be compared.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------------------- names

# SGLang's loaders store some checkpoint tensors fused: (server parameter, checkpoint name) as in
# ``stacked_params_mapping`` / ``FusedMoE.make_expert_params_mapping_fused`` of ``GptOssForCausalLM.load_weights``
# (q/k/v_proj -> qkv_proj; experts.gate_up_proj -> experts.w13_weight, experts.down_proj -> experts.w2_weight, the
# biases alike) and of the Llama-family loaders (gate_proj / up_proj -> gate_up_proj). SGLang matches by substring, in
# this order, and skips the attention mapping inside ``mlp.experts``.
_STACKED = (("qkv_proj", "q_proj"), ("qkv_proj", "k_proj"), ("qkv_proj", "v_proj"))
_EXPERTS = (
    ("experts.w13_weight", "experts.gate_up_proj"),  # also turns experts.gate_up_proj_bias into w13_weight_bias
    ("experts.w2_weight", "experts.down_proj"),  # likewise down_proj_bias -> w2_weight_bias
)
_DENSE_MLP = (("gate_up_proj", "gate_proj"), ("gate_up_proj", "up_proj"))


def sglang_param_name(name: str) -> str:
    """The SGLang parameter a checkpoint tensor ``name`` is loaded into (the loader's renaming; identity otherwise)."""
    if "mlp.experts" not in name:
        for param, shard in _STACKED:
            if shard in name:
                return name.replace(shard, param)
    for param, shard in _EXPERTS:
        if shard in name:
            return name.replace(shard, param)
    if "mlp.experts" not in name:
        for param, shard in _DENSE_MLP:
            if f".{shard}." in name:
                return name.replace(shard, param)
    return name


def sglang_lora_modules(names: Iterable[str]) -> set[str]:
    """LoRA target modules (PEFT's leaf names, or SGLang's ``--lora-target-modules``) as SGLang stores them: q/k/v in
    ``qkv_proj``, gate/up in ``gate_up_proj`` (``get_normalized_target_modules`` in ``sglang/srt/lora/utils.py``)."""
    fused = {shard: param for param, shard in (*_STACKED, *_DENSE_MLP)}
    return {fused.get(leaf, leaf) for leaf in (n.rsplit(".", 1)[-1] for n in names)}


def server_param_names(names: Iterable[str]) -> set[str]:
    """Parameter names as ``/weights_checker`` reports them, with LoRA wrappers' ``.base_layer`` removed."""
    return {n.replace(".base_layer.", ".") for n in names}


def checkpoint_tensor_names(model_path: str | Path) -> set[str] | None:
    """The tensor names of a checkpoint (what SGLang's loader was fed at launch), or None when it cannot be read here.

    ``model_path``: a directory (``*.safetensors.index.json``'s ``weight_map``, else the headers of its
    ``*.safetensors`` files), or a Hugging Face repo id already in the local cache. Only file headers are read.
    """
    path = Path(str(model_path)).expanduser()
    if not path.is_dir():
        path = _cached_snapshot(str(model_path))
        if path is None:
            return None
    for index in sorted(path.glob("*.safetensors.index.json")):
        try:
            return set(json.loads(index.read_text())["weight_map"])
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("cannot read %s: %s", index, exc)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.update(handle.keys())
    return names


def _cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of a Hub repo id whose index or single shard is in the cache (no download)."""
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - a dependency of transformers
        return None
    for filename in ("model.safetensors.index.json", "model.safetensors"):
        found = try_to_load_from_cache(repo_id, filename)
        if isinstance(found, str):
            return Path(found).parent
    return None


def unknown_names(sent: Iterable[str], *, checkpoint: set[str] | None, params: set[str] | None) -> list[str]:
    """The names in ``sent`` that the server would skip: not in its ``checkpoint`` names (when known), else not
    mapped by SGLang's loader onto one of its ``params``."""
    if checkpoint is not None:
        return [n for n in sent if n not in checkpoint]
    if params is None:
        raise ValueError("unknown_names needs the checkpoint's names or the server's parameter names")
    return [n for n in sent if sglang_param_name(n) not in params]


def unknown_lora_modules(adapter_names: Iterable[str], *, checkpoint: set[str] | None, params: set[str] | None):
    """The modules an adapter targets (``base_model.model.<module>.lora_A.weight``) that the served model lacks."""
    modules = sorted({n.split(".lora_")[0].removeprefix("base_model.model.") for n in adapter_names if ".lora_" in n})
    known = checkpoint if checkpoint is not None else params or set()
    if checkpoint is None:
        known = {sglang_param_name(n) for n in known} | known
    prefixes = {n.rsplit(".", 1)[0] for n in known}
    mapped = {m: sglang_param_name(m + ".weight").rsplit(".", 1)[0] for m in modules}
    return [m for m in modules if m not in prefixes and mapped[m] not in prefixes]


def describe_unknown(names: list[str], source: str) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    hint = ""
    if any(n.startswith("base_model.model.") for n in names):
        hint = " (PEFT-prefixed: export the policy with trl_ext.weight_sync.export_policy_weights, which merges LoRA)"
    return f"{len(names)} tensor name(s) the server does not load: {shown}{more}{hint}; the names it loads come from {source}"


# ------------------------------------------------------------------------------------------------------ changes

_SAMPLE = 4096


def served_dtype(dtypes: Iterable[str | None]) -> torch.dtype:
    """The precision to decide "changed" in: float32 only when every server says it serves float32 (``--dtype``),
    else bfloat16, the coarsest precision SGLang serves unquantized weights in."""
    dtypes = list(dtypes)
    return torch.float32 if dtypes and all(d in ("float32", "float") for d in dtypes) else torch.bfloat16


class SentFingerprints:
    """What the trainer sent last, per tensor: a strided sample of at most 4096 elements, rounded to the servers'
    precision (`served_dtype`).

    `diff` lists the tensors whose sample differs from the previous sync's: each certainly changed as the server
    stores it. A change outside the sample is not required to show (no false alarm); an optimizer step changes
    nearly every element, so the sample of a large tensor sees it. A change that rounds away in bf16 (a small
    tensor after a small step) is rightly not required to show on a bf16 server.
    """

    def __init__(self) -> None:
        self._last: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}

    @staticmethod
    def _sample(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLE)]
        return (sample.to(dtype) if sample.is_floating_point() else sample).to("cpu", copy=True)

    def diff(self, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.bfloat16) -> list[str] | None:
        """The names in ``named`` whose sample differs from the last committed sync's (None: nothing committed
        yet). The samples are kept pending until `commit`: a sync that failed is not a reference for the next one."""
        self._pending = {name: self._sample(t, dtype) for name, t in named}
        if not self._last:
            return None
        return [n for n, s in self._pending.items() if n in self._last and not torch.equal(self._last[n], s)]

    def commit(self) -> None:
        """The pending samples become the reference (after a verified sync)."""
        self._last, self._pending = self._pending, {}


def unchanged_after_sync(before: dict, after: dict, changed: list[str]) -> tuple[list[str], list[str]]:
    """``(stale, unmapped)``: the served parameters fed by a ``changed`` tensor whose hash is the same on every rank
    before and after the sync, and the changed tensors mapped onto no parameter the server reports.

    ``before`` / ``after``: ``/weights_checker`` answers (``ranks[i]["checksums"]``: name -> hash). With tensor
    parallelism a parameter counts as changed when it changed on any rank.
    """
    ranks_before = [r.get("checksums") or {} for r in before.get("ranks") or []]
    ranks_after = [r.get("checksums") or {} for r in after.get("ranks") or []]
    params = server_param_names(n for r in ranks_after for n in r)
    stale, unmapped = set(), []
    for name in changed:
        param = sglang_param_name(name)
        if param not in params:
            unmapped.append(name)
            continue
        moved = False
        for rb, ra in zip(ranks_before, ranks_after):
            hb, ha = _lookup(rb, param), _lookup(ra, param)
            if hb is None or ha is None or hb != ha:
                moved = True
                break
        if not moved:
            stale.add(param)
    return sorted(stale), unmapped


def _lookup(checksums: dict, param: str):
    if param in checksums:
        return checksums[param]
    wrapped = param.rsplit(".", 1)
    return checksums.get(f"{wrapped[0]}.base_layer.{wrapped[1]}") if len(wrapped) == 2 else None


# ----------------------------------------------------------------------------------------------------- log-probs


def reference_logprobs(model, input_ids: list[int]) -> list[float]:
    """Log-probs of ``input_ids[1:]`` under ``model`` at temperature 1 (the log-prob probe's reference)."""
    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], device=device)
    # autocast off: the reference must not depend on whether the caller runs inside accelerate's mixed-precision
    # forward (the first sync happens before training, later ones inside it)
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()


def _mean_abs(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b)) / max(len(a), 1)


# The smallest floor the probe assumes: fp32 log-softmax of log-probs of magnitude `scale` rounds at ~1e-7 * scale,
# so two engines holding the same fp32 weights can differ by a few 1e-7 even when this run measured 0.
_FP32_FLOOR = 1e-6


def probe_verdict(
    served: list[float],
    reference: list[float],
    *,
    previous_reference: list[float] | None,
    floor: float | None,
    atol: float,
    rtol: float,
    margin: float,
) -> dict:
    """Compare a server's probe log-probs with the trainer's.

    Returns ``{"tokens", "mean_abs", "max_abs", "mean_abs_reference", "tolerance", "floor", "step_movement",
    "separable", "ok"}``. ``floor`` is the difference measured at the first verified sync (None: this is it); the
    tolerance is the smaller of ``atol + rtol * mean|reference|`` and ``margin * floor``. ``step_movement`` is how
    far the trainer's own log-probs moved since the previous sync: a server that kept the previous weights differs
    by about that much, so it is caught when ``step_movement > tolerance`` (``separable``).
    """
    diff = [abs(a - b) for a, b in zip(served, reference)]
    mean = sum(diff) / max(len(diff), 1)
    scale = sum(abs(v) for v in reference) / max(len(reference), 1)
    cap = atol + rtol * scale
    measured_floor = mean if floor is None else floor
    tolerance = min(cap, margin * max(measured_floor, _FP32_FLOOR * (1.0 + scale)))
    movement = None if previous_reference is None else _mean_abs(reference, previous_reference)
    return {
        "tokens": len(diff),
        "mean_abs": mean,
        "max_abs": max(diff, default=0.0),
        "mean_abs_reference": scale,
        "tolerance": tolerance,
        "floor": measured_floor,
        "step_movement": movement,
        "separable": None if movement is None else movement > tolerance,
        "ok": mean <= (cap if floor is None else tolerance),
    }
