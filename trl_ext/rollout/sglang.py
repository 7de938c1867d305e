"""Rollout engines on SGLang: a client of the native HTTP API, and ``sglang.Engine`` in-process.

`SGLangEngine` talks to one or more ``python -m sglang.launch_server`` processes (FACTS §9):

- ``POST /generate`` with ``input_ids`` and only SGLang's ``sampling_params`` keys (``stop_token_ids`` = the
  harmony stops, ``skip_special_tokens=False``, ``no_stop_trim=True`` so the stop token stays in
  ``output_ids``), ``return_logprob=True``, ``logprob_start_len=-1`` (log-probs of the output only);
- bounded concurrency (a semaphore), per-request timeouts, retries with exponential backoff on connection
  errors, timeouts, 5xx and malformed answers (log-prob/ids length mismatch); 4xx are not retried;
- a readiness wait (``GET /health`` until 200 or a deadline) before the first request;
- least-loaded routing over several servers;
- weight sync after each optimizer step, wrapped in ``/pause_generation`` + ``/continue_generation``:
  ``sync_mode="disk"`` (safetensors shards + config written to a directory the servers can read, then
  ``/update_weights_from_disk``), ``"distributed"`` (``/init_weights_update_group`` once, then per bucket
  ``/update_weights_from_distributed`` while this process broadcasts the tensors from rank 0 of that group),
  ``"tensor"`` (``/update_weights_from_tensor`` with ForkingPickler payloads: CUDA IPC handles, so only for
  servers on the same node and tensors on the GPU);
- ``meta_info.weight_version`` recorded on every output; ``finish_reason`` ``abort`` surfaced, not hidden.

`SGLangOfflineEngine` wraps ``sglang.Engine`` (imported lazily; a clear `ImportError` without sglang).
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import logging
import random
import shutil
import tempfile
import uuid
from datetime import timedelta
import threading
from collections.abc import Iterable
from pathlib import Path

import torch

from .engine import RolloutEngine, validate_input_ids
from .types import GenerationOutput, SamplingParams

logger = logging.getLogger(__name__)

SYNC_MODES = ("disk", "distributed", "tensor")


class SGLangError(RuntimeError):
    """An SGLang request failed (after retries where retrying made sense)."""


class SGLangResponseError(SGLangError):
    """The server answered something that breaks the contract (missing keys, ids/log-probs mismatch)."""


class _RetryableStatus(SGLangError):
    pass


def sampling_params_payload(sampling: SamplingParams) -> dict:
    """SGLang ``sampling_params`` for token-level rollouts (only keys SGLang knows).

    ``min_p`` and the penalties are sent when they are not SGLang's defaults, then ``sampling.sglang_extra``.
    """
    payload = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "stop_token_ids": list(sampling.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    defaults = {"min_p": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    payload.update({k: getattr(sampling, k) for k, v in defaults.items() if getattr(sampling, k) != v})
    payload.update(sampling.sglang_extra)
    return payload


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
        raise SGLangResponseError("/generate answer lacks output_ids or meta_info.output_token_logprobs "
                                  "(send return_logprob=true)")
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


class SGLangEngine(RolloutEngine):
    """Client of one or more SGLang servers (native API), for token-in/token-out agentic rollouts.

    Args:
        base_urls: ``"http://host:30000"`` or a list of them (requests go to the least-loaded one).
        sync_mode: how `update_weights` ships weights: ``"disk"``, ``"distributed"`` or ``"tensor"``.
        max_concurrency: most ``/generate`` requests in flight (all servers together).
        timeout_s: per-request read timeout (a long generation must fit in it); ``connect_timeout_s`` for
            connecting.
        max_retries: retries after the first attempt (connection errors, timeouts, 5xx, malformed answers).
        backoff_s, max_backoff_s: exponential backoff (with jitter) between attempts.
        ready_timeout_s: how long the first request waits for ``GET /health`` to answer 200.
        api_key: sent as a bearer token when the servers were launched with ``--api-key``.
        weight_dir: disk mode: directory shared with the servers (a temporary one by default: only valid when
            the servers run on this machine). ``model_config``: a config (``save_pretrained``-able) written
            next to the weights, since SGLang reads ``config.json`` from that directory.
        max_shard_size: disk mode shard size (``huggingface_hub.save_torch_state_dict``).
        dist_backend: distributed mode backend (``"nccl"`` with CUDA, ``"gloo"`` otherwise);
            ``dist_master_address`` must be reachable from the servers; ``dist_master_port`` (free port by
            default); ``group_name``; ``bucket_bytes`` bounds one ``/update_weights_from_distributed`` call;
            ``dist_timeout_s`` bounds the rendezvous and each collective.
        pause_mode: ``/pause_generation`` mode around syncs (``"retract"``: running requests are recomputed with
            the new weights; ``"abort"``: they return ``abort``; ``"in_place"``; None: no pause).
    """

    def __init__(
        self,
        base_urls: str | list[str],
        *,
        sync_mode: str = "disk",
        max_concurrency: int = 64,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        ready_timeout_s: float = 600.0,
        api_key: str | None = None,
        weight_dir: str | None = None,
        model_config=None,
        max_shard_size: str | int = "5GB",
        dist_backend: str | None = None,
        dist_master_address: str = "127.0.0.1",
        dist_master_port: int | None = None,
        group_name: str = "weight_update_group",
        bucket_bytes: int = 1 << 30,
        dist_timeout_s: float = 600.0,
        pause_mode: str | None = "retract",
        flush_cache_retries: int = 30,
    ) -> None:
        try:
            import httpx  # noqa: F401
        except ImportError as exc:  # pragma: no cover
            raise ImportError("SGLangEngine needs httpx: pip install httpx") from exc
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("SGLangEngine: no base_urls")
        self.base_urls = [u.rstrip("/") for u in urls]
        if sync_mode not in SYNC_MODES:
            raise ValueError(f"sync_mode must be one of {SYNC_MODES}, got {sync_mode!r}")
        if pause_mode not in (None, "abort", "retract", "in_place"):
            raise ValueError(f"pause_mode must be None, 'abort', 'retract' or 'in_place', got {pause_mode!r}")
        if max_concurrency < 1 or max_retries < 0:
            raise ValueError("max_concurrency must be >= 1 and max_retries >= 0")
        self.sync_mode = sync_mode
        self.max_concurrency = int(max_concurrency)
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.ready_timeout_s = float(ready_timeout_s)
        self.api_key = api_key
        self.model_config = model_config
        self.max_shard_size = max_shard_size
        self.dist_backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.dist_master_address = dist_master_address
        self.dist_master_port = dist_master_port
        self.group_name = group_name
        self.bucket_bytes = int(bucket_bytes)
        self.dist_timeout_s = float(dist_timeout_s)
        self.pause_mode = pause_mode
        self.flush_cache_retries = int(flush_cache_retries)
        self._own_weight_dir = weight_dir is None
        self._weight_dir = Path(weight_dir) if weight_dir else None
        self._version: int | str | None = None
        self._inflight = {u: 0 for u in self.base_urls}
        self._rr = itertools.count()
        self._ready = False
        self._group = None
        self._client = None
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self._closed = False
        self._ready_lock_obj: asyncio.Lock | None = None
        self.stats = {"requests": 0, "retries": 0, "aborts": 0, "syncs": 0}

    # ------------------------------------------------------------------ plumbing

    @property
    def weight_version(self) -> int | str | None:
        return self._version

    def _state(self):
        """(httpx client, semaphore), created on the engine's own loop (runs there only)."""
        import httpx

        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s),
                limits=httpx.Limits(max_connections=self.max_concurrency + 16, max_keepalive_connections=self.max_concurrency),
                headers=headers,
                trust_env=False,
            )
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        return self._client, self._semaphore

    async def _on_engine_loop(self, coro):
        """Run ``coro`` on the engine's private event loop (a daemon thread) and await it from any loop.

        asyncio objects (the HTTP connection pool, the semaphore) belong to one loop; callers come from many
        (a trainer running each batch with ``asyncio.run``, a notebook's loop, worker threads), so the client
        lives on a loop of its own. Cancelling the caller cancels the request.
        """
        with self._loop_lock:
            if self._closed:
                coro.close()
                raise RuntimeError("SGLangEngine is closed")
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._loop_thread = threading.Thread(target=self._loop.run_forever, name="SGLangEngine", daemon=True)
                self._loop_thread.start()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _pick_url(self, avoid: str | None = None) -> str:
        candidates = [u for u in self.base_urls if u != avoid] or self.base_urls
        least = min(self._inflight[u] for u in candidates)
        ties = [u for u in candidates if self._inflight[u] == least]
        return ties[next(self._rr) % len(ties)]

    def _backoff(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**attempt) * (0.5 + random.random() / 2)

    async def _request(self, method: str, url: str, path: str, payload: dict | None = None, *, retries: int | None = None):
        """One HTTP call with retries on transport errors, timeouts and 5xx. Returns parsed JSON (or text)."""
        import httpx

        client, _ = self._state()
        retries = self.max_retries if retries is None else retries
        last: Exception | None = None
        for attempt in range(retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(self._backoff(attempt - 1))
            try:
                resp = await client.request(method, url + path, json=payload)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                last = exc
                logger.warning("SGLang %s%s failed (%s: %s), attempt %d", url, path, type(exc).__name__, exc, attempt + 1)
                continue
            if resp.status_code >= 500:
                last = _RetryableStatus(f"{url}{path}: HTTP {resp.status_code}: {resp.text[:300]}")
                continue
            if resp.status_code >= 400:
                raise SGLangError(f"{url}{path}: HTTP {resp.status_code}: {resp.text[:500]}")
            try:
                return resp.json()
            except ValueError:
                return resp.text
        raise SGLangError(f"{url}{path} failed after {retries + 1} attempts: {type(last).__name__}: {last}") from last

    async def wait_until_ready(self, timeout_s: float | None = None) -> None:
        """Poll ``GET /health`` on every server until all answer 200; raise `TimeoutError` at the deadline."""
        await self._on_engine_loop(self._wait_until_ready(timeout_s))

    async def _wait_until_ready(self, timeout_s: float | None = None) -> None:
        """Poll ``GET /health`` on every server until all answer 200; raise `TimeoutError` at the deadline."""
        import httpx

        client, _ = self._state()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.ready_timeout_s if timeout_s is None else timeout_s)
        for url in self.base_urls:
            delay, last = 0.05, None
            while True:
                try:
                    resp = await client.get(url + "/health", timeout=max(0.1, min(5.0, deadline - loop.time())))
                    if resp.status_code == 200:
                        break
                    last = f"HTTP {resp.status_code}"
                except (httpx.TransportError, httpx.TimeoutException) as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if loop.time() + delay > deadline:
                    raise TimeoutError(f"SGLang server {url} not ready before the deadline (last: {last})")
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
        self._ready = True

    async def health(self) -> bool:
        return await self._on_engine_loop(self._health())

    async def _health(self) -> bool:
        import httpx

        client, _ = self._state()
        try:
            answers = await asyncio.gather(*(client.get(u + "/health", timeout=5.0) for u in self.base_urls))
        except (httpx.TransportError, httpx.TimeoutException):
            return False
        return all(r.status_code == 200 for r in answers)

    # ------------------------------------------------------------------ generation

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> GenerationOutput:
        ids = validate_input_ids(input_ids)
        return await self._on_engine_loop(self._generate(ids, sampling))

    async def _ensure_ready(self) -> None:
        if not self._ready:
            async with self._ready_lock():
                if not self._ready:
                    await self._wait_until_ready()

    def _ready_lock(self) -> asyncio.Lock:
        if self._ready_lock_obj is None:
            self._ready_lock_obj = asyncio.Lock()
        return self._ready_lock_obj

    async def _generate(self, ids: list[int], sampling: SamplingParams) -> GenerationOutput:
        import httpx

        await self._ensure_ready()
        client, semaphore = self._state()
        payload = {
            "input_ids": ids,
            "sampling_params": sampling_params_payload(sampling),
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }
        last: Exception | None = None
        url = None
        async with semaphore:
            for attempt in range(self.max_retries + 1):
                if attempt:
                    self.stats["retries"] += 1
                    await asyncio.sleep(self._backoff(attempt - 1))
                url = self._pick_url(avoid=url if len(self.base_urls) > 1 else None)
                payload["rid"] = uuid.uuid4().hex
                self._inflight[url] += 1
                self.stats["requests"] += 1
                try:
                    resp = await client.post(url + "/generate", json=payload)
                except (httpx.TransportError, httpx.TimeoutException) as exc:
                    last = exc
                    logger.warning("SGLang /generate on %s: %s: %s (attempt %d)", url, type(exc).__name__, exc, attempt + 1)
                    continue
                finally:
                    self._inflight[url] -= 1
                if resp.status_code >= 500:
                    last = _RetryableStatus(f"HTTP {resp.status_code}: {resp.text[:300]}")
                    logger.warning("SGLang /generate on %s: %s (attempt %d)", url, last, attempt + 1)
                    continue
                if resp.status_code >= 400:
                    raise SGLangError(f"{url}/generate: HTTP {resp.status_code}: {resp.text[:500]}")
                try:
                    out = parse_generate_item(resp.json())
                except (SGLangResponseError, ValueError) as exc:
                    last = exc
                    logger.warning("SGLang /generate on %s: malformed answer: %s (attempt %d)", url, exc, attempt + 1)
                    continue
                if out.finish_reason == "abort":
                    self.stats["aborts"] += 1
                return out
        raise SGLangError(
            f"/generate failed after {self.max_retries + 1} attempts: {type(last).__name__}: {last}"
        ) from last

    # ------------------------------------------------------------------ control

    async def flush_cache(self) -> None:
        """``POST /flush_cache`` on every server, retrying while it answers 400 (requests still running)."""
        await self._on_engine_loop(self._flush_cache())

    async def _flush_cache(self) -> None:
        client, _ = self._state()
        for url in self.base_urls:
            for attempt in range(self.flush_cache_retries + 1):
                resp = await client.post(url + "/flush_cache")
                if resp.status_code == 200:
                    break
                if resp.status_code != 400 or attempt == self.flush_cache_retries:
                    raise SGLangError(f"{url}/flush_cache: HTTP {resp.status_code}: {resp.text[:300]}")
                await asyncio.sleep(self._backoff(min(attempt, 4)))

    async def _post_all(self, path: str, payloads: list[dict] | dict, *, retries: int | None = None) -> list:
        """POST to every server; ``retries=0`` for calls that pair with collectives (a retry would deadlock)."""
        if isinstance(payloads, dict):
            payloads = [payloads] * len(self.base_urls)
        answers = await asyncio.gather(
            *(self._request("POST", u, path, p, retries=retries) for u, p in zip(self.base_urls, payloads))
        )
        for url, answer in zip(self.base_urls, answers):
            if isinstance(answer, dict) and answer.get("success") is False:
                raise SGLangError(f"{url}{path} refused: {answer.get('message')}")
        return answers

    async def _pause_generation(self) -> None:
        if self.pause_mode is not None:
            await self._post_all("/pause_generation", {"mode": self.pause_mode})

    async def _continue_generation(self) -> None:
        if self.pause_mode is not None:
            await self._post_all("/continue_generation", {})

    # ------------------------------------------------------------------ weight sync

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Ship new weights to every server (``sync_mode``), tagged ``weight_version=str(version)``."""
        named = [(name, t.detach()) for name, t in named_tensors]
        if not named:
            raise ValueError("update_weights: no tensors")
        await self._on_engine_loop(self._update_weights(named, version))

    async def _update_weights(self, named: list[tuple[str, torch.Tensor]], version) -> None:
        await self._ensure_ready()
        await self._pause_generation()
        try:
            if self.sync_mode == "disk":
                await self._sync_disk(named, version)
            elif self.sync_mode == "distributed":
                await self._sync_distributed(named, version)
            else:
                await self._sync_tensor(named, version)
        finally:
            await self._continue_generation()
        self._version = version
        self.stats["syncs"] += 1

    async def _sync_disk(self, named: list[tuple[str, torch.Tensor]], version) -> None:
        from huggingface_hub import save_torch_state_dict

        if self._weight_dir is None:
            self._weight_dir = Path(tempfile.mkdtemp(prefix="sglang_weights_"))
        out_dir = self._weight_dir
        out_dir.mkdir(parents=True, exist_ok=True)

        def write() -> None:
            for stale in list(out_dir.glob("*.safetensors")) + list(out_dir.glob("*.safetensors.index.json")):
                stale.unlink()  # never let an old shard mix with the new ones
            state = {name: t.to("cpu").contiguous() for name, t in named}
            save_torch_state_dict(state, out_dir, max_shard_size=self.max_shard_size)
            if self.model_config is not None:
                self.model_config.save_pretrained(out_dir)

        await asyncio.to_thread(write)
        await self._post_all(
            "/update_weights_from_disk",
            {"model_path": str(out_dir), "weight_version": str(version), "flush_cache": True},
        )

    async def _ensure_group(self) -> None:
        if self._group is not None:
            return
        from .distributed import free_port, init_weight_update_group

        infos = await asyncio.gather(*(self._request("GET", u, "/server_info") for u in self.base_urls))
        for url, info in zip(self.base_urls, infos):
            if int((info or {}).get("dp_size", 1) or 1) > 1:
                raise SGLangError(
                    f"{url} runs with dp_size > 1; distributed weight sync supports one TP group per server: "
                    "launch one server per data-parallel replica (they are load-balanced by the client)"
                )
        sizes = [int((i or {}).get("tp_size", 1)) for i in infos]
        world_size = 1 + sum(sizes)
        port = self.dist_master_port or free_port(self.dist_master_address)
        offsets = [1 + sum(sizes[:k]) for k in range(len(sizes))]
        payloads = [
            {
                "master_address": self.dist_master_address,
                "master_port": port,
                "rank_offset": off,
                "world_size": world_size,
                "group_name": self.group_name,
                "backend": self.dist_backend,
            }
            for off in offsets
        ]
        join = asyncio.to_thread(
            init_weight_update_group,
            backend=self.dist_backend,
            master_address=self.dist_master_address,
            master_port=port,
            world_size=world_size,
            rank=0,
            group_name=self.group_name,
            timeout=timedelta(seconds=self.dist_timeout_s),
        )
        group, _ = await asyncio.gather(join, self._post_all("/init_weights_update_group", payloads, retries=0))
        self._group = group

    async def _sync_distributed(self, named: list[tuple[str, torch.Tensor]], version) -> None:
        import torch.distributed as dist

        await self._ensure_group()
        device = torch.device("cuda", torch.cuda.current_device()) if self.dist_backend == "nccl" else torch.device("cpu")
        buckets, current, size = [], [], 0
        for name, t in named:
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > self.bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append((name, t))
            size += nbytes
        buckets.append(current)
        for k, bucket in enumerate(buckets):
            payload = {
                "names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": self.group_name,
                "flush_cache": k == len(buckets) - 1,
                "weight_version": str(version),
            }

            def broadcast(bucket=bucket) -> None:
                for _, t in bucket:  # same order as `names`: the servers receive in that order
                    dist.broadcast(t.to(device).contiguous(), src=0, group=self._group)

            await asyncio.gather(
                self._post_all("/update_weights_from_distributed", payload, retries=0), asyncio.to_thread(broadcast)
            )

    async def _sync_tensor(self, named: list[tuple[str, torch.Tensor]], version) -> None:
        infos = await asyncio.gather(*(self._request("GET", u, "/server_info") for u in self.base_urls))
        blob = serialize_named_tensors(named)
        payloads = [
            {
                "serialized_named_tensors": [blob] * int((info or {}).get("tp_size", 1)),
                "load_format": None,
                "flush_cache": True,
                "weight_version": str(version),
            }
            for info in infos
        ]
        await self._post_all("/update_weights_from_tensor", payloads)

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
        if self._group is not None:
            from .distributed import destroy_weight_update_group

            try:
                await asyncio.gather(
                    *(self._request("POST", u, "/destroy_weights_update_group", {"group_name": self.group_name}, retries=0)
                      for u in self.base_urls)
                )
            except SGLangError as exc:
                logger.warning("destroy_weights_update_group: %s", exc)
            destroy_weight_update_group(self._group)
            self._group = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._own_weight_dir and self._weight_dir is not None:
            shutil.rmtree(self._weight_dir, ignore_errors=True)
            self._weight_dir = None


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(named_tensors, output_str=True)``: ForkingPickler + base64.

    ForkingPickler applies torch's multiprocessing reductions: a CUDA tensor travels as an IPC handle (the
    receiver maps the sender's memory, so keep the tensors alive until the call returns), a CPU tensor as a
    shared-memory handle.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


class SGLangOfflineEngine(RolloutEngine):
    """``sglang.Engine`` in this process (no HTTP), e.g. colocated with the trainer on one node.

    ``SGLangOfflineEngine(model_path="openai/gpt-oss-20b", mem_fraction_static=0.5, ...)`` forwards keyword
    arguments to ``sglang.Engine`` (its ``ServerArgs``); or pass ``engine=`` an existing one. Generation uses
    ``Engine.async_generate``; weight sync uses ``Engine.update_weights_from_tensor`` (CUDA IPC). sglang is
    imported lazily: without it this raises `ImportError`.
    """

    def __init__(self, engine=None, **server_args) -> None:
        try:
            import sglang
        except ImportError as exc:
            raise ImportError(
                "SGLangOfflineEngine needs the `sglang` package (GPU only): pip install 'sglang[all]'. "
                "Use SGLangEngine (HTTP) or EmbeddedEngine otherwise."
            ) from exc
        self._engine = engine if engine is not None else sglang.Engine(**server_args)
        self._version: int | str | None = None

    @property
    def weight_version(self) -> int | str | None:
        return self._version

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> GenerationOutput:
        ids = validate_input_ids(input_ids)
        item = await self._engine.async_generate(
            input_ids=ids,
            sampling_params=sampling_params_payload(sampling),
            return_logprob=True,
            logprob_start_len=-1,
        )
        return parse_generate_item(item)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        named = [(n, t.detach()) for n, t in named_tensors]
        await asyncio.to_thread(self._engine.update_weights_from_tensor, named_tensors=named, flush_cache=True)
        self._version = version

    async def health(self) -> bool:
        return self._engine is not None

    async def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
