"""bench_prefix_ttft on CPU: both servers launched on a tiny random model, each turn's cached
tokens as the cache makes them, the comparison of the two, and the floor's split."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_prefix_ttft as bench
from tests.e2e.server import device_args
from tests.gpu_worker.checkpoints import make_tiny_checkpoint
from tests.tokenizer_fixture import make_tiny_tokenizer


def test_a_history_must_outgrow_its_answer():
    with pytest.raises(SystemExit):
        bench.parse_args(["--model-path", "m", "--histories", "64", "--answer-tokens", "64"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--model-path", "m", "--histories", "0"])


def test_the_cache_on_and_off_servers_are_timed_on_the_same_conversations(tmp_path):
    model = make_tiny_checkpoint(str(tmp_path / "model"), "llama", vocab_size=384)
    make_tiny_tokenizer(model)
    output = tmp_path / "out" / "ttft.json"
    argv = ["--model-path", model, "--extra-server-args", " ".join(device_args())]
    argv += ["--histories", "40,72", "--answer-tokens", "8", "--new-tokens", "6"]
    argv += ["--decode-tokens", "3", "--repeats", "2", "--warmup", "1", "--trace"]
    argv += ["--output", str(output)]
    bench.main(argv)

    results = json.loads(output.read_text())
    assert [row["history_tokens"] for row in results["table"]] == [40, 72]
    for history, row in zip((40, 72), results["table"], strict=True):
        on, off = row["on"], row["off"]
        # Turn 1 and its answer are cached but the answer's last token (never run through the
        # model); sent again, turn 2 is cached but its last token.
        assert on["turn2_cached_tokens"] == history - 1
        assert on["again_cached_tokens"] == history + 6 - 1
        assert off["turn2_cached_tokens"] == off["again_cached_tokens"] == 0
        assert row["turn2_ttft_ms_off_over_on"] == pytest.approx(
            off["turn2_ttft_ms"] / on["turn2_ttft_ms"], abs=0.01
        )
        assert 0 < on["turn2_server_ttft_ms"] < on["turn2_ttft_ms"]
        assert on["decode_gap_ms"] > 0
    for name in ("on", "off"):  # the warm-up conversation is not counted
        assert len(results[name]["histories"]["72"]["rows"]) == 2
    # --trace: each `again` TTFT split at its prefill step's events. The links run from the
    # client's send to its first event, so they add up to that TTFT.
    for name in ("on", "off"):
        for history in ("40", "72"):
            split = results[name]["histories"][history]["ttft_split_ms"]
            assert min(split[what] for _, _, what in bench.LINKS) >= 0
            rows = results[name]["histories"][history]["rows"]
            ttfts = sorted(row["again"]["ttft_ms"] for row in rows)
            assert ttfts[0] - 0.5 <= split["all (the client's TTFT)"] <= ttfts[-1] + 0.5
    assert (tmp_path / "out" / "server_off.log").exists()
