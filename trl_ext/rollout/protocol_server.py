"""A local HTTP server that speaks SGLang's native API, backed by an `EmbeddedEngine`.

It exists so the SGLang client (`SGLangEngine`) and the trainer can be tested end to end without a GPU or
an SGLang install: real sockets, real JSON, real weight loading. Implemented endpoints (SGLang 0.5.x names
and payloads, FACTS §9):

- ``GET /health``, ``/health_generate``, ``/model_info``, ``/server_info`` (alias ``/get_server_info``),
  ``/get_weight_version``;
- ``POST /generate`` with ``input_ids`` (one prompt or a list), ``sampling_params`` (unknown keys are
  rejected like SGLang does; unsupported features such as penalties or ``n > 1`` are refused with 400),
  ``return_logprob``, ``logprob_start_len``, ``rid``;
- ``POST /flush_cache`` (400 while requests run, as SGLang), ``/pause_generation`` (``mode``: ``abort``
  aborts the running batch, every mode holds new requests until ``/continue_generation``);
- ``POST /update_weights_from_disk`` (safetensors files of a directory), ``/init_weights_update_group`` +
  ``/update_weights_from_distributed`` (+ ``/destroy_weights_update_group``), ``/update_weights_from_tensor``
  (ForkingPickler payloads, base64, one per TP rank).

Faults can be injected per request (`Fault`): an HTTP status, a delay (client timeouts), an ``abort``
finish reason, a dropped log-prob (ids/log-probs length mismatch), or a closed connection.

Run standalone: ``python -m trl_ext.rollout.protocol_server --model-path DIR --port 30000``.
"""

from __future__ import annotations

import argparse
import base64
import json
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from .embedded import EmbeddedEngine
from .types import GenerationOutput, SamplingParams

# SGLang's `SamplingParams` fields: anything else is rejected with 400, as SGLang's server does.
SGLANG_SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "stop_regex",
        "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n", "ignore_eos",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "json_schema",
        "regex", "ebnf", "structural_tag", "custom_params", "sampling_seed", "stream_interval", "logit_bias",
    }
)
# Keys whose non-default values this server cannot honour: refuse rather than silently ignore.
_UNSUPPORTED_DEFAULTS = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "n": 1, "ignore_eos": False, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "stop": None, "stop_regex": None, "logit_bias": None, "custom_params": None,
}


@dataclass
class Fault:
    """One injected fault, consumed by the next request to ``path``.

    kind: ``"status"`` (reply ``status`` with an error body), ``"delay"`` (sleep ``delay_s`` then answer
    normally: exercises client timeouts), ``"abort"`` (generate, then report ``finish_reason`` abort with
    the partial output), ``"drop_logprob"`` (one log-prob fewer than output ids), ``"disconnect"`` (close the
    connection without answering).
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


class SGLangProtocolServer:
    """SGLang-native HTTP API over an `EmbeddedEngine`, on a background thread.

    >>> server = SGLangProtocolServer(EmbeddedEngine(model)).start()
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
    ) -> None:
        self.engine = engine
        self.host = host
        self.port = port
        self.model_path = model_path
        self.request_timeout_s = request_timeout_s
        self.faults: deque[Fault] = deque()
        self.request_counts: dict[str, int] = {}
        self.last_generate_payload: dict | None = None
        self._lock = threading.Lock()
        self._inflight = 0
        self._running = threading.Event()
        self._running.set()  # cleared while paused
        self._groups: dict[str, object] = {}
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "SGLangProtocolServer":
        server = self

        class Handler(_Handler):
            owner = server

        self._httpd = ThreadingHTTPServer((self.host, self.port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="SGLangProtocolServer", daemon=True)
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

    def __enter__(self) -> "SGLangProtocolServer":
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

    def handle(self, method: str, path: str, body: dict, fault: Fault | None = None) -> object:
        routes = {
            ("GET", "/health"): lambda b: {},
            ("GET", "/health_generate"): self._health_generate,
            ("GET", "/model_info"): lambda b: {"model_path": self.model_path, "is_generation": True},
            ("GET", "/server_info"): self._server_info,
            ("GET", "/get_server_info"): self._server_info,
            ("GET", "/get_weight_version"): lambda b: {"weight_version": self._version_str()},
            ("POST", "/generate"): self._generate,
            ("POST", "/flush_cache"): self._flush_cache,
            ("POST", "/pause_generation"): self._pause,
            ("POST", "/continue_generation"): self._continue,
            ("POST", "/update_weights_from_disk"): self._update_from_disk,
            ("POST", "/init_weights_update_group"): self._init_group,
            ("POST", "/update_weights_from_distributed"): self._update_from_distributed,
            ("POST", "/destroy_weights_update_group"): self._destroy_group,
            ("POST", "/update_weights_from_tensor"): self._update_from_tensor,
        }
        route = routes.get((method, path))
        if route is None:
            raise _HTTPError(404, f"no route {method} {path}")
        return self._generate(body, fault) if path == "/generate" else route(body)

    def _version_str(self) -> str:
        version = self.engine.weight_version
        return "default" if version is None else str(version)

    def _server_info(self, body: dict) -> dict:
        return {"model_path": self.model_path, "tp_size": 1, "dp_size": 1, "weight_version": self._version_str()}

    def _health_generate(self, body: dict) -> dict:
        self.engine.submit([0], SamplingParams(max_new_tokens=1)).result(timeout=self.request_timeout_s)
        return {}

    def _generate(self, body: dict, fault: Fault | None = None) -> object:
        self.last_generate_payload = body
        if body.get("text") is not None or "input_ids" not in body:
            raise _HTTPError(400, "this server accepts token ids only: send `input_ids`")
        if body.get("stream"):
            raise _HTTPError(400, "streaming is not supported by the protocol server")
        sampling = self._parse_sampling(body.get("sampling_params") or {})
        input_ids = body["input_ids"]
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
        return_logprob = bool(body.get("return_logprob", False))
        rids = body.get("rid")
        rids = rids if isinstance(rids, list) else [rids] * len(prompts)

        if not self._running.wait(timeout=self.request_timeout_s):
            raise _HTTPError(503, "generation paused for too long")
        start = time.perf_counter()
        with self._lock:
            self._inflight += 1
        try:
            futures = [self.engine.submit(p, sampling) for p in prompts]
            outs: list[GenerationOutput] = [f.result(timeout=self.request_timeout_s) for f in futures]
        except (TypeError, ValueError) as exc:
            raise _HTTPError(400, str(exc)) from exc
        finally:
            with self._lock:
                self._inflight -= 1
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
            meta = {
                "id": rid or uuid.uuid4().hex,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "cached_tokens": 0,
                "finish_reason": finish,
                "weight_version": "default" if out.weight_version is None else str(out.weight_version),
                "e2e_latency": time.perf_counter() - start,
            }
            if return_logprob:
                meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(logprobs, ids)]
            items.append({"text": "", "output_ids": ids, "meta_info": meta})
        return items if batched else items[0]

    @staticmethod
    def _parse_sampling(params: dict) -> SamplingParams:
        unknown = set(params) - SGLANG_SAMPLING_KEYS
        if unknown:
            raise _HTTPError(400, f"sampling_params: unknown keys {sorted(unknown)}")
        for key, default in _UNSUPPORTED_DEFAULTS.items():
            if key in params and params[key] not in (default, [] if default is None else default):
                raise _HTTPError(400, f"sampling_params.{key}={params[key]!r} is not supported by the protocol server")
        try:
            return SamplingParams(
                max_new_tokens=int(params.get("max_new_tokens", 128)),
                temperature=float(params.get("temperature", 1.0)),
                top_p=float(params.get("top_p", 1.0)),
                top_k=int(params.get("top_k", -1)),
                stop_token_ids=tuple(params.get("stop_token_ids") or ()),
            )
        except (TypeError, ValueError) as exc:
            raise _HTTPError(400, f"sampling_params: {exc}") from exc

    def _flush_cache(self, body: dict) -> str:
        with self._lock:
            busy = self._inflight
        if busy:
            raise _HTTPError(400, f"Cache not flushed because there are {busy} pending requests")
        return "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"

    def _pause(self, body: dict) -> dict:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise _HTTPError(400, f"Invalid mode: {mode!r}")
        self._running.clear()
        if mode == "abort":
            self.engine.abort_all()
        return {"success": True, "message": "Generation paused"}

    def _continue(self, body: dict) -> dict:
        self._running.set()
        return {"success": True, "message": "Generation continued"}

    def _load(self, named: list[tuple[str, torch.Tensor]], body: dict) -> None:
        version = body.get("weight_version")
        if version is None:
            version = self.engine.weight_version
        try:
            self.engine.load_weights(named, version=version)
        except (KeyError, ValueError) as exc:
            raise _HTTPError(400, str(exc)) from exc

    def _update_from_disk(self, body: dict) -> dict:
        from safetensors.torch import load_file

        path = Path(body.get("model_path", ""))
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            raise _HTTPError(400, f"update_weights_from_disk: no *.safetensors under {str(path)!r}")
        named = [item for f in files for item in load_file(str(f)).items()]
        self._load(named, body)
        return {"success": True, "message": f"Succeeded to update model weights from {path}.", "num_paused_requests": 0}

    def _init_group(self, body: dict) -> dict:
        from .distributed import init_weight_update_group

        name = body.get("group_name", "weight_update_group")
        try:
            self._groups[name] = init_weight_update_group(
                backend=body.get("backend", "gloo"),
                master_address=body["master_address"],
                master_port=int(body["master_port"]),
                world_size=int(body["world_size"]),
                rank=int(body["rank_offset"]),  # one rank (TP 1) per server
                group_name=name,
            )
        except Exception as exc:  # noqa: BLE001 - reported to the client like SGLang does
            raise _HTTPError(400, f"init_weights_update_group failed: {exc}") from exc
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def _update_from_distributed(self, body: dict) -> dict:
        import torch.distributed as dist

        name = body.get("group_name", "weight_update_group")
        pg = self._groups.get(name)
        if pg is None:
            raise _HTTPError(400, f"no weight update group {name!r}: call /init_weights_update_group first")
        named = []
        for pname, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(tensor, src=0, group=pg)
            named.append((pname, tensor))
        self._load(named, body)
        return {"success": True, "message": "Succeeded to update parameter online from distributed."}

    def _destroy_group(self, body: dict) -> dict:
        from .distributed import destroy_weight_update_group

        destroy_weight_update_group(self._groups.pop(body.get("group_name", "weight_update_group"), None))
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def _update_from_tensor(self, body: dict) -> dict:
        from multiprocessing.reduction import ForkingPickler

        payloads = body.get("serialized_named_tensors")
        if not payloads:
            raise _HTTPError(400, "update_weights_from_tensor: empty serialized_named_tensors")
        try:
            data = base64.b64decode(payloads[0], validate=True)
            named = ForkingPickler.loads(data)  # torch's reductions rebuild the tensors (shared memory / CUDA IPC)
        except Exception as exc:  # noqa: BLE001
            raise _HTTPError(400, f"update_weights_from_tensor: cannot deserialize payload: {exc}") from exc
        if isinstance(named, dict):
            named = list(named.items())
        self._load([(n, t) for n, t in named], body)
        return {"success": True, "message": "Succeeded to update model weights."}


class _Handler(BaseHTTPRequestHandler):
    owner: SGLangProtocolServer
    protocol_version = "HTTP/1.0"  # one request per connection: `stop()` leaves no live keep-alive socket

    def log_message(self, format, *args):  # quiet
        pass

    def _dispatch(self, method: str) -> None:
        owner = self.owner
        path = self.path.split("?", 1)[0]
        with owner._lock:
            owner.request_counts[path] = owner.request_counts.get(path, 0) + 1
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        fault = owner._take_fault(path)
        if fault is not None and fault.kind == "disconnect":
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if fault is not None and fault.kind == "status":
            return self._send(fault.status, {"error": {"message": f"injected fault {fault.status}"}})
        if fault is not None and fault.kind == "delay":
            time.sleep(fault.delay_s)
        try:
            body = json.loads(raw) if raw else {}
            result = owner.handle(method, path, body, fault)
        except json.JSONDecodeError as exc:
            return self._send(400, {"error": {"message": f"invalid JSON: {exc}"}})
        except _HTTPError as exc:
            return self._send(exc.status, {"error": {"message": exc.message}, "success": False, "message": exc.message})
        except Exception as exc:  # noqa: BLE001 - a server bug is a 500, like SGLang's
            return self._send(500, {"error": {"message": f"{type(exc).__name__}: {exc}"}})
        self._send(200, result)

    def _send(self, status: int, payload: object) -> None:
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout): nothing to answer

    def do_GET(self):  # noqa: N802
        self._dispatch("GET")

    def do_POST(self):  # noqa: N802
        self._dispatch("POST")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="SGLang-native HTTP API over a transformers model (tests, CPU)")
    parser.add_argument("--model-path", required=True, help="local transformers model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
    engine = EmbeddedEngine(model, max_batch_size=args.max_batch_size, seed=args.seed, initial_version=None)
    server = SGLangProtocolServer(engine, host=args.host, port=args.port, model_path=args.model_path).start()
    print(f"serving {args.model_path} at {server.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()
        engine.shutdown()


if __name__ == "__main__":
    main()
