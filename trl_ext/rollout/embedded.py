"""An in-process rollout engine on transformers: batched sampling with a KV cache, exact per-token log-probs.

The default engine for small runs and CPU. Concurrent `generate` calls are queued and served by one worker
thread as left-padded batches (up to ``max_batch_size``) sharing one `DynamicCache`; each row keeps its own
sampling parameters, stop ids and token budget, and leaves the batch (and the cache) as soon as it finishes. The event loop is never blocked (callers await a future),
and the engine works from any event loop or thread.

Log-probs: ``log_softmax(logits / temperature)`` at the sampled id, computed in fp32 from the same logits
that were sampled from — TRL's trainer divides logits by the same temperature, so a forward of the trainer's
model on the same weights reproduces them (up to batching/padding numerics). Top-k / top-p only restrict
what can be sampled; they do not renormalise the reported log-probs (SGLang's convention: ``Sampler.forward``
in ``sglang/srt/layers/sampler.py`` returns the log of ``softmax(logits / temperature)``, taken before the
top-p/top-k filters).
"""

from __future__ import annotations

import concurrent.futures
import copy
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from hf_gptoss_rl.packing import cache_keyword

from .engine import RolloutEngine, validate_input_ids
from .types import GenerationOutput, SamplingParams


@dataclass
class _Request:
    input_ids: list[int]
    sampling: SamplingParams
    future: concurrent.futures.Future


def _filter_top_k_top_p(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None = None
) -> torch.Tensor:
    """Mask (to -inf) logits outside each row's top-k, top-p nucleus and min-p set. ``top_k <= 0`` / ``top_p >= 1``
    / ``min_p <= 0`` = off. min-p keeps the tokens with ``p >= min_p * max p`` (SGLang's and transformers' rule).

    scaled: [B, V] temperature-scaled logits; top_k: [B] int; top_p: [B] float; min_p: [B] float.
    """
    no_min_p = min_p is None or bool((min_p <= 0).all())
    if bool((top_k <= 0).all()) and bool((top_p >= 1.0).all()) and no_min_p:
        return scaled
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    rank = torch.arange(vocab, device=scaled.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(-1)
    remove = rank >= k
    # nucleus: drop a token when the probability mass strictly before it already reaches top_p (keeps >= 1)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p.unsqueeze(-1)
    if not no_min_p:  # sorted descending: column 0 holds each row's most likely token (always kept)
        remove |= probs < min_p.unsqueeze(-1) * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, sorted_idx, sorted_logits)


def _apply_penalties(logits: torch.Tensor, counts: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """SGLang's penalties on raw logits, from the counts of the tokens each row generated so far.

    logits, counts: [B, V] float; penalties: [B, 3] = (repetition, frequency, presence). Additive penalties first,
    then the repetition scaling, as SGLang's `SamplingBatchInfo._apply_pre_grammar_logits_transforms` does.
    """
    repetition, frequency, presence = penalties.unbind(-1)
    seen = counts > 0
    logits = logits - frequency.unsqueeze(-1) * counts - presence.unsqueeze(-1) * seen.float()
    scale = torch.where(seen, repetition.unsqueeze(-1), torch.ones_like(logits))
    return torch.where(logits < 0, logits * scale, logits / scale)


class EmbeddedEngine(RolloutEngine):
    """Rollout engine running a transformers causal LM in this process.

    Args:
        model: the inference model (e.g. ``GptOssForCausalLM``); it is put in eval mode with gradients off and
            used as given. Use `from_policy` to make an independent copy of a policy being trained, so weight
            sync really copies weights.
        max_batch_size: most requests decoded together.
        batch_wait_s: how long the worker waits for more requests after the first one arrives.
        pad_token_id: id for left padding (any valid id; padded positions are masked). Defaults to the
            config's ``pad_token_id`` or 0.
        seed: seed of the shared sampling generator, used by requests without a ``sampling_seed`` (None:
            nondeterministic). A request with a ``sampling_seed`` samples from its own generator, so its tokens do
            not depend on which requests it was batched with.
        initial_version: weight version reported before the first `update_weights`.
        record_routing: return, with every output, the experts each MoE layer chose for every token the engine read
            (`GenerationOutput.routed_experts`, SGLang's layout), for routing replay in the trainer. GPT-OSS only.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch_size: int = 16,
        batch_wait_s: float = 0.005,
        pad_token_id: int | None = None,
        seed: int | None = None,
        initial_version: int | str | None = 0,
        record_routing: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        config_pad = getattr(model.config, "pad_token_id", None)
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else (config_pad or 0))
        self.max_batch_size = int(max_batch_size)
        self.batch_wait_s = float(batch_wait_s)
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(int(seed))
        self._version = initial_version
        self._recorder = None
        if record_routing:
            from hf_gptoss_rl.routing import RoutingRecorder

            self._recorder = RoutingRecorder(model)
        self._requests: queue.Queue[_Request | None] = queue.Queue()
        self._model_lock = threading.Lock()  # held while decoding a batch and while loading weights
        self._abort = threading.Event()
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.num_batches = 0  # decoded batches (for tests and stats)
        self.max_batch_seen = 0

    @classmethod
    def from_policy(
        cls, policy_model: torch.nn.Module, attn_implementation: str | None = None, **kwargs
    ) -> EmbeddedEngine:
        """An engine on an independent copy of ``policy_model`` (same device and dtype).

        The copy shares no storage with the policy: until `update_weights` is called it keeps sampling from
        the weights it was built with, exactly like a separate inference server. PEFT models are merged;
        ``attn_implementation`` switches the copy's attention backend (e.g. a faster inference kernel).
        Memory: a full second copy of the weights (no optimizer state, no gradients).
        """
        policy_model = getattr(policy_model, "module", policy_model)  # DDP / accelerate wrappers
        model = copy.deepcopy(policy_model)
        if hasattr(model, "merge_and_unload"):  # PEFT: serve the merged weights
            model = model.merge_and_unload()
        # An instance-level `forward` (TRL patches one in for its fused LM head) is a closure over the *policy*:
        # the copy must use its class forward, or it would silently sample from the live policy.
        model.__dict__.pop("forward", None)
        for param in model.parameters():
            param.grad = None
        if attn_implementation is not None:
            model.set_attn_implementation(attn_implementation)
        return cls(model, **kwargs)

    # ------------------------------------------------------------------ public API

    @property
    def weight_version(self) -> int | str | None:
        return self._version

    def rng_state(self) -> dict:
        """The shared sampling generator's state (requests without a ``sampling_seed`` draw from it)."""
        return {"generator": self._generator.get_state()}

    def load_rng_state(self, state: dict) -> None:
        with self._model_lock:  # not while a batch draws from it
            self._generator.set_state(state["generator"])

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> GenerationOutput:
        import asyncio

        return await asyncio.wrap_future(self.submit(input_ids, sampling))

    def submit(self, input_ids: list[int], sampling: SamplingParams) -> concurrent.futures.Future:
        """Queue a request from any thread; the future resolves to a `GenerationOutput`."""
        if self._closed:
            raise RuntimeError("EmbeddedEngine is closed")
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if sampling.sglang_extra:
            raise ValueError(
                f"the embedded engine does not implement the SGLang sampling keys {sorted(sampling.sglang_extra)}; "
                "use rollout_backend='sglang'"
            )
        ids = validate_input_ids(input_ids, self.vocab_size)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._ensure_worker()
        self._requests.put(_Request(ids, sampling, future))
        return future

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        import asyncio

        await asyncio.to_thread(self.load_weights, named_tensors, version=version)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | str | None) -> None:
        """Copy tensors into the model by ``state_dict`` name (waits for the running batch to finish).

        Raises `KeyError` for unknown names and `ValueError` for shape mismatches; nothing is loaded then
        (all tensors are checked before any is copied).
        """
        from ..weight_sync import load_state_tensors

        with self._model_lock:
            load_state_tensors(self.model, named_tensors)
            self._version = version

    async def health(self) -> bool:
        return not self._closed and (self._thread is None or self._thread.is_alive())

    def abort_all(self) -> None:
        """Abort the batch being decoded: unfinished rows return ``finish_reason="abort"``."""
        self._abort.set()

    async def close(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the worker; queued requests resolve with ``finish_reason="abort"``."""
        if self._closed:
            return
        self._closed = True
        self._abort.set()
        self._requests.put(None)
        if self._thread is not None:
            self._thread.join(timeout=60)
        while True:
            try:
                req = self._requests.get_nowait()
            except queue.Empty:
                break
            if req is not None and not req.future.done():
                req.future.set_result(GenerationOutput([], [], "abort", self._version))

    # ------------------------------------------------------------------ worker

    def _ensure_worker(self) -> None:
        if self._thread is not None:
            return
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name="EmbeddedEngine", daemon=True)
                self._thread.start()
                # a daemon thread still decoding when the interpreter finalizes aborts the process (SIGABRT from
                # torch's C++ side, e.g. after Ctrl-C): stop it first. The weak reference keeps the engine collectable
                import atexit
                import weakref

                shutdown = weakref.WeakMethod(self.shutdown)
                atexit.register(lambda: shutdown() and shutdown()())

    def _worker(self) -> None:
        while True:
            first = self._requests.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + self.batch_wait_s
            stop = False
            while len(batch) < self.max_batch_size:
                try:
                    req = self._requests.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if req is None:
                    stop = True
                    break
                batch.append(req)
            batch = [r for r in batch if r.future.set_running_or_notify_cancel()]
            if batch:
                try:
                    outputs = self._decode(batch)
                except BaseException as exc:  # noqa: BLE001 - surfaced to every waiting caller
                    for req in batch:
                        req.future.set_exception(exc)
                else:
                    for req, out in zip(batch, outputs):
                        req.future.set_result(out)
            if stop:
                return

    @torch.inference_mode()
    def _decode(self, batch: list[_Request]) -> list[GenerationOutput]:
        with self._model_lock:
            if not self._closed:  # a shutdown aborts whatever the worker picks up next
                self._abort.clear()
            version = self._version
            device, bsz = self.device, len(batch)
            self.num_batches += 1
            self.max_batch_seen = max(self.max_batch_seen, bsz)

            lengths = [len(r.input_ids) for r in batch]
            max_len = max(lengths)
            input_ids = torch.full((bsz, max_len), self.pad_token_id, dtype=torch.long, device=device)
            attention_mask = torch.zeros((bsz, max_len), dtype=torch.long, device=device)
            for i, r in enumerate(batch):  # left padding: the last prompt token of every row is at -1
                input_ids[i, max_len - lengths[i] :] = torch.tensor(r.input_ids, device=device)
                attention_mask[i, max_len - lengths[i] :] = 1
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

            temperature = torch.tensor([r.sampling.temperature for r in batch], device=device)
            greedy = temperature == 0
            temperature = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
            top_k = torch.tensor([r.sampling.top_k for r in batch], device=device)
            top_p = torch.tensor([r.sampling.top_p for r in batch], device=device, dtype=torch.float32)
            min_p = torch.tensor([r.sampling.min_p for r in batch], device=device, dtype=torch.float32)
            penalties = torch.tensor(
                [[r.sampling.repetition_penalty, r.sampling.frequency_penalty, r.sampling.presence_penalty]
                 for r in batch], device=device, dtype=torch.float32,
            )  # fmt: skip
            penalised = bool((penalties != torch.tensor([1.0, 0.0, 0.0], device=device)).any())
            # per-row counts of the tokens generated so far (only allocated when a penalty is on)
            counts = torch.zeros(bsz, self.vocab_size, device=device) if penalised else None
            # a seeded request draws from its own stream, an unseeded one from the shared generator
            generators = [
                self._generator
                if r.sampling.sampling_seed is None
                else torch.Generator(device=device).manual_seed(r.sampling.sampling_seed)
                for r in batch
            ]
            seeded = any(r.sampling.sampling_seed is not None for r in batch)
            stop_sets = [frozenset(r.sampling.stop_token_ids) for r in batch]
            budgets = [r.sampling.max_new_tokens for r in batch]

            cache = DynamicCache(config=self.model.config)
            cache_name = cache_keyword(self.model.forward)  # `cache` / `past_key_values`, by transformers version
            with self._capture() as step:
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    **{cache_name: cache},
                    use_cache=True,
                    logits_to_keep=1,
                )
            next_position = position_ids[:, -1:] + 1
            routing: list[list[torch.Tensor]] = [[] for _ in range(bsz)]  # per request: chunks of [tokens, L, k]
            if step is not None:  # the prompt's real (left-padded) tokens
                prefill = step.routing().reshape(bsz, max_len, *step.routing().shape[1:]).cpu()
                for i in range(bsz):
                    routing[i].append(prefill[i, max_len - lengths[i] :])

            tokens: list[list[int]] = [[] for _ in range(bsz)]
            logprobs: list[list[float]] = [[] for _ in range(bsz)]
            reason = ["length"] * bsz
            rows = list(range(bsz))  # batch row j of the tensors below decodes request rows[j]
            while True:
                logits = out.logits[:, -1, :].float()
                if counts is not None:
                    logits = _apply_penalties(logits, counts, penalties)
                scaled = logits / temperature
                logp = torch.log_softmax(scaled, dim=-1)
                probs = _filter_top_k_top_p(scaled, top_k, top_p, min_p).softmax(dim=-1)
                if seeded:  # one draw per row from its own generator: independent of the batch's composition
                    sampled = torch.cat(
                        [torch.multinomial(probs[j], 1, generator=generators[i]) for j, i in enumerate(rows)]
                    )
                else:
                    sampled = torch.multinomial(probs, 1, generator=self._generator).squeeze(-1)
                token = torch.where(greedy, logits.argmax(dim=-1), sampled)
                token_lp = logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
                if counts is not None:
                    counts.scatter_add_(1, token.unsqueeze(-1), torch.ones_like(counts[:, :1]))
                keep = []
                for j, (i, t, lp) in enumerate(zip(rows, token.tolist(), token_lp.tolist())):
                    tokens[i].append(t)
                    logprobs[i].append(lp)
                    if t in stop_sets[i]:
                        reason[i] = "stop"
                    elif len(tokens[i]) < budgets[i]:
                        keep.append(j)
                if not keep:
                    break
                if self._abort.is_set():
                    for j in keep:
                        reason[rows[j]] = "abort"
                    break
                if len(keep) < len(rows):  # drop finished rows from the batch and the KV cache
                    index = torch.tensor(keep, device=device)
                    cache.batch_select_indices(index)
                    attention_mask, next_position, token = attention_mask[index], next_position[index], token[index]
                    temperature, greedy, top_k, top_p = temperature[index], greedy[index], top_k[index], top_p[index]
                    min_p, penalties = min_p[index], penalties[index]
                    counts = counts[index] if counts is not None else None
                    rows = [rows[j] for j in keep]
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=-1)
                with self._capture() as step:
                    out = self.model(
                        input_ids=token.unsqueeze(-1),
                        attention_mask=attention_mask,
                        position_ids=next_position,
                        **{cache_name: cache},
                        use_cache=True,
                    )
                if step is not None:  # the tokens just read: one per decoding row
                    fed = step.routing().cpu()
                    for j, i in enumerate(rows):
                        routing[i].append(fed[j : j + 1])
                next_position = next_position + 1

            return [
                GenerationOutput(
                    tokens[i], logprobs[i], reason[i], version, torch.cat(routing[i]) if self._recorder else None
                )
                for i in range(bsz)
            ]

    def _capture(self):
        import contextlib

        return self._recorder.capture() if self._recorder is not None else contextlib.nullcontext()
