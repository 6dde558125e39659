"""The deterministic mode end to end in a runner (triton backend; CPU under Triton's
interpreter, or CUDA): one request's logits for one token are the same bits however that token
is computed: decoded alone, decoded beside other requests, as the last token of a whole
prefill or of a chunked one, or as the last of a chain or at the end of a path through a
tree of draft tokens verified at once (float32, and bf16 on CUDA). Key
splits are shrunk so 150 tokens cross split and key-block boundaries. Without the mode the same
comparisons differ, which is what the mode is for."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker.build import build_models
from gpu_worker.kernels import batch_invariant
from gpu_worker.step.forward_batch import ForwardMode
from tests.devices import skip_unless_triton_runs_on, triton_devices
from tests.gpu_worker.checkpoints import make_tiny_checkpoint
from tests.gpu_worker.runner_utils import run_step, runner_from_options, shuffled_slots
from tests.gpu_worker.test_worker import make_config

PROMPT = 150  # tokens: three key blocks of 64


def runner_for(model_dir: str, device: str, dtype: torch.dtype, context_length: int = PROMPT + 2):
    return runner_from_options(
        model_dir,
        dtype=dtype,
        attention_backend="triton",
        max_total_tokens=2048,
        max_running_requests=8,
        context_length=context_length,
        device=device,
    )


def last_token_logits(
    device: str, dtype, model_dir: str, context_length: int = PROMPT + 2, only_first: bool = False
) -> dict[str, torch.Tensor]:
    """The logits of token PROMPT - 1 of one prompt, computed six ways (only_first: one)."""
    runner = runner_for(model_dir, device, dtype, context_length)
    rng = random.Random(0)
    ids = [rng.randrange(256) for _ in range(PROMPT)]
    others = [[rng.randrange(256) for _ in range(n)] for n in (40, 97)]
    slots = shuffled_slots(runner, 8, PROMPT + 8)
    extend, decode, verify = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY
    out = {}
    # row 0: prefill all but the last token, decode it alone
    run_step(runner, extend, [0], [0], [ids[:-1]], [slots[0]])
    out["decode alone"] = run_step(runner, decode, [0], [PROMPT - 1], [ids[-1:]], [slots[0]])
    if only_first:
        return {"decode alone": out["decode alone"].next_token_logits[0]}
    # row 1: the same, decoded beside two other requests (rows 2 and 3)
    run_step(runner, extend, [1, 2, 3], [0, 0, 0], [ids[:-1], *others], slots[1:4])
    lens = [PROMPT - 1, *map(len, others)]
    last = [ids[-1:], [5], [7]]
    out["decode in a batch"] = run_step(
        runner,
        decode,
        [2, 1, 3],
        [lens[1], lens[0], lens[2]],
        [last[1], last[0], last[2]],
        [slots[2], slots[1], slots[3]],
    )
    # row 4: the whole prompt at once; row 5: in chunks of 70
    out["prefill"] = run_step(runner, extend, [4], [0], [ids], [slots[4]])
    run_step(runner, extend, [5], [0], [ids[:70]], [slots[5]])
    out["chunked prefill"] = run_step(runner, extend, [5], [70], [ids[70:]], [slots[5]])
    # row 6: the last four tokens verified as a chain (its tree mask is causal)
    run_step(runner, extend, [6], [0], [ids[:-4]], [slots[6]])
    chain = torch.ones(4, 4, dtype=torch.bool).tril()[None]
    out["chain verify"] = run_step(
        runner, verify, [6], [PROMPT - 4], [ids[-4:]], [slots[6]], custom_mask=chain
    )
    # row 7: the last four tokens as a path through a tree of six drafts (siblings 9 and 11
    # off the path), verified at once; node order: ids[-4], 9, ids[-3], 11, ids[-2], ids[-1]
    nodes = [ids[-4], 9, ids[-3], 11, ids[-2], ids[-1]]
    parents = [-1, 0, 0, 2, 2, 4]
    tree = torch.zeros(len(nodes), len(nodes), dtype=torch.bool)
    depth = []
    for i, parent in enumerate(parents):
        tree[i, i] = True
        if parent >= 0:
            tree[i] |= tree[parent]
        depth.append(int(tree[i].sum()) - 1)
    run_step(runner, extend, [7], [0], [ids[:-4]], [slots[7]])
    positions = [[PROMPT - 4 + d for d in depth]]
    out["tree verify"] = run_step(
        runner,
        verify,
        [7],
        [PROMPT - 4],
        [nodes],
        [slots[7]],
        custom_mask=tree[None],
        positions=positions,
    )
    picks = {"decode in a batch": 1, "chain verify": 3, "tree verify": 5}
    return {name: o.next_token_logits[picks.get(name, 0)] for name, o in out.items()}


@pytest.mark.parametrize(
    "device, dtype",
    [(d, t) for d in triton_devices() for t in (torch.float32, torch.bfloat16)[: 1 + (d != "cpu")]],
)
def test_a_tokens_logits_are_the_same_however_it_is_computed(device, dtype, tmp_path):
    model_dir = make_tiny_checkpoint(str(tmp_path), "llama", num_hidden_layers=1)
    batch_invariant.enable()
    try:
        logits = last_token_logits(device, dtype, model_dir)
        # a server with longer rows (a wider req_to_token) computes a token the same way
        longer = last_token_logits(device, dtype, model_dir, 3 * PROMPT, only_first=True)
    finally:
        batch_invariant.enable(False)
    reference = logits.pop("decode alone")
    for name, other in {**logits, "longer rows": longer["decode alone"]}.items():
        assert torch.equal(other, reference), name
    # and still the model's logits: the fast path's, to rounding
    fast = last_token_logits(device, dtype, model_dir)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, other in fast.items():
        torch.testing.assert_close(other, reference, atol=tol, rtol=tol, msg=name)
    assert any(not torch.equal(other, fast["decode alone"]) for other in fast.values()), (
        "the fast path is already batch-invariant here: the comparison proves nothing"
    )


def test_the_worker_switches_the_mode_from_its_config(tiny_dirs):
    """--enable-deterministic-inference reaches every worker process through build_models,
    which sets the switch before its runners choose their kernels; a config without it
    leaves the switch off."""
    skip_unless_triton_runs_on("cpu" if not torch.cuda.is_available() else "cuda")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = make_config(tiny_dirs["llama"]).replace(
        model={"device": device}, runner={"attention_backend": "triton"}
    )
    try:
        on = build_models(config.replace(runner={"enable_deterministic_inference": True}))
        assert batch_invariant.ENABLED and not on.target.fused_greedy_head
        build_models(config)
        assert not batch_invariant.ENABLED
    finally:
        batch_invariant.enable(False)
