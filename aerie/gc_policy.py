"""Garbage collection in the serving processes: what startup built is kept out of the
collector's walks, and a slow collection is logged.

A full (generation 2) collection walks every object the collector tracks. At the end of
startup a process holds hundreds of thousands of them (torch, transformers, the tokenizer,
FastAPI's routes), none of which serving frees, and a burst of requests that leaves enough
objects alive triggers a full collection that stops the process's loop for as long as the walk
takes: every stream it serves misses its events meanwhile. `freeze_startup` moves what exists
at the end of startup into the permanent generation (`gc.freeze`), which collections skip, so
they walk only what serving allocated; and it logs any collection slower than `slow_s`, so a
stall that remains names its cause.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import Any

SLOW_COLLECTION_S = 0.02


def freeze_startup(
    log: logging.Logger, slow_s: float = SLOW_COLLECTION_S
) -> Callable[[str, dict[str, Any]], None]:
    """Collect, freeze what is left, and log collections from now on that take slow_s or
    longer. -> the `gc.callbacks` entry it added."""
    gc.collect()
    gc.freeze()
    started = time.perf_counter()

    def on_collection(phase: str, info: dict[str, Any]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
            return
        took = time.perf_counter() - started
        if took >= slow_s:
            log.warning(
                "a garbage collection (generation %d) stopped this process for %.0f ms "
                "(%d objects freed)",
                info["generation"],
                1e3 * took,
                info["collected"],
            )

    gc.callbacks.append(on_collection)
    return on_collection
