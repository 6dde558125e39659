"""benchmarks/bench_train_step.py on a tiny random checkpoint, on the CPU: every algorithm and
variant (loss, window) runs the trainer's own step on the same rows and reports it, the
variants' losses agree, and a disagreement fails the run."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from tests.gpu_worker.checkpoints import make_tiny_checkpoint

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_train_step.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_train_step", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), "llama")


def run(bench, tiny_dir: str, output, *extra: str) -> int:
    return bench.main(
        [
            "--model",
            tiny_dir,
            "--device",
            "cpu",
            "--algorithms",
            "eagle3,mtp",
            "--shapes",
            "2x64",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--losses",
            "reference,fused",
            "--output",
            str(output),
            *extra,
        ]
    )


def test_every_algorithm_and_loss_variant_is_timed_on_the_same_rows(
    bench, tiny_dir, tmp_path, capsys
):
    output = tmp_path / "steps.json"
    assert (
        run(
            bench,
            tiny_dir,
            output,
            "--profile-steps",
            "1",
            "--windows",
            "on,off",
            "--prompt-frac",
            "0.5",
            "--prompt-spread",
            "0.3",
        )
        == 0
    )
    results = json.loads(output.read_text())
    assert [(r["algorithm"], r["loss"], r["window"]) for r in results] == [
        (algorithm, loss, window)
        for algorithm in ("eagle3", "mtp")
        for loss in ("reference", "fused")
        for window in ("on", "off")
    ]
    for r in results:
        assert r["step_ms"] > r["target_ms"] > 0 and r["learned_tokens_per_s"] > 0
        assert len(r["acc"]) == {"eagle3": 7, "mtp": 3}[r["algorithm"]]  # default depths
        assert r["profile"]["kernels_per_step"] == 0  # the CPU launches no GPU kernels
    for algorithm in ("eagle3", "mtp"):  # learning rate 0: the same weights, the same loss
        losses = [r["total_loss"] for r in results if r["algorithm"] == algorithm]
        assert losses == pytest.approx([losses[0]] * 4, rel=1e-6)
    assert "learned tok/s" in capsys.readouterr().out


def test_variants_that_disagree_fail_the_run(bench, tiny_dir, tmp_path, monkeypatch, capsys):
    measure = bench.measure

    def drifting(*args):
        variants = measure(*args)
        variants[-1]["total_loss"] += 1.0
        return variants

    monkeypatch.setattr(bench, "measure", drifting)
    assert run(bench, tiny_dir, tmp_path / "steps.json") == 1
    assert "different losses" in capsys.readouterr().out
    for bad in (
        ["--losses", "fused,referense"],
        ["--windows", "of"],
        ["--prompt-frac", "0.3", "--prompt-spread", "0.4"],
    ):
        with pytest.raises(SystemExit):
            bench.main(["--model", tiny_dir, *bad])
