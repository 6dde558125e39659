"""The GPU worker process's set-up on a CPU: its intra-op threads leave a core to the other
processes of the server, counted from the cores it may run on."""

from __future__ import annotations

import os

import pytest
import torch

from aerie import codec
from aerie.config import AerieConfig
from aerie.messages import ForwardPlan
from gpu_worker import process
from gpu_worker.process import ON_DEVICE, ON_HOST, cpu_threads, describe_step, join_group


def test_cpu_workers_leave_a_core_to_the_scheduler_and_frontends():
    # On 2 cores one thread: two wait for each other at every op's barrier whenever the
    # scheduler or a frontend has one of the cores (a soak under load then timed out).
    assert cpu_threads(2, workers=1) == 1
    assert cpu_threads(16, workers=1) == 15
    assert cpu_threads(16, workers=2) == 7
    assert cpu_threads(1, workers=1) == cpu_threads(4, workers=8) == 1


def test_join_group_counts_the_cores_this_process_may_run_on():
    """Under taskset (an affinity of one core) the worker runs one thread, whatever the
    machine's core count."""
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    config = AerieConfig().replace(model={"device": "cpu"})
    try:
        os.sched_setaffinity(0, {min(affinity)})
        join_group(config, rank=0, replica=0)
        assert torch.get_num_threads() == 1
        os.sched_setaffinity(0, affinity)
        join_group(config, rank=0, replica=0)
        assert torch.get_num_threads() == cpu_threads(len(affinity), workers=1)
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("disable", [False, True])
def test_the_custom_all_reduce_flag_reaches_the_group(monkeypatch, disable):
    """--disable-custom-all-reduce leaves a tensor-parallel group on NCCL alone."""
    seen = {}

    def fake_init(rank, size, address, device, startup, peer):
        seen["peer"] = peer
        return "group"

    monkeypatch.setattr(process, "init_tensor_parallel", fake_init)
    config = AerieConfig().replace(
        model={"device": "cpu"},
        parallel={"tp_size": 2, "dist_init_addr": "127.0.0.1:29999"},
        runner={},
    )
    config = config.replace(parallel={"disable_custom_all_reduce": disable})
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    assert join_group(config, rank=0, replica=0) == "group"
    assert seen["peer"] is not disable


def test_heartbeats_describe_a_step_by_its_mode_size_and_place():
    prompt = codec.pack_ids(list(range(7000)))
    extend = ForwardPlan(17, "extend", rows=codec.pack_ids([1]), input_ids=prompt)
    expected = "step 17 (extend, 7,000 tokens, 1 request) on the host"
    assert describe_step((extend, ON_HOST)) == expected
    decode = ForwardPlan(18, "decode", rows=codec.pack_ids([1, 2, 3]))
    assert describe_step((decode, ON_DEVICE)) == "step 18 (decode, 3 requests) on the device"
