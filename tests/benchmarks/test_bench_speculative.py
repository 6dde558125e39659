"""bench_speculative runs end to end on CPU: MT-bench-style requests through the launched
server's engine (tiny random target with random EAGLE and MTP drafts; a bigram target with a
draft that always agrees), and the iteration cost."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_speculative, iteration_timing
from tests.gpu_worker.checkpoints import make_tiny_checkpoint
from tests.gpu_worker.draft_checkpoints import make_agreeing_eagle_draft, make_bigram_target
from tests.tokenizer_fixture import make_tiny_tokenizer


def write_questions(tmp_path, *questions: str | list[str]):
    """An MT-bench-style questions file: each question one turn (a string) or several."""
    path = tmp_path / "questions.jsonl"
    path.write_text(
        "\n".join(json.dumps({"turns": [q] if isinstance(q, str) else q}) for q in questions)
    )
    return path


@pytest.mark.parametrize("algorithm", ["EAGLE", "MTP"])
def test_bench_speculative_reports_plain_and_speculative_rows(tmp_path, algorithm):
    model = make_tiny_checkpoint(
        str(tmp_path / "model"), "llama", vocab_size=384, max_position_embeddings=512
    )
    make_tiny_tokenizer(model)
    prompts = write_questions(tmp_path, "Hello?", "Why?")
    out = tmp_path / "result.json"
    bench_speculative.main(
        [
            "--model-path",
            model,
            "--load-format",
            "dummy",
            "--algorithm",
            algorithm,
            "--prompts",
            str(prompts),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "6",
            "--shapes",
            "2,1,3",
            "--device",
            "cpu",
            "--output",
            str(out),
        ]
    )
    results = json.loads(out.read_text())["results"]
    assert [r["mode"] for r in results] == ["plain", f"{algorithm} S=2 topk=1 ND=3"]
    # the same greedy tokens after each first one (which comes from prefill), at most 5 each
    assert 0 < results[0]["decode_tokens"] == results[1]["decode_tokens"] <= 10
    assert 1.0 <= results[1]["accept_length"] <= 3.0
    assert results[0]["accept_length"] is None and results[0]["speedup"] == 1.0


def test_step_costs_price_fixed_and_adaptive_runs_against_plain(tmp_path):
    """A random draft (accept length about 1) against an iteration that costs two plain steps:
    the adaptive run decodes mostly plainly once its first iterations missed, the fixed one
    never does, and the priced speeds say what each choice costs; the tokens are the same."""
    model = make_tiny_checkpoint(
        str(tmp_path / "model"), "llama", vocab_size=384, max_position_embeddings=512
    )
    make_tiny_tokenizer(model)
    prompts = write_questions(tmp_path, "Hello?", "Why?")
    out = tmp_path / "result.json"
    costs = {
        "buckets": [1],
        "plain_ms": {"greedy": [1.0], "sampled": [1.0]},
        "speculative_ms": {"greedy": [2.0], "sampled": [2.0]},
    }
    bench_speculative.main(
        ["--model-path", model, "--load-format", "dummy", "--prompts", str(prompts)]
        + ["--num-prompts", "2", "--turns", "1", "--max-new-tokens", "40", "--shapes", "2,1,3"]
        + ["--device", "cpu", "--output", str(out), "--step-costs", json.dumps(costs)]
    )
    plain, fixed, adaptive = json.loads(out.read_text())["results"]
    assert [fixed["mode"], adaptive["mode"]] == ["EAGLE3 S=2 topk=1 ND=3"] + [
        "EAGLE3 S=2 topk=1 ND=3 adaptive"
    ]
    assert plain["decode_tokens"] == fixed["decode_tokens"] == adaptive["decode_tokens"] == 78
    assert plain["plain_steps"] == fixed["plain_steps"] == 0
    iterations = fixed["decode_tokens"] / fixed["accept_length"]
    assert fixed["priced_speedup"] == pytest.approx(fixed["decode_tokens"] / (2 * iterations))
    assert adaptive["plain_steps"] > adaptive["decode_tokens"] / 2
    assert fixed["priced_speedup"] < 0.6 < 0.9 < adaptive["priced_speedup"] <= 1.0
    assert plain["priced_speedup"] == 1.0


def test_a_draft_that_always_agrees_is_accepted_at_every_position(tmp_path):
    """Accounting: S + 1 tokens per verify and every draft position accepted (13 new tokens:
    the first from prefill, then 3 iterations of 4)."""
    target = make_bigram_target(str(tmp_path / "bigram"), max_position_embeddings=512)
    make_tiny_tokenizer(target)
    draft = make_agreeing_eagle_draft(str(tmp_path / "agreeing"), target)
    prompts = write_questions(tmp_path, "Hello?", "Why not?")
    out = tmp_path / "result.json"
    bench_speculative.main(
        [
            "--model-path",
            target,
            "--algorithm",
            "EAGLE",
            "--draft-path",
            draft,
            "--prompts",
            str(prompts),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "13",
            "--shapes",
            "3,1,4",
            "--temperatures",
            "0",
            "--device",
            "cpu",
            "--output",
            str(out),
        ]
    )
    plain, spec = json.loads(out.read_text())["results"]
    assert spec["decode_tokens"] == plain["decode_tokens"] == 2 * 12
    assert spec["accept_length"] == 4.0 and spec["accept_per_position"] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("turns", [2, 1])
def test_later_turns_follow_the_runs_own_earlier_answers(tmp_path, monkeypatch, turns):
    """--turns 2: each question's second turn is asked after its first turn and this run's
    answer to it (as MT-bench is answered), a question with one turn asks only that, and every
    sampled request has its own seed; the figures add up over the turns, and per turn. --turns
    1 asks the first turns only."""
    from benchmarks.spec_requests import Engine
    from tokenizer_proc.tokenizer import Tokenizer

    served = []  # (prompt, params, answer) of every request, warm-ups included
    serve = Engine.serve

    def recording_serve(self, prompt, params):
        result, answer = serve(self, prompt, params)
        served.append((prompt, params, answer))
        return result, answer

    monkeypatch.setattr(Engine, "serve", recording_serve)
    target = make_bigram_target(str(tmp_path / "bigram"), max_position_embeddings=512)
    make_tiny_tokenizer(target)
    draft = make_agreeing_eagle_draft(str(tmp_path / "agreeing"), target)
    questions = [["Hello?", "And then?"], ["Why not?"]]
    out = tmp_path / "result.json"
    bench_speculative.main(
        [
            "--model-path",
            target,
            "--algorithm",
            "EAGLE",
            "--draft-path",
            draft,
            "--prompts",
            str(write_questions(tmp_path, *questions)),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "9",
            "--shapes",
            "3,1,4",
            "--temperatures",
            "0,0.5",
            "--device",
            "cpu",
            "--turns",
            str(turns),
            "--output",
            str(out),
        ]
    )
    tokenizer = Tokenizer(target)
    asked = [q[:turns] for q in questions]
    per_run = 1 + sum(len(q) for q in asked)  # a warm-up, then every turn
    assert len(served) == 4 * per_run  # plain and speculative, each at both temperatures
    for run, temperature in enumerate([0.0, 0.5, 0.0, 0.5]):
        requests = iter(served[run * per_run + 1 : (run + 1) * per_run])
        seeds = []
        for question in asked:
            messages = []
            for text in question:
                prompt, params, answer = next(requests)
                messages.append({"role": "user", "content": text})
                assert prompt == tokenizer.encode_chat(messages)
                assert params.temperature == temperature
                seeds.append(params.seed)
                reply = tokenizer.decode(answer)
                assert reply  # the bigram target never emits its end-of-turn token
                messages.append({"role": "assistant", "content": reply})
        if temperature > 0:
            assert len(set(seeds)) == len(seeds) and None not in seeds
        else:
            assert set(seeds) == {None}
    for row in json.loads(out.read_text())["results"]:
        assert [t["requests"] for t in row["per_turn"]] == [2, 1][:turns]
        assert [t["decode_tokens"] for t in row["per_turn"]] == [2 * 8, 8][:turns]
        assert row["decode_tokens"] == sum(t["decode_tokens"] for t in row["per_turn"])
        assert row["requests"] == sum(t["requests"] for t in row["per_turn"])


def test_rows_are_written_as_they_finish(tmp_path, monkeypatch):
    """A run cut short (here: the speculative engine fails to start) keeps the rows it made."""
    from benchmarks import spec_requests

    engine = spec_requests.Engine

    def plain_only(config):
        if config.speculative.speculative_algorithm:
            raise RuntimeError("cut short")
        return engine(config)

    monkeypatch.setattr(spec_requests, "Engine", plain_only)
    model = make_tiny_checkpoint(
        str(tmp_path / "model"), "llama", vocab_size=384, max_position_embeddings=512
    )
    make_tiny_tokenizer(model)
    out = tmp_path / "result.json"
    with pytest.raises(RuntimeError, match="cut short"):
        bench_speculative.main(
            [
                "--model-path",
                model,
                "--load-format",
                "dummy",
                "--algorithm",
                "EAGLE",
                "--prompts",
                str(write_questions(tmp_path, "Hello?")),
                "--num-prompts",
                "1",
                "--max-new-tokens",
                "4",
                "--shapes",
                "2,1,3",
                "--temperatures",
                "0,0.5",
                "--device",
                "cpu",
                "--output",
                str(out),
            ]
        )
    rows = json.loads(out.read_text())["results"]
    assert [(r["mode"], r["temperature"]) for r in rows] == [("plain", 0.0), ("plain", 0.5)]


@pytest.mark.parametrize(
    "turns, questions, message",
    [
        (0, ["Hello?"], "--turns must be at least 1"),
        (2, [["Hello?"], []], "every question needs at least one turn"),
    ],
)
def test_bad_turns_are_refused_with_a_message(tmp_path, capsys, turns, questions, message):
    with pytest.raises(SystemExit):
        bench_speculative.main(
            [
                "--model-path",
                str(tmp_path),
                "--prompts",
                str(write_questions(tmp_path, *questions)),
                "--turns",
                str(turns),
                "--device",
                "cpu",
            ]
        )
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "algorithm, shapes, fused_rows", [("EAGLE3", "2,1,3 2,2,4", ""), ("MTP", "2,1,3", "1,4")]
)
def test_iteration_mode_times_random_and_agreeing_drafts(tmp_path, algorithm, shapes, fused_rows):
    """--mode iteration: a row per shape and batch size (and value of --fused-rows, restored
    after); the constructed always-agreeing draft is accepted in full (S+1 tokens per request
    per iteration); the byte bound exceeds 1."""
    from gpu_worker.kernels import pdl

    default_rows = pdl.MAX_ROWS
    model = make_tiny_checkpoint(
        str(tmp_path / "model"), "llama", vocab_size=384, max_position_embeddings=512
    )
    out = tmp_path / "result.json"
    bench_speculative.main(
        [
            "--mode",
            "iteration",
            "--model-path",
            model,
            "--load-format",
            "dummy",
            "--algorithm",
            algorithm,
            "--shapes",
            shapes,
            "--batch-sizes",
            "1,3",
            "--context-len",
            "12",
            "--iters",
            "2",
            "--device",
            "cpu",
            "--output",
            str(out),
            "--fused-rows",
            fused_rows,
        ]
    )
    rows = json.loads(out.read_text())["results"]
    values = [int(n) for n in fused_rows.split(",")] if fused_rows else [default_rows]
    assert [(r["fused_rows"], r["mode"].split()[2], r["batch_size"]) for r in rows] == [
        (n, f"topk={s.split(',')[1]}", bs) for n in values for s in shapes.split() for bs in (1, 3)
    ]
    assert pdl.MAX_ROWS == default_rows  # restored
    for r in rows:
        assert r["agreeing_tokens_per_iteration"] == 3  # S + 1
        assert r["iteration_ms"] > 0 and r["plain_step_ms"] > 0 and r["byte_bound"] > 1
        stages = r["stages"]  # greedy: accepted inside the propose stage
        assert stages["propose_ms"] > 0 and stages["extend_ms"] > 0 and stages["accept_ms"] == 0
        assert stages["stages_ms"] == stages["propose_ms"] + stages["extend_ms"]
        assert stages["host_ms"] == pytest.approx(r["iteration_ms"] - stages["stages_ms"])


def test_iteration_mode_at_a_temperature_samples_in_the_accept_stage(tmp_path, monkeypatch):
    """--temperature above 0: the timed iterations accept in the "sample" accept stage (and
    the plain steps sample); at 0 they accept inside the propose stage."""
    from gpu_worker.speculative.iteration import SpeculativeWorker

    variants = []
    pick = SpeculativeWorker.accept_variant
    monkeypatch.setattr(
        SpeculativeWorker,
        "accept_variant",
        lambda self, *a: variants.append(pick(self, *a)) or variants[-1],
    )
    model = make_tiny_checkpoint(
        str(tmp_path / "model"), "llama", vocab_size=384, max_position_embeddings=512
    )
    for temperature in ("0.8", "0"):
        variants.clear()
        bench_speculative.main(
            [
                "--mode",
                "iteration",
                "--model-path",
                model,
                "--load-format",
                "dummy",
                "--algorithm",
                "EAGLE3",
                "--shapes",
                "2,1,3",
                "--batch-sizes",
                "1",
                "--context-len",
                "12",
                "--iters",
                "2",
                "--device",
                "cpu",
                "--temperature",
                temperature,
                "--output",
                str(tmp_path / "result.json"),
            ]
        )
        assert set(variants) == ({"sample"} if temperature != "0" else {None})
        stages = json.loads((tmp_path / "result.json").read_text())["results"][0]["stages"]
        assert (stages["accept_ms"] > 0) is (temperature != "0")  # the accept stage timed


def test_iteration_steps_are_timed_two_in_flight_as_served(tmp_path, monkeypatch):
    """The ratio's yardstick is the served step: each step is launched before the step before
    it is finished (as the worker process runs them under the overlap schedule), and a step
    emits the same tokens as a step run alone."""
    import argparse

    from gpu_worker.worker import GPUWorker

    model = make_tiny_checkpoint(
        str(tmp_path / "model"), "llama", vocab_size=384, max_position_embeddings=512
    )
    args = argparse.Namespace(
        model_path=model,
        device="cpu",
        dtype="float32",
        load_format="dummy",
        attention_backend="auto",
    )
    config = bench_speculative.iteration_config(args, None, None, 2)
    replay = iteration_timing.Replayer(GPUWorker(config), config, 2, 12)
    calls = []
    launch, finish = replay.worker.launch, replay.worker.finish
    monkeypatch.setattr(replay.worker, "launch", lambda plan: calls.append("L") or launch(plan))
    monkeypatch.setattr(replay.worker, "finish", lambda step: calls.append("F") or finish(step))
    served = iteration_timing.run_steps(replay, None, 4, in_flight=2)
    assert "".join(calls) == "LLFLFLFF"
    calls.clear()
    alone = iteration_timing.run_steps(replay, None, 2, in_flight=1)
    assert "".join(calls) == "LFLF"
    assert served.token_ids == alone.token_ids and len(served.token_ids) > 0
