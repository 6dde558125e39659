"""Resolve a config's "auto" and unset values once, into a new `AerieConfig`.

After `resolve_config` the model path is a local directory, device is "cpu" or "cuda", dtype and
load format are concrete, context length and request limits are ints, the ZMQ port is set and
the runtime directory exists. Only the KV capacity (`max_total_tokens`) may stay None: the GPU
worker measures memory after loading weights and the launcher fills it in from its ready
report. Invalid combinations raise `ConfigError` with a message that says what to change.
"""

from __future__ import annotations

import glob
import os
import tempfile

from aerie.config import AerieConfig
from aerie.model_info import ModelInfo, read_model_info


class ConfigError(ValueError):
    """The command line asks for something impossible; the message says what to change."""


def _resolve_device(device: str) -> str:
    if device != "auto":
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("--device cuda was given but no CUDA device is available")
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve_dtype(dtype: str, device: str, info: ModelInfo) -> str:
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    return "float16" if info.torch_dtype == "float16" else "bfloat16"


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
    fraction = config.cache.mem_fraction_static
    if fraction is not None and not 0 < fraction <= 1:
        raise ConfigError(f"--mem-fraction-static must be in (0, 1], got {fraction}")
    if config.speculative.speculative_algorithm is not None:
        raise ConfigError(
            "--speculative-algorithm is not available in this build yet; "
            "run without it for plain decoding"
        )


def resolve_config(config: AerieConfig) -> AerieConfig:
    """A new config with every auto value resolved (see module docstring)."""
    _validate(config)
    model_path = _resolve_model_path(config.model.model_path)
    info = read_model_info(model_path)
    device = _resolve_device(config.model.device)
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
            "dtype": _resolve_dtype(config.model.dtype, device, info),
            "load_format": _resolve_load_format(config.model.load_format, model_path),
            "context_length": context_length,
        },
        scheduler={
            "max_running_requests": config.scheduler.max_running_requests or default_rows,
        },
        server={"zmq_port": server.zmq_port or server.port + 1},
        runtime_dir=config.runtime_dir or tempfile.mkdtemp(prefix="aerie-"),
    )
