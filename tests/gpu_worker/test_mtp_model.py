"""MTP layers in MiMo's layout: finding them (target checkpoint or separate directory), loading
one runner per layer with its own pools and the target's embedding / LM head, the forward
against a plain re-implementation written here, the agreeing stack the end-to-end tests rely
on, and targets that still load (ours and HF's) with the extra tensors."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.mimo_mtp import mtp_kv_bytes_per_token, mtp_weights_dir, num_mtp_layers
from gpu_worker.step.forward_batch import ForwardMode, SpecInput, build_forward_batch
from gpu_worker.weights import WeightLoadError
from tests.gpu_worker.checkpoints import load_reference, make_tiny_checkpoint, reference_logits
from tests.gpu_worker.mtp_checkpoints import (
    make_agreeing_mtp_target,
    make_tiny_mtp_dir,
    make_tiny_mtp_target,
)
from tests.gpu_worker.runner_utils import run_step, runner_from_options, shuffled_slots

ATOL = 1e-4
VOCAB = 384


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    def path(name: str) -> str:
        return str(tmp_path_factory.mktemp(name))

    llama = make_tiny_mtp_target(path("llama"), "llama", num_mtp_layers=3, seed=1)
    plain = make_tiny_checkpoint(path("plain"), "llama", seed=1, vocab_size=VOCAB)
    return {
        "llama": llama,
        "qwen2": make_tiny_mtp_target(path("qwen2"), "qwen2", num_mtp_layers=2, seed=2),
        "qwen3": make_tiny_mtp_target(path("qwen3"), "qwen3", num_mtp_layers=1, seed=3),
        "plain": plain,
        "separate": make_tiny_mtp_dir(path("separate"), plain, num_mtp_layers=2, seed=4),
        "agreeing": make_agreeing_mtp_target(path("agreeing"), num_mtp_layers=3),
    }


def make_runner(model_dir: str, draft_of: ModelRunner | None = None, **kwargs) -> ModelRunner:
    if draft_of is None:
        kwargs = dict(max_total_tokens=256, max_running_requests=4, context_length=128) | kwargs
    return runner_from_options(model_dir, draft_of, **kwargs)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def run_mtp(runner, rows, committed_lens, ids, all_slots, hidden):
    """One DRAFT_EXTEND of `runner` with spec_info carrying hidden [num_tokens, H]."""
    new_slots = [s[p : p + len(i)] for s, p, i in zip(all_slots, committed_lens, ids, strict=True)]
    runner.req_to_token_pool.write(
        torch.tensor(rows),
        torch.tensor(committed_lens),
        torch.tensor([x for s in new_slots for x in s]),
        torch.tensor([len(s) for s in new_slots]),
    )
    batch = build_forward_batch(
        ForwardMode.DRAFT_EXTEND, ids, committed_lens, new_slots, rows, runner.device
    )
    batch.spec_info = SpecInput(hidden_states=hidden)
    return runner.forward(batch)


# ---- a plain re-implementation of MTP layer i (one sequence, positions 0..n-1) ----


def ref_rms(x, weight, eps=1e-6):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def ref_rotate(x, theta):
    """x [n, heads, d] at positions 0..n-1, rotate-half rotary."""
    n, _, d = x.shape
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angles = torch.arange(n).float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], -1)
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * angles.cos()[:, None] + rotated * angles.sin()[:, None]


def ref_linear(w, name, x):
    bias = w.get(name + ".bias")
    y = x @ w[name + ".weight"].T
    return y if bias is None else y + bias


def ref_attention(w, p, x, cfg):
    """Causal self-attention of the block under prefix p (biases / q-k norms when present)."""
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    n = x.shape[0]
    q = ref_linear(w, p + "self_attn.q_proj", x).view(n, heads, d)
    k = ref_linear(w, p + "self_attn.k_proj", x).view(n, kv_heads, d)
    v = ref_linear(w, p + "self_attn.v_proj", x).view(n, kv_heads, d)
    if p + "self_attn.q_norm.weight" in w:
        q = ref_rms(q, w[p + "self_attn.q_norm.weight"], cfg["rms_norm_eps"])
        k = ref_rms(k, w[p + "self_attn.k_norm.weight"], cfg["rms_norm_eps"])
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    q, k = ref_rotate(q, theta), ref_rotate(k, theta)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    return ref_linear(w, p + "self_attn.o_proj", o)


def ref_mtp(mtp_dir, target_dir, layer, ids, hidden):
    """-> (out [n, H] after final_layernorm, logits [n, vocab]) of MTP layer `layer`."""
    w, t = load_file(f"{mtp_dir}/model.safetensors"), load_file(f"{target_dir}/model.safetensors")
    with open(f"{mtp_dir}/config.json") as f:
        cfg = json.load(f)
    eps, p = cfg["rms_norm_eps"], f"model.mtp_layers.{layer}."
    e = ref_rms(t["model.embed_tokens.weight"][ids], w[p + "token_layernorm.weight"], eps)
    h = ref_rms(hidden, w[p + "hidden_layernorm.weight"], eps)
    x = torch.cat([h, e], -1) @ w[p + "input_proj.weight"].T
    x = x + ref_attention(w, p, ref_rms(x, w[p + "input_layernorm.weight"], eps), cfg)
    m = ref_rms(x, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    out = ref_rms(x, w[p + "final_layernorm.weight"], eps)
    return out, out @ t["lm_head.weight"].T


# ---- where the layers are ----


def test_layer_count_and_weights_dir(dirs):
    names = ("llama", "qwen2", "plain", "separate")
    assert [num_mtp_layers(dirs[k]) for k in names] == [3, 2, 0, 2]
    assert mtp_weights_dir(dirs["llama"], None) == dirs["llama"]
    assert mtp_weights_dir(dirs["plain"], dirs["separate"]) == dirs["separate"]
    # a separate directory wins over the target's own layers
    assert mtp_weights_dir(dirs["llama"], dirs["separate"]) == dirs["separate"]


@pytest.mark.parametrize("draft", [None, "plain"])
def test_missing_layers_name_both_dirs(dirs, draft):
    draft_dir = None if draft is None else dirs[draft]
    with pytest.raises(ValueError, match="no MTP layers") as info:
        mtp_weights_dir(dirs["plain"], draft_dir)
    assert dirs["plain"] in str(info.value)
    assert str(draft_dir) in str(info.value)


def test_layer_beyond_config_or_checkpoint_is_an_error(dirs, tmp_path):
    target = make_runner(dirs["llama"])
    with pytest.raises(ValueError, match="MTP layer 3 does not exist"):
        make_runner(dirs["llama"], draft_of=target, mtp_layer=3)
    with pytest.raises(ValueError, match="draft_of"):
        make_runner(dirs["llama"], mtp_layer=0)
    # a config claiming more layers than the checkpoint holds
    short = make_tiny_mtp_dir(str(tmp_path), dirs["llama"], num_mtp_layers=2, seed=5)
    config_path = os.path.join(short, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "num_nextn_predict_layers": 3}, f)
    with pytest.raises(WeightLoadError, match="MTP layer 2"):
        make_runner(short, draft_of=target, mtp_layer=2)


# ---- runners ----


def test_runners_have_own_pools_and_share_embed_and_head(dirs):
    target = make_runner(dirs["llama"], page_size=4)
    runners = [make_runner(dirs["llama"], draft_of=target, mtp_layer=i) for i in range(3)]
    embed, head = target.model.model.embed_tokens.weight, target.model.lm_head.weight
    pools = {id(r.kv_pool) for r in [target, *runners]}
    tables = {id(r.req_to_token_pool) for r in [target, *runners]}
    assert len(pools) == len(tables) == 4
    for runner in runners:
        assert runner.kv_pool.num_layers == 1
        assert (runner.max_total_tokens, runner.page_size) == (target.max_total_tokens, 4)
        assert runner.req_to_token_pool.req_to_token.shape == (
            target.req_to_token_pool.req_to_token.shape
        )
        assert runner.model.embed_tokens.weight.data_ptr() == embed.data_ptr()
        assert runner.model.lm_head.weight.data_ptr() == head.data_ptr()
    total = sum(r.kv_pool.bytes_per_token() for r in runners)
    assert mtp_kv_bytes_per_token(dirs["llama"], torch.float32) == total


@pytest.mark.parametrize(
    ("name", "layer"), [("llama", 0), ("llama", 2), ("qwen2", 1), ("qwen3", 0), ("separate", 1)]
)
def test_forward_matches_reference(dirs, name, layer):
    target_dir = dirs["plain"] if name == "separate" else dirs[name]
    target = make_runner(target_dir)
    runner = make_runner(dirs[name], draft_of=target, mtp_layer=layer)
    ids = tokens(7, seed=layer)
    hidden = torch.randn(7, 64, generator=torch.Generator().manual_seed(layer))
    slots = shuffled_slots(runner, 2, 7)
    out = run_mtp(runner, [1], [0], [ids], slots[:1], hidden)
    ref_out, ref_logits = ref_mtp(dirs[name], target_dir, layer, ids, hidden)
    torch.testing.assert_close(out.hidden_states, ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.next_token_logits[0], ref_logits[-1], atol=ATOL, rtol=0)
    # chunked through the runner's own KV pool: the same last-row logits
    run_mtp(runner, [2], [0], [ids[:4]], slots[1:], hidden[:4])
    tail = run_mtp(runner, [2], [4], [ids[4:]], slots[1:], hidden[4:])
    torch.testing.assert_close(tail.hidden_states, ref_out[4:], atol=ATOL, rtol=0)


def test_dummy_weights_build_every_layer(dirs):
    target = make_runner(dirs["llama"], load_format="dummy")
    runner = make_runner(dirs["llama"], draft_of=target, load_format="dummy", mtp_layer=2)
    out = run_mtp(runner, [1], [0], [tokens(5, 0)], shuffled_slots(runner, 1, 5), torch.ones(5, 64))
    assert out.next_token_logits.shape == (1, VOCAB)
    assert torch.isfinite(out.hidden_states).all()


def test_agreeing_stack_predicts_the_bigram_targets_argmax(dirs):
    target = make_runner(dirs["agreeing"])
    runners = [make_runner(dirs["agreeing"], draft_of=target, mtp_layer=i) for i in range(3)]
    ids = tokens(12, seed=9)
    slots = shuffled_slots(target, 1, 12)
    target_out = run_step(target, ForwardMode.EXTEND, [1], [0], [ids], slots)
    expected = target.model.compute_logits(target_out.hidden_states).argmax(-1)  # [12]
    for runner in runners:
        out = run_mtp(runner, [1], [0], [ids], slots, target_out.hidden_states)
        assert torch.equal(runner.model.compute_logits(out.hidden_states).argmax(-1), expected)


# ---- targets with MTP tensors still load ----


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_target_with_mtp_tensors_matches_hf(dirs, name):
    runner = make_runner(dirs[name])
    ids = tokens(9, seed=3)
    out = run_step(runner, ForwardMode.EXTEND, [1], [0], [ids], shuffled_slots(runner, 1, 9))
    expected = reference_logits(load_reference(dirs[name]), ids)  # HF ignores mtp_layers.*
    logits = runner.model.compute_logits(out.hidden_states)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_mimo_architecture_is_a_qwen2_target(dirs, tmp_path):
    for file in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(dirs["qwen2"], file), tmp_path / file)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    os.unlink(tmp_path / "config.json")
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**config, "architectures": ["MiMoForCausalLM"], "model_type": "mimo"}, f)
    mimo, qwen2 = make_runner(str(tmp_path)), make_runner(dirs["qwen2"])
    ids = tokens(6, seed=4)
    logits = [
        run_step(r, ForwardMode.EXTEND, [1], [0], [ids], shuffled_slots(r, 1, 6)).hidden_states
        for r in (mimo, qwen2)
    ]
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)
    assert mimo.model.model.layers[0].self_attn.qkv_proj.bias is not None
    # its MTP layers have the Qwen2 block (q/k/v bias)
    layer = make_runner(str(tmp_path), draft_of=mimo, mtp_layer=1)
    assert layer.model.block.self_attn.qkv_proj.bias is not None
