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
    in rank order. Each rank's process group is destroyed when fn returns or raises.

    Raises RankFailure when a rank raised or died without a result (the others, likely waiting
    for it in a collective, get exit_timeout_s to finish, then are killed), when the group
    took longer than timeout_s, or when a rank had not exited exit_timeout_s after the last
    result (killed too: the caller's interpreter would wait for it at its exit)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    address = f"127.0.0.1:{free_port()}"
    procs = [
        context.Process(target=_rank_main, args=(fn, rank, world, address, args, results))
        for rank in range(world)
    ]
    reported: dict[int, tuple[Any, str | None]] = {}
    problems: list[str] = []
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        while len(reported) < world:
            try:
                rank, value, error = results.get(timeout=0.5)
                reported[rank] = value, error
                if error is not None:  # the rest may wait on it: a grace period, no more
                    deadline = min(deadline, time.monotonic() + exit_timeout_s)
                continue
            except queue.Empty:
                pass
            # a rank that exited has put its result already, unless it died
            gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in reported]
            if gone and _drained(results, reported):
                continue
            problems += [f"rank {r} exited ({procs[r].exitcode}) with no result" for r in gone]
            if problems or time.monotonic() > deadline:
                break
        missing = sorted(set(range(world)) - set(reported))
        if missing and not problems:
            problems.append(f"no result from ranks {missing} in time")
        exit_deadline = time.monotonic() + (exit_timeout_s if len(reported) == world else 1.0)
        for proc in procs:
            proc.join(timeout=max(exit_deadline - time.monotonic(), 0.0))
    finally:
        stuck = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for rank in stuck:
            procs[rank].kill()
            procs[rank].join()
    errors = [(r, error) for r, (_, error) in sorted(reported.items()) if error is not None]
    problems = [f"rank {r} raised:\n{error}" for r, error in errors] + problems
    if stuck and len(reported) == world and not errors:
        problems.append(f"ranks {stuck} did not exit within {exit_timeout_s:g} s of their result")
    if problems:
        raise RankFailure("\n".join(problems))
    return [reported[rank][0] for rank in range(world)]


def _drained(results, reported: dict) -> bool:
    """Take every result already in the queue; whether there was one."""
    found = False
    while True:
        try:
            rank, value, error = results.get_nowait()
        except queue.Empty:
            return found
        reported[rank] = value, error
        found = True


def _rank_main(fn, rank: int, world: int, address: str, args: tuple, results) -> None:
    try:
        results.put((rank, fn(rank, world, address, *args), None))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
