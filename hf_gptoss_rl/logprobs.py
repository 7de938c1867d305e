"""Memory-efficient per-token log-probabilities (and entropies) of a causal LM head.

GPT-OSS has a 201,088-token vocabulary: the float32 logits of one 32k-token sequence take 25.7 GB, and autograd would
keep them for the backward pass. Here the LM head is applied to `chunk_size` tokens at a time; each chunk's logits are
reduced to a log-sum-exp and the target logit, then freed. The backward pass recomputes one chunk at a time and
turns it into the gradients of the hidden states, the head weight and its bias, so the peak extra memory is one
`[chunk_size, vocab]` float32 tile whatever the sequence length.

When only the hidden states need a gradient (LoRA or a frozen head: the usual RL setup), the forward computes it
instead: d log p_t / dh = (onehot(t) - p) W / T is known per token before the loss is, so each chunk's logits serve
the forward and that product, and the backward only scales the kept `[N, H]` float32 rows by the upstream gradient.
That is two passes over the head instead of three (forward, recompute, gradient). An entropy that receives a
gradient adds its part by the recompute above, so such a loss pays four passes unless it asks for the plain path
(`hidden_grad_in_forward=False`).

Math, with `z = (h W^T + b) / T` for one token, `p = softmax(z)`, `lse = logsumexp(z)`, target `t`:
    log p_t = z_t - lse                          d log p_t / dz = onehot(t) - p
    H       = lse - sum_j p_j z_j                dH / dz        = -p * (z - (lse - H))
and dz/dlogits = 1/T. On CUDA the elementwise work on each chunk's logits runs in two fused Triton kernels
(`hf_gptoss_rl._logprobs_triton`: one read of the logits in the forward, one read and one write in the backward);
elsewhere the same math runs in PyTorch ops, so this works wherever the model runs. Override with
`hf_gptoss_rl.set_backends(logprobs="torch"|"triton")` or, read at import, `HF_GPTOSS_RL_LOGPROBS_BACKEND`
(`triton` on CPU needs TRITON_INTERPRET=1 set before triton is imported).
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from . import _backend

__all__ = [
    "ChunkedLogProbs",
    "ChunkedLogProbOutput",
    "add_chunked_logprob_head",
    "apply_chunked_logprobs",
    "causal_lm_token_logprobs",
    "chunked_logprobs",
]

DEFAULT_CHUNK_SIZE = 512

try:  # Triton is optional: the PyTorch path covers CPU and any device Triton cannot drive.
    from . import _logprobs_triton
except Exception:  # pragma: no cover - triton missing or unusable on this machine
    _logprobs_triton = None


def _use_triton(t: torch.Tensor) -> bool:
    """Fused Triton kernels for float32 logits on CUDA; on CPU only when asked (tests, under TRITON_INTERPRET=1)."""
    if t.dtype == torch.float64:  # float64 inputs: float64 math, in PyTorch
        return False
    return _backend.use_triton("logprobs", t, _logprobs_triton is not None)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` with a float32 (or float64) result never rounded to bf16/fp16 (logits feed log-prob differences)."""
    if a.dtype in (torch.float32, torch.float64) and a.dtype == b.dtype:
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)  # fp32 output of a half-precision GEMM
        except (RuntimeError, TypeError):
            pass
    return a.float() @ b.float()


def _chunk_logits(hidden, weight, bias, temperature):
    logits = _mm_fp32(hidden, weight.t())
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    return logits / temperature


def _accumulate_head_grads(grad_logits, h, weight, start, end, grad_hidden, grad_weight, grad_bias, acc):
    """One chunk's logit gradient `[C, V]` -> the hidden states' rows, the head weight's and bias' sums."""
    if grad_hidden is not None:
        # each token's hidden gradient is one matmul over the vocabulary (accumulated in fp32 by the GEMM)
        grad_hidden[start:end] += _mm_fp32(grad_logits.to(weight.dtype), weight).to(acc)
    if grad_weight is not None:
        grad_weight += grad_logits.to(acc).t() @ h.to(acc)  # summed over chunks: keep fp32
    if grad_bias is not None:
        grad_bias += grad_logits.to(acc).sum(0)


class ChunkedLogProbs(torch.autograd.Function):
    """`log_softmax((hidden @ weight.T + bias) / T)[target]` and the entropy, chunked over tokens.

    hidden `[N, H]`, weight `[V, H]`, bias `[V]` or None, targets `[N]` (int64) → log-probs `[N]`, entropy `[N]`
    (float32; float64 for float64 inputs). `hidden_grad_in_forward`: compute d log p / d hidden during the forward
    (only valid when the hidden states alone need a gradient; `apply_chunked_logprobs` decides).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk_size: int, hidden_grad_in_forward=False):
        n = hidden.shape[0]
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logps = torch.empty(n, device=hidden.device, dtype=acc)
        entropy = torch.empty_like(logps)
        lse = torch.empty_like(logps)
        # d log p_t / d hidden per token, float32 `[N, H]`
        dlogp_dh = torch.empty(hidden.shape, device=hidden.device, dtype=acc) if hidden_grad_in_forward else None
        fused = _use_triton(hidden)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            if fused:  # raw fp32 logits; bias, temperature and every reduction in one Triton pass
                logits = _mm_fp32(hidden[start:end], weight.t())
                lse[start:end], logps[start:end], entropy[start:end] = _logprobs_triton.row_stats(
                    logits, bias, targets[start:end], 1.0 / temperature
                )
                if dlogp_dh is not None:  # (onehot - p) / T, then the same product the backward would run
                    unit = torch.ones(end - start, device=hidden.device, dtype=acc)
                    grad_logits = _logprobs_triton.grad_logits(
                        logits, bias, targets[start:end], lse[start:end], entropy[start:end], unit, None,
                        1.0 / temperature, weight.dtype,
                    )  # fmt: skip
                    dlogp_dh[start:end] = _mm_fp32(grad_logits, weight)
                    del grad_logits
                del logits
                continue
            z = _chunk_logits(hidden[start:end], weight, bias, temperature)  # [C, V] float32
            chunk_lse = torch.logsumexp(z, dim=-1)
            lse[start:end] = chunk_lse
            logps[start:end] = z.gather(-1, targets[start:end].unsqueeze(-1)).squeeze(-1) - chunk_lse
            p = torch.exp(z - chunk_lse.unsqueeze(-1))
            if dlogp_dh is not None:  # d log p_t / dz = onehot(t) - p; dz / dlogits = 1 / T
                grad_logits = p.neg().scatter_add_(-1, targets[start:end].unsqueeze(-1), torch.ones_like(p[:, :1]))
                dlogp_dh[start:end] = _mm_fp32(grad_logits.div_(temperature).to(weight.dtype), weight).to(acc)
                del grad_logits
            entropy[start:end] = chunk_lse - p.mul_(z).sum(-1)  # in place: one [C, V] temporary besides z
            del z, p
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, dlogp_dh)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not as zeros to work through
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, bias, targets, lse, entropy, dlogp_dh = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = lse.dtype  # float32, or float64 for float64 inputs
        grad_weight = torch.zeros_like(weight, dtype=acc) if need_w else None
        grad_bias = torch.zeros_like(bias, dtype=acc) if (need_b and bias is not None) else None
        if dlogp_dh is not None:  # the log-probs' part was computed in the forward
            grad_hidden = dlogp_dh * grad_logps.to(acc).unsqueeze(-1) if grad_logps is not None else None
            if grad_entropy is None:
                none = (None,) * 6
                return (None, *none) if grad_hidden is None else (grad_hidden.to(hidden.dtype), *none)
            grad_logps = None  # the entropy's part follows, by recomputation
            if grad_hidden is None:
                grad_hidden = torch.zeros_like(hidden, dtype=acc)
        else:
            grad_hidden = torch.zeros_like(hidden, dtype=acc) if need_h else None
        n = hidden.shape[0]
        fused = _use_triton(hidden)
        # the hidden-state gradient's matmul runs in the head's dtype; weight / bias gradients need fp32 logits
        grad_dtype = acc if (grad_weight is not None or grad_bias is not None) else weight.dtype
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            h = hidden[start:end]
            if fused:
                grad_logits = _logprobs_triton.grad_logits(
                    _mm_fp32(h, weight.t()),
                    bias,
                    targets[start:end],
                    lse[start:end],
                    entropy[start:end],
                    None if grad_logps is None else grad_logps[start:end],
                    None if grad_entropy is None else grad_entropy[start:end],
                    1.0 / temperature,
                    grad_dtype,
                )
                _accumulate_head_grads(grad_logits, h, weight, start, end, grad_hidden, grad_weight, grad_bias, acc)
                continue
            z = _chunk_logits(h, weight, bias, temperature)  # [C, V] float32
            p = torch.exp(z - lse[start:end].unsqueeze(-1))
            # d loss / dz = p * (-g_logp - g_H * (z - E_p[z])) + onehot(target) * g_logp, built in z's buffer
            g_lp = grad_logps[start:end].to(acc).unsqueeze(-1) if grad_logps is not None else None
            if grad_entropy is not None:
                mean_z = (lse[start:end] - entropy[start:end]).unsqueeze(-1)
                coef = z.sub_(mean_z).mul_(-grad_entropy[start:end].to(acc).unsqueeze(-1))
                if g_lp is not None:
                    coef.sub_(g_lp)
            elif g_lp is not None:
                coef = z.copy_(-g_lp.expand_as(z))
            else:
                coef = z.zero_()
            grad_logits = coef.mul_(p)
            del p
            if g_lp is not None:
                grad_logits.scatter_add_(-1, targets[start:end].unsqueeze(-1), g_lp)
            grad_logits.div_(temperature)  # dz/dlogits = 1/T
            _accumulate_head_grads(grad_logits, h, weight, start, end, grad_hidden, grad_weight, grad_bias, acc)
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


def apply_chunked_logprobs(
    hidden, weight, bias, targets, temperature: float, chunk_size: int, hidden_grad_in_forward: bool | None = None
):
    """`ChunkedLogProbs` on flat `[N, H]` hidden states. `hidden_grad_in_forward`: None (default) computes the hidden
    states' log-prob gradient in the forward when they alone need one (grad mode on, the head's weight and bias
    frozen); False never does (for losses that also differentiate the entropy: the forward's extra product is then
    wasted, as the backward recomputes the logits for the entropy's part anyway)."""
    in_forward = (
        hidden_grad_in_forward is not False
        and torch.is_grad_enabled()
        and hidden.requires_grad
        and not weight.requires_grad
        and not (bias is not None and bias.requires_grad)
    )
    return ChunkedLogProbs.apply(hidden, weight, bias, targets, float(temperature), int(chunk_size), in_forward)


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    hidden_grad_in_forward: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies of `targets` under the head `(weight, bias)` at `temperature`.

    `hidden` is `[..., H]` and `targets` `[...]` (any leading shape); returns two float32 tensors of `targets`' shape.
    `hidden_grad_in_forward`: see `apply_chunked_logprobs` (pass False when the loss differentiates the entropy).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} != head input size {weight.shape[-1]}")
    lead = targets.shape
    vocab = weight.shape[0]
    flat_targets = targets.reshape(-1).long()
    if flat_targets.numel() and (flat_targets.min() < 0 or flat_targets.max() >= vocab):
        raise ValueError(f"targets must lie in [0, {vocab}); mask ignored positions before calling")
    logps, entropy = apply_chunked_logprobs(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        flat_targets,
        temperature,
        chunk_size,
        hidden_grad_in_forward,
    )
    return logps.view(lead), entropy.view(lead)


def causal_lm_token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    logits_to_keep: int | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    **model_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies `[B, logits_to_keep]` of the last `logits_to_keep` tokens of `input_ids`.

    Runs the model's backbone (`model.base_model`, e.g. `GptOssModel`), never its full-vocabulary head: position `i`
    of the result scores `input_ids[:, -logits_to_keep + i]` from the hidden state just before it. Works with a
    PEFT-wrapped model (the adapters stay active).
    """
    if hasattr(model, "get_base_model"):  # peft.PeftModel
        model = model.get_base_model()
    keep = input_ids.shape[1] - 1 if logits_to_keep is None else int(logits_to_keep)
    if not 0 < keep < input_ids.shape[1]:
        raise ValueError(f"logits_to_keep must be in [1, {input_ids.shape[1] - 1}], got {keep}")
    outputs = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **model_kwargs)
    hidden = outputs.last_hidden_state[:, -keep - 1 : -1]
    head = model.get_output_embeddings()
    return chunked_logprobs(
        hidden, head.weight, input_ids[:, -keep:], bias=head.bias, temperature=temperature, chunk_size=chunk_size
    )


@dataclass
class ChunkedLogProbOutput(ModelOutput):
    """What a model patched by `add_chunked_logprob_head` returns for `model(..., labels=, fused_lm_head=True)`.

    `log_probs` / `entropy` are `[B, S-1]` (position `j` scores token `j+1`; 0 where the label is -100; `[B, S]` scoring
    `shift_labels[:, j]` when pre-shifted labels are passed), `loss` the
    mean negative log-prob of the labelled tokens, `aux_loss` the MoE load-balancing loss when router logits were
    requested.
    """

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def add_chunked_logprob_head(
    model: nn.Module,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    hidden_grad_in_forward: bool | None = None,
):
    """Patch `model.forward` so that `model(..., labels=labels, fused_lm_head=True)` returns per-token log-probs.

    The same call contract as TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`), so a TRL trainer can use
    either; this one only needs torch, scores *only* the labelled positions (prompt positions cost nothing, on every
    device) with `ChunkedLogProbs`, and leaves every other call (generation, plain forward) untouched. The call goes
    through `model.forward`, so DDP / FSDP wrappers see a normal forward. `hidden_grad_in_forward`: see
    `apply_chunked_logprobs` (pass False when the loss differentiates the returned entropy).
    """
    original_forward = type(model).forward
    text_config = model.config.get_text_config()

    @functools.wraps(original_forward)
    def forward(self, *args, fused_lm_head: bool = False, labels=None, shift_labels=None, **kwargs):
        if not fused_lm_head:
            if labels is not None:
                kwargs["labels"] = labels
            if shift_labels is not None:
                kwargs["shift_labels"] = shift_labels
            return original_forward(self, *args, **kwargs)
        kwargs["use_cache"] = False
        outputs = self.base_model(*args, **kwargs)
        if shift_labels is None:
            hidden = outputs.last_hidden_state[:, :-1]
            targets = labels[:, 1:].to(hidden.device)
        else:  # pre-shifted (sequence parallelism: the target of a shard's last token lives on the next rank)
            hidden = outputs.last_hidden_state
            targets = shift_labels.to(hidden.device)
        mask = targets != -100
        head = self.get_output_embeddings()
        # the head math runs in float32 even under autocast (a bf16 logit is off by ~0.03 at |logit| ~ 10)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            logps, entropy = apply_chunked_logprobs(
                hidden[mask], head.weight, head.bias, targets[mask], temperature, chunk_size, hidden_grad_in_forward
            )
        # masked_scatter keeps an all-masked batch connected to the graph (a differentiable zero)
        log_probs = logps.new_zeros(mask.shape).masked_scatter(mask, logps)
        entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
        aux_loss = None
        if kwargs.get("output_router_logits") and getattr(outputs, "router_logits", None) is not None:
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            attention_mask = kwargs.get("attention_mask")
            if isinstance(attention_mask, dict):  # prepared per-layer masks of a packed row: every token is real
                attention_mask = None
            aux_loss = load_balancing_loss_func(
                outputs.router_logits,
                text_config.num_local_experts,
                text_config.num_experts_per_tok,
                attention_mask,
            )
        loss = -logps.sum() / mask.sum().clamp(min=1)
        return ChunkedLogProbOutput(loss=loss, log_probs=log_probs, entropy=entropy, aux_loss=aux_loss)

    model.forward = types.MethodType(forward, model)
    return model
