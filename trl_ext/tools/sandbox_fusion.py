"""Client for a SandboxFusion server's ``POST /run_code``, as ReTool's recipe (verl-recipe ``retool/``) uses it."""

from __future__ import annotations

import asyncio
import random
import time

from .sandbox import SandboxBackend, SandboxResult

__all__ = ["SandboxFusionBackend"]


class SandboxFusionBackend(SandboxBackend):
    """Run code on a `SandboxFusion <https://github.com/bytedance/SandboxFusion>`_ server.

    Request: ``{"code", "language": "python", "run_timeout", "compile_timeout", "memory_limit_MB", "stdin",
    "files": {}, "fetch_files": []}``. Response: ``{"status": "Success"|"Failed"|"SandboxError", "message",
    "compile_result", "run_result": {"status": "Finished"|"TimeLimitExceeded"|"Error", "return_code", "stdout",
    "stderr", "execution_time"}}``. A program that fails (``status: "Failed"``) is a normal result; transport
    errors, 5xx and ``SandboxError`` are retried with exponential backoff and then reported in
    ``SandboxResult.error``.

    The contract matches :class:`~trl_ext.tools.LocalSandbox`: ``timeout_s`` is the program's own run time (sent as
    ``run_timeout``; the wait for one of this client's ``max_concurrency`` slots is bounded separately by
    ``queue_timeout_s`` and reported in ``queued_s``); the exit status is ``exit_code``; a negative
    ``return_code`` (the server's subprocess was killed by a signal) becomes ``signal``. The server does not say
    who sent a signal (its memory limit or the program), so ``killed_by`` is ``"unknown"`` then. Isolation, disk
    quotas and memory limits are the server's (run it in its own container).

    Args:
        url: server root (``http://host:8080``) or the full ``.../run_code`` endpoint.
        max_concurrency: requests in flight at once.
        queue_timeout_s: longest wait for a free slot; past it the call returns ``SandboxResult.error`` unsent.
        max_retries: retries after the first attempt for transport errors, 5xx and ``SandboxError``.
        backoff_s: first retry delay (doubles each retry, with jitter).
        request_timeout_s: HTTP timeout on top of the run's own ``timeout_s``.
        language: SandboxFusion language name.
    """

    def __init__(
        self,
        url: str,
        *,
        max_concurrency: int = 32,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        request_timeout_s: float = 30.0,
        queue_timeout_s: float = 600.0,
        language: str = "python",
        headers: dict | None = None,
    ):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s) URL, got {url!r}")
        if (
            max_concurrency < 1
            or max_retries < 0
            or backoff_s < 0
            or not (request_timeout_s > 0 and queue_timeout_s > 0)
        ):
            raise ValueError(
                "max_concurrency must be >= 1, max_retries and backoff_s >= 0, request_timeout_s and "
                "queue_timeout_s > 0"
            )
        url = url.rstrip("/")
        self.endpoint = url if url.endswith("/run_code") else url + "/run_code"
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.request_timeout_s = request_timeout_s
        self.language = language
        self.headers = headers or {}
        self.max_concurrency = max_concurrency
        self.queue_timeout_s = float(queue_timeout_s)
        self._semaphore = self._client = self._loop = None

    def _bind_loop(self) -> None:
        """Semaphore and HTTP client belong to one event loop; callers may run ``asyncio.run`` per step."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            import httpx

            self._loop = loop
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
            self._client = httpx.AsyncClient(headers=self.headers, trust_env=False)

    def _http(self):
        return self._client

    async def aclose(self) -> None:
        if self._client is not None and self._loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = self._semaphore = self._loop = None

    async def run_code(
        self, code: str, *, timeout_s: float = 10.0, memory_mb: int = 1024, max_output_bytes: int = 1 << 16
    ) -> SandboxResult:
        import httpx

        if not (timeout_s > 0 and memory_mb > 0 and max_output_bytes > 0):
            raise ValueError("timeout_s, memory_mb and max_output_bytes must be positive")
        payload = {
            "code": code,
            "language": self.language,
            "run_timeout": timeout_s,
            "compile_timeout": timeout_s,
            "memory_limit_MB": memory_mb,
            "stdin": "",
            "files": {},
            "fetch_files": [],
        }
        last_error = None
        self._bind_loop()
        queued = time.monotonic()
        try:  # the queue has its own bound: waiting for a slot never eats into the program's timeout_s
            await asyncio.wait_for(self._semaphore.acquire(), timeout=self.queue_timeout_s)
        except asyncio.TimeoutError:
            result = self._failure(
                f"no slot became free within queue_timeout_s={self.queue_timeout_s:g} s "
                f"(max_concurrency={self.max_concurrency}); the program was not sent",
                queued,
            )
            result.queued_s, result.duration_s = result.duration_s, 0.0
            return result
        queued_s = time.monotonic() - queued
        start = time.monotonic()
        try:
            for attempt in range(self.max_retries + 1):
                if attempt:
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1) * (1 + 0.25 * random.random()))
                try:
                    response = await self._http().post(
                        self.endpoint, json=payload, timeout=self.request_timeout_s + timeout_s
                    )
                except httpx.HTTPError as e:
                    last_error = f"{type(e).__name__}: {e}"
                    continue
                if response.status_code >= 500:
                    last_error = f"HTTP {response.status_code}: {response.text[:200]}"
                    continue
                if response.status_code != 200:
                    # 4xx: our request is wrong; retrying will not help
                    result = self._failure(f"HTTP {response.status_code}: {response.text[:500]}", start)
                    break
                try:
                    body = response.json()
                except ValueError:
                    last_error = f"response is not JSON: {response.text[:200]!r}"
                    continue
                if not isinstance(body, dict) or body.get("status") == "SandboxError":
                    last_error = f"SandboxError: {body.get('message', '') if isinstance(body, dict) else body!r}"
                    continue
                result = self._result(body, max_output_bytes, start)
                break
            else:
                result = self._failure(f"{last_error} (after {self.max_retries + 1} attempts)", start)
        finally:
            self._semaphore.release()
        result.queued_s = queued_s
        return result

    @staticmethod
    def _failure(message: str, start: float) -> SandboxResult:
        return SandboxResult(
            "",
            "",
            None,
            False,
            False,
            duration_s=time.monotonic() - start,
            error=message,
            isolation={"backend": "sandbox_fusion"},
        )

    @staticmethod
    def _result(body: dict, max_output_bytes: int, start: float) -> SandboxResult:
        run = body.get("run_result") or {}
        compile_ = body.get("compile_result") or {}
        stdout = (compile_.get("stdout") or "") + (run.get("stdout") or "")
        stderr = (compile_.get("stderr") or "") + (run.get("stderr") or "")
        timed_out = "TimeLimitExceeded" in (run.get("status"), compile_.get("status"))
        # the same combined byte budget as LocalSandbox: stdout first, then stderr
        out_b, err_b = stdout.encode(), stderr.encode()
        truncated = len(out_b) + len(err_b) > max_output_bytes
        if truncated:
            out_b = out_b[:max_output_bytes]
            err_b = err_b[: max_output_bytes - len(out_b)]
        error = None
        if not run and body.get("status") != "Success" and not compile_:
            error = f"{body.get('status')}: {body.get('message', '')}"
        return_code = run.get("return_code")
        exit_code = sig = killed_by = None
        if isinstance(return_code, int) and return_code < 0:  # Python's subprocess convention: -N = killed by N
            sig = -return_code
        elif isinstance(return_code, int):
            exit_code = return_code
        if timed_out:
            exit_code, killed_by = None, "timeout"
        elif sig is not None:
            killed_by = "unknown"  # the server's memory limit or the program's own signal: the response can't tell
        return SandboxResult(
            stdout=out_b.decode("utf-8", errors="replace"),
            stderr=err_b.decode("utf-8", errors="replace"),
            exit_code=exit_code,
            timed_out=timed_out,
            truncated=truncated,
            signal=sig,
            duration_s=time.monotonic() - start,
            error=error,
            isolation={"backend": "sandbox_fusion"},
            killed_by=killed_by,
        )
