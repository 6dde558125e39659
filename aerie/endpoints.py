"""The endpoint table: where each process's inbox listens.

Every process binds one PULL inbox (`ipc://` in the per-launch runtime directory) and one for
its heartbeat thread; the first frontend also binds a `tcp://` ROUTER for ZMQ clients, and with
--nnodes > 1 remote worker ranks bind a `tcp://` address for rank 0's plans.
`http_socket` binds the HTTP port, which every frontend shares.
"""

from __future__ import annotations

import os
import socket

from aerie.config import AerieConfig

PROCESS_NAMES = ("tokenizer", "scheduler", "gpu_worker")


def http_socket(host: str, port: int, shared: bool, backlog: int | None = None) -> socket.socket:
    """A TCP socket bound to host:port, listening when backlog is given (else it only holds
    the port: an unlistening socket never takes a connection). shared: with SO_REUSEPORT, so
    that every frontend can listen on the port. A taken port raises a RuntimeError that says
    so."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(
            f"cannot listen on http://{host}:{port}: {e.strerror} "
            f"(is another server using --port {port}?)"
        ) from e
    if backlog is not None:
        sock.listen(backlog)
    return sock


def frontend_name(index: int = 0) -> str:
    """Frontend process `index` (HTTP, ZMQ, tokenization, detokenization): "tokenizer" for the
    first, then "tokenizer1", "tokenizer2", ..."""
    return "tokenizer" if index == 0 else f"tokenizer{index}"


def frontend_names(config: AerieConfig) -> tuple[str, ...]:
    """Every frontend's name (one while the count is unresolved)."""
    return tuple(frontend_name(i) for i in range(max(1, config.server.tokenizer_worker_num)))


def scheduler_name(replica: int = 0) -> str:
    """The scheduler of data-parallel replica `replica` ("scheduler" for replica 0)."""
    return "scheduler" if replica == 0 else f"dp{replica}_scheduler"


def worker_name(rank: int, replica: int = 0) -> str:
    """The GPU worker of tensor-parallel rank `rank` in replica `replica`. Rank 0 is the one
    its scheduler talks to and forwards plans to the others: "gpu_worker", "tp1_worker", ...
    in replica 0; "dp1_worker", "dp1_tp1_worker", ... in replica 1. (Process names show the
    first 15 bytes of "aerie-" + name, so each stays apart there.)"""
    if replica == 0:
        return "gpu_worker" if rank == 0 else f"tp{rank}_worker"
    return f"dp{replica}_worker" if rank == 0 else f"dp{replica}_tp{rank}_worker"


def worker_names(config: AerieConfig, replica: int = 0) -> tuple[str, ...]:
    return tuple(worker_name(rank, replica) for rank in range(config.parallel.tp_size))


def node_ranks(config: AerieConfig) -> range:
    """The tensor-parallel ranks this machine runs (--nnodes splits them evenly, in order)."""
    parallel = config.parallel
    per_node = parallel.tp_size // parallel.nnodes
    return range(parallel.node_rank * per_node, (parallel.node_rank + 1) * per_node)


def split_host_port(address: str) -> tuple[str, int]:
    """ "HOST:PORT" (IPv6 hosts may be bracketed) -> (host without brackets, port); raises
    ValueError naming the address when it is not that."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def init_address(config: AerieConfig, replica: int) -> str:
    """Where data-parallel replica `replica`'s ranks meet: --dist-init-addr's port plus the
    replica's index."""
    host, port = split_host_port(config.parallel.dist_init_addr or "")
    return f"[{host}]:{port + replica}" if ":" in host else f"{host}:{port + replica}"


def remote_inbox_address(config: AerieConfig) -> str | None:
    """With --nnodes > 1, where a worker also receives from rank 0 on another machine: a
    tcp:// port the OS picks (rank 0 learns it from the group) on this machine's address
    towards --dist-init-addr (the loopback address for a loopback init address). None on one
    machine, where the ipc:// inbox serves."""
    if config.parallel.nnodes == 1:
        return None
    host, _ = split_host_port(config.parallel.dist_init_addr or "")
    with socket.socket(
        socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM
    ) as probe:
        probe.connect((host, 9))  # no packet is sent: this only picks the outgoing interface
        local = probe.getsockname()[0]
    return f"tcp://[{local}]:*" if ":" in local else f"tcp://{local}:*"


def engine_names(config: AerieConfig) -> tuple[str, ...]:
    """Every replica's scheduler and worker ranks, replica by replica."""
    names: list[str] = []
    for replica in range(config.parallel.dp_size):
        names += [scheduler_name(replica), *worker_names(config, replica)]
    return tuple(names)


def inbox(config: AerieConfig, name: str) -> str:
    """The ipc:// address of process `name`'s inbox ("launcher", every frontend, every
    replica's scheduler and worker ranks included)."""
    if (
        name not in PROCESS_NAMES
        and name != "launcher"
        and name not in engine_names(config)
        and name not in frontend_names(config)
    ):
        raise ValueError(f"unknown process {name!r}")
    if not config.runtime_dir:
        raise ValueError("config.runtime_dir is not resolved")
    return "ipc://" + os.path.join(config.runtime_dir, f"{name}.sock")


def heartbeat(config: AerieConfig, name: str) -> str:
    """The ipc:// address where process `name`'s heartbeat thread takes the launcher's
    heartbeats (apart from its inbox, so they are answered while its loop is busy)."""
    return inbox(config, name).removesuffix(".sock") + ".heartbeat.sock"


def step_link(config: AerieConfig, replica: int = 0) -> str:
    """The Unix socket path of replica `replica`'s step link (`aerie.transport.StepLink`):
    its worker rank 0 listens there and its scheduler connects (always one machine)."""
    if not config.runtime_dir:
        raise ValueError("config.runtime_dir is not resolved")
    return os.path.join(config.runtime_dir, f"{worker_name(0, replica)}.link")


def client_bind_address(config: AerieConfig) -> str:
    """The tcp:// address the external ZMQ frontend binds (port 0: the OS picks one; the
    tokenizer reports the address it got in its ready info)."""
    host = config.server.host
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{config.server.zmq_port}"
