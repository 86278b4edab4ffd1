"""A real ``ChunkStore`` and ``Driver`` for the prestage tests (tests/test_prestage*.py):
the driver's apply pipeline without its network."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any


def run_driver(root: Path, trust: Any, weights: Any,
               body: Callable[[Any, Any], Awaitable[Any]]) -> Any:
    """``body(driver, store)`` with a ``ChunkStore`` at ``root`` and a ``Driver`` over
    ``weights`` (no core, no engine); the driver is stopped (its prestage thread
    joined) whatever ``body`` does. Returns what ``body`` returned."""
    from node.driver import Driver
    from node.store import ChunkStore

    async def main(store: ChunkStore) -> Any:
        drv = Driver(None, store, None, weights=weights, host="127.0.0.1", port=0)  # type: ignore[arg-type]
        try:
            return await body(drv, store)
        finally:
            await drv.stop(drain_s=0.1)

    with ChunkStore(root, trust=trust) as store:
        return asyncio.run(main(store))


async def prestage_done(drv: Any) -> None:
    """Wait for the driver's prestage task, if any, to finish."""
    while drv._pre_task is not None:
        await asyncio.sleep(0.001)
