"""freeze_startup: what exists is frozen, and a slow collection is logged."""

from __future__ import annotations

import gc
import logging

from aerie.gc_policy import freeze_startup


def test_startup_objects_are_frozen_and_slow_collections_are_logged(caplog):
    log = logging.getLogger("test_gc_policy")
    kept = [object() for _ in range(10)]  # noqa: F841 - alive at the freeze
    callback = freeze_startup(log, slow_s=0.0)  # every collection counts as slow
    try:
        assert gc.get_freeze_count() > 0
        gc.disable()  # only the collection below runs (callbacks run for it all the same)
        with caplog.at_level(logging.WARNING, logger="test_gc_policy"):
            gc.collect(0)
        gc.enable()
        (record,) = [r for r in caplog.records if r.name == "test_gc_policy"]
        assert "garbage collection (generation 0) stopped this process for" in record.message
    finally:
        gc.enable()
        gc.callbacks.remove(callback)
        gc.unfreeze()
    caplog.clear()
    freeze_startup(log, slow_s=60.0)  # a real threshold: a quick collection says nothing
    try:
        with caplog.at_level(logging.WARNING, logger="test_gc_policy"):
            gc.collect(0)
        assert not [r for r in caplog.records if r.name == "test_gc_policy"]
    finally:
        gc.callbacks.pop()
        gc.unfreeze()
