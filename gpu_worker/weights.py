"""Weights: load HF safetensors (or weights-only `pytorch_model*.bin`) checkpoints into a model by
parameter name, or fill it with seeded random "dummy" weights.

Names map through `model.map_weight_name` and sharded modules' `checkpoint_loaders`; every
parameter (shard) must load exactly once and every tensor map to one, else `WeightLoadError`.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from gpu_worker.layers.linear import Loader

_MAX_NAMES_SHOWN = 10
# (index file, glob of weight files), in order of preference
_WEIGHT_LAYOUTS = (
    ("model.safetensors.index.json", "*.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
)


class WeightLoadError(ValueError):
    """The checkpoint does not match the model (missing, unexpected or mis-shaped tensors)."""


def list_weight_files(model_dir: str) -> list[str]:
    """The weight files of a checkpoint: those named by model.safetensors.index.json if present,
    else every *.safetensors in the directory, else the pytorch_model*.bin files (by their
    index if present)."""
    for index_name, pattern in _WEIGHT_LAYOUTS:
        index_path = os.path.join(model_dir, index_name)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
            return [os.path.join(model_dir, name) for name in files]
        files = sorted(glob.glob(os.path.join(model_dir, pattern)))
        if files:
            return files
    raise WeightLoadError(
        f"no *.safetensors files in {model_dir!r} (use --load-format dummy for random weights)"
    )


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def iterate_tensors(
    files: list[str], keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor in the files whose name `keep` accepts (all by
    default), one tensor in memory at a time. The data of a skipped safetensors tensor is
    never read (.bin files are memory-mapped), so loading one MTP layer out of a large target
    checkpoint costs little more than its headers."""
    for path in files:
        if path.endswith(".bin"):
            items = _load_bin(path).items()
            yield from ((n, t) for n, t in items if keep is None or keep(n))
            continue
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if keep is None or keep(name):
                    yield name, f.get_tensor(name)


def list_tensor_names(model_dir: str) -> set[str]:
    """Names of every tensor in a checkpoint (safetensors: from the headers, no tensor data)."""
    names: set[str] = set()
    for path in list_weight_files(model_dir):
        if path.endswith(".bin"):
            names.update(_load_bin(path))
            continue
        with safe_open(path, framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


def _describe(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_SHOWN])
    more = len(names) - _MAX_NAMES_SHOWN
    return shown + (f" (and {more} more)" if more > 0 else "")


def checkpoint_loaders(model: nn.Module) -> tuple[dict[str, Loader], set[int]]:
    """The checkpoint names that sharded or merged modules load themselves (`MergedLinear`,
    `RowParallelLinear`, the vocabulary-parallel embedding and LM head: each copies its rank's
    slice), e.g. `model.layers.0.self_attn.k_proj.weight` -> that layer's qkv_proj loader; and
    the ids of the parameters those loaders fill. A parameter shared by two modules (a tied LM
    head) is loaded through the first one only, as `named_parameters` names it once."""
    loaders: dict[str, Loader] = {}
    covered: set[int] = set()
    for path, module in model.named_modules():
        if not hasattr(module, "checkpoint_loaders"):
            continue
        params = [id(p) for p in module.parameters(recurse=False)]
        if params and all(p in covered for p in params):
            continue
        loaders.update(module.checkpoint_loaders(path))
        covered.update(params)
    return loaders, covered


@torch.no_grad()
def load_weights(model: nn.Module, model_dir: str, what: str | None = None) -> None:
    """Copy every checkpoint tensor into the parameter of the same (mapped) name, or through
    the loader of the module that takes it (merged projections, tensor-parallel shards),
    casting to the parameter's dtype and device. Mutates the model's parameters in place.
    `what` names the model in errors (default: its class)."""
    params = dict(model.named_parameters())
    loaders, covered = checkpoint_loaders(model)
    expected = {n for n, p in params.items() if id(p) not in covered} | set(loaders)
    loaded: set[str] = set()
    unexpected: list[str] = []
    mapped = lambda name: model.map_weight_name(name) is not None  # noqa: E731
    for name, tensor in iterate_tensors(list_weight_files(model_dir), keep=mapped):
        target = model.map_weight_name(name)
        if target in loaders:
            try:
                loaders[target](tensor)
            except ValueError as e:
                raise WeightLoadError(f"tensor {name!r}: {e}") from None
        elif target in params and target in expected:
            param = params[target]
            if param.shape != tensor.shape:
                raise WeightLoadError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"parameter {target!r} expects {tuple(param.shape)}"
                )
            param.copy_(tensor)
        else:
            unexpected.append(name)
            continue
        loaded.add(target)
    missing = sorted(expected - loaded)
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing tensors: {_describe(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors: {_describe(sorted(unexpected))}")
        raise WeightLoadError(
            f"checkpoint {model_dir!r} does not match {what or type(model).__name__}; "
            + "; ".join(problems)
        )


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Seeded random weights like HF's init: matrices ~ N(0, std), biases 0, norm weights 1.
    Generated on the parameters' device (fast for large models). Mutates in place."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.dim() == 1:
            param.fill_(1.0 if "norm" in name else 0.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        param.normal_(0.0, std, generator=generators[param.device])
