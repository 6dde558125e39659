"""The endpoint table: where each process's inbox listens.

Every process binds one PULL inbox (`ipc://` in the per-launch runtime directory) and connects
PUSH senders to the inboxes of the processes it talks to. The tokenizer also binds a `tcp://`
ROUTER socket for external ZMQ clients (`aerie.client`).
"""

from __future__ import annotations

import os

from aerie.config import AerieConfig

PROCESS_NAMES = ("tokenizer", "scheduler", "gpu_worker", "detokenizer")


def worker_name(rank: int) -> str:
    """The process name of tensor-parallel rank `rank`: rank 0 is "gpu_worker" (the one the
    scheduler talks to), the others "tp1_worker", ...; rank 0 forwards them its plans."""
    return "gpu_worker" if rank == 0 else f"tp{rank}_worker"


def worker_names(config: AerieConfig) -> tuple[str, ...]:
    return tuple(worker_name(rank) for rank in range(config.parallel.tp_size))


def inbox(config: AerieConfig, name: str) -> str:
    """The ipc:// address of process `name`'s inbox ("launcher" and worker ranks included)."""
    ranks = range(1, config.parallel.tp_size)
    if name not in PROCESS_NAMES and name != "launcher" and name not in map(worker_name, ranks):
        raise ValueError(f"unknown process {name!r}")
    if not config.runtime_dir:
        raise ValueError("config.runtime_dir is not resolved")
    return "ipc://" + os.path.join(config.runtime_dir, f"{name}.sock")


def client_bind_address(config: AerieConfig) -> str:
    """The tcp:// address the external ZMQ frontend binds (port 0: the OS picks one; the
    tokenizer reports the address it got in its ready info)."""
    host = config.server.host
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{config.server.zmq_port}"
