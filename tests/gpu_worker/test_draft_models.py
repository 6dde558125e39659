"""Draft models (EAGLE, EAGLE-3) and target aux capture: loading the public formats, sharing the
target's modules, forwards against a plain re-implementation written here, aux hidden states
against HF transformers, and the agreeing target/draft pairs the end-to-end tests rely on."""

from __future__ import annotations

import dataclasses
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from gpu_worker.model_runner import ModelRunner, RunnerSpec
from gpu_worker.models.llama_eagle3 import eagle3_aux_layer_ids
from gpu_worker.step.forward_batch import ForwardMode, SpecInput, build_forward_batch
from gpu_worker.weights import iterate_tensors, list_weight_files
from tests.gpu_worker.checkpoints import load_reference, make_tiny_checkpoint
from tests.gpu_worker.draft_checkpoints import (
    hot_token_ids,
    make_agreeing_eagle3_draft,
    make_agreeing_eagle_draft,
    make_bigram_target,
    make_constant_target,
    make_tiny_eagle3_draft,
    make_tiny_eagle_draft,
    read_config,
)
from tests.gpu_worker.runner_utils import run_step, runner_from_options, shuffled_slots

ATOL = 1e-4
H = 64  # hidden size of the tiny checkpoints


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    def path(name: str) -> str:
        return str(tmp_path_factory.mktemp(name))

    target = make_tiny_checkpoint(path("target"), "llama", num_hidden_layers=4, seed=7)
    return {
        "target": target,
        "eagle": make_tiny_eagle_draft(path("eagle"), target, seed=1),
        "eagle3": make_tiny_eagle3_draft(path("eagle3"), target, draft_vocab_size=50, seed=2),
    }


def make_runner(model_dir: str, draft_of: ModelRunner | None = None, **kwargs) -> ModelRunner:
    if draft_of is None:
        kwargs = dict(max_total_tokens=1024, max_running_requests=4, context_length=512) | kwargs
    return runner_from_options(model_dir, draft_of, **kwargs)


def tokens(n: int, seed: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def run_draft(runner, mode, rows, committed_lens, ids, all_slots, hidden):
    """Like run_step, with spec_info carrying `hidden` [num_tokens, H_in]."""
    new_slots = [s[p : p + len(i)] for s, p, i in zip(all_slots, committed_lens, ids, strict=True)]
    runner.req_to_token_pool.write(
        torch.tensor(rows),
        torch.tensor(committed_lens),
        torch.tensor([x for s in new_slots for x in s]),
        torch.tensor([len(s) for s in new_slots]),
    )
    batch = build_forward_batch(mode, ids, committed_lens, new_slots, rows, runner.device)
    batch.spec_info = SpecInput(hidden_states=hidden)
    return runner.forward(batch)


# ---- a plain re-implementation of the draft forwards (one sequence, positions 0..n-1) ----


def ref_rms(x, weight, eps=1e-6):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def ref_rotate(x, theta):
    """x [n, heads, d] at positions 0..n-1, rotate-half rotary."""
    n, _, d = x.shape
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angles = torch.arange(n).float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos[:, None] + rotated * sin[:, None]


def ref_layer(w, prefix, attn_in, residual, cfg):
    """residual + causal self-attention over attn_in, then residual MLP with its norm."""
    n, d = attn_in.shape[0], cfg["head_dim"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    q = (attn_in @ w[prefix + "self_attn.q_proj.weight"].T).view(n, heads, d)
    k = (attn_in @ w[prefix + "self_attn.k_proj.weight"].T).view(n, kv_heads, d)
    v = (attn_in @ w[prefix + "self_attn.v_proj.weight"].T).view(n, kv_heads, d)
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    q, k = ref_rotate(q, theta), ref_rotate(k, theta)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    x = residual + o @ w[prefix + "self_attn.o_proj.weight"].T
    m = ref_rms(x, w[prefix + "post_attention_layernorm.weight"])
    gate, up = m @ w[prefix + "mlp.gate_proj.weight"].T, m @ w[prefix + "mlp.up_proj.weight"].T
    return x + (F.silu(gate) * up) @ w[prefix + "mlp.down_proj.weight"].T


def ref_eagle(draft_dir, target_dir, ids, hidden):
    """-> (pass-back hidden [n, H], logits [n, vocab])."""
    w, t = load_file(f"{draft_dir}/model.safetensors"), load_file(f"{target_dir}/model.safetensors")
    x = torch.cat([t["model.embed_tokens.weight"][ids], hidden], -1) @ w["fc.weight"].T
    x = x + w["fc.bias"]
    h = ref_layer(w, "layers.0.", x, x, read_config(draft_dir))
    return h, h @ t["lm_head.weight"].T


def ref_eagle3(draft_dir, target_dir, ids, hidden):
    """-> (pass-back hidden [n, H], logits [n, draft_vocab]); fc only for aux-wide hidden."""
    w, t = load_file(f"{draft_dir}/model.safetensors"), load_file(f"{target_dir}/model.safetensors")
    if hidden.shape[-1] != H:
        hidden = hidden @ w["fc.weight"].T
    embeds = ref_rms(t["model.embed_tokens.weight"][ids], w["midlayer.input_layernorm.weight"])
    x = torch.cat([embeds, ref_rms(hidden, w["midlayer.hidden_norm.weight"])], -1)
    h = ref_layer(w, "midlayer.", x, hidden, read_config(draft_dir))
    return h, ref_rms(h, w["norm.weight"]) @ w["lm_head.weight"].T


# ---- loading ----


def draft_output(runner: ModelRunner, hidden_width: int, seed: int = 0) -> torch.Tensor:
    ids = tokens(6, seed)
    hidden = torch.randn(6, hidden_width, generator=torch.Generator().manual_seed(seed))
    slots = shuffled_slots(runner, 1, 6)
    return run_draft(runner, ForwardMode.DRAFT_EXTEND, [1], [0], [ids], slots, hidden)


@pytest.mark.parametrize("fmt", ["eagle", "eagle3"])
@pytest.mark.parametrize(("prefix", "num_shards"), [("model.", 1), ("", 3), ("model.", 2)])
def test_draft_loads_with_prefix_and_shards(dirs, tmp_path, fmt, prefix, num_shards):
    make = make_tiny_eagle_draft if fmt == "eagle" else make_tiny_eagle3_draft
    kwargs = {"seed": 1} if fmt == "eagle" else {"draft_vocab_size": 50, "seed": 2}
    variant = make(str(tmp_path), dirs["target"], prefix=prefix, num_shards=num_shards, **kwargs)
    assert len(list_weight_files(variant)) == num_shards
    target = make_runner(dirs["target"])
    width = H if fmt == "eagle" else 3 * H
    plain = draft_output(make_runner(dirs[fmt], draft_of=target), width)
    other = draft_output(make_runner(variant, draft_of=target), width)
    torch.testing.assert_close(other.hidden_states, plain.hidden_states, atol=0, rtol=0)


def test_draft_loads_from_pytorch_bin(dirs, tmp_path):
    """Public EAGLE checkpoints ship pytorch_model.bin; it loads like the safetensors file."""
    shutil.copy(f"{dirs['eagle']}/config.json", tmp_path / "config.json")
    torch.save(load_file(f"{dirs['eagle']}/model.safetensors"), tmp_path / "pytorch_model.bin")
    target = make_runner(dirs["target"])
    plain = draft_output(make_runner(dirs["eagle"], draft_of=target), H)
    other = draft_output(make_runner(str(tmp_path), draft_of=target), H)
    torch.testing.assert_close(other.hidden_states, plain.hidden_states, atol=0, rtol=0)


def test_draft_shares_target_embedding_and_head(dirs):
    target = make_runner(dirs["target"])
    eagle = make_runner(dirs["eagle"], draft_of=target).model
    eagle3 = make_runner(dirs["eagle3"], draft_of=target).model
    embed, head = target.model.model.embed_tokens.weight, target.model.lm_head.weight
    assert eagle.embed_tokens.weight.data_ptr() == embed.data_ptr()
    assert eagle.lm_head.weight.data_ptr() == head.data_ptr()
    assert eagle3.embed_tokens.weight.data_ptr() == embed.data_ptr()
    assert eagle3.lm_head.weight.shape == (50, H)  # its own, over the draft vocabulary


def test_eagle3_own_embedding_is_loaded_not_shared(dirs, tmp_path):
    path = make_tiny_eagle3_draft(str(tmp_path), dirs["target"], seed=3, with_embed=True)
    target = make_runner(dirs["target"])
    draft = make_runner(path, draft_of=target)
    own = load_file(f"{path}/model.safetensors")["embed_tokens.weight"]
    torch.testing.assert_close(draft.model.embed_tokens.weight, own, atol=0, rtol=0)
    assert (
        draft.model.embed_tokens.weight.data_ptr()
        != target.model.model.embed_tokens.weight.data_ptr()
    )
    assert draft.model.lm_head.weight.shape == (256, H)
    assert draft.hot_token_id is None  # full vocabulary: no d2t


def test_draft_runner_mirrors_target_pool_geometry(dirs):
    target = make_runner(dirs["target"], page_size=4, req_to_token_extra=16)
    draft = make_runner(dirs["eagle"], draft_of=target)
    assert (draft.max_total_tokens, draft.page_size) == (target.max_total_tokens, 4)
    assert draft.req_to_token_pool.req_to_token.shape == (5, 512 + 16)
    assert draft.kv_pool is not target.kv_pool
    assert draft.req_to_token_pool is not target.req_to_token_pool
    # Nothing is silently overridden: a draft given other pools than its target's is refused.
    other = dataclasses.replace(target.pools, page_size=1)
    with pytest.raises(ValueError, match="target's slots"):
        ModelRunner(RunnerSpec(dirs["eagle"]), other, draft_of=target)


def test_draft_and_target_roles_are_checked(dirs):
    target = make_runner(dirs["target"])
    with pytest.raises(ValueError, match="draft_of"):
        make_runner(dirs["eagle"])
    with pytest.raises(ValueError, match="not a draft"):
        make_runner(dirs["target"], draft_of=target)


def test_dummy_draft_weights_load(dirs):
    target = make_runner(dirs["target"])
    draft = make_runner(dirs["eagle3"], draft_of=target, load_format="dummy")
    torch.testing.assert_close(draft.hot_token_id, torch.arange(50))  # d2t all zero
    assert draft_output(draft, 3 * H).next_token_logits.shape == (1, 50)


# ---- forwards ----


def run_extend_then_decode(draft, width, seed):
    """Two requests: DRAFT_EXTEND of 5 and 3 tokens, then one DRAFT_DECODE token each.
    -> per request (ids, hidden, extend output rows, decode output row)."""
    gen = torch.Generator().manual_seed(seed)
    ids = [tokens(6, seed), tokens(4, seed + 1)]
    hidden = [torch.randn(6, width, generator=gen), torch.randn(4, width, generator=gen)]
    slots = shuffled_slots(draft, 2, 6)
    ext = run_draft(
        draft,
        ForwardMode.DRAFT_EXTEND,
        [1, 2],
        [0, 0],
        [ids[0][:5], ids[1][:3]],
        slots,
        torch.cat([hidden[0][:5], hidden[1][:3]]),
    )
    dec = run_draft(
        draft,
        ForwardMode.DRAFT_DECODE,
        [1, 2],
        [5, 3],
        [ids[0][5:], ids[1][3:]],
        slots,
        torch.cat([hidden[0][5:], hidden[1][3:]]),
    )
    return ids, hidden, ext, dec


@pytest.mark.parametrize("fmt", ["eagle", "eagle3"])
def test_draft_forward_matches_reimplementation(dirs, fmt):
    target = make_runner(dirs["target"])
    draft = make_runner(dirs[fmt], draft_of=target)
    ref = ref_eagle if fmt == "eagle" else ref_eagle3
    width = H if fmt == "eagle" else 3 * H
    ids, hidden, ext, dec = run_extend_then_decode(draft, width, seed=5)
    assert ext.next_token_logits.shape[0] == 2  # DRAFT_EXTEND: each request's last token
    assert dec.next_token_logits.shape[0] == 2  # DRAFT_DECODE: every token
    exp = [
        ref(dirs[fmt], dirs["target"], torch.tensor(i), h) for i, h in zip(ids, hidden, strict=True)
    ]
    ext_hidden = torch.cat([exp[0][0][:5], exp[1][0][:3]])
    torch.testing.assert_close(ext.hidden_states, ext_hidden, atol=ATOL, rtol=0)
    torch.testing.assert_close(
        ext.next_token_logits, torch.stack([exp[0][1][4], exp[1][1][2]]), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        dec.hidden_states, torch.stack([exp[0][0][5], exp[1][0][3]]), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        dec.next_token_logits, torch.stack([exp[0][1][5], exp[1][1][3]]), atol=ATOL, rtol=0
    )


def test_eagle3_fc_only_for_aux_width_input(dirs):
    """H-wide input skips fc: feeding fc(aux) gives the same result as feeding aux."""
    target = make_runner(dirs["target"])
    draft = make_runner(dirs["eagle3"], draft_of=target)
    ids = torch.tensor(tokens(5, 9))
    aux = torch.randn(5, 3 * H, generator=torch.Generator().manual_seed(9))
    fc = load_file(f"{dirs['eagle3']}/model.safetensors")["fc.weight"]
    slots = shuffled_slots(draft, 2, 5)
    wide = run_draft(draft, ForwardMode.DRAFT_EXTEND, [1], [0], [ids.tolist()], slots[:1], aux)
    narrow = run_draft(
        draft, ForwardMode.DRAFT_EXTEND, [2], [0], [ids.tolist()], slots[1:], aux @ fc.T
    )
    torch.testing.assert_close(wide.hidden_states, narrow.hidden_states, atol=ATOL, rtol=0)
    expected, _ = ref_eagle3(dirs["eagle3"], dirs["target"], ids, aux @ fc.T)
    torch.testing.assert_close(narrow.hidden_states, expected, atol=ATOL, rtol=0)


def test_hot_token_id_maps_draft_ids_to_target_ids(dirs):
    target = make_runner(dirs["target"])
    draft = make_runner(dirs["eagle3"], draft_of=target)
    expected = hot_token_ids(256, 50, seed=2)
    assert torch.equal(draft.hot_token_id, expected)
    t2d = load_file(f"{dirs['eagle3']}/model.safetensors")["t2d"]
    assert torch.equal(t2d.nonzero().flatten(), draft.hot_token_id)


# ---- target aux capture ----


def test_eagle3_aux_layer_ids():
    assert eagle3_aux_layer_ids({}, 32) == [2, 16, 29]
    assert eagle3_aux_layer_ids({}, 2) == [2, 1, 0]  # clamped for tiny targets
    nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    assert eagle3_aux_layer_ids(nested, 32) == [2, 16, 29]
    assert eagle3_aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [0, 3]}, 4) == [1, 4]
    with pytest.raises(ValueError, match="out of range"):
        eagle3_aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [4]}, 4)


def test_aux_capture_matches_hf_hidden_states(dirs):
    layers = [3, 0, 2]
    target = make_runner(dirs["target"], aux_hidden_layers=layers)
    ids = tokens(11, 4)
    out = run_step(target, ForwardMode.EXTEND, [1], [0], [ids], shuffled_slots(target, 1, 11))
    with torch.no_grad():
        hf = load_reference(dirs["target"])(torch.tensor([ids]), output_hidden_states=True)
    expected = torch.cat([hf.hidden_states[i][0] for i in layers], -1)  # HF [i] = input of i
    assert out.aux_hidden_states.shape == (11, 3 * H)
    torch.testing.assert_close(out.aux_hidden_states, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.next_token_logits[0], hf.logits[0, -1], atol=ATOL, rtol=0)


def test_aux_after_last_layer_is_the_pre_norm_stream(dirs):
    target = make_runner(dirs["target"], aux_hidden_layers=[4])
    ids = tokens(7, 6)
    out = run_step(target, ForwardMode.EXTEND, [1], [0], [ids], shuffled_slots(target, 1, 7))
    norm = dict(iterate_tensors(list_weight_files(dirs["target"])))["model.norm.weight"]
    torch.testing.assert_close(
        ref_rms(out.aux_hidden_states, norm), out.hidden_states, atol=ATOL, rtol=0
    )


def test_target_without_aux_returns_none(dirs):
    target = make_runner(dirs["target"])
    out = run_step(target, ForwardMode.EXTEND, [1], [0], [[1, 2]], shuffled_slots(target, 1, 2))
    assert out.aux_hidden_states is None


# ---- agreeing pairs used by the end-to-end tests ----


def all_argmax(runner: ModelRunner, out) -> torch.Tensor:
    return runner.model.compute_logits(out.hidden_states).argmax(-1)


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [("llama", torch.float32), ("qwen3", torch.float32), ("llama", torch.bfloat16)],
)
def test_agreeing_eagle_draft_agrees_with_bigram_target(tmp_path, arch, dtype):
    target_dir = make_bigram_target(str(tmp_path / "t"), arch=arch, seed=3)
    draft_dir = make_agreeing_eagle_draft(str(tmp_path / "d"), target_dir)
    target = make_runner(target_dir, dtype=dtype)
    draft = make_runner(draft_dir, draft_of=target, dtype=dtype)
    ids = torch.randperm(384, generator=torch.Generator().manual_seed(0)).tolist()  # every token
    slots = shuffled_slots(target, 1, 384)
    out = run_step(target, ForwardMode.EXTEND, [1], [0], [ids], slots)
    target_next = all_argmax(target, out)
    draft_out = run_draft(
        draft, ForwardMode.DRAFT_EXTEND, [1], [0], [ids], slots, out.hidden_states
    )
    assert torch.equal(all_argmax(draft, draft_out), target_next)
    # the target really is a bigram model: the same token always predicts the same next token
    single = run_step(
        target, ForwardMode.DECODE, [2], [0], [[ids[5]]], shuffled_slots(target, 2, 1)[1:]
    )
    assert single.next_token_logits.argmax().item() == target_next[5].item()


def test_agreeing_eagle3_draft_agrees_with_constant_target(tmp_path):
    target_dir = make_constant_target(str(tmp_path / "t"))
    draft_dir = make_agreeing_eagle3_draft(str(tmp_path / "d"), target_dir)
    layers = eagle3_aux_layer_ids(read_config(draft_dir), 2)
    target = make_runner(target_dir, aux_hidden_layers=layers)
    draft = make_runner(draft_dir, draft_of=target)
    ids = tokens(40, 1, vocab=384)
    slots = shuffled_slots(target, 1, 40)
    out = run_step(target, ForwardMode.EXTEND, [1], [0], [ids], slots)
    assert torch.equal(all_argmax(target, out), torch.zeros(40, dtype=torch.int64))
    draft_out = run_draft(
        draft, ForwardMode.DRAFT_EXTEND, [1], [0], [ids], slots, out.aux_hidden_states
    )
    proposed = draft.hot_token_id[all_argmax(draft, draft_out)]
    assert torch.equal(proposed, torch.zeros(40, dtype=torch.int64))
