"""benchmarks/bench_decode.py on a tiny random checkpoint, on CPU, with a couple of steps."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from gpu_worker.models import read_arch_config
from tests.gpu_worker.checkpoints import load_reference, make_tiny_checkpoint

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_decode.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decode", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), "llama")


def test_cli_writes_table_json_and_roofline(bench, tiny_dir: str, tmp_path, capsys) -> None:
    output = tmp_path / "decode.json"
    argv = [
        "--models",
        tiny_dir,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--prompt-len",
        "8",
        "--decode-steps",
        "2",
        "--warmup-steps",
        "1",
        "--repeats",
        "2",
        "--bandwidth-mib",
        "4",
        "--output",
        str(output),
    ]
    bench.main(argv)
    report = json.loads(output.read_text())
    assert "tok/s" in capsys.readouterr().out
    (result,) = report["results"]
    assert report["prompt_len"] == 8 and report["decode_steps"] == 2
    assert report["bandwidth_gbps"] > 0 and report["h100_bandwidth_gbps"] == 3000
    # Weights read per step: every tensor once, but only one row of the untied input embedding.
    tensors = load_file(os.path.join(tiny_dir, "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    expected = sum(t.numel() for t in tensors.values()) - embed.numel() + embed.shape[1]
    assert result["weight_bytes"] == expected * 4
    assert result["tokens_per_s"] == pytest.approx(1e3 / result["median_step_ms"])
    bandwidth = report["bandwidth_gbps"] * 1e9
    assert result["roofline_tokens_per_s"] == pytest.approx(bandwidth / result["weight_bytes"])


def test_decode_loop_produces_greedy_tokens(bench, tiny_dir: str) -> None:
    args = bench.parse_args(
        ["--device", "cpu", "--dtype", "float32", "--prompt-len", "6", "--decode-steps", "4"]
    )
    runner = bench.build_runner(tiny_dir, "auto", args)
    prompt = torch.tensor([5, 17, 3, 99, 42, 7])
    run = bench.run_request(runner, prompt, 4, bench.make_timer(runner.device))
    assert len(run.step_s) == 4
    reference = load_reference(tiny_dir)
    with torch.no_grad():
        expected = reference.generate(
            prompt[None], max_new_tokens=5, do_sample=False, min_new_tokens=5
        )[0, 6:]
    assert run.token_ids.tolist() == expected.tolist()


def test_llama8b_config_is_llama31_8b_shaped(bench, tmp_path) -> None:
    cfg = read_arch_config(bench.write_llama8b_config(str(tmp_path)))
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * cfg.intermediate_size + 2 * h
    num_params = 2 * cfg.vocab_size * h + cfg.num_layers * per_layer + h
    assert 8.0e9 < num_params < 8.1e9  # Llama-3.1-8B has 8.03B parameters
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
