"""Native HTTP API against a live uvicorn with a fake engine behind the frontend."""

from __future__ import annotations

import json

import httpx
import pytest

from aerie.codec import unpack_ids
from aerie.messages import SchedulerStats
from tests.tokenizer_proc.harness import LOGPROB, fake_output_ids, fake_text, wait_until


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def test_generate_single(live):
    server, frontend, engine = live
    body = {"text": "Hello world", "sampling_params": {"max_new_tokens": 5, "top_k": 3}}
    r = httpx.post(server.url + "/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    (request,) = engine.submitted
    assert unpack_ids(request.input_ids) == frontend.tokenizer.encode("Hello world")
    assert request.sampling.max_new_tokens == 5 and request.sampling.top_k == 3
    expected = fake_output_ids(request)
    assert out["output_ids"] == expected and out["text"] == fake_text(expected)
    meta = out["meta_info"]
    assert meta["id"] == request.rid and meta["finish_reason"]["type"] == "length"
    assert meta["prompt_tokens"] == len(unpack_ids(request.input_ids))
    assert meta["completion_tokens"] == 5 and meta["spec_verify_ct"] == 3
    assert meta["spec_accept_length"] == pytest.approx(5 / 3)
    assert meta["e2e_latency"] > 0 and "output_token_logprobs" not in meta


def test_generate_batch_with_rids_and_logprobs(live):
    server, _, engine = live
    body = {
        "input_ids": [[5, 6], [7]],
        "sampling_params": {"max_new_tokens": 3},
        "rid": ["r1", "r2"],
        "return_logprob": True,
    }
    out = httpx.post(server.url + "/generate", json=body).json()
    assert [o["meta_info"]["id"] for o in out] == ["r1", "r2"]  # the client's rids, echoed
    assert not {r.rid for r in engine.submitted} & {"r1", "r2"}  # the engine keys on its own
    for o, request in zip(out, engine.submitted, strict=True):
        ids = fake_output_ids(request)
        assert o["output_ids"] == ids
        assert o["meta_info"]["output_token_logprobs"] == [[LOGPROB, i, None] for i in ids]
    assert all(r.return_logprob for r in engine.submitted)


def test_generate_stream_is_cumulative_and_ends_with_done(live):
    server, _, engine = live
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 5}, "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    dicts = [json.loads(e) for e in events[:-1]]
    expected = fake_output_ids(engine.submitted[0])
    assert dicts[-1]["output_ids"] == expected and dicts[-1]["text"] == fake_text(expected)
    for earlier, later in zip(dicts, dicts[1:], strict=False):
        assert later["text"].startswith(earlier["text"])
        assert earlier["meta_info"]["finish_reason"] is None
    assert dicts[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_batch_stream_events_carry_an_index(live):
    server, _, _ = live
    body = {"input_ids": [[5], [6]], "sampling_params": {"max_new_tokens": 4}, "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body) as r:
        events = [json.loads(e) for e in sse_events(r)[:-1]]
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1] and all(len(e["output_ids"]) == 4 for e in finals.values())


@pytest.mark.parametrize(
    "body",
    [
        {"text": ""},
        {"input_ids": [1, 10**9]},
        {"input_ids": [1] * 64},
        {"text": "hi", "sampling_params": {"top_p": 0}},
        {"text": "hi", "rid": 5},
    ],
)
def test_bad_input_is_a_400_and_nothing_is_submitted(live, body):
    server, _, engine = live
    r = httpx.post(server.url + "/generate", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert len(error["message"]) > 10
    assert engine.submitted == []
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("raw", [b"", b"{not json", b"[1, 2]", b"null"])
def test_malformed_json_is_a_400(live, raw):
    server, _, _ = live
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "message" in r.json()["error"], (path, r.text)


def test_health_follows_readiness_and_drain(live):
    server, frontend, _ = live
    frontend.ready = False
    assert httpx.get(server.url + "/health").status_code == 503
    assert httpx.post(server.url + "/generate", json={"input_ids": [1]}).status_code == 503
    frontend.mark_ready({"page_size": 1})
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health_generate").status_code == 200
    frontend.begin_drain()
    assert httpx.get(server.url + "/health").status_code == 503
    r = httpx.post(server.url + "/generate", json={"input_ids": [1]})
    assert r.status_code == 503 and "draining" in r.json()["error"]["message"]


def test_server_info_and_metrics(live):
    server, frontend, _ = live
    before = httpx.get(server.url + "/server_info").json()  # no scheduler report yet
    assert before["kv_used_tokens"] == 0 and before["kv_total_tokens"] == 1000
    assert before["num_running"] == 0 and before["accepted_per_position"] == []
    httpx.post(
        server.url + "/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 4}}
    )
    frontend.metrics.observe_stats(SchedulerStats(2, 1, 25, 100, 2.5, [10, 7, 3], 4))
    info = httpx.get(server.url + "/server_info").json()
    assert info["accepted_per_position"] == [10, 7, 3] and info["num_retractions"] == 4
    assert info["model_path"] == frontend.model_name and info["max_total_tokens"] == 1000
    assert info["num_running"] == 2 and info["num_waiting"] == 1
    assert info["kv_usage"] == 0.25 and info["avg_accept_length"] == 2.5
    assert set(info) == set(before)  # the schema does not change after the first report
    text = httpx.get(server.url + "/metrics").text
    assert 'aerie_requests_total{finish_type="length"} 1.0' in text
    assert "aerie_prompt_tokens_total 1.0" in text
    assert "aerie_generation_tokens_total 4.0" in text
    assert "aerie_num_running_requests 2.0" in text and "aerie_num_queued_requests 1.0" in text
    assert "aerie_kv_usage_ratio 0.25" in text
    assert 'aerie_spec_accepted_tokens_total{position="1"} 7.0' in text
    assert "aerie_retractions_total 4.0" in text
    assert "# TYPE aerie_spec_accepted_tokens_total counter" in text
    assert "aerie_time_to_first_token_seconds_count 1.0" in text
    assert "aerie_e2e_request_latency_seconds_count 1.0" in text


def test_stream_disconnect_aborts(live):
    server, frontend, engine = live
    engine.hold = True
    body = {"input_ids": [5], "sampling_params": {"max_new_tokens": 8}, "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body) as r:
        next(r.iter_lines())  # the first event arrived; now walk away
    assert wait_until(lambda: engine.aborted == [engine.submitted[0].rid])
    assert frontend.tracker.num_in_flight == 0


def test_non_stream_disconnect_aborts(live):
    server, frontend, engine = live
    engine.hold = True
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json={"input_ids": [5]}, timeout=0.3)
    assert wait_until(lambda: engine.aborted == [engine.submitted[0].rid])
    assert frontend.tracker.num_in_flight == 0


def test_client_rids_are_echoed_scoped_and_reusable_after_an_abort(live):
    """A client's rid is only echoed: the engine gets ids of its own, a rid in flight is a 400,
    and reusing a rid right after its request was aborted starts a new, separate request."""
    server, frontend, engine = live
    engine.hold = True
    body = {"input_ids": [5, 6], "rid": "mine", "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body) as r:
        lines = r.iter_lines()  # NOTE: a dropped line iterator closes the response
        next(lines)  # in flight
        dup = httpx.post(server.url + "/generate", json={"input_ids": [7], "rid": "mine"})
        assert dup.status_code == 400 and "already in flight" in dup.json()["error"]["message"]
    assert wait_until(lambda: frontend.tracker.num_in_flight == 0)  # the disconnect aborted it
    engine.hold = False
    again = httpx.post(server.url + "/generate", json={"input_ids": [7], "rid": "mine"}).json()
    assert again["meta_info"]["id"] == "mine"
    assert again["meta_info"]["finish_reason"]["type"] == "length"
    assert again["output_ids"] == fake_output_ids(engine.submitted[-1])
    first, second = engine.submitted[0].rid, engine.submitted[-1].rid
    assert len(engine.submitted) == 2 and first != second and "mine" not in (first, second)
    assert engine.aborted == [first]


def test_health_turns_503_as_soon_as_an_engine_process_is_gone(live):
    """The tokenizer checks the engine's pids on every health request: a killed process is
    noticed at once, while its parent has not even reaped it (a zombie)."""
    import signal
    import subprocess

    from aerie.process import process_alive

    server, frontend, _ = live
    victim = subprocess.Popen(["sleep", "60"])
    frontend.mark_ready({"page_size": 1}, {"scheduler": victim.pid})
    assert httpx.get(server.url + "/health").status_code == 200
    victim.send_signal(signal.SIGKILL)
    assert wait_until(lambda: not process_alive(victim.pid))  # a zombie: not reaped yet
    r = httpx.get(server.url + "/health")
    assert r.status_code == 503 and "scheduler process is gone" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/generate", json={"input_ids": [5]})
    assert r.status_code == 503  # and new requests are refused, not left hanging
    victim.wait()


@pytest.mark.parametrize("receive_fails", [False, True])
def test_a_client_gone_mid_request_aborts_it_and_leaves_no_unretrieved_error(receive_fails):
    """The waits of a request whose client disconnects are cancelled: the requests are aborted,
    and no "exception was never retrieved" is logged once the cancelled wait is collected (the
    soak's tokenizer log showed one per disconnected client), nor when reading the
    disconnect itself failed."""
    import asyncio
    import gc

    from tokenizer_proc.http_api import wait_all_or_abort

    class State:
        async def wait_finished(self) -> None:
            await asyncio.sleep(60)

    class Request:
        async def receive(self) -> dict:
            await asyncio.sleep(0.01)
            if receive_fails:
                raise RuntimeError("the connection broke")
            return {"type": "http.disconnect"}

    class Frontend:
        aborted: list = []

        def abort_unfinished(self, states: list) -> None:
            self.aborted.extend(states)

    async def run() -> tuple[bool, list, list]:
        loop = asyncio.get_running_loop()
        logged: list = []
        loop.set_exception_handler(lambda _, context: logged.append(context["message"]))
        states, frontend = [State(), State()], Frontend()
        finished = await wait_all_or_abort(frontend, Request(), states)
        for _ in range(3):  # the cancellation runs its callbacks, then the wait is collected
            await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0)
        return finished, frontend.aborted == states, logged

    finished, aborted, logged = asyncio.run(run())
    assert not finished and aborted
    assert logged == []
