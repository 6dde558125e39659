"""Configuration: one frozen dataclass per concern, composed into `AerieConfig`.

The command line is generated from these dataclasses (`build_arg_parser`, `config_from_args`)
so every default and help text is written once. Flag names follow SGLang: the field
`chunked_prefill_size` is the flag `--chunked-prefill-size`. Values spelled "auto" or None are
resolved once, by `aerie.resolve.resolve_config`, into a new object; nothing mutates a config.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any


def _opt(
    default: Any,
    help: str,
    choices: tuple[str, ...] | None = None,
    flag: bool = False,
    secret: bool = False,
    aliases: dict[str, str] | None = None,
):
    """A config field; secret ones never appear in `to_flat_dict` (logs, /server_info).
    aliases (flags only): other spellings and their argparse action on the same field."""
    metadata = {
        "help": help,
        "choices": choices,
        "flag": flag,
        "secret": secret,
        "aliases": aliases or {},
    }
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class ModelConfig:
    model_path: str | None = _opt(
        None, "HF model directory (safetensors). Default: SmolLM2-135M-Instruct, converted once."
    )
    tokenizer_path: str | None = _opt(None, "Tokenizer directory. Default: the model directory.")
    device: str = _opt("auto", "Device to run the model on.", ("auto", "cpu", "cuda"))
    dtype: str = _opt(
        "auto", "Weight and activation dtype.", ("auto", "float32", "bfloat16", "float16")
    )
    load_format: str = _opt(
        "auto",
        "dummy: random weights from config.json (for benchmarks).",
        ("auto", "safetensors", "dummy"),
    )
    context_length: int | None = _opt(
        None,
        "Max tokens of prompt + output per request (default: the model's max_position_embeddings).",
    )
    random_seed: int = _opt(0, "Seeds dummy weights and the seeds drawn for unseeded requests.")


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = _opt(1, "Tokens per KV page.")
    max_total_tokens: int | None = _opt(None, "KV cache capacity in tokens (default: by memory).")
    mem_fraction_static: float | None = _opt(
        None, "Fraction of device memory for weights + KV cache (default 0.85 on CUDA)."
    )
    disable_radix_cache: bool = _opt(
        False,
        "Prefill every prompt in full: no prefix cache. By default the KV of finished "
        "requests stays cached (until its pages are needed) and a new request reuses its "
        "longest cached prefix, for the target and every draft. --enable-prefix-caching / "
        "--no-enable-prefix-caching are accepted as vLLM spells them.",
        flag=True,
        aliases={
            "--no-enable-prefix-caching": "store_true",
            "--enable-prefix-caching": "store_false",
        },
    )


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int | None = _opt(
        None, "Max requests decoding at once (default: 256 on CUDA, 32 on CPU)."
    )
    chunked_prefill_size: int = _opt(8192, "Max prompt tokens run in one prefill step.")
    schedule_conservativeness: float = _opt(
        1.0,
        "Scales the KV kept back, when admitting requests, for running requests' future "
        "outputs. Lower admits more at the risk of retracting (and recomputing) requests "
        "when KV runs out; 0 admits on free KV alone.",
    )
    disable_overlap_schedule: bool = _opt(
        False,
        "Plan each step only after the previous one's result (one plan in flight); by default "
        "the scheduler plans step N+1 while the GPU runs step N.",
        flag=True,
    )


@dataclass(frozen=True)
class RunnerConfig:
    attention_backend: str = _opt(
        "auto",
        "Attention implementation (and the layer kernels with it): triton on CUDA, "
        "torch_native (the reference) on CPU; triton on CPU needs TRITON_INTERPRET=1.",
        ("auto", "torch_native", "triton"),
    )
    disable_cuda_graph: bool = _opt(False, "Run every forward eagerly.", flag=True)
    enable_deterministic_inference: bool = _opt(
        False,
        "Compute every token the same way whatever else runs: a request's output is then the "
        "same at any load, with or without speculation (greedy, and sampled with a seed). "
        "Batch-invariant projections and attention, at some cost in speed; needs the triton "
        "backend and one GPU per replica.",
        flag=True,
    )
    cuda_graph_max_bs: int | None = _opt(
        None,
        "Largest batch size captured in a CUDA graph (default: "
        "--max-running-requests, at most 512); larger decode batches run eagerly.",
    )
    cuda_graph_max_prefill_tokens: int | None = _opt(
        None,
        "Largest prefill step (prompt tokens of all its requests) replayed as a CUDA graph; "
        "longer ones, and steps of more than 64 requests, run eagerly; 0 runs every prefill "
        "eagerly. Default: 1024 on CUDA.",
    )


@dataclass(frozen=True)
class SpeculativeConfig:
    speculative_algorithm: str | None = _opt(
        None,
        "Speculative decoding algorithm (default: none, plain decoding).",
        ("EAGLE", "EAGLE3", "MTP"),
    )
    speculative_draft_model_path: str | None = _opt(
        None,
        "Draft model directory (default: the draft shipped for the default "
        "model; MTP: the layers in the target checkpoint).",
    )
    speculative_num_steps: int | None = _opt(
        None, "Draft depth S (default: 3, at most the draft's MTP layers)."
    )
    speculative_eagle_topk: int | None = _opt(
        None, "Branches per draft step (default: 1, a chain)."
    )
    speculative_num_draft_tokens: int | None = _opt(
        None, "Tree nodes verified per step (ND) (default: S + 1 for a chain, else at most 8)."
    )

    speculative_adaptive: str = _opt(
        "on",
        "on: before each decode step, speculate or decode plainly, whichever the measured "
        "step costs and the running acceptance expect to be faster for that batch; off: "
        "always speculate.",
        ("on", "off"),
    )
    speculative_step_costs: str | None = _opt(
        None,
        "The step costs adaptive speculation compares, as JSON (the shape /server_info shows "
        "under speculative_step_costs). Default: measured by the GPU worker at start-up "
        "(on CUDA; without them, on CPU, every decode step speculates).",
    )

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm is not None

    @property
    def adaptive(self) -> bool:
        """Whether decode steps may run as plain decoding (`speculative_adaptive`)."""
        return self.enabled and self.speculative_adaptive == "on"

    @property
    def decode_alloc_len(self) -> int:
        """KV positions reserved per request per decode step (resolved config only).

        1 without speculation. With it, the step writes draft scratch at positions
        seq + branch * S + step (draft pool) and the ND verify nodes at seq .. seq + ND - 1
        (target pool), so it needs max(ND, topk * S) positions from seq.
        """
        if not self.enabled:
            return 1
        steps, topk = self.speculative_num_steps or 1, self.speculative_eagle_topk or 1
        return draft_alloc_len(topk, steps, self.speculative_num_draft_tokens or steps + 1)

    @property
    def draft_lookahead(self) -> int:
        """How many later tokens a draft's KV at a position was made with: 0 without a draft,
        1 for EAGLE (features at p, token p + 1), S for MTP (layer k reads token p + 1 + k).
        A cached prefix is reused only up to that many tokens short of its match."""
        if not self.enabled:
            return 0
        if self.speculative_algorithm == "MTP":
            return self.speculative_num_steps or 1
        return 1


def draft_alloc_len(topk: int, num_steps: int, num_draft_tokens: int) -> int:
    """Positions past `seq` one speculative decode iteration touches: max(ND, topk * S)."""
    return max(num_draft_tokens, topk * num_steps)


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = _opt(
        1,
        "Tensor-parallel ranks: the model's heads, MLP and vocabulary are split over this "
        "many GPUs (one process each; on CPU, processes joined over gloo).",
    )
    dp_size: int = _opt(
        1,
        "Data-parallel replicas (each a scheduler and --tp-size GPUs) behind the one "
        "frontend, which sends each new request to the replica with the fewest unfinished.",
    )
    nnodes: int = _opt(
        1,
        "Machines the --tp-size ranks are spread over: run the same command on each, with "
        "its --node-rank. Node 0 serves HTTP/ZMQ and runs the scheduler; the others run "
        "worker ranks only.",
    )
    node_rank: int = _opt(0, "This machine's index among --nnodes (0: the one that serves).")
    disable_custom_all_reduce: bool = _opt(
        False,
        "Sum the tensor-parallel ranks' partial results through NCCL only, not through "
        "buffers in each other's GPU memory (used for small messages on one machine).",
        flag=True,
    )
    dist_init_addr: str | None = _opt(
        None,
        "HOST:PORT where the tensor-parallel ranks meet; rank 0 listens there (with "
        "--nnodes > 1 an address of node 0 every node reaches; default: a free port on "
        "127.0.0.1). Replica d of --dp-size meets at PORT + d.",
    )


@dataclass(frozen=True)
class ServerConfig:
    host: str = _opt("127.0.0.1", "HTTP host.")
    port: int = _opt(30000, "HTTP port (0: any free port, reported when ready).")
    zmq_port: int | None = _opt(
        None, "TCP port of the ZMQ client frontend (default: port + 1; 0 with --port 0)."
    )
    tokenizer_worker_num: int = _opt(
        0,
        "Frontend processes (HTTP, tokenization, detokenization) sharing --port; each owns its "
        "connections and requests. ZMQ clients are served by the first. 0: one per 4 CPU cores "
        "this process may use, 1 to 4.",
    )
    log_level: str = _opt("info", "Log level.", ("debug", "info", "warning", "error"))
    startup_timeout_s: float = _opt(600.0, "Seconds to wait for every process to be ready.")
    drain_timeout_s: float = _opt(30.0, "Seconds running requests get to finish on SIGTERM.")
    served_model_name: str | None = _opt(
        None, "Model name in /v1/models and responses (default: the model directory's name)."
    )
    watchdog_timeout_s: float = _opt(
        30.0,
        "A process that answers no heartbeat for this long, or (but a GPU worker) stays busy "
        "this long without progress, is reported stuck and the server exits (systemd then "
        "restarts it).",
    )
    watchdog_busy_timeout_s: float = _opt(
        600.0,
        "A GPU worker on one step without progress for this long is reported stuck and the "
        "server exits; raise it if one step can take longer (a large chunk on a CPU).",
    )


@dataclass(frozen=True)
class SecurityConfig:
    api_key: str | None = _opt(
        None,
        "Key every client must present: HTTP 'Authorization: Bearer KEY', ZMQ api_key= "
        "(default: $AERIE_API_KEY).",
        secret=True,
    )
    allow_unauthenticated: bool = _opt(
        False,
        "Listen beyond loopback without --api-key (anyone who can connect may use it).",
        flag=True,
    )
    allowed_hosts: str | None = _opt(
        None,
        "Comma list of Host header values HTTP accepts (default: loopback names when "
        "bound to loopback, any otherwise); stops DNS rebinding.",
    )
    zmq_curve: bool = _opt(
        False,
        "Encrypt the ZMQ port with CURVE; the server key pair is kept in the cache "
        "directory (or --zmq-curve-key-file) and its public key is logged at start.",
        flag=True,
    )
    zmq_curve_key_file: str | None = _opt(
        None,
        "File holding the server's CURVE secret key (Z85), created if missing "
        "(default: in the cache directory, with --zmq-curve).",
    )
    enable_debug_info: bool = _opt(
        False,
        "Publish filesystem paths (model, tokenizer, runtime directory) in /server_info, "
        "and where each unfinished request is at GET /debug/requests.",
        flag=True,
    )


@dataclass(frozen=True)
class LimitsConfig:
    max_request_bytes: int = _opt(
        8 << 20, "Largest HTTP body or ZMQ message accepted (413 beyond it)."
    )
    max_batch_size: int = _opt(64, "Most prompts in one /generate batch.")
    max_queued_requests: int = _opt(
        1024, "Requests waiting beyond the running ones; more get 503 with Retry-After."
    )
    max_connections: int = _opt(1024, "Open HTTP connections; more get 503.")
    max_zmq_requests_per_connection: int = _opt(
        256, "Unfinished requests one ZMQ client connection may have; more get a 429 error."
    )
    header_timeout_s: float = _opt(10.0, "Seconds a client gets to send a request's headers.")
    body_timeout_s: float = _opt(30.0, "Seconds a client gets to send a request's body (408).")
    slow_client_timeout_s: float = _opt(
        30.0,
        "Seconds an HTTP client may read nothing while its send buffer is full; then it is "
        "cut off and its unfinished requests are aborted.",
    )


@dataclass(frozen=True)
class AerieConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    # Set by resolution: the per-launch directory holding the ipc:// sockets.
    runtime_dir: str = ""

    def replace(self, **sections: Any) -> AerieConfig:
        """A new config with whole sections or single fields replaced.

        `cfg.replace(cache={"max_total_tokens": 100})` replaces one field of a section.
        """
        updates: dict[str, Any] = {}
        for name, value in sections.items():
            if isinstance(value, dict):
                updates[name] = dataclasses.replace(getattr(self, name), **value)
            else:
                updates[name] = value
        return dataclasses.replace(self, **updates)

    def to_flat_dict(self) -> dict[str, Any]:
        """Every field by its flag name (underscored), for /server_info and logs; secrets
        are left out (an "api_key_set" boolean says whether a key is configured)."""
        flat: dict[str, Any] = {}
        for section in _SECTIONS:
            value = getattr(self, section)
            for f in dataclasses.fields(value):
                if not f.metadata.get("secret"):
                    flat[f.name] = getattr(value, f.name)
        flat["api_key_set"] = self.security.api_key is not None
        flat["runtime_dir"] = self.runtime_dir
        return flat


_SECTIONS = (
    "model",
    "cache",
    "scheduler",
    "runner",
    "speculative",
    "parallel",
    "server",
    "security",
    "limits",
)


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(AerieConfig)
    return {name: hints[name] for name in _SECTIONS}


def _scalar_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _states_default(help_text: str, default: Any) -> bool:
    """Whether a flag's help already says what its default is (then no "(default: ...)"
    is appended); a None default must be explained there, never printed as "None"."""
    if "default" in help_text.lower():
        return True
    if default is None:
        raise ValueError(f"help {help_text!r} must say what its None default means")
    return False


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launch.py", description="Aerie: an LLM server built around EAGLE speculation."
    )
    for section, cls in _section_types().items():
        group = parser.add_argument_group(section)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            meta = f.metadata
            if meta.get("flag"):
                group.add_argument(flag, dest=f.name, action="store_true", help=meta["help"])
                for alias, action in meta["aliases"].items():
                    group.add_argument(alias, dest=f.name, action=action, help=f"see {flag}")
                continue
            group.add_argument(
                flag,
                dest=f.name,
                type=_scalar_type(hints[f.name]),
                default=f.default,
                choices=meta.get("choices"),
                help=meta["help"]
                if _states_default(meta["help"], f.default)
                else f"{meta['help']} (default: {f.default})",
            )
    return parser


def config_from_args(argv: list[str] | None = None) -> AerieConfig:
    args = vars(build_arg_parser().parse_args(argv))
    sections = {}
    for section, cls in _section_types().items():
        sections[section] = cls(**{f.name: args[f.name] for f in dataclasses.fields(cls)})
    return AerieConfig(**sections)
