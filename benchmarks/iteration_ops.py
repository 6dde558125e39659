"""Every launch of one speculative iteration outside the decoder layers, with its source line,
on CPU: each aten kernel and Triton launch of a recorded iteration, tagged with its stage and
the innermost line of this repository that made it.

    python3 benchmarks/iteration_ops.py --model-path <target dir> --draft-path <draft dir> \
      --algorithm EAGLE3 --shape 3,1,4 [--load-format dummy] [--json ops.json]
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (CPU)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from aerie.config import AerieConfig  # noqa: E402
from benchmarks.iteration_timing import Replayer  # noqa: E402
from gpu_worker.graphs.stage_graph import StageGraph  # noqa: E402
from gpu_worker.layers.layernorm import set_use_triton  # noqa: E402
from gpu_worker.worker import GPUWorker  # noqa: E402

# Allocations, and what the dispatcher computes on the host.
NOT_KERNELS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
NOT_KERNELS |= {"result_type"}


def where(frame) -> tuple[str, str, bool]:
    """(stage, innermost repository line, inside a decoder layer) of the code at `frame`."""
    stage, line, in_layer = "host", "?", False
    while frame is not None:
        code, owner = frame.f_code, frame.f_locals.get("self")
        path = os.path.abspath(code.co_filename)
        if line == "?" and path.startswith(ROOT) and path != os.path.abspath(__file__):
            line = f"{os.path.relpath(path, ROOT)}:{frame.f_lineno} ({code.co_name})"
        if type(owner).__name__.endswith("DecoderLayer"):
            in_layer = True
        if stage == "host" and isinstance(owner, StageGraph):
            stage = owner.name
        frame = frame.f_back
    return stage, line, in_layer


class Recorder(TorchDispatchMode):
    """Records launches while `on`: aten kernels here, Triton launches through `triton_hook`."""

    def __init__(self) -> None:
        super().__init__()
        self.on, self.launches = False, []

    def add(self, op: str) -> None:
        stage, line, in_layer = where(inspect.currentframe().f_back.f_back)
        if not in_layer:
            self.launches.append({"stage": stage, "op": op, "line": line})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.on and not func.is_view and name not in NOT_KERNELS:
            self.add(name)
        return out


def triton_hook(recorder: Recorder):
    """Count every Triton launch (the interpreter runs it with aten calls of its own, which
    are not kernels on the GPU: they are left out). Returns the hook's undo."""
    from triton.runtime import interpreter

    run = interpreter.InterpretedFunction.run

    def traced(self, *args, **kwargs):
        if recorder.on:
            recorder.add(f"triton {self.fn.__name__}")
        on, recorder.on = recorder.on, False
        try:
            return run(self, *args, **kwargs)
        finally:
            recorder.on = on

    interpreter.InterpretedFunction.run = traced
    return lambda: setattr(interpreter.InterpretedFunction, "run", run)


def make_config(args) -> AerieConfig:
    steps, topk, num_draft = (int(v) for v in args.shape.split(","))
    return AerieConfig().replace(
        model={
            "model_path": args.model_path,
            "tokenizer_path": args.model_path,
            "device": "cpu",
            "dtype": args.dtype,
            "load_format": args.load_format,
            "context_length": 512,
        },
        cache={"max_total_tokens": 2048},
        scheduler={"max_running_requests": 1},
        speculative={
            "speculative_algorithm": args.algorithm,
            "speculative_draft_model_path": args.draft_path,
            "speculative_num_steps": steps,
            "speculative_eagle_topk": topk,
            "speculative_num_draft_tokens": num_draft,
            "speculative_adaptive": "off",
        },
        runner={"attention_backend": "triton", "cuda_graph_max_bs": 1},
    )


def record_iteration(args) -> list[dict]:
    worker = GPUWorker(make_config(args))
    for runner in worker.runners:  # the references inside the layers: nothing recorded there
        for module in runner.model.modules():
            if type(module).__name__.endswith("DecoderLayer"):
                set_use_triton(module, False)
    replay = Replayer(worker, make_config(args), 1, args.context_len, args.temperature)
    replay.execute()
    replay.restore()
    recorder = Recorder()
    undo = triton_hook(recorder)
    try:
        with recorder:
            recorder.on = True
            worker.execute(replay.plan)
            recorder.on = False
    finally:
        undo()
    return recorder.launches


def summary(launches: list[dict]) -> str:
    rows = collections.Counter((x["stage"], x["line"], x["op"]) for x in launches)
    stages = collections.Counter(x["stage"] for x in launches)
    lines = [f"{len(launches)} launches outside the decoder layers"]
    for stage, count in stages.items():
        lines.append(f"\n{stage}: {count}")
        lines += [f"  {n:3d}  {op:28s} {line}" for (s, line, op), n in rows.items() if s == stage]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model-path", required=True, help="the target's directory")
    p.add_argument("--draft-path", default=None, help="the draft's directory (not for MTP)")
    p.add_argument("--algorithm", default="EAGLE3", help="EAGLE3, EAGLE or MTP")
    p.add_argument("--shape", default="3,1,4", help="S,topk,ND")
    p.add_argument("--load-format", default="dummy", help="dummy: random weights")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context-len", type=int, default=16, help="prompt tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0: the greedy iteration")
    p.add_argument("--json", default=None, help="write every launch here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if torch.cuda.is_available():
        raise SystemExit("iteration_ops runs on CPU (Triton's interpreter); use --profile on CUDA")
    launches = record_iteration(args)
    print(summary(launches))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "algorithm": args.algorithm, "launches": launches}, f)
    return launches


if __name__ == "__main__":
    main()
