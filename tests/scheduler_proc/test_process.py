from __future__ import annotations

import dataclasses
import json
import threading
import time

from aerie import endpoints
from aerie.messages import (
    AbortRequest,
    DebugQuery,
    DebugReport,
    ForwardPlan,
    SchedulerStats,
    Shutdown,
    StepOutputs,
)
from aerie.outputs import read_outputs
from aerie.transport import Inbox, Receiver, Sender, StepLink
from scheduler_proc.process import RESULT_SPIN_S, SchedulerLoop, load_decoder
from tests.scheduler_proc.fake_worker import (
    FakeWorker,
    make_config,
    make_request,
    reference_output,
)
from tests.tokenizer_fixture import make_tiny_tokenizer

TIMEOUT_S = 5.0


def loop_config(tmp_path):
    """The config of a scheduler loop on a tiny model directory (config.json, tokenizer)."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "vocab_size": 50,
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
                "eos_token_id": 49,
            }
        )
    )
    make_tiny_tokenizer(model_dir)
    return make_config().replace(
        model={"model_path": str(model_dir)},
        cache={"max_total_tokens": 64},
        runtime_dir=str(tmp_path),
    )


def test_loop_moves_plans_results_outputs_and_stats(tmp_path):
    """Two frontends: each request's outputs reach the frontend that sent it, in one StepOutputs
    per step; stats reach both."""
    config = loop_config(tmp_path).replace(server={"tokenizer_worker_num": 2})
    worker_link = StepLink.listen(endpoints.step_link(config))  # as the worker does
    worker_inbox = Inbox(worker_link)  # plans come over the link, results go back over it
    frontends = [Receiver(endpoints.inbox(config, name)) for name in ("tokenizer", "tokenizer1")]
    loop = SchedulerLoop(config)
    waits = []  # (plans in flight, spin_s) of every blocking wait of the loop
    recv = loop.messages.recv

    def recording_recv(timeout_s=None, spin_s=0.0):
        waits.append((loop.core.num_in_flight, spin_s))
        return recv(timeout_s=timeout_s, spin_s=spin_s)

    loop.messages.recv = recording_recv
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    to_scheduler = Sender(endpoints.inbox(config, "scheduler"))
    try:
        prompt = [1, 2, 3, 4]
        to_scheduler.send(make_request("a", prompt, max_new_tokens=5, ignore_eos=True))
        b = make_request("b", [7, 7], max_new_tokens=40, ignore_eos=True)
        to_scheduler.send(dataclasses.replace(b, frontend=1))
        worker, outputs, finishes = FakeWorker(), {"a": [], "b": []}, {}
        stats: list[SchedulerStats | None] = [None, None]
        for _ in range(6):  # prefill + 4 decodes finish "a"
            plan = worker_inbox.recv(timeout_s=TIMEOUT_S)
            assert isinstance(plan, ForwardPlan)
            worker_link.send(worker.run(plan))
        to_scheduler.send(AbortRequest(rid="b"))
        deadline = time.monotonic() + TIMEOUT_S
        while len(finishes) < 2 and time.monotonic() < deadline:
            plan = worker_inbox.recv(timeout_s=0.05)  # b's plan in flight, if any
            if plan is not None:
                worker_link.send(worker.run(plan))
            for frontend, inbox in enumerate(frontends):
                for message in inbox.drain():
                    if isinstance(message, SchedulerStats):
                        stats[frontend] = message
                        continue
                    assert isinstance(message, StepOutputs) and message.frontend == frontend
                    for out in read_outputs(message):
                        assert out.rid == ("a", "b")[frontend]
                        outputs[out.rid] += out.token_ids
                        if out.finish is not None:
                            finishes[out.rid] = out.finish.type
        assert finishes == {"a": "length", "b": "abort"}, (finishes, outputs)
        # b's abort is reported at once, but its row and KV stay held until the plans still in
        # flight for it are answered: answer them, or the allocator is not whole at the end.
        while loop.core.num_in_flight and time.monotonic() < deadline:
            plan = worker_inbox.recv(timeout_s=0.05)
            if plan is not None:
                worker_link.send(worker.run(plan))
        assert outputs["a"] == reference_output(prompt, 5)
        assert finishes == {"a": "length", "b": "abort"}
        assert outputs["b"] and len(outputs["b"]) < 40
        assert all(s is not None and s.kv_total_tokens == 64 for s in stats)
        to_scheduler.send(Shutdown(reason="test"))
        thread.join(TIMEOUT_S)
        assert not thread.is_alive()
        assert loop.core.allocator.is_whole()
        # It spins for the result of a step in flight, and only then (idle, it blocks).
        assert {spin for in_flight, spin in waits if in_flight} == {RESULT_SPIN_S}
        assert {spin for in_flight, spin in waits if not in_flight} == {0.0}
    finally:
        for socket in (to_scheduler, worker_link, *frontends):
            socket.close()
        loop.close()


def test_a_debug_query_is_answered_with_where_each_request_is(tmp_path):
    config = loop_config(tmp_path)
    worker_link = StepLink.listen(endpoints.step_link(config))
    worker_inbox = Inbox(worker_link)
    tokenizer_inbox = Receiver(endpoints.inbox(config, "tokenizer"))
    loop = SchedulerLoop(config)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    to_scheduler = Sender(endpoints.inbox(config, "scheduler"))
    try:
        to_scheduler.send(make_request("a", [1, 2, 3], max_new_tokens=5))
        assert isinstance(worker_inbox.recv(timeout_s=TIMEOUT_S), ForwardPlan)  # not answered
        to_scheduler.send(make_request("b", [4, 5, 6], max_new_tokens=5))
        to_scheduler.send(DebugQuery(query_id=7))
        deadline = time.monotonic() + TIMEOUT_S
        report = None
        while not isinstance(report, DebugReport) and time.monotonic() < deadline:
            report = tokenizer_inbox.recv(timeout_s=TIMEOUT_S)  # stats come too
        assert isinstance(report, DebugReport)
        assert (report.query_id, report.replica) == (7, 0)
        # a's prefill and its first decode are in flight (overlap), unanswered: b must wait.
        assert report.summary["plans_in_flight"] == 2 and not report.summary["can_plan"]
        by_rid = {entry["rid"]: entry for entry in report.requests}
        assert by_rid["a"]["state"] == "running" and by_rid["a"]["plans_in_flight"] == 2
        assert by_rid["a"]["committed_len"] == 3 and by_rid["a"]["output_len"] == 0
        assert by_rid["b"]["state"] == "waiting" and by_rid["b"]["queue_position"] == 0
        to_scheduler.send(Shutdown(reason="test"))
        thread.join(TIMEOUT_S)
    finally:
        for socket in (to_scheduler, worker_link, tokenizer_inbox):
            socket.close()
        loop.close()


def test_the_stop_string_decoder_is_loaded_up_front_and_matches_transformers(tmp_path):
    """Loading on the first stop-string request stalled every stream for seconds: the decoder
    is ready when load_decoder returns, and decodes as transformers does."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    path = make_tiny_tokenizer(tmp_path)
    decode = load_decoder(path)
    reference = AutoTokenizer.from_pretrained(path)
    for ids in ([5, 6, 7], [300, 1, 2, 77], list(range(40, 80))):
        assert decode(ids) == reference.decode(ids, skip_special_tokens=False)
    probe = (
        f"import sys; from scheduler_proc.process import load_decoder; "
        f"load_decoder({path!r}); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # the scheduler stays torch-free
