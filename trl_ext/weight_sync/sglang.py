"""SGLang's weight-update endpoints, driven for every server of an `SGLangEngine`, and checked.

One sync (`SGLangHTTPWeightSync.update`):

1. ``GET /server_info`` of every server; the tensor names are checked against the names each server loads
   (`verify.unknown_names`) before anything is sent;
2. ``/pause_generation`` on every server (inside the ``try``: a failed pause still continues the servers already
   paused), ``/begin_weight_update`` where the server has it, the load (``/update_weights_from_disk``, an NCCL
   broadcast with ``/update_weights_from_distributed``, CUDA-IPC ``/update_weights_from_tensor``, or a LoRA
   adapter), ``/end_weight_update``, ``/continue_generation`` on every paused server (always);
3. with ``pause_mode="in_place"``: ``/flush_cache`` once the requests that kept running are done (SGLang refuses to
   flush a running batch), while the engine holds its new requests;
4. the checks (`verify`): every server reports the new ``weight_version``; with ``"checksum"`` every served
   parameter fed by a changed tensor changed; with LoRA the server lists the new adapter.

Every answer's ``success`` is checked. When a server fails, the step fails with a `WeightSyncError` naming each
server's state, and the engine refuses to generate until a later sync succeeds. SGLang behaviour is cited by
upstream file and function (sglang 0.5.17 and 0.5.23 wheels).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from . import verify as checks
from .history import SYNC_HISTORY_LIMIT, SyncRecord
from .settings import ServerLostError, WeightSyncConfig, WeightSyncError
from .transport import (
    default_weight_dir,
    destroy_weight_update_group,
    flatten_bucket,
    free_port,
    init_weight_update_group,
    on_cuda_for_ipc,
    plan_buckets,
    serialize_per_rank,
    write_adapter,
    write_checkpoint,
)

logger = logging.getLogger(__name__)


def version_tuple(version: str | None) -> tuple[int, ...] | None:
    if not version:
        return None
    parts = []
    for piece in str(version).split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or None


# ``/begin_weight_update`` and ``/end_weight_update`` appeared between 0.5.17 and 0.5.23; from then on
# ``update_weights_from_tensor``/``_distributed`` answer "must run between begin_weight_update() and
# end_weight_update()" without a session (``SchedulerWeightUpdaterManager.update_weights_from_distributed``
# in ``sglang/srt/managers/scheduler_components/weight_updater.py``, 0.5.23). Servers that report an older
# version, or answer 404 on ``/begin_weight_update``, are driven without the session.
_SESSION_SINCE = (0, 5, 18)

# attempts of one sync when servers die during it and come back (`SGLangHTTPWeightSync.update`): a server that dies
# again and again fails the sync instead of holding the trainer
SYNC_ATTEMPTS = 3


@dataclass
class ServerState:
    """What the client knows of one SGLang server (from ``GET /server_info``)."""

    url: str
    tp_size: int = 1
    dp_size: int = 1
    version: str | None = None
    has_session: bool | None = None  # begin/end weight-update session (None: not known yet)
    enable_lora: bool = False
    model_path: str | None = None
    dtype: str | None = None  # the server's ``--dtype`` ("auto": the checkpoint's)
    deterministic_inference: bool = False  # ``--enable-deterministic-inference``: ``sampling_seed`` is honoured
    return_routed_experts: bool = False  # ``--enable-return-routed-experts``
    moe_runner_backend: str | None = None  # ``--moe-runner-backend`` after SGLang's model overrides
    max_lora_rank: int | None = None  # ``--max-lora-rank`` (None: inferred from ``--lora-paths`` at launch)
    lora_target_modules: tuple[str, ...] | None = None  # ``--lora-target-modules`` (None: inferred likewise)

    @classmethod
    def from_info(cls, url: str, info) -> ServerState:
        info = info if isinstance(info, dict) else {}
        version = info.get("version")
        vt = version_tuple(version)
        return cls(
            url=url,
            tp_size=int(info.get("tp_size") or 1),
            dp_size=int(info.get("dp_size") or 1),
            version=version,
            has_session=None if vt is None else vt >= _SESSION_SINCE,
            enable_lora=bool(info.get("enable_lora", False)),
            model_path=info.get("model_path"),
            dtype=info.get("dtype"),
            deterministic_inference=bool(info.get("enable_deterministic_inference", False)),
            return_routed_experts=bool(info.get("enable_return_routed_experts", False)),
            moe_runner_backend=info.get("moe_runner_backend"),
            max_lora_rank=int(info["max_lora_rank"]) if info.get("max_lora_rank") else None,
            lora_target_modules=tuple(sorted(info["lora_target_modules"])) if info.get("lora_target_modules") else None,
        )


def check_lora_servers(states: list[ServerState], *, rank: int, target_modules) -> None:
    """Start-up check for LoRA sync: every server was launched able to load an adapter of this ``rank`` on these
    ``target_modules`` (PEFT's names). Raises `WeightSyncError` listing each server and the flag it lacks; a limit
    the server infers from ``--lora-paths`` (reported as None) is checked by SGLang at the first load instead."""
    wanted = checks.sglang_lora_modules(target_modules)
    problems = []
    for s in states:
        if not s.enable_lora:
            problems.append(f"{s.url} was launched without --enable-lora")
            continue
        if s.max_lora_rank is not None and s.max_lora_rank < rank:
            problems.append(f"{s.url} has --max-lora-rank {s.max_lora_rank}, below the adapter's rank {rank}")
        if s.lora_target_modules is not None and "all" not in s.lora_target_modules:
            missing = sorted(wanted - checks.sglang_lora_modules(s.lora_target_modules))
            if missing:
                problems.append(
                    f"{s.url} has --lora-target-modules {' '.join(s.lora_target_modules)}, without {', '.join(missing)}"
                )
    if problems:
        raise WeightSyncError(
            "weight_sync_lora needs SGLang servers launched for the adapter (--enable-lora --max-lora-rank R "
            "--lora-target-modules ..., as `python -m trl_ext.sglang_serve --lora-rank R` passes): "
            + "; ".join(problems)
        )


@dataclass
class _LoadedNames:
    """The names one server loads: its checkpoint's (when readable here) or its parameters'."""

    checkpoint: set[str] | None
    params: set[str] | None
    source: str


def _in_daemon_thread(fn, /, **kwargs) -> concurrent.futures.Future:
    """``fn(**kwargs)`` in a daemon thread: a rendezvous abandoned after a failure does not hold the interpreter's
    exit (the default executor's threads are joined at exit)."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        # running from here on: an awaiting side that gives up can no longer cancel the future, so the outcome is
        # always set on a live one (setting it on a cancelled future raised InvalidStateError in this thread)
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(fn(**kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side
            done.set_exception(exc)

    threading.Thread(target=run, name="weight-update-group-join", daemon=True).start()
    return done


def _same_version(served, synced) -> bool:
    """Whether a server's ``weight_version`` is the last sync's version (None, or SGLang's "default": none yet)."""

    def norm(v):
        return None if v in (None, "default") else str(v)

    return norm(served) == norm(synced)


def _destroy_joined_group(join: concurrent.futures.Future) -> None:
    """Done callback of a weight-update group join abandoned after a failure: destroy a group it formed."""
    if join.exception() is not None:
        return
    try:
        destroy_weight_update_group(join.result())
    except Exception as exc:  # noqa: BLE001 - nothing uses this group
        logger.warning("destroying an abandoned weight-update group: %s", exc)


class SGLangHTTPWeightSync:
    """The weight-sync protocol of SGLang's HTTP server for the servers of ``client`` (an `SGLangEngine`).

    ``client`` provides ``base_urls``, ``request(method, url, path, payload, *, retries, ok_statuses)`` (one HTTP
    call with its retry policy; None for a status in ``ok_statuses``) and its ``retry_deadline_s`` /
    ``backoff_s``. The engine reads `version`, `failure` (set while the servers may disagree), `served_adapter`
    (the ``lora_path`` of its requests) and waits on `wait_until_cache_clean` before each request. `sync_history`
    holds a `SyncRecord` per sync (the last `SYNC_HISTORY_LIMIT`), the log-prob probe that follows it included.
    """

    def __init__(self, client, config: WeightSyncConfig) -> None:
        self.client = client
        self.config = config
        self.version: int | str | None = None
        self.failure: str | None = None
        self.served_adapter: str | None = None
        self.group = None
        self.paused_urls: set[str] = set()  # paused by a sync that has not continued them yet
        self.last_logprob_probe: dict[str, dict] = {}  # url -> what the last probe measured there
        self.sync_history: deque[SyncRecord] = deque(maxlen=SYNC_HISTORY_LIMIT)  # one record per sync, oldest first
        self.dist_backend = config.dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self._weight_dir = Path(config.weight_dir) if config.weight_dir else None
        self._own_weight_dir = config.weight_dir is None
        self._names: dict[str, _LoadedNames] = {}
        self.last_verify_s: float | None = None  # seconds the last successful sync spent in `verify`
        self._checksums: dict[str, dict] = {}  # url -> /weights_checker answer after the last verified sync
        self._sent = checks.SentFingerprints()
        self._requested_adapters: dict[str, set[str]] = {}  # url -> adapter names whose load was requested
        self._served_adapters: dict[str, str] = {}  # url -> adapter name loaded and served
        self._probe_floor: dict[str, float] = {}
        self._probe_reference: list[float] | None = None
        self._cache_clean: asyncio.Event | None = None
        self._stale_group = False  # a failed group was dropped here; servers may still hold it (`drop_group`)
        self._lost_at_last_sync: dict[str, int] = {}  # the client's lost connections when the last sync succeeded

    # -------------------------------------------------------------- helpers

    def fail(self, message: str) -> WeightSyncError:
        """Record ``message`` as the reason the engine refuses to generate; the error to raise."""
        self.failure = message
        logger.error("SGLang weight sync: %s", message)
        return WeightSyncError(message)

    def weights_dir(self) -> Path:
        if self._weight_dir is None:
            self._weight_dir = default_weight_dir()
        self._weight_dir.mkdir(parents=True, exist_ok=True)
        return self._weight_dir

    async def server_states(self) -> list[ServerState]:
        urls = self.client.base_urls
        infos = await asyncio.gather(*(self.client.request("GET", u, "/server_info") for u in urls))
        return [ServerState.from_info(u, i) for u, i in zip(urls, infos)]

    async def continue_servers(self) -> None:
        """``/continue_generation`` on every server: a client killed between a sync's ``/pause_generation`` and its
        ``/continue_generation`` leaves its servers paused, holding every request; a server that is not paused is
        left as it is (SGLang's ``continue_generation`` only resumes a paused scheduler)."""
        await asyncio.gather(*(self._post(u, "/continue_generation", {}) for u in self.client.base_urls))

    async def _post(self, url: str, path: str, payload: dict, *, retries: int | None = None, ok_404: bool = False):
        """POST and check SGLang's ``success``; returns the answer (None for an accepted 404 when ``ok_404``)."""
        answer = await self.client.request(
            "POST", url, path, payload, retries=retries, ok_statuses=(404,) if ok_404 else ()
        )
        if isinstance(answer, dict) and answer.get("success") is False:
            raise WeightSyncError(f"{url}{path} refused: {answer.get('message') or answer.get('error_message')}")
        return answer

    async def _begin(self, state: ServerState) -> bool:
        if state.has_session is False:
            return False
        answer = await self._post(state.url, "/begin_weight_update", {}, retries=0, ok_404=True)
        state.has_session = answer is not None
        return state.has_session

    async def _end(self, state: ServerState) -> None:
        await self._post(state.url, "/end_weight_update", {}, retries=0)

    async def wait_until_cache_clean(self) -> None:
        """Return once no radix-cache flush is pending (see ``pause_mode="in_place"``)."""
        if self._cache_clean is not None:
            await self._cache_clean.wait()

    # -------------------------------------------------------------- names

    async def _loaded_names(self, state: ServerState) -> _LoadedNames:
        """The names ``state`` loads, read once per server: ``checkpoint_path``, else the checkpoint the server was
        launched from (read before the first sync: a disk sync repoints the server's ``model_path`` at the files
        written here), else its parameters as ``/weights_checker`` lists them."""
        cached = self._names.get(state.url)
        if cached is not None:
            return cached
        for path, what in ((self.config.checkpoint_path, "checkpoint_path"), (state.model_path, "the server's")):
            if path:
                names = await asyncio.to_thread(checks.checkpoint_tensor_names, path)
                if names:
                    cached = _LoadedNames(names, None, f"{what} checkpoint {path}")
                    break
        if cached is None:
            try:
                answer = await self._post(state.url, "/weights_checker", {"action": "checksum"})
            except Exception as exc:  # noqa: BLE001 - reported with the way out
                raise WeightSyncError(
                    f"{state.url}: cannot tell which tensor names the server loads: its checkpoint "
                    f"({state.model_path!r}) is not readable here and /weights_checker failed ({exc}); set "
                    "checkpoint_path (AgenticGRPOConfig.weight_sync_checkpoint) to a copy of the served checkpoint"
                ) from exc
            params = checks.server_param_names(n for r in (answer or {}).get("ranks") or [] for n in r["checksums"])
            cached = _LoadedNames(None, params, f"the server's {len(params)} parameters (/weights_checker)")
        self._names[state.url] = cached
        return cached

    async def _check_names(self, states: list[ServerState], named, adapter) -> None:
        for s in states:
            known = await self._loaded_names(s)
            if adapter is not None:
                modules = checks.unknown_lora_modules(
                    (n for n, _ in adapter.named_tensors), checkpoint=known.checkpoint, params=known.params
                )
                if modules:
                    raise WeightSyncError(
                        f"{s.url}: the adapter targets {len(modules)} module(s) the served model does not have: "
                        f"{modules[:5]} (names it loads come from {known.source})"
                    )
                continue
            unknown = checks.unknown_names((n for n, _ in named), checkpoint=known.checkpoint, params=known.params)
            if unknown:
                raise WeightSyncError(f"{s.url}: {checks.describe_unknown(unknown, known.source)}")

    # -------------------------------------------------------------- entry points

    async def update(self, named: list[tuple[str, torch.Tensor]], version, *, lora=None) -> None:
        """Send ``named`` (or the LoRA adapter ``lora``) to every server as ``version``, then verify.

        A server that dies during the sync (a connection to it lost, then refused, or a server that answers on
        another version than the last sync's: a supervisor restarted it, with its launch weights) and answers again
        within the client's ``retry_deadline_s`` gets the whole sync again, at most `SYNC_ATTEMPTS` times in all; one
        that does not answer by then fails the sync with `ServerLostError`. Other failures (a refusal, a failed check,
        an answer cut off by a server that stayed up) are raised at once. The sync is recorded in `sync_history`.
        """
        record = SyncRecord.for_update(version, named, lora)
        self.sync_history.append(record)
        with record.timed("ok", "transfer_s"):
            await self._update_until_served(named, version, lora=lora)

    async def _update_until_served(self, named, version, *, lora=None) -> None:
        """`update`'s attempts: `_update_once`, sent again (at most `SYNC_ATTEMPTS` in all) while a server that lost
        its connection during the sync answers again on other weights."""
        if self.group is not None and self._lost_connections() != self._lost_at_last_sync:
            # a server lost its connection since the last sync (it may have restarted, without the group): a new one
            self.drop_group()
        for attempt in range(1, SYNC_ATTEMPTS + 1):
            lost_before = dict(self._lost_connections())
            try:
                await self._update_once(named, version, lora=lora)
                self._lost_at_last_sync = self._lost_connections()
                return
            except ServerLostError:
                raise
            except WeightSyncError as exc:
                lost = [u for u, n in self._lost_connections().items() if n > lost_before.get(u, 0)]
                if not lost or attempt == SYNC_ATTEMPTS:
                    raise
                restarted = {
                    url: served
                    for url, (served, was_down) in zip(lost, await self._answering_again(lost, version, exc))
                    if was_down or not _same_version(served, self.version)
                }
                if not restarted:
                    raise
                logger.warning(
                    "SGLang weight sync to version %s: %s restarted during the sync (now serving weight version %s): "
                    "sending the weights again (attempt %d of %d)",
                    version,
                    ", ".join(restarted),
                    ", ".join(repr(v) for v in restarted.values()),
                    attempt + 1,
                    SYNC_ATTEMPTS,
                )

    def _lost_connections(self) -> dict[str, int]:
        return dict(getattr(self.client, "lost_connections", None) or {})

    async def _answering_again(self, urls: list[str], version, failure: Exception) -> list:
        """Poll ``GET /model_info`` of each of ``urls`` until it answers, for up to the client's ``retry_deadline_s``;
        per server, the weight version it serves and whether it failed to answer first. `ServerLostError` naming a
        server that did not answer by then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.client.retry_deadline_s

        async def one(url: str):
            pause, was_down = max(self.client.backoff_s, 0.05), False
            while True:
                try:
                    info = await self.client.request("GET", url, "/model_info", retries=0)
                    return (info or {}).get("weight_version") if isinstance(info, dict) else None, was_down
                except Exception as exc:  # noqa: BLE001 - down (or still loading): polled until the deadline
                    was_down = True
                    left = deadline - loop.time()
                    if left <= 0:
                        raise self.fail_lost(
                            f"{url} stopped answering during the weight sync to version {version} and did not answer "
                            f"again within retry_deadline_s={self.client.retry_deadline_s:g} s (last error: {exc}); "
                            f"the sync failed with: {failure}"
                        ) from None
                await asyncio.sleep(min(pause, left))
                pause = min(pause * 2, 2.0)

        return list(await asyncio.gather(*(one(u) for u in urls)))

    def fail_lost(self, message: str) -> ServerLostError:
        """As `fail`, for a server that stopped answering."""
        self.failure = message
        logger.error("SGLang weight sync: %s", message)
        return ServerLostError(message)

    async def _update_once(self, named: list[tuple[str, torch.Tensor]], version, *, lora=None) -> None:
        config = self.config
        lost_before = self._lost_connections()
        try:
            states = await self.server_states()
        except Exception as exc:
            lost = [u for u, n in self._lost_connections().items() if n > lost_before.get(u, 0)]
            if not lost:
                raise
            raise self.fail_lost(
                f"weight sync to version {version}: {', '.join(lost)} did not answer within retry_deadline_s="
                f"{self.client.retry_deadline_s:g} s ({exc})"
            ) from exc
        for s in states:
            if s.dp_size > 1 and config.mode != "disk":
                raise WeightSyncError(
                    f"{s.url} runs with dp_size={s.dp_size}; {config.mode} sync supports one TP group per server "
                    "(SGLang asserts dp_size == 1 for it): launch one server per data-parallel replica"
                )
        self.failure = None  # a new sync may repair a previous failure; it records one again if it fails
        try:
            await self._check_names(states, named, lora)
        except WeightSyncError as exc:  # nothing was sent: the servers still serve the previous version
            raise self.fail(f"weight sync to version {version} refused before sending: {exc}") from None
        check_sums = "checksum" in config.verify and lora is None
        # None at the first sync (nothing to compare); "changed" as the coarsest server stores the values
        changed = self._sent.diff(named, checks.served_dtype(s.dtype for s in states)) if check_sums else None
        paused: list[str] = []
        failures: dict[str, str] = {}
        loaded: set[str] = set()
        in_place = config.pause_mode == "in_place"
        if in_place:
            self._hold_requests()
        try:
            if config.pause_mode is not None:
                for s in states:
                    paused.append(s.url)  # before the call: a pause that failed half-way is continued too
                    self.paused_urls.add(s.url)
                    await self._post(s.url, "/pause_generation", {"mode": config.pause_mode})
            if lora is not None:
                await self._load_lora(states, lora, version, loaded, failures)
            elif config.mode == "disk":
                await self._sync_disk(states, named, version, loaded, failures)
            elif config.mode == "distributed":
                await self._sync_distributed(states, named, version, loaded, failures)
            else:
                await self._sync_tensor(states, named, version, loaded, failures)
        except WeightSyncError as exc:
            failures.setdefault("(sync)", str(exc))
        except Exception as exc:  # noqa: BLE001 - reported with the per-server state below
            failures.setdefault("(sync)", f"{type(exc).__name__}: {exc}")
        finally:
            # After a failed sync, one attempt each: the engine refuses to generate until a later sync succeeds,
            # and that sync pauses and continues every server again, so retrying only held the trainer (for
            # `retry_deadline_s`) on a server that died in the sync; a restarted server is not paused anyway.
            retries = 0 if failures else None
            for url in paused:
                try:
                    await self._post(url, "/continue_generation", {}, retries=retries)
                    self.paused_urls.discard(url)
                except Exception as exc:  # noqa: BLE001 - every paused server must be continued; report all
                    failures[url] = f"{failures.get(url, '')} /continue_generation failed: {exc}".strip()
        if in_place and loaded:
            # The requests that kept running finish on their old KV cache; then the radix cache, which holds
            # prefixes computed with the old weights, is flushed before this engine sends anything new.
            for url in sorted(loaded):
                try:
                    await self._flush_when_idle(url)
                except Exception as exc:  # noqa: BLE001
                    failures[url] = f"{failures.get(url, '')} /flush_cache after the in-place update: {exc}".strip()
        if failures:
            detail = "; ".join(f"{u}: {m}" for u, m in failures.items())
            states_text = ", ".join(f"{s.url} {'loaded' if s.url in loaded else 'not loaded'}" for s in states)
            raise self.fail(f"weight sync to version {version} failed ({detail}); servers: {states_text}")
        if in_place:
            self._release_requests()
        verify_start = time.perf_counter()
        await self.verify(states, version, changed=changed, check_sums=check_sums)
        self.last_verify_s = time.perf_counter() - verify_start
        if check_sums:
            self._sent.commit()
        self.version = version

    def _hold_requests(self) -> None:
        if self._cache_clean is None:
            self._cache_clean = asyncio.Event()
        self._cache_clean.clear()

    def _release_requests(self) -> None:
        if self._cache_clean is not None:
            self._cache_clean.set()

    async def _flush_when_idle(self, url: str) -> None:
        """``POST /flush_cache`` until SGLang accepts it (400 while requests run), within ``retry_deadline_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.client.retry_deadline_s
        pause = max(self.client.backoff_s, 0.01)
        while True:
            try:
                await self.client.request("POST", url, "/flush_cache", retries=0)
                return
            except Exception as exc:  # noqa: BLE001 - SGLangError "HTTP 400" while requests run
                if "HTTP 400" not in str(exc) or loop.time() + pause > deadline:
                    raise
            await asyncio.sleep(pause * (0.5 + random.random() / 2))
            pause = min(pause * 2, 2.0)

    async def verify(
        self, states: list[ServerState], version, *, changed: list[str] | None = None, check_sums: bool = False
    ) -> None:
        """Every server must report ``weight_version == str(version)``; then, with ``check_sums``, the checksum check
        (`_verify_checksums`; ``changed``: the tensors that changed since the last verified sync, None at the first)."""
        infos = await asyncio.gather(*(self.client.request("GET", s.url, "/model_info") for s in states))
        wrong = {
            s.url: (i or {}).get("weight_version")
            for s, i in zip(states, infos)
            if str((i or {}).get("weight_version")) != str(version)
        }
        if wrong:
            msg = ", ".join(f"{u} reports weight_version {v!r}" for u, v in wrong.items())
            raise self.fail(f"after the sync to version {version}: {msg} (expected {str(version)!r})")
        if check_sums:
            await self._verify_checksums(states, version, changed)

    async def checksums(self, states: list[ServerState]) -> dict[str, dict]:
        answers = await asyncio.gather(*(self._post(s.url, "/weights_checker", {"action": "checksum"}) for s in states))
        return {s.url: (a or {}) for s, a in zip(states, answers)}

    async def _verify_checksums(self, states: list[ServerState], version, changed: list[str] | None) -> None:
        """Every served parameter fed by a tensor that changed since the last verified sync must have changed since
        then (`verify.unchanged_after_sync`), and servers with the same parallelism must agree. The first verified
        sync sets the reference (what a server held before it is not known to the trainer)."""
        now = await self.checksums(states)
        problems = []
        for url, answer in now.items():
            before = self._checksums.get(url)
            if not before or changed is None:  # the first verified sync (of this server): the reference
                continue
            stale, unmapped = checks.unchanged_after_sync(before, answer, changed)
            if stale:
                problems.append(
                    f"{url}: {len(stale)} served parameter(s) unchanged although the tensors feeding them changed: "
                    f"{stale[:5]}{' ...' if len(stale) > 5 else ''} (a stale or partly loaded server)"
                )
            if unmapped:
                logger.info(
                    "%s: %d changed tensor(s) map onto no reported parameter: %s", url, len(unmapped), unmapped[:5]
                )
        by_layout: dict[tuple, list[tuple[str, str]]] = {}
        for s in states:
            by_layout.setdefault((s.tp_size, s.dp_size), []).append((s.url, now[s.url].get("per_engine_checksum")))
        for layout, members in by_layout.items():
            if len({c for _, c in members}) > 1:
                problems.append(f"servers with tp/dp {layout} disagree: " + ", ".join(f"{u}={c}" for u, c in members))
        if problems:
            raise self.fail(f"checksum verification of version {version}: " + "; ".join(problems))
        self._checksums = now

    # -------------------------------------------------------------- log-prob probe

    async def verify_logprobs(self, probe_ids: list[int], reference: list[float]) -> dict[str, dict]:
        """Score ``probe_ids`` on every server (``input_token_logprobs``, temperature 1) and compare with
        ``reference`` (`verify.probe_verdict`); raise `WeightSyncError` naming the server when it fails. The probe
        follows a sync: its outcome, seconds and measurements go into that sync's record (`sync_history`)."""
        record = self.sync_history[-1] if self.sync_history else None
        with record.timed("probe_pass", "verify_s") if record is not None else contextlib.nullcontext():
            try:
                return await self._score_probe(probe_ids, reference)
            finally:
                if record is not None:
                    record.add_probe(self.last_logprob_probe)

    async def _score_probe(self, probe_ids: list[int], reference: list[float]) -> dict[str, dict]:
        self.last_logprob_probe = measured = {}
        if len(reference) != len(probe_ids) - 1:
            raise ValueError(
                f"reference must have len(probe_ids) - 1 = {len(probe_ids) - 1} log-probs, got {len(reference)}"
            )
        payload = {
            "input_ids": probe_ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        if self.served_adapter is not None:
            payload["lora_path"] = self.served_adapter
        urls = self.client.base_urls
        answers = await asyncio.gather(*(self.client.request("POST", u, "/generate", payload) for u in urls))
        config, problems = self.config, []
        for url, item in zip(urls, answers):
            entries = ((item or {}).get("meta_info") or {}).get("input_token_logprobs") or []
            served = [e[0] if isinstance(e, (list, tuple)) else e for e in entries][1:]  # the first token has none
            if len(served) != len(reference) or any(v is None for v in served):
                problems.append(f"{url}: {len(served)} input log-probs for {len(reference)} probe tokens")
                continue
            verdict = checks.probe_verdict(
                served,
                reference,
                previous_reference=self._probe_reference,
                floor=self._probe_floor.get(url),
                atol=config.probe_atol,
                rtol=config.probe_rtol,
                margin=config.probe_margin,
            )
            measured[url] = verdict
            if not verdict["ok"]:
                problems.append(
                    f"{url}: mean |log-prob difference| {verdict['mean_abs']:.3g} > tolerance {verdict['tolerance']:.3g}"
                    f" (floor {verdict['floor']:.3g} at the first verified sync x margin {config.probe_margin:g}, at "
                    f"most atol {config.probe_atol:g} + rtol {config.probe_rtol:g} * mean |trainer log-prob| "
                    f"{verdict['mean_abs_reference']:.3g}; the trainer moved {verdict['step_movement']} since the "
                    "previous sync)"
                )
            elif verdict["separable"] is False:
                logger.warning(
                    "%s: the log-prob probe cannot tell this sync from a stale server: the trainer's log-probs moved "
                    "%.3g since the previous sync, under the probe's tolerance %.3g; the checksum check is the one "
                    "that can catch a stale server here",
                    url,
                    verdict["step_movement"],
                    verdict["tolerance"],
                )
        if problems:
            raise self.fail(f"log-prob probe after the sync to version {self.version}: " + "; ".join(problems))
        for url, verdict in measured.items():
            self._probe_floor.setdefault(url, verdict["floor"])
        self._probe_reference = list(reference)
        return measured

    # -------------------------------------------------------------- modes

    async def _sync_disk(self, states, named, version, loaded, failures) -> None:
        config = self.config
        out_dir = self.weights_dir()
        await asyncio.to_thread(
            write_checkpoint, out_dir, named, max_shard_size=config.max_shard_size, model_config=config.model_config
        )
        payload = {
            "model_path": str(out_dir),
            "weight_version": str(version),
            "flush_cache": config.pause_mode != "in_place",
        }

        async def one(s: ServerState) -> None:
            try:
                await self._post(s.url, "/update_weights_from_disk", payload)
                loaded.add(s.url)
            except Exception as exc:  # noqa: BLE001
                failures[s.url] = str(exc)

        await asyncio.gather(*(one(s) for s in states))

    async def _sync_tensor(self, states, named, version, loaded, failures) -> None:
        config = self.config
        hint = ""
        named = on_cuda_for_ipc(named)  # CUDA IPC: the servers map this process's GPU memory
        if not torch.cuda.is_available():
            hint = (
                " (no CUDA here: the tensors travel as CPU shared memory, which a server in another process can only "
                "open if it shares this process's multiprocessing authkey; use weight_sync_mode='disk' on CPU)"
            )
        buckets = plan_buckets(named, config.bucket_bytes)

        async def one(s: ServerState) -> None:
            session = False
            try:
                session = await self._begin(s)
                for k, bucket in enumerate(buckets):
                    payload = {
                        "serialized_named_tensors": serialize_per_rank(bucket, s.tp_size),
                        "load_format": None,
                        "flush_cache": config.pause_mode != "in_place" and k == len(buckets) - 1,
                        "weight_version": str(version),
                    }
                    await self._post(s.url, "/update_weights_from_tensor", payload, retries=0)
                loaded.add(s.url)
            except Exception as exc:  # noqa: BLE001
                failures[s.url] = str(exc) + hint
            finally:
                if session:
                    try:
                        await self._end(s)
                    except Exception as exc:  # noqa: BLE001
                        failures[s.url] = f"{failures.get(s.url, '')} /end_weight_update: {exc}".strip()

        await asyncio.gather(*(one(s) for s in states))

    def drop_group(self) -> None:
        """Destroy this process's side of the weight-update group after a failed distributed sync.

        A failed collective leaves the group unusable: with a server dead, every later broadcast fails (gloo:
        "Connection closed by peer"), and a restarted server has no group (it answers 400 "Group ... not in []").
        The next sync builds a new group with ``/init_weights_update_group`` on every server; SGLang replaces a
        group of the same name (``init_weights_update_group`` in
        ``sglang/srt/model_executor/model_runner_components/weight_updater.py`` assigns
        ``_model_update_group[group_name]``), and the old one is destroyed on the servers first (`ensure_group`).
        """
        group, self.group = self.group, None
        if group is None:
            return
        self._stale_group = True
        try:
            destroy_weight_update_group(group)
        except Exception as exc:  # noqa: BLE001 - the group is broken already; a new one replaces it
            logger.warning("destroying the failed weight-update group: %s", exc)

    async def ensure_group(self, states: list[ServerState]) -> None:
        if self.group is not None:
            return
        config = self.config
        if self._stale_group:  # after `drop_group`: servers that survived still hold the old group
            self._stale_group = False
            answers = await asyncio.gather(
                *(
                    self._post(s.url, "/destroy_weights_update_group", {"group_name": config.group_name}, retries=0)
                    for s in states
                ),
                return_exceptions=True,
            )
            for s, answer in zip(states, answers):
                if isinstance(answer, BaseException):  # a restarted server has none: "does not exist"
                    logger.info("%s: old weight-update group not destroyed: %s", s.url, answer)
        world_size = 1 + sum(s.tp_size for s in states)
        port = config.dist_master_port or free_port("")
        offsets, offset = [], 1
        for s in states:
            offsets.append(offset)
            offset += s.tp_size
        joined = _in_daemon_thread(
            init_weight_update_group,
            backend=self.dist_backend,
            master_address=config.dist_master_address,
            master_port=port,
            world_size=world_size,
            rank=0,
            group_name=config.group_name,
            timeout=timedelta(seconds=config.dist_timeout_s),
        )
        join = asyncio.wrap_future(joined)
        posts = {
            asyncio.ensure_future(
                self._post(
                    s.url,
                    "/init_weights_update_group",
                    {
                        "master_address": config.dist_master_address,
                        "master_port": port,
                        "rank_offset": off,
                        "world_size": world_size,
                        "group_name": config.group_name,
                        "backend": self.dist_backend,
                    },
                    retries=0,
                )
            ): s.url
            for s, off in zip(states, offsets)
        }
        # A server that answers with an error never joins, so this process's side would wait for it until
        # `dist_timeout_s`: the first failure ends the wait. The join runs on in its thread until that timeout (a
        # blocked rendezvous cannot be interrupted); a group it still forms is destroyed then.
        pending = {join, *posts}
        failure = None
        while pending and failure is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None and failure is None:
                    where = posts.get(task, "this process's side of the group")
                    failure = f"{where}: {task.exception()}"
        if failure is not None:
            for task in pending:
                task.cancel()  # the join's wrapper too: its thread runs on, and `_destroy_joined_group` ends it
            joined.add_done_callback(_destroy_joined_group)
            self._stale_group = True  # servers that joined may hold the group: destroyed before the next one
            raise WeightSyncError(f"init_weights_update_group failed: {failure}")
        self.group = join.result()

    async def _sync_distributed(self, states, named, version, loaded, failures) -> None:
        """NCCL broadcast from this process (rank 0) to every server rank, one flattened bucket per call.

        Every server must join every broadcast (a collective), so the session is opened on all servers before
        the first broadcast: a server that refuses ``/begin_weight_update`` fails the step *before* anyone waits
        in a collective (without an open update, SGLang 0.5.23 answers 400 and never joins, and the broadcast would hang).
        """
        import torch.distributed as dist

        config = self.config
        await self.ensure_group(states)
        sessions = []
        done = False
        try:
            for s in states:
                if await self._begin(s):
                    sessions.append(s)
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if self.dist_backend == "nccl"
                else torch.device("cpu")
            )
            buckets = plan_buckets(named, config.bucket_bytes)
            for k, bucket in enumerate(buckets):
                flat, meta = flatten_bucket(bucket, device=device)
                payload = {
                    "names": [m.name for m in meta],
                    "dtypes": [str(m.dtype).removeprefix("torch.") for m in meta],
                    "shapes": [list(m.shape) for m in meta],
                    "group_name": config.group_name,
                    "flush_cache": config.pause_mode != "in_place" and k == len(buckets) - 1,
                    "weight_version": str(version),
                    "load_format": "flattened_bucket",
                }

                def broadcast(flat=flat) -> None:
                    dist.broadcast(flat, src=0, group=self.group)

                results = await asyncio.gather(
                    asyncio.to_thread(broadcast),
                    *(self._post(s.url, "/update_weights_from_distributed", payload, retries=0) for s in states),
                    return_exceptions=True,
                )
                bad = {s.url: r for s, r in zip(states, results[1:]) if isinstance(r, BaseException)}
                if isinstance(results[0], BaseException):
                    bad["(broadcast)"] = results[0]
                if bad:
                    for url, exc in bad.items():
                        failures[url] = f"bucket {k + 1}/{len(buckets)}: {exc}"
                    return
            loaded.update(s.url for s in states)
            done = True
        finally:
            for s in sessions:
                try:
                    await self._end(s)
                except Exception as exc:  # noqa: BLE001
                    failures[s.url] = f"{failures.get(s.url, '')} /end_weight_update: {exc}".strip()
            if not done:  # a failed collective (or a server gone before it) leaves the group unusable
                self.drop_group()

    async def _load_lora(self, states, adapter, version, loaded, failures) -> None:
        """Load the adapter under a new name (``<lora_name>-v<version>``), then unload the previous one.

        An adapter's name is recorded before its load is requested, so that an adapter whose load failed or whose
        answer was cut off (it may be loaded all the same) is unloaded by the next sync: a server holds at most the
        served adapter and the one being loaded. Requests name the adapter with ``lora_path``
        (``GenerateReqInput.lora_path``); the engine switches to the new name once every server loaded it.
        ``disk`` mode writes ``adapter_model.safetensors`` + ``adapter_config.json`` and calls
        ``/load_lora_adapter``; ``tensor`` mode sends the tensors per TP rank to ``/load_lora_adapter_from_tensors``
        (CUDA IPC: same node). SGLang has no NCCL path for adapters.
        """
        config = self.config
        name = f"{config.lora_name}-v{version}"
        if config.mode == "distributed":
            raise WeightSyncError(
                "LoRA sync supports weight sync mode 'disk' or 'tensor' (SGLang loads adapters "
                "from a path or from tensors, not over NCCL)"
            )
        for s in states:
            if not s.enable_lora:
                raise WeightSyncError(
                    f"{s.url} was not launched with --enable-lora; LoRA sync needs it "
                    "(--enable-lora --max-lora-rank R --lora-target-modules ...)"
                )
        if config.mode == "disk":
            out_dir = self.weights_dir() / name
            await asyncio.to_thread(write_adapter, out_dir, adapter)
            payload_for = lambda s: {"lora_name": name, "lora_path": str(out_dir)}  # noqa: E731
            path = "/load_lora_adapter"
        else:
            tensors = dict(on_cuda_for_ipc(adapter.named_tensors))
            payload_for = lambda s: {  # noqa: E731
                "lora_name": name,
                "config_dict": adapter.config_dict,
                "serialized_named_tensors": serialize_per_rank(tensors, s.tp_size),
            }
            path = "/load_lora_adapter_from_tensors"

        async def one(s: ServerState) -> None:
            requested = self._requested_adapters.setdefault(s.url, set())
            served = self._served_adapters.get(s.url)
            try:
                for leftover in sorted(requested - {served}):  # a failed or cut load may have left it loaded
                    await self._unload(s.url, leftover, requested)
                requested.add(name)  # before the request: its answer may never arrive
                answer = await self._post(s.url, path, payload_for(s), retries=0)
                listed = (answer or {}).get("loaded_adapters") if isinstance(answer, dict) else None
                if isinstance(listed, dict) and name not in listed:
                    raise WeightSyncError(
                        f"{s.url}{path} answered success but does not list {name!r}: {sorted(listed)}"
                    )
                self._served_adapters[s.url] = name
                # the adapter carries no version of its own: tag the server so /model_info and meta_info agree
                await self._post(
                    s.url, "/update_weight_version", {"new_version": str(version), "abort_all_requests": False}
                )
                loaded.add(s.url)
                if served and served != name:
                    try:
                        await self._unload(s.url, served, requested)
                    except Exception as exc:  # noqa: BLE001 - the new adapter serves; the old one is retried next sync
                        logger.warning("%s: could not unload adapter %s: %s", s.url, served, exc)
            except Exception as exc:  # noqa: BLE001
                failures[s.url] = str(exc)

        await asyncio.gather(*(one(s) for s in states))
        if not failures:
            self.served_adapter = name

    async def _unload(self, url: str, name: str, requested: set[str]) -> None:
        """``/unload_lora_adapter``; a 400 (SGLang's answer for a name it does not hold) counts as unloaded."""
        try:
            await self._post(url, "/unload_lora_adapter", {"lora_name": name})
        except Exception as exc:  # noqa: BLE001
            if "HTTP 400" not in str(exc):
                raise
        requested.discard(name)

    # -------------------------------------------------------------- teardown

    async def close(self) -> None:
        # a sync interrupted between its pause and its continue (Ctrl-C) must not leave a server paused
        for url in sorted(self.paused_urls):
            try:
                await self._post(url, "/continue_generation", {}, retries=0)
                self.paused_urls.discard(url)
            except Exception as exc:  # noqa: BLE001 - reported; the other servers are continued all the same
                logger.warning("%s/continue_generation at close: %s", url, exc)
        # an adapter whose load was interrupted (Ctrl-C) or cut off may be loaded all the same: unload it, so the
        # server holds only the adapter it serves
        for url, requested in sorted(self._requested_adapters.items()):
            for name in sorted(requested - {self._served_adapters.get(url)}):
                try:
                    await self._unload(url, name, requested)
                except Exception as exc:  # noqa: BLE001 - reported; the other servers are released all the same
                    logger.warning("%s: could not unload adapter %s at close: %s", url, name, exc)
        if self.group is not None:
            answers = await asyncio.gather(
                *(
                    self._post(u, "/destroy_weights_update_group", {"group_name": self.config.group_name}, retries=0)
                    for u in self.client.base_urls
                ),
                return_exceptions=True,
            )
            for url, answer in zip(self.client.base_urls, answers):
                if isinstance(answer, BaseException):
                    logger.warning("%s/destroy_weights_update_group: %s", url, answer)
            destroy_weight_update_group(self.group)
            self.group = None
        if self._own_weight_dir and self._weight_dir is not None:
            import shutil

            shutil.rmtree(self._weight_dir, ignore_errors=True)
            self._weight_dir = None
