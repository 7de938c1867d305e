"""Client for a SandboxFusion server's ``POST /run_code`` (FACTS §11), as ReTool's recipe uses it."""

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

    Args:
        url: server root (``http://host:8080``) or the full ``.../run_code`` endpoint.
        max_concurrency: requests in flight at once.
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
        language: str = "python",
        headers: dict | None = None,
    ):
        url = url.rstrip("/")
        self.endpoint = url if url.endswith("/run_code") else url + "/run_code"
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.request_timeout_s = request_timeout_s
        self.language = language
        self.headers = headers or {}
        self.max_concurrency = max_concurrency
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
        start = time.monotonic()
        last_error = None
        self._bind_loop()
        async with self._semaphore:
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
                    return self._failure(f"HTTP {response.status_code}: {response.text[:500]}", start)
                try:
                    body = response.json()
                except ValueError:
                    last_error = f"response is not JSON: {response.text[:200]!r}"
                    continue
                if body.get("status") == "SandboxError":
                    last_error = f"SandboxError: {body.get('message', '')}"
                    continue
                return self._result(body, max_output_bytes, start)
        return self._failure(f"{last_error} (after {self.max_retries + 1} attempts)", start)

    @staticmethod
    def _failure(message: str, start: float) -> SandboxResult:
        return SandboxResult("", "", None, False, False, duration_s=time.monotonic() - start, error=message,
                             isolation={"backend": "sandbox_fusion"})

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
        return SandboxResult(
            stdout=out_b.decode("utf-8", errors="replace"),
            stderr=err_b.decode("utf-8", errors="replace"),
            exit_code=run.get("return_code"),
            timed_out=timed_out,
            truncated=truncated,
            duration_s=time.monotonic() - start,
            error=error,
            isolation={"backend": "sandbox_fusion"},
        )
