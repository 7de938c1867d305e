"""A test double of SGLang's HTTP server, backed by an `EmbeddedEngine` (CPU, no sglang install).

It lives under ``tests/`` because it is a test double, not part of the library: the client (`SGLangEngine`)
and the trainer are tested end to end against it (real sockets, real JSON, real weight loading), and it follows
the semantics of SGLang's own server where the client depends on them, read from the source of sglang 0.5.17 and
0.5.23 (``sglang/srt/entrypoints/http_server.py``, ``managers/io_struct.py``,
``managers/scheduler_components/weight_updater.py``, ``models/gpt_oss.py``):

- only routes SGLang has; ``/begin_weight_update`` and ``/end_weight_update`` only when emulating 0.5.23 (404
  on 0.5.17), and then ``/update_weights_from_tensor`` and ``/update_weights_from_distributed`` answer 400
  outside a session (the distributed one *without joining the broadcast*);
- ``serialized_named_tensors`` holds one payload per TP rank; rank ``r`` deserializes ``payloads[r]`` only;
- tensor names the model does not know are skipped and the update still succeeds (``load_weights`` of
  SGLang's models); ``skipped_names`` records them; with ``stale_weights=True`` every update answers success and
  takes the requested ``weight_version`` but keeps the weights it had (a stale server); with a callable, the names
  for which it returns True are accepted and not loaded (a half-loading server);
- ``/weights_checker`` ``checksum`` hashes the parameters under SGLang's own names for GPT-OSS (``qkv_proj`` fused
  from q/k/v, ``experts.w13_weight`` / ``experts.w2_weight``), as ``WeightChecker`` lists a real server's;
- ``/pause_generation``: ``abort`` aborts the running batch, every mode holds new requests until
  ``/continue_generation``; an update with ``flush_cache=True`` while a request is in the running batch under
  ``in_place`` loads the weights and answers 400 "Weights were updated, but the cache was not flushed" with the
  reported version unchanged (0.5.23), or 500 (0.5.17 asserts);
- ``meta_info.cached_tokens``: a radix-cache stand-in (longest prefix shared with an earlier request);
- LoRA: ``/load_lora_adapter`` (a directory), ``/load_lora_adapter_from_tensors``, ``/unload_lora_adapter``,
  ``lora_path`` per request; the active adapter is merged into the served weights (``W + B A * alpha / r``).

``validator(method, path, body) -> list[str]`` (e.g. SGLang's own request schemas, `sglang_schema`) turns each
problem into a 400 and a record in ``schema_violations``. Faults can be injected per request (`Fault`); a server
in its own process can also be told to die (``--die-on PATH:N``: SIGKILL itself when the N-th request to PATH
arrives, e.g. in the middle of a distributed weight sync, as a crashed SGLang process does).

Run standalone: ``python tests/fake_sglang_server.py --model-path DIR --port 30000``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import signal
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from trl_ext.rollout.embedded import EmbeddedEngine
from trl_ext.rollout.types import GenerationOutput, SamplingParams

# SGLang's `SamplingParams` fields: anything else is rejected with 400, as SGLang's server does.
SGLANG_SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "stop_regex",
        "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n", "ignore_eos",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "json_schema",
        "regex", "ebnf", "structural_tag", "custom_params", "sampling_seed", "stream_interval", "logit_bias",
    }
)  # fmt: skip
# Keys whose non-default values this server cannot honour: refuse rather than silently ignore.
_UNSUPPORTED_DEFAULTS = {
    "n": 1, "ignore_eos": False, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "stop": None, "stop_regex": None, "logit_bias": None, "custom_params": None,
    "min_new_tokens": 0,
}  # fmt: skip
_PENALTIES = ("min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


@dataclass
class Fault:
    """One injected fault, consumed by the next request to ``path``.

    kind: ``"status"`` (reply ``status`` with an error body), ``"delay"`` (sleep ``delay_s`` while counted as a
    running request, then answer normally), ``"trickle"`` (send a valid ``/generate`` answer at once, but one
    byte every ``delay_s``: each read is quick, the whole body is not),
    ``"abort"`` (generate, then report ``finish_reason`` abort with the partial output), ``"drop_logprob"``
    (one log-prob fewer than output ids), ``"disconnect"`` (close the connection without answering),
    ``"refuse"`` (a weight-update route answers ``success: false``), ``"cut"`` (handle the request, then send only
    half of the answer's body and close: the work is done, the client never sees the answer);
    contract breakers of ``/generate``: ``"extra_output_ids"`` (twice ``max_new_tokens`` output ids),
    ``"foreign_rid"`` (``meta_info.id`` of another request), ``"wrong_prompt_tokens"`` (one prompt token more than
    sent); ``"zero_routing"`` (``meta_info.routed_experts`` all zeros).
    """

    kind: str
    status: int = 500
    delay_s: float = 0.0
    path: str = "/generate"


class _HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class FakeSGLangServer:
    """SGLang's native HTTP API over an `EmbeddedEngine`, on a background thread.

    >>> server = FakeSGLangServer(EmbeddedEngine(model)).start()
    >>> engine = SGLangEngine(server.url)
    >>> server.stop()
    """

    def __init__(
        self,
        engine: EmbeddedEngine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_path: str = "embedded",
        request_timeout_s: float = 600.0,
        version: str = "0.5.23",
        tp_size: int = 1,
        enable_lora: bool = False,
        validator=None,
        die_on: tuple[str, int] | None = None,
        stale_weights: bool | Callable[[str], bool] = False,
        deterministic_inference: bool = True,
        return_routed_experts: bool = False,
        moe_runner_backend: str = "triton",
        max_lora_rank: int | None = None,
        lora_target_modules: list[str] | None = None,
    ) -> None:
        if version not in ("0.5.17", "0.5.23"):
            raise ValueError(f"version must be '0.5.17' or '0.5.23', got {version!r}")
        self.engine = engine
        self.host = host
        self.port = port
        self.model_path = model_path
        self.request_timeout_s = request_timeout_s
        self.version = version
        self.tp_size = int(tp_size)
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank  # reported in /server_info, as SGLang's --max-lora-rank
        self.lora_target_modules = lora_target_modules
        self.validator = validator
        self.die_on = die_on  # (path, n): SIGKILL this process when the n-th request to path arrives
        self.stale_weights = stale_weights
        # reported as `enable_deterministic_inference`; requests with a sampling_seed are reproducible either way
        self.deterministic_inference = deterministic_inference
        # --enable-return-routed-experts: the engine's own routing, in SGLang's encoding; the triton_kernel runner
        # records nothing, so its answers hold zeros, as SGLang's do
        if return_routed_experts and getattr(engine, "_recorder", None) is None:
            raise ValueError("return_routed_experts needs an EmbeddedEngine(..., record_routing=True)")
        self.return_routed_experts = return_routed_experts
        self.moe_runner_backend = moe_runner_backend
        self.faults: deque[Fault] = deque()
        self.request_counts: dict[str, int] = {}
        self.requests: list[tuple[str, str, object]] = []
        self.schema_violations: list[str] = []
        self.skipped_names: list[str] = []
        self.last_generate_payload: dict | None = None
        self.served_version = "default" if engine.weight_version is None else str(engine.weight_version)
        self._lock = threading.Lock()
        self._running_reqs = 0  # requests in the running batch
        self._running = threading.Event()
        self._running.set()  # cleared while paused
        self._pause_mode: str | None = None
        self._session = False
        self._groups: dict[str, object] = {}
        self._radix: list[list[int]] = []
        self._base_state: dict[str, torch.Tensor] | None = None  # weights without the LoRA adapter
        self._adapters: dict[str, tuple[dict, dict]] = {}  # name -> (config, tensors)
        self._active_adapter: str | None = None
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FakeSGLangServer:
        server = self

        class Handler(_Handler):
            owner = server

        class HTTPServer(ThreadingHTTPServer):
            allow_reuse_address = True
            daemon_threads = True

        self._httpd = HTTPServer((self.host, self.port), Handler)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="FakeSGLangServer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._running.set()

    def restart(self, down_s: float) -> threading.Thread:
        """Stop now and serve again on the same port after ``down_s`` (a background thread), as a restarted
        server does: the weights and version survive here, the radix cache and paused state do not."""
        self.stop()

        def later() -> None:
            time.sleep(down_s)
            self._radix.clear()
            self._pause_mode = None
            self.start()

        thread = threading.Thread(target=later, daemon=True)
        thread.start()
        return thread

    def __enter__(self) -> FakeSGLangServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def inject(self, *faults: Fault) -> None:
        """Queue faults; each is consumed by the next request to its path."""
        with self._lock:
            self.faults.extend(faults)

    def _take_fault(self, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.path == path:
                    self.faults.remove(fault)
                    return fault
        return None

    # ------------------------------------------------------------------ endpoints

    def routes(self) -> dict:
        routes = {
            ("GET", "/health"): lambda b: "",
            ("GET", "/health_generate"): self._health_generate,
            ("GET", "/model_info"): lambda b: {
                "model_path": self.model_path,
                "is_generation": True,
                "weight_version": self.served_version,
            },
            ("GET", "/server_info"): self._server_info,
            ("GET", "/get_server_info"): self._server_info,
            ("POST", "/generate"): self._generate,
            ("GET", "/flush_cache"): self._flush_cache,
            ("POST", "/flush_cache"): self._flush_cache,
            ("POST", "/pause_generation"): self._pause,
            ("POST", "/continue_generation"): self._continue,
            ("POST", "/update_weights_from_disk"): self._update_from_disk,
            ("POST", "/init_weights_update_group"): self._init_group,
            ("POST", "/update_weights_from_distributed"): self._update_from_distributed,
            ("POST", "/destroy_weights_update_group"): self._destroy_group,
            ("POST", "/update_weights_from_tensor"): self._update_from_tensor,
            ("POST", "/update_weight_version"): self._update_weight_version,
            ("POST", "/weights_checker"): self._weights_checker,
            ("POST", "/load_lora_adapter"): self._load_lora_from_path,
            ("POST", "/load_lora_adapter_from_tensors"): self._load_lora_from_tensors,
            ("POST", "/unload_lora_adapter"): self._unload_lora,
        }
        if self.version >= "0.5.23":
            routes[("POST", "/begin_weight_update")] = self._begin
            routes[("POST", "/end_weight_update")] = self._end
        return routes

    def handle(self, method: str, path: str, body, fault: Fault | None = None) -> object:
        route = self.routes().get((method, path))
        if route is None:
            raise _HTTPError(404, f"no route {method} {path}")
        if self.validator is not None:
            problems = self.validator(method, path, body)
            if problems:
                self.schema_violations.extend(problems)
                raise _HTTPError(400, "; ".join(problems))
        if fault is not None and fault.kind == "refuse":
            return {"success": False, "message": "injected refusal"}
        return self._generate(body, fault) if path == "/generate" else route(body)

    def _server_info(self, body) -> dict:
        return {
            "model_path": self.model_path,
            "tp_size": self.tp_size,
            "dp_size": 1,
            "version": self.version,
            "enable_lora": self.enable_lora,
            "max_lora_rank": self.max_lora_rank,
            "lora_target_modules": self.lora_target_modules,
            "enable_deterministic_inference": self.deterministic_inference,
            "enable_return_routed_experts": self.return_routed_experts,
            "moe_runner_backend": self.moe_runner_backend,
            "weight_version": self.served_version,
            "dtype": str(next(self.engine.model.parameters()).dtype).removeprefix("torch."),
        }

    def _health_generate(self, body) -> str:
        self.engine.submit([0], SamplingParams(max_new_tokens=1)).result(timeout=self.request_timeout_s)
        return ""

    def _generate(self, body: dict, fault: Fault | None = None) -> object:
        self.last_generate_payload = body
        if body.get("text") is not None or "input_ids" not in body:
            raise _HTTPError(400, "this server accepts token ids only: send `input_ids`")
        if body.get("stream"):
            raise _HTTPError(400, "streaming is not supported by the fake server")
        lora = body.get("lora_path")
        if lora is not None and lora not in self._adapters:
            raise _HTTPError(400, f"LoRA adapter {lora!r} is not loaded (loaded: {sorted(self._adapters)})")
        if lora != self._active_adapter:  # SGLang batches adapters per request; this double serves one at a time
            raise _HTTPError(400, f"the fake server serves only {self._active_adapter!r} now, not {lora!r}")
        sampling = self._parse_sampling(body.get("sampling_params") or {})
        input_ids = body["input_ids"]
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
        return_logprob = bool(body.get("return_logprob", False))
        start_len = int(body.get("logprob_start_len", -1) if body.get("logprob_start_len") is not None else -1)
        rids = body.get("rid")
        rids = rids if isinstance(rids, list) else [rids] * len(prompts)

        if not self._running.wait(timeout=self.request_timeout_s):
            raise _HTTPError(503, "generation paused for too long")
        start = time.perf_counter()
        with self._lock:
            self._running_reqs += 1
        try:
            if fault is not None and fault.kind == "delay":
                time.sleep(fault.delay_s)
            futures = [self.engine.submit(p, sampling) for p in prompts]
            outs: list[GenerationOutput] = [f.result(timeout=self.request_timeout_s) for f in futures]
        except (TypeError, ValueError) as exc:
            raise _HTTPError(400, str(exc)) from exc
        finally:
            with self._lock:
                self._running_reqs -= 1
        items = []
        for prompt, out, rid in zip(prompts, outs, rids):
            ids, logprobs, reason = list(out.output_ids), list(out.logprobs), out.finish_reason
            if fault is not None and fault.kind == "abort":
                ids, logprobs, reason = ids[: len(ids) // 2], logprobs[: len(ids) // 2], "abort"
            if reason == "stop":
                finish = {"type": "stop", "matched": ids[-1]}
            elif reason == "length":
                finish = {"type": "length", "length": len(ids)}
            else:
                finish = {"type": "abort", "message": "request aborted"}
            if fault is not None and fault.kind == "drop_logprob" and logprobs:
                logprobs = logprobs[:-1]
            if fault is not None and fault.kind == "extra_output_ids":
                extra = 2 * sampling.max_new_tokens - len(ids)
                ids, logprobs = ids + [ids[-1]] * extra, logprobs + [logprobs[-1]] * extra
            cached = self._cached_prefix(prompt)
            self._radix.append(list(prompt) + ids)
            meta = {
                "id": uuid.uuid4().hex
                if fault is not None and fault.kind == "foreign_rid"
                else rid or uuid.uuid4().hex,
                "prompt_tokens": len(prompt) + (fault is not None and fault.kind == "wrong_prompt_tokens"),
                "completion_tokens": len(ids),
                "cached_tokens": cached,
                "finish_reason": finish,
                "weight_version": self.served_version,
                "e2e_latency": time.perf_counter() - start,
            }
            if body.get("return_routed_experts") and self.return_routed_experts and out.routed_experts is not None:
                routing = out.routed_experts.to(torch.int32)[int(body.get("routed_experts_start_len") or 0) :]
                if self.moe_runner_backend == "triton_kernel" or (fault is not None and fault.kind == "zero_routing"):
                    routing = torch.zeros_like(routing)
                meta["routed_experts"] = base64.b64encode(routing.numpy().tobytes()).decode()
            if return_logprob:
                meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(logprobs, ids)]
                if start_len >= 0:
                    meta["input_token_logprobs"] = self._input_logprobs(prompt, start_len)
            items.append({"text": "", "output_ids": ids, "meta_info": meta})
        return items if batched else items[0]

    def _cached_prefix(self, prompt: list[int]) -> int:
        best = 0
        for seq in self._radix:
            n = 0
            for a, b in zip(seq, prompt[:-1]):  # SGLang always recomputes at least the last prompt token
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    def _input_logprobs(self, prompt: list[int], start_len: int) -> list:
        ids = torch.tensor([prompt])
        with self.engine._model_lock, torch.no_grad():
            logits = self.engine.model(input_ids=ids).logits[0].float()
        lps = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
        entries = [[None, prompt[0], None]] + [[lp, tok, None] for lp, tok in zip(lps, prompt[1:])]
        return entries[start_len:]

    @staticmethod
    def _parse_sampling(params: dict) -> SamplingParams:
        unknown = set(params) - SGLANG_SAMPLING_KEYS
        if unknown:
            raise _HTTPError(400, f"sampling_params: unknown keys {sorted(unknown)}")
        for key, default in _UNSUPPORTED_DEFAULTS.items():
            if key in params and params[key] not in (default, [] if default is None else default):
                raise _HTTPError(400, f"sampling_params.{key}={params[key]!r} is not supported by the fake server")
        try:
            return SamplingParams(
                max_new_tokens=int(params.get("max_new_tokens", 128)),
                temperature=float(params.get("temperature", 1.0)),
                top_p=float(params.get("top_p", 1.0)),
                top_k=int(params.get("top_k", -1)),
                stop_token_ids=tuple(params.get("stop_token_ids") or ()),
                sampling_seed=params.get("sampling_seed"),
                **{k: float(params[k]) for k in _PENALTIES if k in params},
            )
        except (TypeError, ValueError) as exc:
            raise _HTTPError(400, f"sampling_params: {exc}") from exc

    def _can_flush(self) -> bool:
        # `Scheduler.flush_cache`: idle except the waiting queue while paused; `retract`/`abort` empty the running
        # batch, `in_place` keeps it
        with self._lock:
            running = self._running_reqs
        return running == 0 or self._pause_mode in ("retract", "abort")

    def _flush_cache(self, body) -> str:
        if not self._can_flush():
            raise _HTTPError(400, "Flush cache failed.\n")
        self._radix.clear()
        return "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"

    def _pause(self, body: dict) -> dict:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise _HTTPError(400, f"Invalid mode: {mode!r}")
        self._running.clear()
        self._pause_mode = mode
        if mode == "abort":
            self.engine.abort_all()
        return {"message": "Generation paused successfully.", "status": "ok"}

    def _continue(self, body: dict) -> dict:
        self._pause_mode = None
        self._running.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def _begin(self, body: dict) -> dict:
        if self._session:
            raise _HTTPError(400, "a weight-update session is already open; call end_weight_update() first")
        self._session = True
        return {"success": True, "message": "Success"}

    def _end(self, body: dict) -> dict:
        if not self._session:
            raise _HTTPError(400, "no weight-update session is open; call begin_weight_update() first")
        self._session = False
        return {"success": True, "message": "Success"}

    def _require_session(self, what: str) -> None:
        if self.version >= "0.5.23" and not self._session:
            raise _HTTPError(400, f"{what} must run between begin_weight_update() and end_weight_update()")

    def _load(self, named: list[tuple[str, torch.Tensor]], body: dict) -> dict:
        state = self.engine.model.state_dict()
        known = [(n, t) for n, t in named if n in state]
        self.skipped_names += [n for n, _ in named if n not in state]  # SGLang's load_weights skips them
        if callable(self.stale_weights):  # a half-loading server: these names are accepted, and not loaded
            known = [(n, t) for n, t in known if not self.stale_weights(n)]
        try:
            if self.stale_weights is not True:
                self.engine.load_weights(known, version=self.engine.weight_version)
        except (KeyError, ValueError) as exc:
            raise _HTTPError(400, str(exc)) from exc
        if self._base_state is not None:  # new base weights: the adapter is merged on top of them
            self._base_state = {k: v.detach().clone() for k, v in self.engine.model.state_dict().items()}
            self._apply_adapter()
        if body.get("flush_cache", True) and not self._can_flush():
            if self.version < "0.5.23":
                raise _HTTPError(500, "AssertionError: Cache flush failed after updating weights")
            raise _HTTPError(
                400,
                "Weights were updated, but the cache was not flushed because requests are "
                "still running or queued. Retract or finish them, then call /flush_cache.",
            )
        if body.get("flush_cache", True):
            self._radix.clear()
        if body.get("weight_version") is not None:
            self.served_version = str(body["weight_version"])
        return {"success": True, "message": "Succeeded to update model weights."}

    def _update_from_disk(self, body: dict) -> dict:
        from safetensors.torch import load_file

        path = Path(body.get("model_path", ""))
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            raise _HTTPError(400, f"Failed to get weights iterator: no *.safetensors under {str(path)!r}")
        named = [item for f in files for item in load_file(str(f)).items()]
        out = self._load(named, body)
        out["num_paused_requests"] = 0
        return out

    def _init_group(self, body: dict) -> dict:
        from trl_ext.weight_sync.transport import init_weight_update_group

        if self.tp_size != 1:
            raise _HTTPError(400, "the fake server joins weight-update groups with tp_size=1 only")
        name = body.get("group_name", "weight_update_group")
        try:
            self._groups[name] = init_weight_update_group(
                backend=body.get("backend", "nccl"),
                master_address=body["master_address"],
                master_port=int(body["master_port"]),
                world_size=int(body["world_size"]),
                rank=int(body["rank_offset"]),
                group_name=name,
            )
        except Exception as exc:  # noqa: BLE001 - reported to the client like SGLang does
            raise _HTTPError(400, f"Failed to initialize custom process group: {exc}.") from exc
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def _update_from_distributed(self, body: dict) -> dict:
        import torch.distributed as dist

        from trl_ext.weight_sync.transport import BucketMetadata, unflatten_bucket

        self._require_session("update_weights_from_distributed")  # before joining: the sender would hang
        name = body.get("group_name", "weight_update_group")
        pg = self._groups.get(name)
        if pg is None:
            raise _HTTPError(
                400, f"Group {name} not in {list(self._groups)}. Please call `init_weights_update_group` first."
            )
        shapes, dtypes = body["shapes"], [getattr(torch, d) for d in body["dtypes"]]
        if body.get("load_format") == "flattened_bucket":
            meta, offset = [], 0
            for pname, dtype, shape in zip(body["names"], dtypes, shapes):
                size = int(torch.Size(shape).numel()) * dtype.itemsize
                if offset % dtype.itemsize:
                    raise _HTTPError(400, f"Unaligned received tensor {pname}: byte offset {offset}, dtype {dtype}")
                meta.append(BucketMetadata(pname, torch.Size(shape), dtype, offset, offset + size, size))
                offset += size
            flat = torch.empty(offset, dtype=torch.uint8)
            dist.broadcast(flat, src=0, group=pg)
            named = unflatten_bucket(flat, meta)
        else:
            named = []
            for pname, dtype, shape in zip(body["names"], dtypes, shapes):
                tensor = torch.empty(shape, dtype=dtype)
                dist.broadcast(tensor, src=0, group=pg)
                named.append((pname, tensor))
        return self._load(named, body)

    def _destroy_group(self, body: dict) -> dict:
        from trl_ext.weight_sync.transport import destroy_weight_update_group

        pg = self._groups.pop(body.get("group_name", "weight_update_group"), None)
        if pg is None:
            raise _HTTPError(400, "The group to be destroyed does not exist.")
        destroy_weight_update_group(pg)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def _deserialize_ranks(self, payloads) -> list:
        """Each simulated TP rank deserializes its own payload (``TpModelWorker.deserialize_own_rank``)."""
        from multiprocessing.reduction import ForkingPickler

        if not isinstance(payloads, list) or len(payloads) != self.tp_size:
            raise _HTTPError(
                400,
                f"serialized_named_tensors must hold one payload per TP rank ({self.tp_size}), "
                f"got {len(payloads) if isinstance(payloads, list) else type(payloads).__name__}",
            )
        out = []
        for payload in payloads:
            try:
                out.append(ForkingPickler.loads(base64.b64decode(payload, validate=True)))
            except Exception as exc:  # noqa: BLE001
                raise _HTTPError(400, f"cannot deserialize payload: {exc}") from exc
        return out

    def _update_from_tensor(self, body: dict) -> dict:
        self._require_session("update_weights_from_tensor")
        if body.get("load_format") not in (None, "direct"):
            raise _HTTPError(400, f"the fake server does not implement load_format={body.get('load_format')!r}")
        named = self._deserialize_ranks(body.get("serialized_named_tensors"))[0]
        if isinstance(named, dict):
            named = list(named.items())
        return self._load([(n, t) for n, t in named], body)

    def _update_weight_version(self, body: dict) -> dict:
        if body.get("abort_all_requests", True):
            self.engine.abort_all()
        self.served_version = str(body["new_version"])
        return {
            "success": True,
            "message": f"Weight version updated to {body['new_version']}",
            "new_version": body["new_version"],
        }

    def _weights_checker(self, body: dict) -> dict:
        if body.get("action", "checksum") != "checksum":
            raise _HTTPError(400, f"the fake server implements action='checksum' only, got {body.get('action')!r}")
        checksums = {
            name: hashlib.sha256(
                b"".join(t.detach().float().contiguous().numpy().tobytes() for t in parts)
            ).hexdigest()[:16]
            for name, parts in _sglang_parameters(self.engine.model.state_dict()).items()
        }
        overall = hashlib.sha256("".join(f"{k}{checksums[k]}" for k in sorted(checksums)).encode()).hexdigest()
        info = {
            "role": "target",
            "tp_rank": 0,
            "tp_size": 1,
            "dp_rank": 0,
            "dp_size": 1,
            "pp_rank": 0,
            "pp_size": 1,
            "rank": 0,
            "size": 1,
        }
        return {
            "success": True,
            "message": "",
            "ranks": [{"checksums": checksums, "per_gpu_checksum": overall, "parallelism_info": info}],
            "per_engine_checksum": hashlib.sha256(overall.encode()).hexdigest(),
        }

    # ------------------------------------------------------------------ LoRA

    def _lora_result(self, success: bool, error: str | None = None) -> dict:
        return {"success": success, "error_message": error, "loaded_adapters": {n: n for n in self._adapters}}

    def _add_adapter(self, name: str, config: dict, tensors: dict) -> dict:
        if not self.enable_lora:
            raise _HTTPError(400, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if name in self._adapters:
            raise _HTTPError(400, f"Failed to load LoRA adapter {name}: an adapter with that name is already loaded")
        self._adapters[name] = (config, tensors)
        if self._base_state is None:
            self._base_state = {k: v.detach().clone() for k, v in self.engine.model.state_dict().items()}
        self._active_adapter = name  # one adapter served at a time here; SGLang batches several
        self._apply_adapter()
        return self._lora_result(True)

    def _apply_adapter(self) -> None:
        """Served weights = base + B @ A * scaling of the active adapter (PEFT's merge)."""
        state = {k: v.clone() for k, v in self._base_state.items()}
        if self._active_adapter is not None:
            config, tensors = self._adapters[self._active_adapter]
            r = int(config["r"])
            scaling = config["lora_alpha"] / (r**0.5 if config.get("use_rslora") else r)
            for key, a in tensors.items():
                if ".lora_A." not in key:
                    continue
                module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
                b = tensors[key.replace(".lora_A.", ".lora_B.")]
                name = module + ".weight"
                if name not in state:
                    raise _HTTPError(400, f"LoRA target {module} is not a module of the model")
                state[name] = state[name] + (b.float() @ a.float() * scaling).to(state[name].dtype)
        with self.engine._model_lock, torch.no_grad():
            own = self.engine.model.state_dict()
            for k, v in state.items():
                own[k].copy_(v)

    def _load_lora_from_path(self, body: dict) -> dict:
        from safetensors.torch import load_file

        path = Path(body["lora_path"])
        try:
            config = json.loads((path / "adapter_config.json").read_text())
            tensors = load_file(str(path / "adapter_model.safetensors"))
        except OSError as exc:
            raise _HTTPError(400, f"Failed to load LoRA adapter {body['lora_name']}: {exc}") from exc
        return self._add_adapter(body["lora_name"], config, tensors)

    def _load_lora_from_tensors(self, body: dict) -> dict:
        tensors = self._deserialize_ranks(body.get("serialized_named_tensors"))[0]
        return self._add_adapter(body["lora_name"], body["config_dict"], dict(tensors))

    def _unload_lora(self, body: dict) -> dict:
        name = body["lora_name"]
        if name not in self._adapters:
            raise _HTTPError(400, f"LoRA adapter {name} is not loaded")
        del self._adapters[name]
        if self._active_adapter == name:
            self._active_adapter = None
            self._apply_adapter()
        return self._lora_result(True)


def _sglang_parameters(state: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """A GPT-OSS state dict grouped as SGLang's model holds it: ``self_attn.qkv_proj`` = q, k, v (weight and bias)
    concatenated, ``mlp.experts.w13_weight`` / ``w2_weight`` (+ ``_bias``) for the experts' ``gate_up_proj`` /
    ``down_proj`` (``GptOssForCausalLM.load_weights``, sglang 0.5.23); other names as they are."""
    params: dict[str, list[torch.Tensor]] = {}
    for name, tensor in state.items():
        target = name
        for shard in ("q_proj", "k_proj", "v_proj"):
            if f"self_attn.{shard}." in name:
                target = name.replace(shard, "qkv_proj")
        for ckpt, param in (("experts.gate_up_proj", "experts.w13_weight"), ("experts.down_proj", "experts.w2_weight")):
            if ckpt in name:
                target = name.replace(ckpt, param)
        params.setdefault(target, []).append(tensor)
    return params


class _Handler(BaseHTTPRequestHandler):
    owner: FakeSGLangServer
    protocol_version = "HTTP/1.0"  # one request per connection: `stop()` leaves no live keep-alive socket

    def log_message(self, format, *args):  # quiet
        pass

    def _dispatch(self, method: str) -> None:
        owner = self.owner
        path = self.path.split("?", 1)[0]
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        with owner._lock:
            owner.request_counts[path] = owner.request_counts.get(path, 0) + 1
            count = owner.request_counts[path]
        if owner.die_on is not None and owner.die_on == (path, count):
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no answer, no cleanup, sockets reset by the kernel
        fault = owner._take_fault(path)
        if fault is not None and fault.kind == "disconnect":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault is not None and fault.kind == "status":
            return self._send(fault.status, {"error": {"message": f"injected fault {fault.status}"}})
        if fault is not None and fault.kind == "trickle":  # a valid answer, one byte every delay_s
            canned = {
                "text": "",
                "output_ids": [1],
                "meta_info": {
                    "finish_reason": {"type": "length", "length": 1},
                    "output_token_logprobs": [[-0.5, 1, None]],
                    "weight_version": owner.served_version,
                    "prompt_tokens": 1,
                    "cached_tokens": 0,
                    "pad": "x" * 200,
                },
            }
            return self._send(200, canned, trickle_s=fault.delay_s)
        try:
            body = json.loads(raw) if raw else {}
            with owner._lock:
                owner.requests.append((method, path, body))
            result = owner.handle(method, path, body, fault)
        except json.JSONDecodeError as exc:
            return self._send(400, {"error": {"message": f"invalid JSON: {exc}"}})
        except _HTTPError as exc:
            return self._send(exc.status, {"error": {"message": exc.message}, "success": False, "message": exc.message})
        except Exception as exc:  # noqa: BLE001 - a server bug is a 500, like SGLang's
            return self._send(500, {"error": {"message": f"{type(exc).__name__}: {exc}"}})
        status = 400 if isinstance(result, dict) and result.get("success") is False else 200
        if fault is not None and fault.kind == "cut":
            return self._send(status, result, cut=True)
        self._send(status, result)

    def _send(self, status: int, payload: object, trickle_s: float = 0.0, cut: bool = False) -> None:
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if cut:  # half the body, then close: the client's read fails mid-answer
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
            elif trickle_s:
                for i in range(len(data)):
                    self.wfile.write(data[i : i + 1])
                    self.wfile.flush()
                    time.sleep(trickle_s)
            else:
                self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout): nothing to answer

    def do_GET(self):  # noqa: N802
        self._dispatch("GET")

    def do_POST(self):  # noqa: N802
        self._dispatch("POST")


SGLangProtocolServer = FakeSGLangServer  # former name


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="SGLang-native HTTP API over a transformers model (tests, CPU)")
    parser.add_argument("--model-path", required=True, help="local transformers model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=None)
    # sglang.launch_server flags a client sends; the others are refused by argparse, as SGLang refuses unknown ones
    parser.add_argument("--skip-tokenizer-init", action="store_true", help="accepted: this server takes ids only")
    parser.add_argument("--mem-fraction-static", type=float, default=None, help="accepted: no GPU memory here")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="served dtype")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument(
        "--drop-sinks",
        action="store_true",
        help="fault: serve GPT-OSS attention without the sink column (a server that ignores the sinks)",
    )
    parser.add_argument(
        "--stale-weights",
        action="store_true",
        help="fault: answer every weight update with success and keep the weights it has",
    )
    parser.add_argument("--enable-return-routed-experts", action="store_true", help="answer with routed experts")
    parser.add_argument("--moe-runner-backend", default="triton", help="triton_kernel: routed experts are zeros")
    parser.add_argument("--attention-backend", default=None, help="accepted: eager attention here")
    parser.add_argument("--sampling-backend", default=None, help="accepted: torch sampling here")
    parser.add_argument("--grammar-backend", default=None, help="accepted: no grammar here")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="accepted: no CUDA graphs here")
    parser.add_argument("--weight-version", default=None, help="the version reported before the first sync")
    parser.add_argument("--tp-size", type=int, default=1, help="reported in /server_info")
    parser.add_argument(
        "--enable-deterministic-inference", action="store_true", help="reported; seeded requests are reproducible"
    )
    parser.add_argument("--max-lora-rank", type=int, default=None, help="reported in /server_info")
    parser.add_argument("--lora-target-modules", nargs="+", default=None, help="reported in /server_info")
    parser.add_argument(
        "--die-on",
        metavar="PATH:N",
        default=None,
        help="SIGKILL this process when the N-th request to PATH arrives (fault injection for tests)",
    )
    args = parser.parse_args(argv)
    die_on = None
    if args.die_on is not None:
        path, _, n = args.die_on.rpartition(":")
        if not path.startswith("/") or not n.isdigit() or int(n) < 1:
            parser.error(f"--die-on must be PATH:N with PATH starting with / and N >= 1, got {args.die_on!r}")
        die_on = (path, int(n))

    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype)
    if args.drop_sinks:
        from hf_gptoss_rl.attention_variants import register_sink_dropping_attention

        model.set_attn_implementation(register_sink_dropping_attention())
    engine = EmbeddedEngine(
        model,
        max_batch_size=args.max_batch_size,
        seed=args.seed,
        initial_version=None,
        record_routing=args.enable_return_routed_experts,
    )
    server = FakeSGLangServer(
        engine,
        host=args.host,
        port=args.port,
        model_path=args.model_path,
        die_on=die_on,
        enable_lora=args.enable_lora,
        stale_weights=args.stale_weights,
        return_routed_experts=args.enable_return_routed_experts,
        moe_runner_backend=args.moe_runner_backend,
        tp_size=args.tp_size,
        deterministic_inference=args.enable_deterministic_inference,
        max_lora_rank=args.max_lora_rank,
        lora_target_modules=args.lora_target_modules,
    )
    if args.weight_version is not None:
        server.served_version = args.weight_version
    server.start()
    print(f"serving {args.model_path} at {server.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()
        engine.shutdown()


if __name__ == "__main__":
    main()
