"""Training data from the target itself: its responses to a prompt file, generated in batches on
Aerie's own model runner. Finished rows are refilled with the next prompts; finishing is
checked every `check_every` steps (one host sync), and tokens past a stop token dropped.
Output: a token file with extra arrays `dev`, `greedy` and `finished`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from aerie.model_info import read_model_info
from gpu_worker.model_runner import ModelRunner, PoolSpec, RunnerSpec
from gpu_worker.step.forward_batch import ForwardMode
from gpu_worker.step.host_batch import HostBatch
from training.target import resolve_device
from training.tokens import TokenFile


@dataclass
class GenerateConfig:
    model: str
    prompts: str
    out: str
    batch_size: int = 256
    max_new_tokens: int = 1024
    sampled_per_prompt: int = 1
    temperature: float = 0.7
    max_prompts: int = 0  # 0 = every prompt
    max_minutes: float = 0.0  # 0 = no limit: stop taking new prompts when it is up
    check_every: int = 16
    prefill_tokens: int = 16384  # prompt tokens per prefill forward
    seed: int = 0
    device: str = "auto"
    load_format: str = "auto"  # dummy: random weights (to measure the tool's speed)


@dataclass
class Row:
    job: int  # index into the job list (a prompt and greedy or sampled)
    length: int  # KV length so far (prompt + generated)
    tokens: list[int]  # generated so far
    checked: int = 0  # tokens[:checked] hold no stop token


class Generator:
    def __init__(self, cfg: GenerateConfig, prompts: TokenFile) -> None:
        self.cfg = cfg
        if cfg.sampled_per_prompt and cfg.temperature <= 0:
            raise ValueError("sampled responses need --temperature > 0 (or --sampled-per-prompt 0)")
        device = resolve_device(cfg.device)
        cuda = device.type == "cuda"
        # a row may run up to check_every steps past its cap before the check drops them
        self.row_len = int(prompts.lengths.max()) + cfg.max_new_tokens + cfg.check_every + 1
        spec = RunnerSpec(
            cfg.model,
            device=str(device),
            dtype=torch.bfloat16 if cuda else torch.float32,
            load_format=cfg.load_format,
            attention_backend="triton" if cuda else "torch_native",
            cuda_graph_max_bs=cfg.batch_size if cuda else 0,
        )
        pools = PoolSpec(
            max_running_requests=cfg.batch_size + 1,
            context_length=self.row_len,
            max_total_tokens=(cfg.batch_size + 1) * self.row_len,
        )
        self.runner = ModelRunner(spec, pools)
        self.device = device
        self.prompts = prompts
        self.stop_ids = np.array(read_model_info(cfg.model).eos_token_ids, dtype=np.int64)
        # Row r (1..batch_size) keeps position p in slot r * row_len + p: a fixed layout.
        positions = torch.arange(self.row_len, device=device)
        for r in range(1, cfg.batch_size + 1):
            self.runner.req_to_token_pool.req_to_token[r, : self.row_len] = (
                r * self.row_len + positions
            ).int()
        self.generator = torch.Generator(device).manual_seed(cfg.seed)
        self.jobs: list[tuple[int, bool]] = []  # (prompt, greedy), see run

    def slot(self, row: int, position: int) -> int:
        return row * self.row_len + position

    def sample(self, logits: torch.Tensor, greedy: list[bool]) -> torch.Tensor:
        """logits [n, V] -> tokens [n]: argmax where greedy, else sampled at temperature."""
        chosen = logits.argmax(-1)
        if all(greedy):
            return chosen
        probs = torch.softmax(logits.float() / self.cfg.temperature, -1)
        sampled = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        return torch.where(torch.tensor(greedy, device=self.device), chosen, sampled)

    def is_greedy(self, rows: dict[int, Row], which: list[int]) -> list[bool]:
        return [self.jobs[rows[r].job][1] for r in which]

    def prefill(self, rows: dict[int, Row], free: list[int], queue: list[int]) -> None:
        """Start the next prompts in the free rows (up to prefill_tokens prompt tokens, at
        least one prompt) and append their first tokens."""
        started: list[int] = []
        budget = self.cfg.prefill_tokens
        while (
            free
            and queue
            and (not started or budget >= self.prompts.lengths[self.jobs[queue[0]][0]])
        ):
            r, p = free.pop(0), queue.pop(0)
            rows[r] = Row(p, int(self.prompts.lengths[self.jobs[p][0]]), [])
            budget -= rows[r].length
            started.append(r)
        ids = [
            self.prompts.sequence(self.jobs[rows[r].job][0]).astype(np.int64).tolist()
            for r in started
        ]
        host = HostBatch.from_requests(
            ForwardMode.EXTEND,
            ids,
            [0] * len(started),
            [[self.slot(r, p) for p in range(len(i))] for r, i in zip(started, ids, strict=True)],
            started,
        )
        out = self.runner.forward(host.to_device(self.device, self.runner.staging))
        first = self.sample(out.next_token_logits, self.is_greedy(rows, started))
        for r, t in zip(started, first.tolist(), strict=True):
            rows[r].tokens.append(t)

    def decode(self, rows: dict[int, Row], active: list[int]) -> np.ndarray:
        """Up to check_every decode steps of the active rows -> their tokens [steps, n] (host;
        the one synchronisation of the window)."""
        steps = min(
            self.cfg.check_every, max(self.cfg.max_new_tokens - len(rows[r].tokens) for r in active)
        )
        steps = max(steps, 1)
        bs = len(active)
        rows_np = np.array(active, dtype=np.int64)
        tokens = torch.tensor([rows[r].tokens[-1] for r in active], device=self.device)
        greedy = self.is_greedy(rows, active)
        lengths = np.array([rows[r].length for r in active], dtype=np.int64)
        out_tokens = []
        for _ in range(steps):
            # the newest token sits at position `lengths` (its KV is written by this step)
            host = HostBatch(
                ForwardMode.DECODE,
                np.zeros(bs, np.int64),
                lengths.copy(),
                rows_np * self.row_len + lengths,
                rows_np,
                lengths + 1,
                np.ones(bs, np.int64),
            )
            logits = self.runner.forward_host(host, input_ids=tokens).next_token_logits
            tokens = self.sample(logits[:bs], greedy)
            out_tokens.append(tokens)
            lengths += 1
        for r, length in zip(active, lengths.tolist(), strict=True):
            rows[r].length = length
        return torch.stack(out_tokens).cpu().numpy()

    def finished(self, row: Row) -> tuple[list[int], bool] | None:
        """(the response, ended by a stop token) once the row is done, else None; only the
        tokens since the last check are searched."""
        new = np.asarray(row.tokens[row.checked :], dtype=np.int64)
        stops = np.flatnonzero(np.isin(new, self.stop_ids))
        cap = self.cfg.max_new_tokens
        if len(stops) and row.checked + stops[0] < cap:
            return row.tokens[: row.checked + stops[0] + 1], True
        if len(row.tokens) >= cap:
            return row.tokens[:cap], False
        row.checked = len(row.tokens)
        return None

    def run(self) -> TokenFile:
        cfg, prompts = self.cfg, self.prompts
        n = len(prompts) if cfg.max_prompts <= 0 else min(cfg.max_prompts, len(prompts))
        dev = prompts.extra.get("dev", np.zeros(len(prompts), bool)).astype(bool)
        # (prompt, greedy): every greedy answer first, so a time limit cuts sampled ones
        self.jobs = [(p, True) for p in range(n)] + [
            (p, False) for _ in range(cfg.sampled_per_prompt) for p in range(n) if not dev[p]
        ]
        queue = list(range(len(self.jobs)))
        free = list(range(1, cfg.batch_size + 1))
        rows: dict[int, Row] = {}
        done: dict[int, tuple[list[int], bool]] = {}
        deadline = time.monotonic() + cfg.max_minutes * 60 if cfg.max_minutes > 0 else float("inf")
        start = last_report = time.monotonic()
        generated = 0
        while queue or rows:
            if time.monotonic() > deadline and queue:
                print(f"time limit: {len(queue)} responses not started", flush=True)
                queue.clear()
            while free and queue:  # refill every free row before decoding on
                self.prefill(rows, free, queue)
            if not rows:
                break
            active = sorted(rows)
            window = self.decode(rows, active)  # [steps, len(active)] on the host
            generated += window.size
            for j, r in enumerate(active):
                rows[r].tokens.extend(window[:, j].tolist())
                result = self.finished(rows[r])
                if result is not None:
                    done[rows.pop(r).job] = result
                    free.append(r)
            if time.monotonic() - last_report > 15 or not (queue or rows):
                last_report = time.monotonic()
                elapsed = last_report - start
                print(
                    f"generated {len(done)}/{len(self.jobs)} responses, {generated / 1e6:.2f}M "
                    f"tokens, {generated / elapsed / 1e3:.1f}k tok/s",
                    flush=True,
                )
        order = sorted(done)
        idx = np.array([self.jobs[j][0] for j in order], dtype=np.int64)
        seqs = [
            np.concatenate([prompts.sequence(p), np.array(done[j][0], dtype=np.uint32)])
            for j, p in zip(order, idx, strict=True)
        ]
        return TokenFile.from_sequences(
            seqs,
            prompts.lengths[idx],
            dev=dev[idx],
            prompt=idx,
            greedy=np.array([self.jobs[j][1] for j in order], dtype=bool),
            finished=np.array([done[j][1] for j in order], dtype=bool),
        )


def generate(cfg: GenerateConfig) -> TokenFile:
    prompts = TokenFile.load(cfg.prompts)
    data = Generator(cfg, prompts).run()
    data.save(cfg.out)
    print(
        f"wrote {cfg.out}: {len(data)} sequences, {data.num_response_tokens() / 1e6:.2f}M "
        f"response tokens ({int(data.extra['finished'].sum())} ended by a stop token)"
    )
    return data
