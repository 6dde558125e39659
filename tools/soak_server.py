"""The server the soak launches (`tools/soak.py`): its arguments, its engine processes by
name, and their resident memory."""

from __future__ import annotations

from aerie.endpoints import frontend_name
from tools.soak_plan import MAX_NEW


def rss_mib(pids: dict[str, int]) -> dict[str, float]:
    """Resident memory of each named process (Linux /proc), in MiB."""
    sizes = {}
    for name, pid in pids.items():
        with open(f"/proc/{pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        sizes[name] = kib / 1024
    return sizes


PROCESS_NAMES = ("tokenizer", "scheduler", "gpu_worker")  # "tokenizer": every frontend


def server_pids(server) -> dict[str, int]:
    """The launcher and each engine process, by name. Children name themselves aerie-<name>,
    which the kernel cuts to 15 bytes ("aerie-gpu_worke"): every frontend is "aerie-tokenizer",
    so they are named `frontend_name(i)` ("tokenizer", "tokenizer1", ...) in pid order. Other
    children (multiprocessing's resource tracker) are not engine processes and are left out."""
    pids = {"launcher": server.proc.pid}
    num_frontends = 0
    for pid in sorted(server.children):
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        short = comm.removeprefix("aerie-")
        name = next((n for n in PROCESS_NAMES if n.startswith(short)), None)
        if comm == short or name is None:
            continue
        if name == "tokenizer":
            name, num_frontends = frontend_name(num_frontends), num_frontends + 1
        pids[name] = pid
    return pids


def soak_server_args(
    model_path: str, concurrency: int, draft_path: str | None = None, overlap: bool = True
) -> list[str]:
    """A KV cache for about a third of the in-flight requests' full lengths, admitted without
    reserve: retraction happens throughout. draft_path: an EAGLE draft (chains of 3, trees of
    6 nodes: 6 positions of headroom per step); overlap False: --disable-overlap-schedule.
    --enable-debug-info: /debug/requests tells where a stuck request is."""
    args = [
        "--model-path",
        model_path,
        "--max-running-requests",
        str(concurrency),
        "--max-total-tokens",
        str(max(256, concurrency * (60 + MAX_NEW) // 3)),
        "--page-size",
        "4",
        "--chunked-prefill-size",
        "64",
        "--schedule-conservativeness",
        "0",
        "--enable-debug-info",
    ]
    if draft_path is not None:
        args += [
            "--speculative-algorithm",
            "EAGLE",
            "--speculative-draft-model-path",
            draft_path,
            "--speculative-num-steps",
            "3",
            "--speculative-eagle-topk",
            "2",
            "--speculative-num-draft-tokens",
            "6",
        ]
    if not overlap:
        args.append("--disable-overlap-schedule")
    return args
