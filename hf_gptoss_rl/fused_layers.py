"""Fused GPT-OSS layers for training: Liger-Kernel's RMSNorm with GPT-OSS's own rounding, and a fused rotary embedding.

Both are opt-in (``AgenticGRPOConfig.liger_rms_norm`` / ``fused_rope``) and change no parameter, name or state.

RMSNorm
-------

Unfused, each of GPT-OSS's two RMSNorms per layer is half a dozen elementwise passes over a ``[tokens, 2880]`` fp32
tensor (cast, square, mean, scale, weight, cast back), run three times per checkpointed step (forward, recompute,
backward). Liger-Kernel (``pip install liger-kernel``) does it in one Triton kernel each way.

Why not ``use_liger_kernel=True`` (``liger_kernel.transformers.apply_liger_kernel_to_gpt_oss``)? It installs
``LigerRMSNorm`` with ``casting_mode="llama"``, which rounds the normalised activations to bf16 *before* the weight
multiply. GPT-OSS multiplies by the weight in fp32 and rounds once (``(self.weight * hidden_states).to(dtype)``),
and so do the inference engines that roll out the policy: a systematic rounding difference between training and
rollout is what this project exists to remove. ``casting_mode="gemma"`` with ``offset=0`` is GPT-OSS's math (on an
H200 its logits and gradients match the stock bf16 model's error against fp32 to 3 digits,
``tests/test_fused_layers.py``).

Liger's GPT-OSS RoPE kernel is deliberately not applied: in that same check it made several gradients 2-10x less
accurate than the stock bf16 model (router weights 0.10 vs 0.01 relative error).

:func:`apply_liger_gptoss_rms_norm` replaces every ``GptOssRMSNorm`` module by a
``LigerRMSNorm(casting_mode="gemma", offset=0.0)`` holding the *same* weight ``Parameter`` (optimizer state, PEFT and
state-dict names are unchanged). CUDA only (Liger's kernels do not run on CPU tensors). When the weight is frozen
(LoRA on the attention projections), the backward is ``hf_gptoss_rl._rms_norm_triton`` instead of Liger's: Liger
always runs its weight-gradient kernel (one program per SM looping over rows, each with a weight-gradient partial
sum) and zero-fills the input gradient first (``in_place=False``), which cost 0.33 ms per call on a
``[32768, 2880]`` bf16 input on an H200 where the input gradient alone is one pass over ~0.55 GB.

Rotary embedding
----------------
Stock GPT-OSS applies RoPE with seven bf16 elementwise passes per tensor (four multiplies, an add, a subtract, a
``cat``), again in the recompute and twice as many in the backward: ~0.15 s of a 32k-token gpt-oss-20b step on an
H200. :func:`apply_fused_gptoss_rope` routes the GPT-OSS modeling module's ``apply_rotary_pos_emb`` through one
Triton kernel each way (``hf_gptoss_rl._rope_triton``): fp32 math rounded once (closer to exact than the stock
bf16 chain, never further), the output in the projections' memory order so the attention call needs no copy.
Tensors the kernel does not take (CPU without the ``rope`` backend ``triton``, a ``cos`` that needs a
gradient, other layouts) go to the original function, so other models in the process are unaffected.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import warnings

import torch
from torch import nn

from . import _backend

__all__ = ["apply_fused_gptoss_rope", "apply_liger_gptoss_rms_norm", "fused_rotary_pos_emb", "liger_available"]


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def apply_liger_gptoss_rms_norm(model: nn.Module) -> nn.Module:
    """Swap GPT-OSS's RMSNorm modules for Liger's Triton RMSNorm with GPT-OSS's rounding; returns `model`.

    Works on a plain or PEFT-wrapped GPT-OSS model whose parameters live on a CUDA device. Idempotent.
    """
    if not liger_available():
        raise ImportError("apply_liger_gptoss_rms_norm needs liger-kernel: pip install liger-kernel")
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cuda"}:
        raise ValueError(f"Liger's Triton kernels run on CUDA tensors only; the model's parameters are on {devices}")
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, GptOssRMSNorm)]
    if not targets and not any(isinstance(m, LigerRMSNorm) for m in model.modules()):
        raise ValueError("no GptOssRMSNorm module found: is this a GPT-OSS model?")
    for name, module in targets:
        # in_place=False: Liger's in-place backward overwrites the incoming gradient buffer
        fused = LigerRMSNorm(
            module.weight.shape[0], eps=module.variance_epsilon, offset=0.0, casting_mode="gemma", in_place=False
        )
        fused.weight = module.weight  # the same Parameter: nothing about the training state changes
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, fused)
    for module in model.modules():
        if isinstance(module, LigerRMSNorm) and not getattr(module, "_hf_gptoss_rl_frozen_weight_backward", False):
            # an instance attribute shadows the class's forward; `original` is the bound Liger forward
            module.forward = functools.partial(_rms_norm_forward, module, module.forward)
            module._hf_gptoss_rl_frozen_weight_backward = True
    return model


class _RMSNormFrozenWeight(torch.autograd.Function):
    """Liger's forward (run without autograd: grad mode is off inside `forward`), the input-gradient kernel of
    `hf_gptoss_rl._rms_norm_triton` as the backward; the weight gets no gradient (it is frozen)."""

    @staticmethod
    def forward(ctx, x, weight, eps, liger_forward):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return liger_forward(x)

    @staticmethod
    def backward(ctx, grad):
        from ._rms_norm_triton import rms_norm_input_grad

        x, weight = ctx.saved_tensors
        return rms_norm_input_grad(x, weight, grad, ctx.eps), None, None, None


def _rms_norm_forward(module, original, hidden_states):
    frozen = module.weight is not None and not module.weight.requires_grad
    gptoss_math = module.offset == 0.0 and module.casting_mode == "gemma"
    if frozen and gptoss_math and hidden_states.requires_grad and torch.is_grad_enabled():
        return _RMSNormFrozenWeight.apply(hidden_states, module.weight, module.variance_epsilon, original)
    return original(hidden_states)


# ------------------------------------------------------------------------------------------------- rotary embedding


class _FusedRotary(torch.autograd.Function):
    """`y = rotate(x; cos, sin)` with GPT-OSS's half split; cos / sin are constants (no gradient)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        from . import _rope_triton

        ctx.save_for_backward(cos, sin)
        return _rope_triton.rotate_half_pairs(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        from . import _rope_triton

        cos, sin = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return _rope_triton.rotate_half_pairs(grad, cos, sin, inverse=True), None, None


def _fused_rope_declines(q, k, cos, sin, unsqueeze_dim) -> str | None:
    """Why the fused kernel does not take this call (None: it does)."""
    backend = _backend.current.rope
    if backend == "torch":
        return "the rope backend is torch"
    if not (q.is_cuda or backend == "triton"):
        return "CPU tensors (the Triton interpreter needs the rope backend triton)"
    if unsqueeze_dim != 1:
        return f"unsqueeze_dim={unsqueeze_dim}"
    if cos.requires_grad or sin.requires_grad:
        return "cos / sin need a gradient"
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
    half = q.shape[-1] // 2
    if not (q.shape[-1] == k.shape[-1] == 2 * half and (half & (half - 1)) == 0):
        return f"head_dim {q.shape[-1]} (the kernel takes twice a power of two)"
    if tuple(cos.shape[1:]) != (q.shape[2], half) or cos.shape[0] not in (1, q.shape[0]):
        return f"cos {tuple(cos.shape)} does not match q {tuple(q.shape)}"
    if not (q.stride(-1) == k.stride(-1) == 1):
        return "q or k with a last dimension that is not contiguous"
    return None


_WARNED: set[str] = set()


def _make_fused_rotary_pos_emb(original):
    def fused_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        """GPT-OSS ``apply_rotary_pos_emb`` through the fused Triton kernel (see ``apply_fused_gptoss_rope``)."""
        reason = _fused_rope_declines(q, k, cos, sin, unsqueeze_dim)
        if reason is not None:
            if q.is_cuda and reason not in _WARNED:  # asked for on a GPU and not taken: say so, once per reason
                _WARNED.add(reason)
                warnings.warn(
                    f"fused GPT-OSS RoPE: using transformers' implementation for this call: {reason}", stacklevel=2
                )
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return _FusedRotary.apply(q, cos, sin), _FusedRotary.apply(k, cos, sin)

    fused_rotary_pos_emb.hf_gptoss_rl_original = original
    return fused_rotary_pos_emb


def fused_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """GPT-OSS's ``apply_rotary_pos_emb(q, k, cos, sin)`` on the fused kernel, whatever is installed in transformers."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    current = modeling_gpt_oss.apply_rotary_pos_emb
    original = getattr(current, "hf_gptoss_rl_original", current)
    return _make_fused_rotary_pos_emb(original)(q, k, cos, sin, unsqueeze_dim)


def apply_fused_gptoss_rope(model: nn.Module) -> nn.Module:
    """Route the GPT-OSS attention layers of `model` through the fused rotary kernel; returns `model`. Idempotent.

    GPT-OSS's attention calls its modeling module's ``apply_rotary_pos_emb``; that module-level function is swapped
    for a dispatcher (the one place transformers looks it up, as Liger-Kernel patches it too). The dispatcher keeps
    the original for every call the kernel does not take, so CPU models and other layouts behave as before.
    """
    modules = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__name__ == "GptOssAttention"}
    if not modules:
        raise ValueError("no GptOssAttention module found: is this a GPT-OSS model?")
    if _backend.current.rope != "torch":
        try:
            from . import _rope_triton  # noqa: F401
        except Exception as exc:  # pragma: no cover - triton missing
            raise ImportError(f"apply_fused_gptoss_rope needs triton: {exc}") from exc
    for module in modules:
        current = getattr(module, "apply_rotary_pos_emb", None)
        if current is None:
            raise RuntimeError(
                f"{module.__name__} has no apply_rotary_pos_emb: this transformers version is not "
                "supported by apply_fused_gptoss_rope"
            )
        if not hasattr(current, "hf_gptoss_rl_original"):
            module.apply_rotary_pos_emb = _make_fused_rotary_pos_emb(current)
    return model
