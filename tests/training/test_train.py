"""The training loop: an exported draft is what the server loads, runs resume exactly where
they stopped, and a resumed run refuses options or data other than its own."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from gpu_worker.worker import GPUWorker
from tests.training.conftest import DEPTH, engine_config, train_config
from training.build import build_recipe
from training.rows import make_rows
from training.target import Target
from training.tokens import TokenFile
from training.train import Trainer


def exported(draft_dir: str) -> dict[str, torch.Tensor]:
    import glob

    tensors = {}
    for path in sorted(glob.glob(f"{draft_dir}/*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def server_draft_modules(target: str, algorithm: str, draft: str) -> list[torch.nn.Module]:
    worker = GPUWorker(engine_config(target, algorithm, draft, DEPTH[algorithm]))
    return [runner.model for runner in worker.draft_runner_list]


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle", "mtp"])
def test_the_server_loads_the_trained_draft_and_computes_its_logits(
    algorithm, bigram_target, greedy_data, tmp_path
):
    cfg = train_config(algorithm, bigram_target, greedy_data, str(tmp_path), max_steps=4)
    trainer = Trainer(cfg)
    trainer.run()
    trained = trainer.recipe
    with torch.no_grad():  # the export is bfloat16: compare with the weights rounded alike
        for p in trained.parameters():
            p.copy_(p.bfloat16().float())

    # the server holds exactly the trained weights, under the checkpoint's names
    draft_dir = str(tmp_path / "draft")
    served = server_draft_modules(bigram_target, algorithm, draft_dir)
    assert len(served) == len(trained.modules)
    for ours, theirs in zip(trained.modules, served, strict=True):
        mine = {k: v for k, v in ours.state_dict().items()}
        for name, value in theirs.state_dict().items():
            assert torch.equal(value.float(), mine[name].float()), name
    assert exported(draft_dir)  # non-empty, loadable

    # and a draft loaded from the export computes the trained draft's logits at every step
    loaded = build_recipe(algorithm, trainer.target, None, DEPTH[algorithm], init_from=draft_dir)
    data = TokenFile.load(greedy_data)
    rows = make_rows(data, trainer.batches[0][:4], cfg.max_len)
    teacher = trainer.target.run(rows.ids, trained.aux_layers)
    trained.training = loaded.training = False  # EAGLE's input noise off
    with torch.no_grad():
        for a, b in zip(trained.unroll(rows, teacher), loaded.unroll(rows, teacher), strict=True):
            where = a.learns.nonzero().squeeze(1)
            torch.testing.assert_close(a.logits(where), b.logits(where), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle", "mtp"])
def test_teacher_logits_only_where_steps_learn_give_the_losses_of_every_position(
    algorithm, bigram_target, greedy_data
):
    """The training loop asks the target for logits only at `Rows.teaches()` positions: every
    step's learning positions must find their rows there, and the losses and accuracies must
    be those computed from every position's logits."""
    data = TokenFile.load(greedy_data)
    target = Target(bigram_target, "cpu", torch.float32)
    recipe = build_recipe(algorithm, target, data, DEPTH[algorithm], draft_vocab=200)
    recipe.training = False  # EAGLE's input noise off: both runs see the same inputs
    rows = make_rows(data, np.arange(6), max_len=256)
    full = target.run(rows.ids, recipe.aux_layers)
    some = target.run(rows.ids, recipe.aux_layers, rows.teaches())
    assert 0 < len(some.logits) < rows.ids.numel()  # the prompts and padding are left out
    for out in recipe.unroll(rows, some):
        index = out.teacher_index[out.learns.nonzero().squeeze(1)]
        assert (some.row[index] >= 0).all()
        torch.testing.assert_close(some.logits[some.row[index]], full.logits[index])
        assert torch.equal(some.choice_at(index), full.logits[index].argmax(-1))
    with torch.no_grad():
        loss_some, metrics_some = recipe.losses(rows, some)
        loss_full, metrics_full = recipe.losses(rows, full)
    torch.testing.assert_close(loss_some, loss_full)
    for key in ("loss", "acc"):  # matrix products over other row counts may round differently
        assert metrics_some[key] == pytest.approx(metrics_full[key], rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle"])
def test_later_steps_over_the_response_window_give_the_losses_and_gradients_of_every_position(
    algorithm, bigram_target, greedy_data
):
    """Training runs an unrolled chain's steps after the first only over `Rows.window`: the
    losses, accuracies and gradients must be those of the unroll over every position (a
    window that starts one position late, a misplaced mask or a misread hidden state changes
    them)."""
    data = TokenFile.load(greedy_data)
    target = Target(bigram_target, "cpu", torch.float32)
    recipe = build_recipe(algorithm, target, data, DEPTH[algorithm], draft_vocab=200)
    recipe.training = False  # EAGLE's input noise off: both runs see the same inputs
    rows = make_rows(data, np.arange(6), max_len=256)
    # prompts of every share of their rows: long ones start their windows late, the row whose
    # prompt is one token needs a window as wide as itself, so the others run past the padded
    # row's end (positions clamped)
    rows.prompt_lens = torch.minimum(rows.lengths - 1, torch.tensor([1, 4, 12, 24, 36, 48]))
    window = rows.window(recipe.depth)
    assert (window[2:, 0] > 0).all()  # their prompts are left out
    assert len(set(window[:, 0].tolist())) >= 5  # rows start their windows at different places
    assert (window == rows.shape[1] - 1).sum() > 1  # and some reach past the padded row
    teacher = target.run(rows.ids, recipe.aux_layers, rows.teaches())
    results = []
    for windowed in (True, False):
        for p in recipe.parameters():
            p.grad = None
        loss, metrics = recipe.losses(rows, teacher, window=windowed)
        loss.backward()
        results.append((loss.detach(), metrics, [p.grad.clone() for p in recipe.parameters()]))
    (loss_w, metrics_w, grads_w), (loss_f, metrics_f, grads_f) = results
    torch.testing.assert_close(loss_w, loss_f)
    for key in ("loss", "acc"):
        assert metrics_w[key] == pytest.approx(metrics_f[key], rel=1e-5, abs=1e-6)
    for a, b in zip(grads_w, grads_f, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(
    bigram_target, greedy_data, tmp_path, device
):
    """EAGLE draws input noise every step: the random state is resumed with the weights. On a
    GPU (where the state file's random states must be loaded to the CPU) the run resumes;
    exact equality is checked on the CPU, whose arithmetic is deterministic."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    whole = train_config(
        "eagle", bigram_target, greedy_data, str(tmp_path / "whole"), total_steps=8, device=device
    )
    Trainer(whole).run()
    parts = dataclasses.replace(whole, out=str(tmp_path / "parts"), max_steps=3)
    first = Trainer(parts).run()
    assert (first["step"], first["finished"]) == (3, False)
    second = Trainer(dataclasses.replace(parts, resume=True, max_steps=0)).run()
    assert (second["step"], second["finished"]) == (8, True)
    a, b = exported(f"{whole.out}/draft"), exported(f"{parts.out}/draft")
    assert a.keys() == b.keys()
    for name in a:
        if device == "cpu":
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(a[name].float(), b[name].float(), rtol=0.05, atol=0.01)


def test_resuming_with_other_options_or_data_is_refused(bigram_target, greedy_data, tmp_path):
    cfg = train_config("mtp", bigram_target, greedy_data, str(tmp_path), max_steps=1)
    Trainer(cfg).run()
    with pytest.raises(ValueError, match="depth=3"):
        Trainer(dataclasses.replace(cfg, depth=2, resume=True))
    with pytest.raises(ValueError, match="lr=0.003"):
        Trainer(dataclasses.replace(cfg, lr=1e-3, resume=True))
    with pytest.raises(ValueError, match="pass --resume"):
        Trainer(cfg)  # a new run over the old one's state
    other = TokenFile.load(greedy_data).select(torch.arange(10).numpy())
    other.save(str(tmp_path / "other.npz"))
    with pytest.raises(ValueError, match="other data"):
        Trainer(dataclasses.replace(cfg, data=str(tmp_path / "other.npz"), resume=True))


def test_targets_that_are_drafts_are_refused(trained):
    with pytest.raises(ValueError, match="holds a draft"):
        Target(trained["eagle"]["draft"], "cpu", torch.float32)


def test_the_command_line_generates_trains_and_estimates(bigram_target, tmp_path, capsys):
    from tests.training.conftest import random_prompts, write_prompts
    from training.__main__ import main

    prompts = write_prompts(str(tmp_path / "p.npz"), random_prompts(5, 24), num_dev=4)
    data, out = str(tmp_path / "d.npz"), str(tmp_path / "run")
    assert (
        main(
            [
                "generate",
                "--model",
                bigram_target,
                "--prompts",
                prompts,
                "--out",
                data,
                "--batch-size",
                "8",
                "--max-new-tokens",
                "32",
                "--sampled-per-prompt",
                "0",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "train",
                "mtp",
                "--model",
                bigram_target,
                "--data",
                data,
                "--out",
                out,
                "--depth",
                "2",
                "--epochs",
                "8",
                "--lr",
                "3e-3",
                "--tokens-per-batch",
                "512",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    trained = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert trained["finished"] and trained["accept_length"] > 1.2
    log = [json.loads(line) for line in open(f"{out}/train_log.jsonl")]
    assert log[-1]["eval"]["accept_length"] == trained["accept_length"]
    assert (
        main(
            [
                "estimate",
                "mtp",
                "--model",
                bigram_target,
                "--draft",
                f"{out}/draft",
                "--data",
                data,
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out.strip().splitlines()
    estimate = json.loads(printed[-1])
    assert estimate["depth"] == 2 and estimate["accept_length"] > 1.2
    assert estimate["sequences"] == 4 and 0.0 <= estimate["repeated_share"] <= 1.0
    assert f"{100 * estimate['repeated_share']:.1f}% of their tokens repeat" in printed[-2]


def test_losses_refuse_teacher_logits_missing_at_a_learning_position(bigram_target, greedy_data):
    data = TokenFile.load(greedy_data)
    target = Target(bigram_target, "cpu", torch.float32)
    recipe = build_recipe("mtp", target, data, DEPTH["mtp"])
    rows = make_rows(data, np.arange(4), max_len=256)
    too_few = rows.teaches() & (rows.positions() >= rows.prompt_lens[:, None])  # drops u = p - 1
    with pytest.raises(RuntimeError, match="no teacher logits"):
        recipe.losses(rows, target.run(rows.ids, recipe.aux_layers, too_few))


@pytest.mark.parametrize("saved_fused, built_fused", [(False, True), (True, False)])
def test_a_resumed_optimizer_keeps_the_kind_it_was_built_as(saved_fused, built_fused):
    """`load_state_dict` would take `fused` from the saved state: a GPU run resuming an older
    (unfused) state would silently lose its fused AdamW. Either way round, the loaded optimiser
    keeps its own kind and takes the same next step as the one that saved the state."""
    from training.train import load_optimizer_state

    torch.manual_seed(0)
    weight = torch.randn(4, 3)

    def optimizer(fused: bool) -> tuple[torch.nn.Parameter, torch.optim.AdamW]:
        param = torch.nn.Parameter(weight.clone())
        return param, torch.optim.AdamW([param], lr=1e-2, betas=(0.9, 0.95), fused=fused)

    saved_param, saved = optimizer(saved_fused)
    for _ in range(2):
        saved_param.grad = torch.ones_like(saved_param)
        saved.step()
    param, loaded = optimizer(built_fused)
    with torch.no_grad():
        param.copy_(saved_param)
    load_optimizer_state(loaded, copy.deepcopy(saved.state_dict()))  # as from a file
    assert loaded.param_groups[0]["fused"] is built_fused
    for p, opt in ((saved_param, saved), (param, loaded)):
        p.grad = torch.full_like(p, -0.5)
        opt.step()
    torch.testing.assert_close(param, saved_param)
