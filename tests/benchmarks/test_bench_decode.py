"""benchmarks/bench_decode.py on a tiny random checkpoint, on CPU (Triton in the interpreter),
with a couple of steps: the report's arithmetic, and every variant decoding the same greedy
tokens as transformers."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.bench_models import write_llama8b_config
from gpu_worker.kernels import batch_invariant
from gpu_worker.models import read_arch_config
from tests.devices import skip_unless_triton_runs_on
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
    skip_unless_triton_runs_on("cpu")
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
        "1",
        "--batch-size",
        "1,3",
        "--variants",
        "torch_native,triton,triton+graph,deterministic+graph,compiled",
        "--bandwidth-mib",
        "4",
        "--output",
        str(output),
    ]
    bench.main(argv)
    assert not batch_invariant.ENABLED  # the deterministic group switched the mode back off
    report = json.loads(output.read_text())
    assert "tok/s" in capsys.readouterr().out
    rows = {(r["variant"], r["batch_size"]): r for r in report["results"]}
    # compiled needs CUDA; every other variant ran at both batch sizes
    ran = ("torch_native", "triton", "triton+graph", "deterministic+graph")
    assert set(rows) == {(v, bs) for v in ran for bs in (1, 3)}
    tensors = load_file(os.path.join(tiny_dir, "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    expected = sum(t.numel() for t in tensors.values()) - embed.numel() + embed.shape[1]
    bandwidth = report["bandwidth_gbps"] * 1e9
    for (_, bs), r in rows.items():
        assert r["weight_bytes"] == expected * 4  # one row of the untied input embedding
        assert r["tokens_per_s"] == pytest.approx(bs * 1e3 / r["step_ms"])
        assert r["roofline_tokens_per_s"] == pytest.approx(bandwidth / r["weight_bytes"] * bs)
        assert r["greedy_agreement_with_torch_native"] == 1.0  # float32: the same tokens
        assert r["prefill_logits_rel_diff_vs_torch_native"] < 1e-5


def test_gemv_variants_decode_the_reference_tokens(bench, tiny_dir, tmp_path, monkeypatch):
    """library+graph (large weights by the library GEMM) and triton+graph@<config> (the graphs
    captured again with each GEMV launch shape) decode what torch_native does, and the module
    settings are the production ones afterwards. Every weight counts as large here."""
    skip_unless_triton_runs_on("cpu")
    from gpu_worker.kernels import small_m_linear as sml

    monkeypatch.setattr(bench, "FUSED_WEIGHT", 0)
    monkeypatch.setattr(sml, "MAX_FUSED_WEIGHT", 0)
    production = sml.GEMV_CONFIG
    launched = []
    launch = sml._launch
    monkeypatch.setattr(sml, "_launch", lambda p, *a: launched.append(a[-1]) or launch(p, *a))
    output = tmp_path / "decode.json"
    bench.main(
        [
            "--models",
            tiny_dir,
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--prompt-len",
            "6",
            "--decode-steps",
            "2",
            "--warmup-steps",
            "0",
            "--repeats",
            "1",
            "--variants",
            "torch_native,library+graph",
            "--gemv-configs",
            "2,64,2;4,32,2",
            "--bandwidth-mib",
            "4",
            "--output",
            str(output),
        ]
    )
    rows = {r["variant"]: r for r in json.loads(output.read_text())["results"]}
    assert set(rows) == {
        "torch_native",
        "library+graph",
        "triton+graph@2,64,2",
        "triton+graph@4,32,2",
    }
    for r in rows.values():
        assert r["greedy_agreement_with_torch_native"] == 1.0
    assert {sml.Config(2, 64, 2), sml.Config(4, 32, 2)} <= set(launched)
    assert sml.GEMV_CONFIG == production


@pytest.mark.parametrize("variant", ["torch_native", "triton", "triton+graph"])
def test_decode_loop_produces_greedy_tokens(bench, tiny_dir: str, variant: str) -> None:
    args = bench.parse_args(
        [
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--prompt-len",
            "6",
            "--decode-steps",
            "4",
            "--warmup-steps",
            "0",
            "--batch-size",
            "2",
        ]
    )
    backend = variant.split("+")[0]
    if backend == "triton":
        skip_unless_triton_runs_on("cpu")
    runner = bench.build_runner(tiny_dir, "auto", args, backend, 2 if "graph" in variant else 0)
    prompts = torch.tensor([[5, 17, 3, 99, 42, 7], [8, 8, 1, 2, 200, 31]])
    decoder = bench.Decoder(runner, 2, runner.context_length, variant.endswith("graph"))
    decoder.prefill(prompts)
    for _ in range(4):
        decoder.step()
    tokens = torch.stack(decoder.history, dim=1)
    reference = load_reference(tiny_dir)
    with torch.no_grad():
        expected = reference.generate(prompts, max_new_tokens=5, do_sample=False, min_new_tokens=5)[
            :, 6:
        ]
    assert tokens.tolist() == expected.tolist()


def test_llama8b_config_is_llama31_8b_shaped(tmp_path) -> None:
    cfg = read_arch_config(write_llama8b_config(str(tmp_path)))
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * cfg.intermediate_size + 2 * h
    num_params = 2 * cfg.vocab_size * h + cfg.num_layers * per_layer + h
    assert 8.0e9 < num_params < 8.1e9  # Llama-3.1-8B has 8.03B parameters
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"


def test_run_apart_runs_in_a_process_of_its_own() -> None:
    """The compiled baseline's home: a spawned child, so its CUDA graph trees cannot free the
    cuBLAS workspace that this process's captured graphs use."""
    from benchmarks import bench_decode

    assert bench_decode.run_apart(os.getpid) not in (os.getpid(), None)


@pytest.mark.gpu
def test_two_models_with_graphs_and_the_compiled_baseline_in_one_run(tmp_path) -> None:
    """Two models, graphs at batch 1 and 64, and the compiled baseline between them: a library
    GEMM replayed after torch.compile recorded its graphs in the same process faulted. Run as
    its own process, as users run it (its profiler would stay attached to pytest's)."""
    import subprocess

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tiny = make_tiny_checkpoint(str(tmp_path / "tiny"), "llama")
    out = tmp_path / "report.json"
    subprocess.run(
        [
            sys.executable,
            _PATH,
            "--models",
            f"{tiny},llama3-8b",
            "--load-format",
            "dummy",
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--batch-size",
            "1,64",
            "--variants",
            "triton+graph,compiled",
            "--decode-steps",
            "8",
            "--warmup-steps",
            "2",
            "--repeats",
            "1",
            "--profile-steps",
            "1",
            "--output",
            str(out),
        ],
        check=True,
        timeout=900,
    )
    report = json.loads(out.read_text())
    assert {(r["variant"], r["batch_size"]) for r in report["results"]} == {
        (v, bs) for v in ("triton+graph", "compiled") for bs in (1, 64)
    }
