"""Decode speed of a `ModelRunner`, variant by variant, next to the bandwidth roofline and a
compiled static-KV baseline (`static_kv_baseline`), all measured in the same run. Variants:
torch_native, triton, triton+graph (the serving default), unfused, nopdl and library, each
without one fast path, and deterministic (the kernels of --enable-deterministic-inference);
tokens/s, step time, kernels and host time per step, and the roofline.

  python benchmarks/bench_decode.py --models smollm2,llama3-8b --batch-size 1,64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aerie.resolve import resolve_device, resolve_dtype  # noqa: E402
from benchmarks.bench_models import resolve_model  # noqa: E402
from benchmarks.decode_timing import measure_bandwidth, profile_kernels, sync, time_loop  # noqa: E402
from gpu_worker.build import DTYPES  # noqa: E402
from gpu_worker.graphs.forward_graph import decode_graphs  # noqa: E402
from gpu_worker.kernels import batch_invariant, pdl, small_m_linear  # noqa: E402
from gpu_worker.model_runner import ModelRunner, PoolSpec, RunnerSpec  # noqa: E402
from gpu_worker.models import read_arch_config  # noqa: E402
from gpu_worker.step.forward_batch import ForwardMode  # noqa: E402
from gpu_worker.step.host_batch import HostBatch  # noqa: E402

H100_BANDWIDTH_TBPS = 3.0
FUSED_WEIGHT = small_m_linear.MAX_FUSED_WEIGHT  # the "unfused" variants set it to 0
GEMV_CONFIG = small_m_linear.GEMV_CONFIG  # "unfused" and "library" set it to None
VARIANTS = (
    "torch_native",
    "triton",
    "triton+graph",
    "unfused",
    "unfused+graph",
    "nopdl",
    "nopdl+graph",
    "library",
    "library+graph",
    "deterministic",
    "deterministic+graph",
    "compiled",
)
# one runner (and graphs) each
GROUPS = ("torch_native", "triton", "unfused", "nopdl", "library", "deterministic")


def configure_kernels(group: str, gemv: small_m_linear.Config | None = GEMV_CONFIG) -> None:
    small_m_linear.MAX_FUSED_WEIGHT = 0 if group == "unfused" else FUSED_WEIGHT
    small_m_linear.GEMV_CONFIG = None if group in ("unfused", "library") else gemv
    pdl.FORCE_OFF = group == "nopdl"
    batch_invariant.enable(group == "deterministic")


def parse_gemv_configs(text: str) -> list[small_m_linear.Config]:
    """'4,2048,4;8,1024,4' -> Configs (block_n, block_k, num_warps)."""
    return [
        small_m_linear.Config(*(int(v) for v in part.split(",")))
        for part in text.split(";")
        if part.strip()
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models",
        default="smollm2,llama3-8b",
        help="comma list of smollm2, llama3-8b or model directories",
    )
    p.add_argument(
        "--real-weights",
        action="store_true",
        help="smollm2 with its real weights (converted once) instead of random ones",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "safetensors", "dummy"),
        help="for model directories",
    )
    p.add_argument("--batch-size", default="1", help="comma list of batch sizes")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=128, help="timed decode steps per run")
    p.add_argument("--warmup-steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant")
    p.add_argument(
        "--gemv-configs",
        default="",
        type=parse_gemv_configs,
        help="BN,BK,WARPS;...: triton+graph@<config> variants",
    )
    p.add_argument("--profile-steps", type=int, default=4, help="steps profiled for kernels")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument(
        "--bandwidth-mib",
        type=int,
        default=None,
        help="copy size for the bandwidth probe (default 1024 on GPU, 64 on CPU)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


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


# ---------------------------------------------------------------------------------- decode


def build_runner(path: str, load_format: str, args, backend: str, graph_bs: int) -> ModelRunner:
    device = resolve_device(args.device)
    max_bs = max(parse_sizes(args.batch_size))
    max_len = sequence_len(args)
    spec = RunnerSpec(
        path,
        device=device,
        dtype=DTYPES[resolve_dtype(args.dtype, device)],
        load_format=load_format,
        seed=args.seed,
        attention_backend=backend,
        cuda_graph_max_bs=graph_bs,
    )
    pools = PoolSpec(
        max_running_requests=max_bs, context_length=max_len, max_total_tokens=max_bs * max_len
    )
    return ModelRunner(spec, pools)


@dataclass
class Decoder:
    """bs requests on rows 1..bs, request r's position p in slot (r-1) * max_len + p + 1."""

    runner: ModelRunner
    bs: int
    max_len: int
    use_graph: bool

    def __post_init__(self) -> None:
        device = self.runner.device
        self.rows = np.arange(1, self.bs + 1, dtype=np.int64)
        positions = torch.arange(self.max_len, device=device)
        for r in self.rows.tolist():
            self.runner.req_to_token_pool.req_to_token[r, : self.max_len] = (
                (r - 1) * self.max_len + positions + 1
            ).int()
        self.tokens: torch.Tensor | None = None  # [bs] on the device
        self.pos = 0
        self.history: list[torch.Tensor] = []

    def prefill(self, prompts: torch.Tensor) -> None:
        """prompts [bs, prompt_len] (host int64)."""
        bs, n = prompts.shape
        host = HostBatch.from_requests(
            ForwardMode.EXTEND,
            prompts.tolist(),
            [0] * bs,
            [[(r - 1) * self.max_len + p + 1 for p in range(n)] for r in self.rows.tolist()],
            self.rows.tolist(),
        )
        out = self.runner.forward(host.to_device(self.runner.device, self.runner.staging))
        self.first_logits = out.next_token_logits.float().clone()  # [bs, V]
        self.tokens = out.next_token_logits.argmax(-1)
        self.pos = n
        self.history = [self.tokens]

    def step(self) -> None:
        slots = (self.rows - 1) * self.max_len + self.pos + 1
        host = HostBatch(
            ForwardMode.DECODE,
            np.zeros(self.bs, np.int64),
            np.full(self.bs, self.pos),
            slots,
            self.rows,
            np.full(self.bs, self.pos + 1),
            np.ones(self.bs, np.int64),
        )
        if self.use_graph:
            out = self.runner.forward_host(host, input_ids=self.tokens)
        else:
            batch = host.to_device(self.runner.device, self.runner.staging)
            out = self.runner.forward(dataclasses.replace(batch, input_ids=self.tokens))
        self.tokens = out.next_token_logits.argmax(-1)
        self.history.append(self.tokens)
        self.pos += 1


def sequence_len(args) -> int:
    """Positions a decode run reaches: prompt, warm-up, timed and profiled steps."""
    return args.prompt_len + args.warmup_steps + args.decode_steps + args.profile_steps + 2


def parse_sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def bench_variant(make_decoder: Callable[[], Decoder], prompts: torch.Tensor, args) -> dict:
    """Warm up, time `repeats` runs of decode_steps, profile a few steps; also returns the
    greedy tokens of the first run (for the agreement check)."""
    step_times, host_times, tokens, first_logits = [], [], None, None
    for repeat in range(args.repeats):
        decoder = make_decoder()
        decoder.prefill(prompts)
        for _ in range(args.warmup_steps):
            decoder.step()
        step_s, host_s = time_loop(decoder.runner.device, decoder.step, args.decode_steps)
        step_times.append(step_s)
        host_times.append(host_s)
        if repeat == 0:
            tokens = torch.stack(decoder.history, dim=1).cpu()  # [bs, 1 + steps]
            first_logits = decoder.first_logits.cpu()
    kernels, busy_ms, top = profile_kernels(decoder.runner.device, decoder.step, args.profile_steps)
    step_s = statistics.median(step_times)
    return {
        "step_ms": step_s * 1e3,
        "host_us": statistics.median(host_times) * 1e6,
        "kernels_per_step": kernels,
        "gpu_busy_ms": busy_ms,
        "top_kernels": top,
        "tokens": tokens,
        "first_logits": first_logits,
    }


def bench_compiled(runner: ModelRunner, bs: int, args) -> dict:
    from benchmarks.static_kv_baseline import compile_decoder

    device = runner.device
    max_len = sequence_len(args)
    decoder, step = compile_decoder(runner.model, bs, max_len)
    tokens = torch.zeros(bs, dtype=torch.int64, device=device)
    pos = torch.tensor([args.prompt_len], device=device)
    compile_start = time.perf_counter()

    def one() -> None:
        nonlocal tokens
        with torch.inference_mode():
            tokens = step(tokens, pos).argmax(-1)
        pos.add_(1)

    for _ in range(args.warmup_steps + 3):  # the first calls compile and record the graph
        one()
    sync(device)
    compile_s = time.perf_counter() - compile_start
    times = []
    for _ in range(args.repeats):
        pos.fill_(args.prompt_len)
        times.append(time_loop(device, one, args.decode_steps))
    kernels, busy_ms, top = profile_kernels(device, one, args.profile_steps)
    return {
        "step_ms": statistics.median(t[0] for t in times) * 1e3,
        "host_us": statistics.median(t[1] for t in times) * 1e6,
        "kernels_per_step": kernels,
        "gpu_busy_ms": busy_ms,
        "top_kernels": top,
        "compile_s": compile_s,
        "tokens": None,
        "first_logits": None,
    }


def compiled_results(path: str, load_format: str, sizes: list[int], args) -> dict[int, dict]:
    """The compiled baseline of the model at each batch size (run in a child process)."""
    runner = build_runner(path, load_format, args, "triton", graph_bs=0)
    return {bs: bench_compiled(runner, bs, args) for bs in sizes}


def run_apart(fn: Callable, *args):
    """fn(*args) in a spawned process of its own (fn and args picklable). The compiled baseline
    runs so: torch.compile's CUDA graphs (reduce-overhead mode) clear the process's cuBLAS
    workspaces when they record, and graphs this process captured earlier still write into the
    freed workspace, so the next replay that runs a library GEMM (the 8B shape at batch 64)
    corrupts memory or faults. Dummy weights come from the seed, so the child's are the same."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def bench_model(name: str, tmp_dir: str, args, bandwidth: float) -> list[dict]:
    path, load_format = resolve_model(name, tmp_dir, args)
    sizes = parse_sizes(args.batch_size)
    variants = [v.strip() for v in args.variants.split(",")]
    max_len = sequence_len(args)
    generator = torch.Generator().manual_seed(args.seed)
    vocab = read_arch_config(path).vocab_size
    prompts_of = {
        bs: torch.randint(0, vocab, (bs, args.prompt_len), generator=generator) for bs in sizes
    }  # the same prompts for every variant
    results: dict[tuple[str, int], dict] = {}
    weight_bytes, num_layers = 0, 0
    for group in GROUPS:
        wanted = [
            v
            for v in variants
            if v.split("+")[0] == group or (group == "triton" and v == "compiled")
        ]
        gemv_configs = args.gemv_configs if group == "triton" else []
        if not wanted and not gemv_configs:
            continue
        with_graphs = gemv_configs or any(v.endswith("+graph") for v in wanted)
        graph_bs = max(sizes) if with_graphs else 0
        configure_kernels(group)
        backend = "torch_native" if group == "torch_native" else "triton"
        runner = build_runner(path, load_format, args, backend, graph_bs)
        weight_bytes, num_layers = weight_bytes_per_token(runner), runner.config.num_layers
        for bs in sizes:
            prompts = prompts_of[bs]
            for variant in wanted:
                if variant == "compiled":
                    continue  # after the group, in a process of its own
                print(f"{name}: {variant} at batch {bs}", file=sys.stderr, flush=True)
                use_graph = variant.endswith("+graph")
                results[(variant, bs)] = bench_variant(
                    lambda r=runner, b=bs, g=use_graph: Decoder(r, b, max_len, g), prompts, args
                )
        for config in gemv_configs:  # the same runner, its graphs captured again
            configure_kernels(group, config)
            runner.decode_graphs = None
            torch.cuda.empty_cache()
            on_cuda = runner.device.type == "cuda"
            runner.decode_graphs = decode_graphs(runner, graph_bs, capture=on_cuda)
            tag = f"{config.block_n},{config.block_k},{config.num_warps}"  # as --gemv-configs
            for bs in sizes:
                results[(f"triton+graph@{tag}", bs)] = bench_variant(
                    lambda r=runner, b=bs: Decoder(r, b, max_len, True), prompts_of[bs], args
                )
        if "compiled" in wanted and runner.device.type == "cuda":
            print(f"{name}: compiled at batch {args.batch_size}", file=sys.stderr, flush=True)
            for bs, result in run_apart(compiled_results, path, load_format, sizes, args).items():
                results[("compiled", bs)] = result
        configure_kernels("triton")
        del runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return summarize(name, results, weight_bytes, num_layers, bandwidth)


def summarize(name, results, weight_bytes, num_layers, bandwidth) -> list[dict]:
    rows = []
    for (variant, bs), r in results.items():
        reference = results.get(("torch_native", bs), {})
        agree = logits_diff = None
        if reference and r["tokens"] is not None:
            # Greedy tokens agree exactly in float32; in bfloat16 a near-tie at one step sends
            # a whole sequence another way, so the prefill logits' relative difference is the
            # fairer check there.
            agree = float((r["tokens"] == reference["tokens"]).float().mean())
            want = reference["first_logits"]
            logits_diff = float((r["first_logits"] - want).norm() / want.norm())
        kernels = r["kernels_per_step"]
        roofline = bandwidth / weight_bytes * bs  # weights read once per step, whole batch
        rows.append(
            {
                "model": name,
                "variant": variant,
                "batch_size": bs,
                "step_ms": r["step_ms"],
                "tokens_per_s": bs / (r["step_ms"] / 1e3),
                "host_us_per_step": r["host_us"],
                "kernels_per_step": kernels,
                "kernels_per_layer": None if kernels is None else kernels / num_layers,
                "weight_bytes": weight_bytes,
                "roofline_tokens_per_s": roofline,
                "fraction_of_roofline": bs / (r["step_ms"] / 1e3) / roofline,
                "greedy_agreement_with_torch_native": agree,
                "prefill_logits_rel_diff_vs_torch_native": logits_diff,
                "compile_s": r.get("compile_s"),
                "gpu_busy_ms_per_step": r["gpu_busy_ms"],
                "top_kernels": r["top_kernels"],
            }
        )
    for row in rows:  # ratios against the compiled baseline at the same batch size
        base = next(
            (
                x
                for x in rows
                if x["variant"] == "compiled" and x["batch_size"] == row["batch_size"]
            ),
            None,
        )
        row["vs_compiled"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
    return rows


def print_table(report: dict) -> None:
    print(
        f"device {report['device_name']} ({report['dtype']}), prompt {report['prompt_len']}, "
        f"{report['decode_steps']} steps x {report['repeats']} runs; bandwidth measured "
        f"{report['bandwidth_gbps']:.0f} GB/s"
    )
    header = (
        "model",
        "variant",
        "bs",
        "step ms",
        "busy ms",
        "tok/s",
        "host us",
        "kern/step",
        "kern/layer",
        "of roof",
        "vs comp",
    )
    print(f"{header[0]:<10}{header[1]:<22}" + "".join(f"{h:>10}" for h in header[2:]))

    def fmt(value, spec):
        return f"{value:{spec}}" if value is not None else "-"

    for r in report["results"]:
        print(
            f"{r['model'][-10:]:<10}{r['variant']:<22}{r['batch_size']:>10}"
            f"{r['step_ms']:>10.3f}{fmt(r['gpu_busy_ms_per_step'], '.3f'):>10}"
            f"{r['tokens_per_s']:>10.0f}{r['host_us_per_step']:>10.0f}"
            f"{fmt(r['kernels_per_step'], '.0f'):>10}{fmt(r['kernels_per_layer'], '.1f'):>10}"
            f"{r['fraction_of_roofline']:>10.1%}{fmt(r['vs_compiled'], '.2f'):>10}"
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
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "repeats": args.repeats,
        "bandwidth_gbps": bandwidth / 1e9,
        "h100_bandwidth_gbps": H100_BANDWIDTH_TBPS * 1e3,
        "results": [],
    }
    with tempfile.TemporaryDirectory(prefix="aerie-bench-") as tmp_dir:
        for name in args.models.split(","):
            report["results"] += bench_model(name.strip(), tmp_dir, args, bandwidth)
    print_table(report)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
