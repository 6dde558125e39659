from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.layers.linear import MergedLinear
from gpu_worker.models import build_model, get_model_class, read_arch_config
from gpu_worker.weights import WeightLoadError, list_weight_files, load_weights


def load(model_dir: str):
    model = build_model(read_arch_config(model_dir), "cpu", torch.float32)
    load_weights(model, model_dir)
    return model


def test_sharded_checkpoint_loads_every_tensor(tiny_dirs):
    files = list_weight_files(tiny_dirs["llama_sharded"])
    assert len(files) > 1
    model = load(tiny_dirs["llama_sharded"])
    stored = {}
    for path in files:
        stored.update(load_file(path))
    merged = {  # checkpoint name -> (merged module, shard, parameter)
        f"{path.rpartition('.')[0]}.{shard}.{param_name}": (module, shard, param_name)
        for path, module in model.named_modules()
        if isinstance(module, MergedLinear)
        for shard in module.shard_rows
        for param_name in ("weight", "bias")
    }
    for name, tensor in stored.items():
        if name in merged:  # q/k/v, gate/up: their rows of the merged projection
            module, shard, param_name = merged[name]
            start, rows = module.shard_rows[shard]
            assert torch.equal(getattr(module, param_name)[start : start + rows], tensor), name
        else:
            assert torch.equal(model.get_parameter(name), tensor), name
    assert {n for n in stored if ".self_attn." in n} >= {  # HF names: the merge is ours
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    }


def test_tied_embeddings_share_one_parameter(tiny_dirs):
    model = load(tiny_dirs["llama_tied"])
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_bfloat16_cast(tiny_dirs):
    model = build_model(read_arch_config(tiny_dirs["qwen2"]), "cpu", torch.bfloat16)
    load_weights(model, tiny_dirs["qwen2"])
    bias = model.model.layers[0].self_attn.qkv_proj.bias
    assert bias.dtype == torch.bfloat16 and bias.abs().sum() > 0


def _rewrite(src: str, dst: str, edit) -> str:
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_missing_and_unexpected_tensors_are_named(tmp_path, tiny_dirs):
    def drop_and_add(tensors):
        del tensors["model.layers.1.mlp.up_proj.weight"]
        tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(2)

    bad = _rewrite(tiny_dirs["llama"], str(tmp_path / "bad"), drop_and_add)
    with pytest.raises(WeightLoadError) as info:
        load(bad)
    assert "model.layers.1.mlp.up_proj.weight" in str(info.value)
    assert "model.layers.1.mlp.extra.weight" in str(info.value)


def test_wrong_shape_is_named(tmp_path, tiny_dirs):
    def shrink(tensors):
        tensors["model.norm.weight"] = torch.ones(3)

    bad = _rewrite(tiny_dirs["llama"], str(tmp_path / "shape"), shrink)
    with pytest.raises(WeightLoadError, match="model.norm.weight"):
        load(bad)


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")
