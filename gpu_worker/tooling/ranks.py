"""A tensor-parallel group in one process tree: `run_ranks` spawns one process per rank for the
tests and benchmarks of collectives and sharded runners (a server's ranks are the launcher's
worker processes instead)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from aerie.resolve import free_port


class RankFailure(RuntimeError):
    """A rank raised, died before reporting, or did not exit; the message holds each one's
    traceback or exit."""


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 300.0,
    exit_timeout_s: float = 30.0,
) -> list[Any]:
    """fn(rank, world, address, *args) in a spawned process per rank, `address` a free
    127.0.0.1 port for the group's rendezvous (fn and args must pickle, and so must its
    result: numpy arrays, not tensors, which would die with the rank) -> every rank's result,
    in rank order. Each rank's process group is destroyed when fn returns or raises. Raises
    RankFailure when a rank raised, died without a result, took longer than timeout_s in all,
    or had not exited exit_timeout_s after its result (such ranks are killed first, or the
    caller's interpreter would wait for them at its exit)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    address = f"127.0.0.1:{free_port()}"
    procs = [
        context.Process(target=_rank_main, args=(fn, rank, world, address, args, results))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    reported: dict[int, tuple[Any, str | None]] = {}
    problems: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(reported) < world and not problems:
        try:
            rank, value, error = results.get(timeout=1.0)
            reported[rank] = value, error
        except queue.Empty:
            gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in reported]
            problems += [f"rank {r} exited ({procs[r].exitcode}) with no result" for r in gone]
            if time.monotonic() > deadline:
                problems.append(f"no result from ranks {sorted(set(range(world)) - set(reported))}")
    for proc in procs:
        proc.join(timeout=exit_timeout_s if not problems else 1.0)
    stuck = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for rank in stuck:
        procs[rank].kill()
        procs[rank].join()
    problems += [
        f"rank {r} raised:\n{error}" for r, (_, error) in sorted(reported.items()) if error
    ]
    if stuck and len(reported) == world:
        problems.append(f"ranks {stuck} did not exit within {exit_timeout_s:g} s of their result")
    if problems:
        raise RankFailure("\n".join(problems))
    return [reported[rank][0] for rank in range(world)]


def _rank_main(fn, rank: int, world: int, address: str, args: tuple, results) -> None:
    try:
        results.put((rank, fn(rank, world, address, *args), None))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
