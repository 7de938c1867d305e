"""Rollout engines on SGLang: a client of the native HTTP API, and ``sglang.Engine`` in-process.

`SGLangEngine` talks to one or more ``python -m sglang.launch_server`` processes (SGLang 0.5.17 to 0.5.23;
request bodies follow ``sglang/srt/managers/io_struct.py`` of both):

- ``POST /generate`` with ``input_ids`` and only SGLang's ``sampling_params`` keys (``stop_token_ids`` = the
  harmony stops, ``skip_special_tokens=False``, ``no_stop_trim=True`` so the stop token stays in
  ``output_ids``), ``return_logprob=True``, ``logprob_start_len=-1`` (log-probs of the output only), and
  ``lora_path`` = the synced adapter's name with LoRA sync;
- an overall deadline per request (``timeout_s``: connecting, waiting and reading the whole body, so a server
  that trickles its answer trips it), retries with exponential backoff on connection errors, timeouts, 5xx and
  malformed answers until ``retry_deadline_s`` has passed (long enough to span a server restart); 4xx are not
  retried;
- one readiness wait (``GET /health`` on every server, concurrently, with a log line every ``log_every_s``)
  shared by all requests; when it fails, every later request fails at once with the URL and the cause;
- routing: a trajectory's turns stay on one server (requests from the same asyncio task; the radix cache then
  reuses the trajectory's prefix, reported as ``meta_info.cached_tokens``), new trajectories go to the
  least-loaded server; a failing server is left for another one on retry;
- a progress line every ``log_every_s`` while requests are in flight (done, in flight, retries, cached
  prefix tokens);
- the ``/generate`` contract checked on every answer: at most ``max_new_tokens`` output ids, one log-prob per
  output id, ``meta_info.id`` equal to the request's ``rid``, ``meta_info.prompt_tokens`` equal to the number of ids
  sent (`SGLangContractError`, never retried: the trajectory is aborted);
- weight sync (`trl_ext.weight_sync`, configured by one `WeightSyncConfig`): ``"disk"``, ``"distributed"`` (NCCL,
  flattened buckets), ``"tensor"`` (CUDA IPC, one payload per TP rank), or LoRA adapters (`update_lora_adapter`),
  each checked and verified; a failed sync makes the engine refuse to generate until a sync succeeds;
- ``meta_info.weight_version`` (the version the server says it served) recorded on every output; ``finish_reason``
  ``abort`` surfaced, not hidden.

`SGLangOfflineEngine` wraps ``sglang.Engine`` (imported lazily; a clear `ImportError` without sglang); its weight
sync is `trl_ext.weight_sync.offline`.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import random
import threading
import uuid
from collections.abc import Iterable

import torch

from ..weight_sync import LoRAAdapter, WeightSyncConfig
from ..weight_sync.offline import SGLangOfflineWeightSync
from ..weight_sync.sglang import SGLangHTTPWeightSync
from .engine import RolloutEngine, validate_input_ids
from .settings import (
    MAX_CONCURRENCY,
    SGLANG_LOG_EVERY_S,
    SGLANG_READY_TIMEOUT_S,
    SGLANG_RETRY_DEADLINE_S,
    SGLANG_TIMEOUT_S,
)
from .types import GenerationOutput, SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "SGLangEngine",
    "SGLangError",
    "SGLangContractError",
    "SGLangOfflineEngine",
    "SGLangResponseError",
    "SGLangUnavailableError",
    "parse_generate_item",
    "sampling_params_payload",
]


class SGLangError(RuntimeError):
    """An SGLang request failed (after retries where retrying made sense)."""


class SGLangResponseError(SGLangError):
    """The server answered something that breaks the contract (missing keys, ids/log-probs mismatch)."""


class SGLangContractError(SGLangError):
    """A ``/generate`` answer that is not the answer to the request sent (too many tokens, another request's id, a
    different prompt); never retried: the trajectory is aborted."""


class SGLangUnavailableError(SGLangError, TimeoutError):
    """No answer from a server before a deadline (the readiness wait's, or a request's ``retry_deadline_s``); the
    message names the URL and the last cause."""


class _RetryableStatus(SGLangError):
    pass


# The server a trajectory's requests go to: each trajectory of `AgentLoop.run_batch` runs in its own asyncio
# task, and a task's context variables persist across its awaits, so all turns of a trajectory share it.
_AFFINITY: contextvars.ContextVar[dict | None] = contextvars.ContextVar("sglang_affinity", default=None)


def sampling_params_payload(sampling: SamplingParams) -> dict:
    """SGLang ``sampling_params`` for token-level rollouts (only keys SGLang's ``SamplingParams`` knows)."""
    payload = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "stop_token_ids": list(sampling.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    for key, off in (
        ("min_p", 0.0),
        ("repetition_penalty", 1.0),
        ("frequency_penalty", 0.0),
        ("presence_penalty", 0.0),
    ):
        value = getattr(sampling, key, off)
        if value != off:
            payload[key] = value
    if (
        getattr(sampling, "sampling_seed", None) is not None
    ):  # honoured by servers run with --enable-deterministic-inference
        payload["sampling_seed"] = sampling.sampling_seed
    payload.update(getattr(sampling, "sglang_extra", None) or {})
    return payload


def decode_routed_experts(meta: dict, tokens: int, shape: tuple[int, int, int], url: str):
    """``meta_info.routed_experts`` (base64 of an int32 ``[tokens, layers, top_k]`` array, SGLang's
    ``DetokenizerManager._b64_encode_per_request``) as a compact tensor, checked; `RoutingError` when it is missing
    or is not a top-k."""
    import base64

    import numpy as np
    import torch

    from hf_gptoss_rl.routing import RoutingError, check_routing, routing_dtype

    layers, top_k, experts = shape
    encoded = meta.get("routed_experts")
    if encoded is None:
        raise RoutingError(
            f"{url}/generate answered without meta_info.routed_experts although the request asked for them: launch "
            "the server with --enable-return-routed-experts (SGLang >= 0.5.7), or set routing_replay=False"
        )
    try:
        flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    except (ValueError, TypeError) as exc:
        raise RoutingError(f"{url}: meta_info.routed_experts is not base64 of int32 ids: {exc}") from exc
    if flat.size != tokens * layers * top_k:
        raise RoutingError(
            f"{url}: meta_info.routed_experts holds {flat.size} ids, expected {tokens} tokens x {layers} layers x "
            f"{top_k} (prompt + output - 1 tokens)"
        )
    routing = torch.from_numpy(flat.reshape(tokens, layers, top_k).copy())
    try:
        check_routing(routing, num_layers=layers, top_k=top_k, num_experts=experts, source=f"{url} routed_experts")
    except RoutingError as exc:
        raise RoutingError(
            f"{exc}. SGLang's triton_kernel MoE runner (its default for GPT-OSS on Hopper) and flashinfer_mxfp4 record "
            "no routing: launch with --moe-runner-backend triton (bf16) or marlin (MXFP4)"
        ) from None
    return routing.to(routing_dtype(experts))


# MoE runners that do not run SGLang's routing capture for GPT-OSS (`TopK.forward_cuda` in sglang/srt/layers/moe/topk.py)
_RUNNERS_WITHOUT_ROUTING = ("triton_kernel", "flashinfer_mxfp4")


def check_routing_servers(states) -> None:
    """Start-up check for routing replay: every server returns routed experts with a runner that records them."""
    from hf_gptoss_rl.routing import RoutingError

    for s in states:
        if not s.return_routed_experts:
            raise RoutingError(
                f"{s.url} runs without --enable-return-routed-experts: it cannot return the routing that routing "
                "replay needs (relaunch with the flag, SGLang >= 0.5.7, or set routing_replay=False)"
            )
        if s.moe_runner_backend in _RUNNERS_WITHOUT_ROUTING:
            raise RoutingError(
                f"{s.url} runs the {s.moe_runner_backend} MoE runner, which records no routing (it would return "
                "zeros): relaunch with --moe-runner-backend triton (bf16) or marlin (MXFP4)"
            )


def _parse_version(version):
    if isinstance(version, str) and version.lstrip("-").isdigit():
        return int(version)
    return None if version == "default" else version


def parse_generate_item(item: dict) -> GenerationOutput:
    """Turn one ``/generate`` answer into a `GenerationOutput`, checking the contract.

    Raises `SGLangResponseError` when keys are missing, log-probs are missing/None, their count differs
    from ``output_ids`` or their token ids disagree (an aborted request may be partial: it is cut to the
    consistent prefix instead).
    """
    if not isinstance(item, dict) or "meta_info" not in item:
        raise SGLangResponseError(f"/generate answer without meta_info: {str(item)[:200]}")
    meta = item["meta_info"]
    finish = meta.get("finish_reason") or {}
    reason = finish.get("type") if isinstance(finish, dict) else str(finish)
    if reason not in ("stop", "length", "abort"):
        raise SGLangResponseError(f"/generate: unknown finish_reason {finish!r}")
    ids = item.get("output_ids")
    entries = meta.get("output_token_logprobs")
    if ids is None or entries is None:
        if reason == "abort":
            return GenerationOutput([], [], "abort", _parse_version(meta.get("weight_version")))
        raise SGLangResponseError(
            "/generate answer lacks output_ids or meta_info.output_token_logprobs (send return_logprob=true)"
        )
    ids = [int(t) for t in ids]
    logprobs = []
    for entry in entries:
        lp = entry[0] if isinstance(entry, (list, tuple)) else entry
        logprobs.append(None if lp is None else float(lp))
    entry_ids = [e[1] for e in entries if isinstance(e, (list, tuple)) and len(e) > 1]
    if reason == "abort":
        n = min(len(ids), len(logprobs))
        ids, logprobs = ids[:n], logprobs[:n]
    if len(logprobs) != len(ids):
        raise SGLangResponseError(
            f"/generate: {len(ids)} output ids but {len(logprobs)} log-probs (finish_reason {reason}); "
            "check no_stop_trim=true and logprob_start_len=-1"
        )
    if len(entry_ids) == len(entries) and [int(t) for t in entry_ids[: len(ids)]] != ids:
        raise SGLangResponseError("/generate: output_token_logprobs token ids differ from output_ids")
    if any(lp is None for lp in logprobs):
        raise SGLangResponseError("/generate: a log-prob is null")
    return GenerationOutput(ids, logprobs, reason, _parse_version(meta.get("weight_version")))


def _check_contract(url: str, payload: dict, item: dict, out: GenerationOutput) -> None:
    """The ``/generate`` answer must be the answer to ``payload``: at most ``max_new_tokens`` output ids, the rid
    sent (``meta_info.id``), as many prompt tokens as ids sent. One log-prob per output id is checked by
    `parse_generate_item`. Raises `SGLangContractError` naming the request and what differs."""
    meta = item.get("meta_info") or {}
    rid, problems = payload.get("rid"), []
    limit = (payload.get("sampling_params") or {}).get("max_new_tokens")
    if limit is not None and len(out.output_ids) > limit:
        problems.append(f"{len(out.output_ids)} output ids for max_new_tokens={limit}")
    if rid is not None and meta.get("id") != rid:
        problems.append(f"meta_info.id is {meta.get('id')!r}, not the rid sent")
    sent = len(payload.get("input_ids") or ())
    if meta.get("prompt_tokens") != sent:
        problems.append(f"meta_info.prompt_tokens is {meta.get('prompt_tokens')!r} for {sent} input ids sent")
    if problems:
        raise SGLangContractError(
            f"{url}/generate request {rid}: the answer breaks the contract: " + "; ".join(problems)
        )


class SGLangEngine(RolloutEngine):
    """Client of one or more SGLang servers (native API), for token-in/token-out agentic rollouts.

    Args:
        base_urls: ``"http://host:30000"`` or a list of them.
        weight_sync: how `update_weights` / `update_lora_adapter` reach the servers and how each sync is checked
            (`WeightSyncConfig`; default: disk sync, ``verify=("version", "checksum")``).
        max_concurrency: most ``/generate`` requests in flight (all servers together).
        timeout_s: overall deadline of one HTTP request (connect + wait + whole body); a long generation must
            fit in it. ``connect_timeout_s`` bounds connecting alone.
        retry_deadline_s: how long a request keeps retrying (connection refused, timeouts, 5xx, malformed
            answers) before it fails; the default spans an ordinary server restart. ``max_retries`` optionally
            caps the number of retries as well (None: the deadline alone).
        backoff_s, max_backoff_s: exponential backoff (with jitter) between attempts.
        ready_timeout_s: how long the readiness wait (``GET /health`` on every server) may take.
        log_every_s: period of the log lines while waiting for servers and while requests are in flight.
        api_key: sent as ``Authorization: Bearer`` (servers launched with ``--api-key`` / ``--admin-api-key``).
        record_routing: ``(MoE layers, top_k, experts)`` of the served model: every request asks for the routed
            experts (``return_routed_experts``; servers launched with ``--enable-return-routed-experts`` and a MoE
            runner that records them, see ``docs/rollouts.md``), which are checked and returned in
            `GenerationOutput.routed_experts`. A missing, all-zero or out-of-range record raises `RoutingError`.
    """

    def __init__(
        self,
        base_urls: str | list[str],
        *,
        weight_sync: WeightSyncConfig | None = None,
        max_concurrency: int = MAX_CONCURRENCY,
        timeout_s: float = SGLANG_TIMEOUT_S,
        connect_timeout_s: float = 10.0,
        retry_deadline_s: float = SGLANG_RETRY_DEADLINE_S,
        max_retries: int | None = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        ready_timeout_s: float = SGLANG_READY_TIMEOUT_S,
        log_every_s: float = SGLANG_LOG_EVERY_S,
        api_key: str | None = None,
        record_routing: tuple[int, int, int] | None = None,
    ) -> None:
        try:
            import httpx  # noqa: F401
        except ImportError as exc:  # pragma: no cover
            raise ImportError("SGLangEngine needs httpx: pip install httpx") from exc
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("SGLangEngine: no base_urls")
        for u in urls:
            if not isinstance(u, str) or not u.startswith(("http://", "https://")):
                raise ValueError(f"SGLangEngine: base URL {u!r} must start with http:// or https://")
        self.base_urls = [u.rstrip("/") for u in urls]
        if len(set(self.base_urls)) != len(self.base_urls):
            raise ValueError(f"SGLangEngine: duplicate base URLs {self.base_urls}")
        if weight_sync is not None and not isinstance(weight_sync, WeightSyncConfig):
            raise TypeError(f"weight_sync must be a WeightSyncConfig, got {type(weight_sync).__name__}")
        if max_concurrency < 1 or (max_retries is not None and max_retries < 0):
            raise ValueError("max_concurrency must be >= 1 and max_retries >= 0")
        for name, value in (
            ("timeout_s", timeout_s),
            ("connect_timeout_s", connect_timeout_s),
            ("ready_timeout_s", ready_timeout_s),
            ("log_every_s", log_every_s),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if retry_deadline_s < 0:
            raise ValueError(f"retry_deadline_s must be >= 0, got {retry_deadline_s}")
        self.max_concurrency = int(max_concurrency)
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.retry_deadline_s = float(retry_deadline_s)
        self.max_retries = None if max_retries is None else int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.ready_timeout_s = float(ready_timeout_s)
        self.log_every_s = float(log_every_s)
        self.api_key = api_key
        self.record_routing = None if record_routing is None else tuple(int(x) for x in record_routing)
        self.weight_sync = SGLangHTTPWeightSync(self, weight_sync or WeightSyncConfig())
        self._inflight = {u: 0 for u in self.base_urls}
        self._rr = itertools.count()
        self._ready = False
        self._ready_error: SGLangUnavailableError | None = None
        self._client = None
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self._closed = False
        self._ready_lock_obj: asyncio.Lock | None = None
        self._reporter: asyncio.Task | None = None
        self._warned_versions: set[tuple[str, object]] = set()
        # per URL: connections lost (refused, reset, closed without an answer; not timeouts), which a weight sync
        # reads to tell a server that died during it; and the servers a request gave up on (cleared by an answer)
        self.lost_connections = {u: 0 for u in self.base_urls}
        self.unreachable: dict[str, str] = {}
        self.stats = {
            "requests": 0, "done": 0, "retries": 0, "aborts": 0, "syncs": 0,
            "prompt_tokens": 0, "cached_tokens": 0,
        }  # fmt: skip

    # ------------------------------------------------------------------ plumbing

    @property
    def weight_version(self) -> int | str | None:
        """The version of the last verified weight sync (None before the first)."""
        return self.weight_sync.version

    @property
    def last_logprob_probe(self) -> dict[str, dict]:
        """What the last log-prob probe measured on each server (`trl_ext.weight_sync.verify.probe_verdict`)."""
        return self.weight_sync.last_logprob_probe

    def _state(self):
        """(httpx client, semaphore), created on the engine's own loop (runs there only)."""
        import httpx

        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s),
                limits=httpx.Limits(
                    max_connections=self.max_concurrency + 16, max_keepalive_connections=self.max_concurrency
                ),
                headers=headers,
                trust_env=False,
            )
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        return self._client, self._semaphore

    def _start_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._closed:
                raise RuntimeError("SGLangEngine is closed")
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._loop_thread = threading.Thread(target=self._loop.run_forever, name="SGLangEngine", daemon=True)
                self._loop_thread.start()
            return self._loop

    async def _on_engine_loop(self, coro):
        """Run ``coro`` on the engine's private event loop (a daemon thread) and await it from any loop.

        asyncio objects (the HTTP connection pool, the semaphore) belong to one loop; callers come from many
        (a trainer running each batch with ``asyncio.run``, a notebook's loop, worker threads), so the client
        lives on a loop of its own. Cancelling the caller cancels the request.
        """
        try:
            loop = self._start_loop()
        except RuntimeError:
            coro.close()
            raise
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    def run(self, coro, timeout_s: float | None = None):
        """Run one of this engine's coroutines from synchronous code (blocks the calling thread)."""
        loop = self._start_loop()
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    def _pick_url(self, avoid: str | None = None) -> str:
        candidates = [u for u in self.base_urls if u != avoid] or self.base_urls
        least = min(self._inflight[u] for u in candidates)
        ties = [u for u in candidates if self._inflight[u] == least]
        return ties[next(self._rr) % len(ties)]

    def _backoff(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**attempt) * (0.5 + random.random() / 2)

    def _may_retry(self, attempt: int, started: float, loop) -> float | None:
        """The pause before retry number ``attempt + 1``, or None when the retry budget is spent."""
        if self.max_retries is not None and attempt >= self.max_retries:
            return None
        pause = self._backoff(attempt)
        if loop.time() + pause - started > self.retry_deadline_s:
            return None
        return pause

    async def _send(self, method: str, url: str, payload: dict | None):
        """One HTTP exchange under the overall deadline ``timeout_s`` (connect, wait, whole body)."""
        client, _ = self._state()
        try:
            return await asyncio.wait_for(client.request(method, url, json=payload), timeout=self.timeout_s)
        except asyncio.TimeoutError as exc:
            raise _RequestDeadline(f"no complete answer within timeout_s={self.timeout_s:g} s") from exc

    async def request(
        self,
        method: str,
        url: str,
        path: str,
        payload: dict | None = None,
        *,
        retries: int | None = None,
        ok_statuses: tuple[int, ...] = (),
    ):
        """One call of a server's native API (``url`` one of ``base_urls``, ``path`` e.g. ``"/server_info"``), with
        the engine's retry policy: transport errors, timeouts and 5xx are retried within ``retry_deadline_s``
        (``retries`` caps the count; 0 for calls that pair with a collective or are not idempotent), 4xx raise
        `SGLangError`. Returns the parsed JSON (or text); None for a status in ``ok_statuses``."""
        return await self._on_engine_loop(
            self._request(method, url, path, payload, retries=retries, ok_statuses=ok_statuses)
        )

    def _count_lost_connection(self, url: str, exc: BaseException) -> None:
        import httpx

        if isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException):
            self.lost_connections[url] = self.lost_connections.get(url, 0) + 1

    async def _request(
        self,
        method: str,
        url: str,
        path: str,
        payload: dict | None = None,
        *,
        retries: int | None = None,
        ok_statuses: tuple[int, ...] = (),
    ):
        """One HTTP call with retries on transport errors, timeouts and 5xx. Returns parsed JSON (or text).

        ``retries=0`` for calls that pair with a collective or are not idempotent. A status in ``ok_statuses``
        returns None instead of raising.
        """
        import httpx

        loop = asyncio.get_running_loop()
        started = loop.time()
        attempt = 0
        while True:
            try:
                resp = await self._send(method, url + path, payload)
                if resp.status_code in ok_statuses:
                    return None
                if resp.status_code >= 500:
                    raise _RetryableStatus(f"HTTP {resp.status_code}: {resp.text[:300]}")
                if resp.status_code >= 400:
                    raise SGLangError(f"{url}{path}: HTTP {resp.status_code}: {resp.text[:500]}")
                try:
                    return resp.json()
                except ValueError:
                    return resp.text
            except (httpx.TransportError, httpx.TimeoutException, _RequestDeadline, _RetryableStatus) as exc:
                self._count_lost_connection(url, exc)
                pause = None if retries == 0 else self._may_retry(attempt, started, loop)
                if retries is not None and attempt >= retries:
                    pause = None
                if pause is None:
                    raise SGLangError(
                        f"{url}{path} failed after {attempt + 1} attempt(s) in {loop.time() - started:.1f} s: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                logger.warning(
                    "SGLang %s%s: %s: %s (attempt %d, retrying in %.1f s)",
                    url,
                    path,
                    type(exc).__name__,
                    exc,
                    attempt + 1,
                    pause,
                )
                self.stats["retries"] += 1
                attempt += 1
                await asyncio.sleep(pause)

    # ------------------------------------------------------------------ readiness

    def check_servers(self, timeout_s: float | None = None) -> None:
        """Block until every server answers ``GET /health`` with 200, or raise `SGLangUnavailableError` naming
        each URL that did not and its last error; then read ``GET /server_info`` from each (SGLang exempts
        ``/health`` from ``--api-key``, not ``/server_info``: a wrong key fails here), and continue any server a
        killed client left paused. For trainer start-up: fail before training, not during it."""
        self.run(self._ensure_ready(timeout_s))
        states = self.run(self.weight_sync.server_states())
        self.run(self.weight_sync.continue_servers())  # left paused by a client killed during a sync
        logger.info("SGLang servers: %s", ", ".join(f"{s.url} (sglang {s.version}, tp {s.tp_size})" for s in states))
        if self.record_routing is not None:
            check_routing_servers(states)
        unseeded = [s.url for s in states if not s.deterministic_inference]
        if unseeded:
            # SGLang reads sampling_params.sampling_seed only in deterministic mode (`SamplingBatchInfo.from_schedule_batch`
            # in sglang/srt/sampling/sampling_batch_info.py); otherwise it samples with its own generator
            logger.warning(
                "SGLang servers %s run without --enable-deterministic-inference: they ignore the per-request "
                "sampling_seed, so rollouts are not reproducible and a resumed run samples other completions",
                ", ".join(unseeded),
            )

    async def wait_until_ready(self, timeout_s: float | None = None) -> None:
        """Poll ``GET /health`` on every server until all answer 200; `SGLangUnavailableError` at the deadline."""
        await self._on_engine_loop(self._ensure_ready(timeout_s))

    async def _ensure_ready(self, timeout_s: float | None = None) -> None:
        if self._ready:
            return
        if self._ready_error is not None and timeout_s is None:
            raise self._ready_error
        async with self._ready_lock():
            if not self._ready:
                await self._wait_until_ready(timeout_s)

    def _ready_lock(self) -> asyncio.Lock:
        if self._ready_lock_obj is None:
            self._ready_lock_obj = asyncio.Lock()
        return self._ready_lock_obj

    async def _wait_until_ready(self, timeout_s: float | None = None) -> None:
        import httpx

        client, _ = self._state()
        loop = asyncio.get_running_loop()
        budget = self.ready_timeout_s if timeout_s is None else float(timeout_s)
        start = loop.time()
        deadline = start + budget
        last: dict[str, str] = {u: "no answer yet" for u in self.base_urls}
        pending = set(self.base_urls)
        next_log = start + self.log_every_s
        delay = 0.05
        logger.info("waiting for SGLang servers %s (up to %.0f s)", ", ".join(self.base_urls), budget)
        while pending:

            async def probe(url: str) -> tuple[str, bool]:
                try:
                    resp = await asyncio.wait_for(
                        client.get(url + "/health"), timeout=max(0.1, min(5.0, deadline - loop.time()))
                    )
                    if resp.status_code == 200:
                        return url, True
                    last[url] = f"HTTP {resp.status_code}: {resp.text[:200]}"
                except (httpx.TransportError, httpx.TimeoutException, asyncio.TimeoutError) as exc:
                    last[url] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                return url, False

            for url, ok in await asyncio.gather(*(probe(u) for u in sorted(pending))):
                if ok:
                    pending.discard(url)
                    logger.info("SGLang server %s is ready (%.1f s)", url, loop.time() - start)
            if not pending:
                break
            now = loop.time()
            if now >= deadline:
                detail = "; ".join(f"{u}: {last[u]}" for u in sorted(pending))
                self._ready_error = SGLangUnavailableError(
                    f"SGLang server(s) not ready after {budget:g} s: {detail}. Check that the server is running "
                    "and reachable at that URL (launch: python -m sglang.launch_server --model-path ... --port ...)"
                )
                raise self._ready_error
            if now >= next_log:
                logger.warning(
                    "still waiting for SGLang server(s) after %.0f s (deadline %.0f s): %s",
                    now - start,
                    budget,
                    "; ".join(f"{u}: {last[u]}" for u in sorted(pending)),
                )
                next_log = now + self.log_every_s
            await asyncio.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(2.0, delay * 2)
        self._ready = True
        self._ready_error = None

    async def health(self) -> bool:
        return await self._on_engine_loop(self._health())

    async def _health(self) -> bool:
        import httpx

        client, _ = self._state()
        try:
            answers = await asyncio.gather(
                *(asyncio.wait_for(client.get(u + "/health"), timeout=5.0) for u in self.base_urls)
            )
        except (httpx.TransportError, httpx.TimeoutException, asyncio.TimeoutError):
            return False
        return all(r.status_code == 200 for r in answers)

    # ------------------------------------------------------------------ generation

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> GenerationOutput:
        ids = validate_input_ids(input_ids)
        affinity = _AFFINITY.get()
        if affinity is None:  # first request of this task (trajectory): its later turns reuse the server
            affinity = {}
            _AFFINITY.set(affinity)
        return await self._on_engine_loop(self._generate(ids, sampling, affinity))

    def _ensure_reporter(self) -> None:
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.get_running_loop().create_task(self._report())

    async def _report(self) -> None:
        """A progress line every ``log_every_s`` while requests are in flight (INFO; WARNING when no request
        finished during the period, so a stalled batch shows up under the default logging level)."""
        last_done = self.stats["done"]
        while True:
            await asyncio.sleep(self.log_every_s)
            inflight = sum(self._inflight.values())
            if inflight == 0:
                self._reporter = None
                return
            s = self.stats
            cached = s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0
            stalled = s["done"] == last_done
            last_done = s["done"]
            logger.log(
                logging.WARNING if stalled else logging.INFO,
                "SGLang rollouts: %d done, %d in flight (%s), %d retries, %d aborted, %.0f%% of prompt tokens cached%s",
                s["done"],
                inflight,
                ", ".join(f"{u}: {n}" for u, n in self._inflight.items()),
                s["retries"],
                s["aborts"],
                100 * cached,
                f"; none finished in the last {self.log_every_s:g} s" if stalled else "",
            )

    async def _generate(self, ids: list[int], sampling: SamplingParams, affinity: dict) -> GenerationOutput:
        import httpx

        if self.weight_sync.failure is not None:
            raise SGLangError(f"refusing to generate: {self.weight_sync.failure}")
        await self._ensure_ready()
        await self.weight_sync.wait_until_cache_clean()
        _, semaphore = self._state()
        payload = {
            "input_ids": ids,
            "sampling_params": sampling_params_payload(sampling),
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }
        if self.weight_sync.served_adapter is not None:
            payload["lora_path"] = self.weight_sync.served_adapter
        if self.record_routing is not None:
            payload["return_routed_experts"] = True
        loop = asyncio.get_running_loop()
        started = loop.time()
        attempt = 0
        async with semaphore:
            self._ensure_reporter()
            while True:
                url = affinity.get("url")
                if url is None or url not in self._inflight:
                    url = affinity["url"] = self._pick_url()
                payload["rid"] = uuid.uuid4().hex
                self._inflight[url] += 1
                self.stats["requests"] += 1
                try:
                    resp = await self._send("POST", url + "/generate", payload)
                    if resp.status_code >= 500:
                        raise _RetryableStatus(f"HTTP {resp.status_code}: {resp.text[:300]}")
                    if resp.status_code >= 400:
                        raise SGLangError(f"{url}/generate: HTTP {resp.status_code}: {resp.text[:500]}")
                    try:
                        item = resp.json()
                    except ValueError as exc:
                        raise SGLangResponseError(f"/generate answer is not JSON: {resp.text[:200]}") from exc
                    out = parse_generate_item(item)
                    _check_contract(url, payload, item, out)
                except (
                    httpx.TransportError,
                    httpx.TimeoutException,
                    _RequestDeadline,
                    _RetryableStatus,
                    SGLangResponseError,
                ) as exc:
                    self._count_lost_connection(url, exc)
                    pause = self._may_retry(attempt, started, loop)
                    if pause is None:
                        message = (
                            f"{url}/generate failed after {attempt + 1} attempt(s) in {loop.time() - started:.1f} s "
                            f"(retry_deadline_s={self.retry_deadline_s:g}): {type(exc).__name__}: {exc}"
                        )
                        if not isinstance(exc, SGLangResponseError):  # no usable answer: the server is unavailable
                            self.unreachable[url] = message
                            raise SGLangUnavailableError(message) from exc
                        raise SGLangError(message) from exc
                    logger.warning(
                        "SGLang /generate on %s: %s: %s (attempt %d, retrying in %.1f s)",
                        url,
                        type(exc).__name__,
                        exc,
                        attempt + 1,
                        pause,
                    )
                    self.stats["retries"] += 1
                    attempt += 1
                    if len(self.base_urls) > 1:  # leave the failing server to the others
                        affinity["url"] = self._pick_url(avoid=url)
                    await asyncio.sleep(pause)
                    continue
                finally:
                    self._inflight[url] -= 1
                break
        meta = item.get("meta_info") or {}
        # an aborted request may finish before its routing is collected: it is not trained on (its turn ends the
        # trajectory) and routes natively
        aborted_without = out.finish_reason == "abort" and meta.get("routed_experts") is None
        if self.record_routing is not None and out.output_ids and not aborted_without:
            out.routed_experts = decode_routed_experts(
                meta, len(ids) + len(out.output_ids) - 1, self.record_routing, url
            )
        prompt_tokens, cached = meta.get("prompt_tokens"), meta.get("cached_tokens")
        if isinstance(prompt_tokens, int) and isinstance(cached, int):
            self.stats["prompt_tokens"] += prompt_tokens
            self.stats["cached_tokens"] += cached
            logger.debug("SGLang %s: %d prompt tokens, %d cached", url, prompt_tokens, cached)
        self.stats["done"] += 1
        if out.finish_reason == "abort":
            self.stats["aborts"] += 1
        synced = self.weight_sync.version
        if synced is not None and out.weight_version != synced:
            key = (url, out.weight_version)
            if key not in self._warned_versions:
                self._warned_versions.add(key)
                logger.warning(
                    "%s served weight_version %r, but the engine synced version %r (did the server restart?); the "
                    "trajectory records the served version and the next sync reloads the server",
                    url,
                    out.weight_version,
                    synced,
                )
        return out

    def served_versions(self) -> dict[str, int | str | None]:
        """The weight version each server serves now (``GET /model_info``; None: its launch weights, SGLang's
        ``"default"``). Blocks the calling thread."""

        async def read():
            infos = await asyncio.gather(*(self._request("GET", u, "/model_info") for u in self.base_urls))
            return {u: _parse_version((i or {}).get("weight_version")) for u, i in zip(self.base_urls, infos)}

        return self.run(read())

    def take_unreachable(self) -> dict[str, str]:
        """The servers that a ``/generate`` gave up on since the last call (URL -> the request's last error): no
        answer within ``retry_deadline_s``. Cleared by the call."""
        found, self.unreachable = self.unreachable, {}
        return found

    # ------------------------------------------------------------------ control

    async def flush_cache(self) -> None:
        """``POST /flush_cache`` on every server (SGLang answers 400 while requests are running: retried
        within ``retry_deadline_s``)."""
        await self._on_engine_loop(self._flush_cache())

    async def _flush_cache(self) -> None:
        loop = asyncio.get_running_loop()
        for url in self.base_urls:
            started, attempt = loop.time(), 0
            while True:
                try:
                    await self._request("POST", url, "/flush_cache", retries=0)
                    break
                except SGLangError as exc:
                    pause = self._may_retry(attempt, started, loop)
                    if pause is None or "HTTP 400" not in str(exc):
                        raise
                    attempt += 1
                    await asyncio.sleep(pause)

    # ------------------------------------------------------------------ weight sync

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Ship new weights to every server (``weight_sync.config.mode``), tagged ``weight_version=str(version)``,
        and verify (`trl_ext.weight_sync.sglang.SGLangHTTPWeightSync.update`).

        Raises `WeightSyncError` naming the server(s) and the problem; the servers are never left paused.
        """
        named = [(name, t.detach()) for name, t in named_tensors]
        if not named:
            raise ValueError("update_weights: no tensors")
        await self._on_engine_loop(self._update(named, None, version))

    async def update_lora_adapter(self, adapter: LoRAAdapter, *, version: int) -> None:
        """Load a PEFT adapter on every server as ``<lora_name>-v<version>``; later requests name it in
        ``lora_path``. Servers must run with ``--enable-lora`` (and ``--max-lora-rank``/``--lora-target-modules``
        covering the adapter)."""
        if not adapter.named_tensors:
            raise ValueError("update_lora_adapter: empty adapter")
        await self._on_engine_loop(self._update([], adapter, version))

    async def _update(self, named, adapter, version) -> None:
        await self._ensure_ready()
        await self.weight_sync.update(named, version, lora=adapter)
        self.stats["syncs"] += 1
        logger.info("SGLang weight sync: %d server(s) on version %s", len(self.base_urls), version)

    async def verify_logprobs(self, probe_ids: list[int], reference: list[float]) -> dict[str, dict]:
        """Score ``probe_ids`` on every server and compare with ``reference``, the trainer's log-probs of
        ``probe_ids[1:]`` (`trl_ext.weight_sync.verify.probe_verdict`); raise `WeightSyncError` naming the server
        when they differ by more than the probe's tolerance. Returns, and keeps in ``last_logprob_probe``, what
        was measured per server."""
        return await self._on_engine_loop(self.weight_sync.verify_logprobs(list(probe_ids), list(reference)))

    # ------------------------------------------------------------------ teardown

    async def close(self) -> None:
        """Close connections, leave the weight-update group, stop the engine's loop. Idempotent."""
        if self._loop is None or self._closed:
            self._closed = True
            return
        await self._on_engine_loop(self._close())
        with self._loop_lock:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=10)
        self._loop.close()

    async def _close(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
            self._reporter = None
        await self.weight_sync.close()
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class _RequestDeadline(SGLangError):
    """The overall per-request deadline passed (the server was slow to answer or to send the body)."""


class SGLangOfflineEngine(RolloutEngine):
    """``sglang.Engine`` in this process (no HTTP), e.g. colocated with the trainer on one node.

    ``SGLangOfflineEngine(model_path="openai/gpt-oss-20b", mem_fraction_static=0.5, ...)`` forwards keyword
    arguments to ``sglang.Engine`` (its ``ServerArgs``); or pass ``engine=`` an existing one.

    SGLang's tokenizer manager binds its output loop to the first event loop that uses it
    (``TokenizerManager.auto_create_handle_loop``), and ``Engine``'s synchronous methods run on the loop that
    existed at construction (``Engine.loop``). A trainer that calls ``asyncio.run`` per batch would strand the
    output loop on a closed loop after the first batch, so every call here runs on one private loop (a daemon
    thread) for the engine's life. Weight updates are the ``weight_sync`` of the engine
    (`trl_ext.weight_sync.offline.SGLangOfflineWeightSync`), which calls the tokenizer manager's coroutines on that
    loop and checks every result: a refusal raises `WeightSyncError`. Before an update, every tensor name must be one
    of the checkpoint the engine was built from (``checkpoint_path``, default its ``model_path``): ``sglang.Engine``
    skips unknown names and still reports success.
    """

    def __init__(self, engine=None, *, checkpoint_path: str | None = None, **server_args) -> None:
        try:
            import sglang
        except ImportError as exc:
            raise ImportError(
                "SGLangOfflineEngine needs the `sglang` package (GPU only): pip install 'sglang[all]'. "
                "Use SGLangEngine (HTTP) or EmbeddedEngine otherwise."
            ) from exc
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="SGLangOfflineEngine", daemon=True)
        self._thread.start()
        self._engine = engine if engine is not None else sglang.Engine(**server_args)
        self.weight_sync = SGLangOfflineWeightSync(self._engine, self._on_loop, checkpoint_path=checkpoint_path)

    @property
    def weight_version(self) -> int | str | None:
        """The version of the last verified weight sync (None before the first)."""
        return self.weight_sync.version

    @property
    def lora_name(self) -> str:
        """Name prefix of the adapters loaded with LoRA sync (``<lora_name>-v<version>``)."""
        return self.weight_sync.config.lora_name

    @lora_name.setter
    def lora_name(self, name: str) -> None:
        self.weight_sync.config.lora_name = name

    async def _on_loop(self, coro):
        if self._engine is None:
            coro.close()
            raise RuntimeError("SGLangOfflineEngine is closed")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> GenerationOutput:
        ids = validate_input_ids(input_ids)
        kwargs = dict(
            input_ids=ids, sampling_params=sampling_params_payload(sampling), return_logprob=True, logprob_start_len=-1
        )
        if self.weight_sync.served_adapter is not None:
            kwargs["lora_path"] = self.weight_sync.served_adapter
        item = await self._on_loop(self._engine.async_generate(**kwargs))
        return parse_generate_item(item)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Load new weights as ``version`` and verify (`trl_ext.weight_sync.offline.SGLangOfflineWeightSync.update`:
        ``update_weights_from_tensor`` through the tokenizer manager, one payload per TP rank, every result checked
        and the served ``weight_version`` read back)."""
        named = [(n, t.detach()) for n, t in named_tensors]
        if not named:
            raise ValueError("update_weights: no tensors")
        await self.weight_sync.update(named, version)

    async def update_lora_adapter(self, adapter: LoRAAdapter, *, version: int) -> None:
        """Load a PEFT adapter as ``<lora_name>-v<version>``; later requests name it in ``lora_path``
        (`trl_ext.weight_sync.offline.SGLangOfflineWeightSync.update_lora`)."""
        await self.weight_sync.update_lora(adapter, version)

    async def health(self) -> bool:
        return self._engine is not None

    async def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
