"""bench_spec_serving: the accept-length arithmetic on /metrics scrapes, the --servers settings,
the prompts, the plot, and one run on CPU that launches a plain and a speculative server (tiny
random target, random EAGLE-3 draft)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_spec_serving as bench
from tests.e2e.server import device_args
from tests.gpu_worker.checkpoints import make_tiny_checkpoint
from tests.gpu_worker.draft_checkpoints import make_tiny_eagle3_draft
from tests.tokenizer_fixture import make_tiny_tokenizer
from tools import divergence


def scrape(
    accepted: list[float],
    plain_steps: float | None = None,
    decode_steps: float | None = None,
    cached: float | None = None,
) -> str:
    """/metrics text as the server writes it (counters end in _total), with other metrics."""
    lines = [
        "# HELP aerie_num_running_requests Requests running.",
        "# TYPE aerie_num_running_requests gauge",
        "aerie_num_running_requests 0.0",
        "# HELP aerie_spec_accepted_tokens Speculative verify steps that emitted more than k.",
        "# TYPE aerie_spec_accepted_tokens counter",
        *(
            f'aerie_spec_accepted_tokens_total{{position="{k}"}} {n}'
            for k, n in enumerate(accepted)
        ),
        "# HELP aerie_retractions Requests retracted.",
        "# TYPE aerie_retractions counter",
        "aerie_retractions_total 3.0",
    ]
    if plain_steps is not None:
        lines += [
            "# HELP aerie_spec_plain_steps Decode steps run as plain decoding.",
            "# TYPE aerie_spec_plain_steps counter",
            f"aerie_spec_plain_steps_total {plain_steps}",
        ]
    if decode_steps is not None:
        lines += [
            "# HELP aerie_decode_steps Decode steps run.",
            "# TYPE aerie_decode_steps counter",
            f"aerie_decode_steps_total {decode_steps}",
        ]
    if cached is not None:
        lines += [
            "# HELP aerie_prefix_cache_hit_tokens Prompt tokens reused from the prefix cache.",
            "# TYPE aerie_prefix_cache_hit_tokens counter",
            f"aerie_prefix_cache_hit_tokens_total {cached}",
        ]
    return "\n".join(lines) + "\n"


def test_cached_prompt_tokens_come_from_the_counter_delta():
    before = bench.parse_counters(scrape([1], cached=40))
    after = bench.parse_counters(scrape([1], cached=100))
    assert bench.spec_stats(before, after)["cached_prompt_tokens"] == 60
    assert bench.parse_counters(scrape([1])).cached_tokens == 0  # a server without the cache


def test_accept_length_per_position_and_plain_share_come_from_counter_deltas():
    before = bench.parse_counters(scrape([10, 6, 3], plain_steps=5, decode_steps=15))
    after = bench.parse_counters(scrape([30, 20, 11, 4], plain_steps=15, decode_steps=45))
    stats = bench.spec_stats(before, after)
    assert stats["decode_steps"] == 30  # the 10 plain steps and the 20 iterations
    # deltas 20 verify steps, 14 / 8 / 4 of them accepted draft 1 / 2 / 3
    assert stats["accepted_delta"] == [20, 14, 8, 4]
    assert stats["accept_length"] == pytest.approx((20 + 14 + 8 + 4) / 20)
    assert stats["accept_per_position"] == pytest.approx([0.7, 0.4, 0.2])
    assert stats["plain_step_share"] == pytest.approx(10 / 30)


def test_the_plain_share_counts_batched_steps_not_requests():
    """The verify counter counts one a request an iteration, the plain one a step a batch: 10
    plain steps and 20 iterations of 4 requests are a third plain, not a ninth."""
    before = bench.parse_counters(scrape([0], plain_steps=0, decode_steps=0))
    after = bench.parse_counters(scrape([80, 40], plain_steps=10, decode_steps=30))
    stats = bench.spec_stats(before, after)
    assert stats["plain_step_share"] == pytest.approx(10 / 30)
    assert stats["accept_length"] == pytest.approx(120 / 80)


def test_draft_positions_never_accepted_count_as_zero():
    before = bench.parse_counters(scrape([]))
    stats = bench.spec_stats(before, bench.parse_counters(scrape([8, 2])), num_steps=3)
    assert stats["accepted_delta"] == [8, 2, 0, 0]
    assert stats["accept_per_position"] == pytest.approx([0.25, 0, 0])


def test_a_server_without_the_plain_step_counter_ran_none_plain():
    stats = bench.spec_stats(
        bench.parse_counters(scrape([4, 1])), bench.parse_counters(scrape([12, 5, 2]))
    )
    assert stats["plain_steps"] == 0 and stats["plain_step_share"] == 0.0
    assert stats["accept_length"] == pytest.approx((8 + 4 + 2) / 8)


def test_a_plain_server_has_no_accept_length():
    stats = bench.spec_stats(bench.parse_counters(scrape([])), bench.parse_counters(scrape([])))
    assert stats["accept_length"] is None and stats["accept_per_position"] == []
    assert stats["plain_step_share"] is None


def test_servers_take_builtin_names_and_custom_settings_with_plain_first():
    custom = (
        "eagle3-s5=--speculative-algorithm EAGLE3 --speculative-num-steps 5 "
        "--speculative-num-draft-tokens 6"
    )
    args = bench.parse_args(["--servers", "eagle3-fixed", custom, "mtp"])
    assert [s.name for s in args.servers] == ["plain", "eagle3-fixed", "eagle3-s5", "mtp"]
    settings = {s.name: s.args for s in args.servers}
    assert settings["plain"] == ()
    assert settings["eagle3-fixed"] == (
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-adaptive",
        "off",
    )
    assert settings["eagle3-s5"] == (
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-num-steps",
        "5",
        "--speculative-num-draft-tokens",
        "6",
    )
    assert settings["mtp"] == ("--speculative-algorithm", "MTP")
    default = bench.parse_args([])
    assert [s.name for s in default.servers] == ["plain", "eagle3", "eagle3-fixed", "mtp"]
    assert default.temperatures == [0.0, 0.7] and default.concurrency == [1, 16, 64, 256]


def test_server_env_names_each_server_and_rejects_a_bare_key():
    env = bench.server_env(["AERIE_HOST_PROFILE=5,10,/out/{server}", "X=a=b"], "eagle3")
    assert env == {"AERIE_HOST_PROFILE": "5,10,/out/eagle3", "X": "a=b"}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        bench.server_env(["AERIE_STEP_TRACE"], "plain")


def test_a_run_sends_several_requests_per_stream_unless_told():
    default = bench.parse_args([])
    assert [bench.default_num_prompts(default, c) for c in (1, 16, 64, 256)] == [80, 80, 256, 1024]
    given = bench.parse_args(["--num-prompts", "12"])
    assert bench.default_num_prompts(given, 256) == 12


@pytest.mark.parametrize("servers", [["eagle4"], ["plain", "plain"], ["=--speculative-x"]])
def test_unknown_repeated_or_unnamed_servers_are_errors(servers):
    with pytest.raises(SystemExit):
        bench.parse_args(["--servers", *servers])


def test_the_plot_draws_ratios_and_acceptance(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import plot_spec_serving

    rows = [
        {
            "server": "plain",
            "temperature": 0.0,
            "concurrency": c,
            "ratio_to_plain": 1.0,
            "accepted_delta": [],
        }
        for c in (1, 4)
    ]
    rows += [
        {
            "server": "eagle3",
            "temperature": 0.0,
            "concurrency": c,
            "ratio_to_plain": r,
            "accepted_delta": d,
        }
        for c, r, d in ((1, 1.3, [10, 6]), (4, 0.9, [10, 7, 2]))
    ]
    assert plot_spec_serving.sum_positions([r["accepted_delta"] for r in rows]) == [20, 13, 2]
    path = tmp_path / "results.json"
    report = {
        "model_path": "/m/SmolLM2/",
        "machine": "NVIDIA H200",
        "date": "2026-11-28",
        "rows": rows,
    }
    assert plot_spec_serving.title(report) == "SmolLM2, NVIDIA H200, 2026-11-28"
    assert plot_spec_serving.title({"model_path": "/m/SmolLM2"}) == "SmolLM2"
    path.write_text(json.dumps(report))
    out = plot_spec_serving.main([str(path), "--out", str(tmp_path / "plot.png")])
    assert (tmp_path / "plot.png").stat().st_size > 10_000 and out.endswith("plot.png")


@pytest.mark.e2e
@pytest.mark.slow
def test_plain_and_speculative_servers_are_launched_loaded_and_compared(tmp_path):
    model = make_tiny_checkpoint(
        str(tmp_path / "model"), "llama", vocab_size=384, max_position_embeddings=512
    )
    make_tiny_tokenizer(model)
    draft = make_tiny_eagle3_draft(str(tmp_path / "draft"), model, draft_vocab_size=200)
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        "\n".join(json.dumps({"turns": [q, "And then?"]}) for q in ("Hello?", "Why not?"))
    )
    spec = (
        f"spec=--speculative-algorithm EAGLE3 --speculative-draft-model-path {draft} "
        "--speculative-num-steps 2 --speculative-num-draft-tokens 3"
    )
    out = tmp_path / "results.json"
    bench.main(
        [
            "--model-path",
            model,
            "--servers",
            "plain",
            spec,
            "--prompts",
            str(questions),
            "--temperatures",
            "0",
            "--concurrency",
            "1,2",
            "--turns",
            "1,2",
            "--num-prompts",
            "4",
            "--max-new-tokens",
            "8",
            "--ignore-eos",
            "--warmup-prompts",
            "0",
            "--port",
            "0",
            "--extra-server-args",
            " ".join(device_args()),
            "--output",
            str(out),
            "--server-env",
            f"AERIE_STEP_TRACE=1,100000,{tmp_path}/trace_{{server}}",
            "--save-outputs",
            str(tmp_path / "answers"),
        ]
    )
    report = json.loads(out.read_text())
    for name in ("plain", "spec"):  # each server traced into its own directory
        trace = tmp_path / f"trace_{name}"
        assert report["servers"][name]["env"] == {"AERIE_STEP_TRACE": f"1,100000,{trace}"}
        assert sorted(p.name for p in trace.iterdir()) == ["gpu_worker.json", "scheduler.json"]
    assert report["machine"] and len(report["date"]) == 10
    assert set(report["servers"]) == {"plain", "spec"}
    for server in report["servers"].values():
        assert "error" not in server
    assert report["servers"]["spec"]["server_info"]["speculative_algorithm"] == "EAGLE3"
    rows = {(r["server"], r["turn"], r["concurrency"]): r for r in report["rows"]}
    assert sorted(rows) == [(s, t, c) for s in ("plain", "spec") for t in (1, 2) for c in (1, 2)]
    for (name, turn, concurrency), row in rows.items():
        assert row["summary"]["completed"] == 4 and row["summary"]["total_output_tokens"] == 32
        assert 0.0 <= row["repeated_share"] <= 1.0
        # first turns alternate MT-bench and code; second turns are MT-bench only
        kinds = row["accept_length_by_kind"]
        assert set(kinds) == ({"mt-bench", "code"} if turn == 1 else {"mt-bench"})
        assert all((v is None) == (name == "plain") for v in kinds.values())
        plain = rows["plain", turn, concurrency]
        assert row["ratio_to_plain"] == pytest.approx(row["output_tok_s"] / plain["output_tok_s"])
        # A decode step serves every running request: one stream runs 7 plain steps a request
        # (the first token comes from prefill), or one iteration per verify; two share steps.
        per_request = 4 * 7 if name == "plain" else row["verify_steps"] + row["plain_steps"]
        if concurrency == 1:
            assert row["decode_steps"] == per_request
        else:
            assert per_request / 2 <= row["decode_steps"] < per_request
        cost = row["ms_per_decode_step"] / plain["ms_per_decode_step"]
        assert row["step_cost_in_plain_steps"] == pytest.approx(cost)
        if name == "plain":
            assert row["accept_length"] is None and row["verify_steps"] == 0
        else:
            # 7 decoded tokens a request (the first comes from prefill), at most 3 a verify
            assert 4 * 7 / 3 <= row["verify_steps"] <= 4 * 7
            assert 1.0 <= row["accept_length"] <= 3.0 and len(row["accept_per_position"]) == 2
            # on CPU no step costs are measured, so adaptive speculation never runs plain
            assert row["plain_step_share"] == 0.0
        # the launched server's engine processes (named as ps shows them: 15 bytes of
        # "aerie-<name>") and the client, by CPU share
        shares = row["summary"]["cpu_share"]
        assert {"scheduler", "tokenizer", "gpu_worke", "client"} <= set(shares)
        assert all(share >= 0 for share in shares.values())
    # --save-outputs: each run's answers, and on CPU in float32 the speculative server's
    # greedy answers are the plain server's, alone or two at a time
    answers = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "answers").iterdir()}
    assert sorted(answers) == sorted(
        f"{s}_turn{t}_T0_c{c}" for s in ("plain", "spec") for t in (1, 2) for c in (1, 2)
    )
    plain = answers["plain_turn1_T0_c1"]
    assert len(plain) == 4 and all(len(a["output_ids"]) == 8 for a in plain)
    for run in ("plain_turn1_T0_c2", "spec_turn1_T0_c1", "spec_turn1_T0_c2"):
        report = divergence.compare(plain, answers[run], lambda ids: None)
        assert report["identical"] == 4, run
