"""Logging set-up shared by every process: one line format with a process tag."""

from __future__ import annotations

import logging
import sys


def setup_logging(tag: str, level: str = "info") -> logging.Logger:
    """Configure the root logger for this process; lines read `[time tag] LEVEL message`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"[%(asctime)s {tag}] %(levelname)s %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "httpx", "transformers"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    return logging.getLogger(tag)
