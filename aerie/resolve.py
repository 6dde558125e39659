"""Resolve a config's "auto" and unset values once, into a new `AerieConfig`.

After `resolve_config` the model path is a local directory, device is "cpu" or "cuda", dtype and
load format are concrete, context length and request limits are ints, the ZMQ port is set and
the runtime directory exists. Only the KV capacity (`max_total_tokens`) may stay None: the GPU
worker measures memory after loading weights and the launcher fills it in from its ready
report. Invalid combinations raise `ConfigError` with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import tempfile

from aerie.config import AerieConfig, SpeculativeConfig
from aerie.endpoints import split_host_port
from aerie.model_info import ModelInfo, read_model_info
from aerie.step_costs import StepCosts


class ConfigError(ValueError):
    """The command line asks for something impossible; the message says what to change."""


def resolve_device(device: str) -> str:
    """ "auto" -> "cuda" when a GPU is present, else "cpu"; "cuda" without one is an error."""
    if device != "auto":
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("--device cuda was given but no CUDA device is available")
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: str | None = None) -> str:
    """ "auto" -> float32 on CPU; on CUDA bfloat16 (float16 for float16 checkpoints)."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    return "float16" if checkpoint_dtype == "float16" else "bfloat16"


def _resolve_load_format(load_format: str, model_path: str) -> str:
    has_weights = bool(glob.glob(os.path.join(model_path, "*.safetensors")))
    if load_format == "auto":
        load_format = "safetensors"
    if load_format == "safetensors" and not has_weights:
        raise ConfigError(
            f"no *.safetensors weights in {model_path!r}. Convert the checkpoint to "
            "safetensors, or pass --load-format dummy for random weights (benchmarks)."
        )
    return load_format


def default_zmq_port(port: int, zmq_port: int | None) -> int:
    """--zmq-port as given, else --port + 1 (0, any free port, when --port is 0 too)."""
    if zmq_port is not None:
        return zmq_port
    return port + 1 if port else 0


def resolve_attention_backend(backend: str, device: str) -> str:
    """ "auto" -> triton on CUDA, torch_native on CPU. Triton on CPU runs in Triton's
    interpreter, which must be switched on before the server starts."""
    if backend == "auto":
        return "triton" if device == "cuda" else "torch_native"
    if backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            "--attention-backend triton on CPU runs in Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment (slow; for testing), or use torch_native"
        )
    return backend


def _deterministic_backend(config: AerieConfig, device: str) -> str:
    """The attention backend asked for, checked against --enable-deterministic-inference,
    which runs only on the triton backend's batch-invariant kernels (the library kernels
    behind torch_native choose their reduction order by batch shape)."""
    backend = config.runner.attention_backend
    if not config.runner.enable_deterministic_inference:
        return backend
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            "--enable-deterministic-inference runs the triton backend, which on CPU needs "
            "Triton's interpreter: set TRITON_INTERPRET=1 in the environment (slow; for testing)"
        )
    if backend == "torch_native":
        raise ConfigError(
            "--enable-deterministic-inference runs on the triton backend's batch-invariant "
            "kernels: drop --attention-backend torch_native (on CPU, set TRITON_INTERPRET=1)"
        )
    if config.parallel.tp_size > 1:
        raise ConfigError(
            "--enable-deterministic-inference is not yet available with --tp-size > 1 (NCCL "
            "sums large messages in an order that depends on their size): use --dp-size"
        )
    return "triton"


def resolve_cuda_graph_max_bs(config: AerieConfig, device: str, default_rows: int) -> int:
    """--cuda-graph-max-bs, else the request limit, at most 512 (CPU: 32; there the same
    padded path runs eagerly). A decode batch above it runs eagerly, several times slower."""
    given = config.runner.cuda_graph_max_bs
    if given is not None:
        if given < 1:
            raise ConfigError("--cuda-graph-max-bs must be >= 1 (use --disable-cuda-graph)")
        return given
    rows = config.scheduler.max_running_requests or default_rows
    return min(rows, MAX_DEFAULT_GRAPH_BS if device == "cuda" else 32)


DEFAULT_PREFILL_GRAPH_TOKENS = 1024
MAX_DEFAULT_GRAPH_BS = 512  # graphs cost start-up time and memory per bucket
CORES_PER_FRONTEND = 4  # the default frontend count: one per this many cores
MAX_FRONTENDS = 64


def resolve_prefill_graph_tokens(config: AerieConfig, device: str) -> int:
    """--cuda-graph-max-prefill-tokens, else DEFAULT_PREFILL_GRAPH_TOKENS on CUDA; 0 (every
    prefill eager) on CPU, where nothing is captured, or with --disable-cuda-graph. At most
    --chunked-prefill-size: no prefill step is longer."""
    given = config.runner.cuda_graph_max_prefill_tokens
    if given is not None and given < 0:
        raise ConfigError("--cuda-graph-max-prefill-tokens must be >= 0 (0: prefill eagerly)")
    if config.runner.disable_cuda_graph:
        return 0
    if given is None:
        given = DEFAULT_PREFILL_GRAPH_TOKENS if device == "cuda" else 0
    return min(given, config.scheduler.chunked_prefill_size)


def _resolve_model_path(model_path: str | None) -> str:
    if model_path is None:
        from aerie.default_model import ensure_default_model

        return ensure_default_model()
    path = os.path.abspath(os.path.expanduser(model_path))
    if not os.path.isdir(path):
        raise ConfigError(f"--model-path {model_path!r} is not a directory")
    return path


def _check_positive(name: str, value: int | float | None) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")


def _validate(config: AerieConfig) -> None:
    for name in ("page_size", "max_total_tokens"):
        _check_positive(name, getattr(config.cache, name))
    _check_positive("chunked_prefill_size", config.scheduler.chunked_prefill_size)
    _check_positive("max_running_requests", config.scheduler.max_running_requests)
    _check_positive("context_length", config.model.context_length)
    if not 0 <= config.scheduler.schedule_conservativeness <= 10:
        raise ConfigError("--schedule-conservativeness must be in [0, 10]")
    limits = config.limits
    for name in (
        "max_request_bytes",
        "max_batch_size",
        "max_connections",
        "header_timeout_s",
        "body_timeout_s",
        "slow_client_timeout_s",
        "max_zmq_requests_per_connection",
    ):
        _check_positive(name, getattr(limits, name))
    if limits.max_queued_requests < 0:
        raise ConfigError("--max-queued-requests must be >= 0")
    if not 0 <= config.server.tokenizer_worker_num <= MAX_FRONTENDS:
        raise ConfigError(f"--tokenizer-worker-num must be in [0, {MAX_FRONTENDS}] (0: automatic)")
    _check_positive("watchdog_timeout_s", config.server.watchdog_timeout_s)
    _check_positive("watchdog_busy_timeout_s", config.server.watchdog_busy_timeout_s)
    for name in ("port", "zmq_port"):
        port = getattr(config.server, name)
        if port is not None and not 0 <= port <= 65535:
            raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 65535], got {port}")
    fraction = config.cache.mem_fraction_static
    if fraction is not None and not 0 < fraction <= 1:
        raise ConfigError(f"--mem-fraction-static must be in (0, 1], got {fraction}")
    costs = config.speculative.speculative_step_costs
    if costs:
        try:
            StepCosts.from_json(costs)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _resolve_parallel(config: AerieConfig, device: str, info: ModelInfo) -> dict:
    """Check the parallel flags and pick where each replica's ranks meet (replica d at the
    port of --dist-init-addr plus d; by default a free local port)."""
    parallel = config.parallel
    size, replicas, nodes = parallel.tp_size, parallel.dp_size, parallel.nnodes
    if size < 1 or replicas < 1 or nodes < 1:
        raise ConfigError(
            f"--tp-size, --dp-size and --nnodes must be >= 1, got {size}, {replicas}, {nodes}"
        )
    if not 0 <= parallel.node_rank < nodes:
        raise ConfigError(f"--node-rank must be in [0, {nodes}), got {parallel.node_rank}")
    if nodes > 1:
        if replicas != 1 or size % nodes:
            raise ConfigError(
                f"--nnodes {nodes} splits the --tp-size ranks over the machines: --tp-size must "
                f"be a multiple of it ({size} is not) and --dp-size 1"
            )
        if parallel.dist_init_addr is None:
            raise ConfigError(
                f"--nnodes {nodes} needs --dist-init-addr HOST:PORT: an address of node 0 that "
                "every node can reach, the same on every node"
            )
    heads, kv_heads = info.num_attention_heads, info.num_kv_heads
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ConfigError(
            f"--tp-size {size} must divide the model's {heads} attention heads, and divide or "
            f"be a multiple of its {kv_heads} KV heads"
        )
    if device == "cuda":
        import torch

        needed = size * replicas // nodes
        if needed > torch.cuda.device_count():
            raise ConfigError(
                f"--tp-size {size} x --dp-size {replicas} over {nodes} machine(s) needs "
                f"{needed} GPUs here, this machine has {torch.cuda.device_count()}"
            )
    address = parallel.dist_init_addr
    if size > 1 and address is None:
        address = f"127.0.0.1:{free_ports(replicas)}"
    if address is not None:
        try:
            _, port = split_host_port(address)
        except ValueError:
            port = -1
        if not 0 < port <= 65536 - replicas:  # replica d meets at port + d
            raise ConfigError(f"--dist-init-addr must be HOST:PORT, got {address!r}")
    return {"dist_init_addr": address}


def free_port() -> int:
    """A TCP port nothing listens on now (on 127.0.0.1)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_ports(count: int) -> int:
    """The first of `count` consecutive TCP ports nothing listens on now (on 127.0.0.1)."""
    import socket

    for _ in range(100):
        first = free_port()
        if first + count - 1 > 65535:
            continue
        try:
            for port in range(first + 1, first + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise ConfigError(f"found no {count} consecutive free ports for --dist-init-addr: pass one")


DRAFT_ARCHITECTURES = {"EAGLE": "LlamaForCausalLMEagle", "EAGLE3": "LlamaForCausalLMEagle3"}
DEFAULT_NUM_STEPS = 3


def _num_mtp_layers(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return int(json.load(f).get("num_nextn_predict_layers") or 0)


def _is_default_model(model_path: str | None) -> bool:
    """No --model-path, or the converted default model's own directory."""
    from aerie.default_model import default_model_dir

    if model_path is None:
        return True
    default = default_model_dir()
    return os.path.isdir(default) and os.path.samefile(model_path, default)


def _draft_path(spec: SpeculativeConfig, model_path: str | None) -> str | None:
    """--speculative-draft-model-path, else the default model's shipped draft when it is the
    model served (for MTP the target checkpoint may hold the layers itself)."""
    from aerie.default_model import SHIPPED_DRAFT_NAMES, shipped_draft

    if spec.speculative_draft_model_path is not None:
        return os.path.abspath(os.path.expanduser(spec.speculative_draft_model_path))
    if spec.speculative_algorithm not in SHIPPED_DRAFT_NAMES or not _is_default_model(model_path):
        return None
    path = shipped_draft(spec.speculative_algorithm or "")
    if path is None:
        raise ConfigError(
            f"this install ships no {spec.speculative_algorithm} draft for the default model: "
            "pass --speculative-draft-model-path (train one with `python3 -m training`)"
        )
    return path


def _resolve_mtp(spec: SpeculativeConfig, model_path: str) -> SpeculativeConfig:
    """MTP: a chain (topk 1, ND = S+1) of S <= the number of MTP layers, found in the draft
    directory when given, else in the target checkpoint."""
    where = spec.speculative_draft_model_path
    if where is not None:
        where = os.path.abspath(os.path.expanduser(where))
        if not os.path.isfile(os.path.join(where, "config.json")):
            raise ConfigError(f"--speculative-draft-model-path {where} has no config.json")
    num_layers = _num_mtp_layers(where or model_path)
    if num_layers == 0:
        raise ConfigError(
            f"{where or model_path} has no MTP layers (config.json num_nextn_predict_layers); "
            "pass --speculative-draft-model-path with MiMo-layout MTP layers"
        )
    steps = spec.speculative_num_steps or min(DEFAULT_NUM_STEPS, num_layers)
    if not 1 <= steps <= num_layers:
        raise ConfigError(
            f"--speculative-num-steps {steps} needs {steps} MTP layers, but there are "
            f"{num_layers}; use at most {num_layers}"
        )
    if (spec.speculative_eagle_topk or 1) != 1:
        raise ConfigError("MTP drafts a chain: --speculative-eagle-topk must be 1")
    num_draft = spec.speculative_num_draft_tokens or steps + 1
    if num_draft != steps + 1:
        raise ConfigError(
            f"MTP drafts a chain of S={steps} tokens: --speculative-num-draft-tokens must be "
            f"S+1={steps + 1} (got {num_draft})"
        )
    return dataclasses.replace(
        spec,
        speculative_draft_model_path=where,
        speculative_num_steps=steps,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=num_draft,
    )


def _resolve_speculative(spec: SpeculativeConfig, model_path: str) -> SpeculativeConfig:
    """Defaults (S=3, topk=1, ND=S+1) and clear errors for impossible shapes."""
    algorithm = spec.speculative_algorithm
    if algorithm is None:
        given = [
            f.name
            for f in dataclasses.fields(spec)
            if getattr(spec, f.name) not in (None, f.default)
        ]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ConfigError(f"{flags} need --speculative-algorithm (EAGLE, EAGLE3 or MTP)")
        return spec
    if algorithm == "MTP":
        return _resolve_mtp(spec, model_path)
    if algorithm not in DRAFT_ARCHITECTURES:
        raise ConfigError(f"unknown --speculative-algorithm {algorithm}: use EAGLE, EAGLE3 or MTP")
    steps = spec.speculative_num_steps or DEFAULT_NUM_STEPS
    topk = spec.speculative_eagle_topk or 1
    max_nodes = 1 + topk + (steps - 1) * topk * topk
    num_draft = spec.speculative_num_draft_tokens or (steps + 1 if topk == 1 else min(max_nodes, 8))
    if steps < 1 or topk < 1:
        raise ConfigError("--speculative-num-steps and --speculative-eagle-topk must be >= 1")
    if topk == 1 and num_draft != steps + 1:
        raise ConfigError(
            f"with --speculative-eagle-topk 1 the draft is a chain of S={steps} tokens, so "
            f"--speculative-num-draft-tokens must be S+1={steps + 1} (got {num_draft})"
        )
    if not 2 <= num_draft <= max_nodes:
        raise ConfigError(
            f"--speculative-num-draft-tokens {num_draft} is impossible for S={steps}, topk={topk}: "
            f"the draft tree has at most 1 + topk + (S-1)*topk^2 = {max_nodes} nodes "
            "(and at least 2)"
        )
    path = spec.speculative_draft_model_path
    if path is None:
        raise ConfigError(
            f"--speculative-algorithm {algorithm} needs --speculative-draft-model-path"
        )
    architecture = read_model_info(path).architecture
    if architecture != DRAFT_ARCHITECTURES[algorithm]:
        raise ConfigError(
            f"the draft at {path} is a {architecture}; --speculative-algorithm {algorithm} needs a "
            f"{DRAFT_ARCHITECTURES[algorithm]} checkpoint"
        )
    return dataclasses.replace(
        spec,
        speculative_draft_model_path=path,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=num_draft,
    )


def resolve_config(config: AerieConfig) -> AerieConfig:
    """A new config with every auto value resolved (see module docstring)."""
    _validate(config)
    model_path = _resolve_model_path(config.model.model_path)
    speculative = config.speculative
    if speculative.speculative_algorithm is not None:
        draft = _draft_path(speculative, config.model.model_path and model_path)
        speculative = dataclasses.replace(speculative, speculative_draft_model_path=draft)
    speculative = _resolve_speculative(speculative, model_path)
    info = read_model_info(model_path)
    device = resolve_device(config.model.device)
    context_length = config.model.context_length or info.max_position_embeddings
    if context_length > info.max_position_embeddings:
        raise ConfigError(
            f"--context-length {context_length} exceeds the model's max_position_embeddings "
            f"({info.max_position_embeddings})"
        )
    default_rows = 256 if device == "cuda" else 32
    server = config.server
    return config.replace(
        model={
            "model_path": model_path,
            "tokenizer_path": os.path.abspath(config.model.tokenizer_path or model_path),
            "device": device,
            "dtype": resolve_dtype(config.model.dtype, device, info.torch_dtype),
            "load_format": _resolve_load_format(config.model.load_format, model_path),
            "context_length": context_length,
        },
        scheduler={
            "max_running_requests": config.scheduler.max_running_requests or default_rows,
        },
        speculative=speculative,
        parallel=_resolve_parallel(config, device, info),
        runner={
            "attention_backend": resolve_attention_backend(
                _deterministic_backend(config, device), device
            ),
            "cuda_graph_max_bs": resolve_cuda_graph_max_bs(config, device, default_rows),
            "cuda_graph_max_prefill_tokens": resolve_prefill_graph_tokens(config, device),
        },
        server={
            "zmq_port": default_zmq_port(server.port, server.zmq_port),
            "tokenizer_worker_num": server.tokenizer_worker_num or default_frontends(),
            "served_model_name": server.served_model_name or os.path.basename(model_path),
        },
        security=_resolve_security(config),
        runtime_dir=config.runtime_dir or tempfile.mkdtemp(prefix="aerie-"),
    )


def default_frontends(num_cores: int | None = None) -> int:
    """Frontend processes for a machine of num_cores usable cores (default: this process's):
    one per CORES_PER_FRONTEND, 1 to 4. The scheduler and each GPU worker keep a core each."""
    if num_cores is None:
        num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    return max(1, min(4, num_cores // CORES_PER_FRONTEND))


def _resolve_security(config: AerieConfig) -> dict:
    from aerie.access import AccessError, resolve_access
    from aerie.default_model import aerie_cache_dir

    try:
        return resolve_access(config, aerie_cache_dir())
    except AccessError as e:
        raise ConfigError(str(e)) from None
