"""Running the package's coroutines from synchronous code (scripts, the trainer, notebooks)."""

from __future__ import annotations

import asyncio
import concurrent.futures


def run_sync(coro):
    """Run a coroutine to completion from synchronous code: a plain script, or inside a running event loop (a
    notebook), where it runs on a fresh loop in a worker thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()
