"""The endpoint table: where each process's inbox listens.

Every process binds one PULL inbox (`ipc://` in the per-launch runtime directory) and connects
PUSH senders to the inboxes of the processes it talks to. The tokenizer also binds a `tcp://`
ROUTER socket for external ZMQ clients (`aerie.client`).
"""

from __future__ import annotations

import os

from aerie.config import AerieConfig

PROCESS_NAMES = ("tokenizer", "scheduler", "gpu_worker", "detokenizer")


def inbox(config: AerieConfig, name: str) -> str:
    """The ipc:// address of process `name`'s inbox ("launcher" included)."""
    if name not in PROCESS_NAMES and name != "launcher":
        raise ValueError(f"unknown process {name!r}")
    if not config.runtime_dir:
        raise ValueError("config.runtime_dir is not resolved")
    return "ipc://" + os.path.join(config.runtime_dir, f"{name}.sock")


def client_address(config: AerieConfig, bind: bool = False) -> str:
    """The tcp:// address of the external ZMQ frontend (bind form uses the configured host)."""
    host = config.server.host
    if not bind and host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"tcp://{host}:{config.server.zmq_port}"
