"""Training lines up with serving: the drafts the recipes train are the drafts the server runs.

- Every chain a served draft proposes (draft extend, the draft loop's positions and keys, the
  hidden states fed forward, the MTP windows) is what the training side's unroll predicts
  after the same prefix when fed its own earlier tokens: checked with random drafts over a
  random target, where every input moves the argmax.
- So the offline estimate is the served acceptance: a draft trained here, exported and loaded
  by the server, accepts in each decode iteration exactly what the teacher-forced unroll,
  walked like the verifier, predicts.

A misalignment would keep greedy output exact but quietly lose acceptance; these tests are
what notices it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aerie.codec import pack_ids
from aerie.config import AerieConfig
from aerie.messages import SamplingParams, TokenizedRequest
from gpu_worker.worker import GPUWorker
from scheduler_proc.scheduler import Scheduler
from tests.engine_loop import drive
from tests.gpu_worker.checkpoints import make_tiny_checkpoint
from tests.training.conftest import ALGORITHMS, DEPTH, VOCAB, engine_config, random_prompts
from training.build import build_recipe
from training.estimate import chain_runs, walk_rows
from training.rows import Rows
from training.target import Target
from training.tokens import TokenFile

NEW_TOKENS = 40


def serve(config: AerieConfig, prompts: list[list[int]]) -> tuple[dict, dict]:
    """Greedy, to NEW_TOKENS each -> (rid -> output ids, rid -> tokens of each verify)."""
    worker = GPUWorker(config)
    sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        sched.add_request(TokenizedRequest(f"r{i}", pack_ids(prompt), params))
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    accepts = {f"r{i}": [] for i in range(len(prompts))}
    verify = dict.fromkeys(outputs, 0)

    def collect(plan, result, deltas):
        for d in deltas:
            tokens = d.token_ids
            outputs[d.rid] += tokens
            if d.spec_verify_ct > verify[d.rid]:
                accepts[d.rid].append(len(tokens))
                verify[d.rid] = d.spec_verify_ct

    drive(sched, worker, collect)
    return outputs, accepts


@pytest.fixture(scope="module")
def random_target(tmp_path_factory) -> str:
    return make_tiny_checkpoint(
        str(tmp_path_factory.mktemp("random")),
        "llama",
        vocab_size=VOCAB,
        max_position_embeddings=512,
    )


def untrained_draft(algorithm: str, target: Target, out: str) -> str:
    """A draft of random weights, exported like a trained one (EAGLE-3: the first 200 ids).
    Its matrices are scaled up from the initial N(0, 0.02) so that attention is far from
    uniform: positions and keys then move the argmax."""
    data = TokenFile.from_sequences([list(range(VOCAB))], [0])
    recipe = build_recipe(algorithm, target, data, DEPTH[algorithm], seed=3, draft_vocab=200)
    with torch.no_grad():
        for p in recipe.parameters():
            if p.dim() == 2:
                p.mul_(10.0)
    recipe.export(out)
    return out


def served_chains(config: AerieConfig, prompt: list[int]) -> tuple[list[int], list[tuple]]:
    """One greedy request -> (its output, (committed length, chain) of every decode
    iteration, as the worker's draft proposed it)."""
    worker = GPUWorker(config)
    sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    sched.add_request(TokenizedRequest("r", pack_ids(prompt), params))
    chains, propose = [], worker.spec.draft_tree

    def spy(rows, committed_lens, committed_lens_cpu, bonus, coupled=False):
        tree = propose(rows, committed_lens, committed_lens_cpu, bonus, coupled)
        tokens = tree.tokens.view(rows.shape[0], -1)[0, 1:].tolist()  # node 0 is the bonus
        chains.append((int(committed_lens[0]), tokens))
        return tree

    worker.spec.draft_tree = spy
    output = []
    drive(
        sched,
        worker,
        lambda plan, result, deltas: output.extend(t for d in deltas for t in d.token_ids),
    )
    return output, chains


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_served_chains_are_what_the_training_unroll_predicts(algorithm, random_target, tmp_path):
    depth = DEPTH[algorithm]
    target = Target(random_target, "cpu", torch.float32)
    draft = untrained_draft(algorithm, target, str(tmp_path / "draft"))
    recipe = build_recipe(algorithm, target, None, depth, init_from=draft)
    recipe.training = False
    checked = 0
    for prompt in random_prompts(seed=11, n=2):
        config = engine_config(random_target, algorithm, draft, depth)
        output, chains = served_chains(config, prompt)
        sequence = prompt + output
        for prefix, chain in chains:
            if prefix + 1 > len(sequence):
                continue  # a step past the end, whose tokens were dropped
            # the chain after position prefix - 1 reads the bonus, then its own tokens
            ids = torch.tensor([sequence[: prefix + 1] + chain])
            rows = Rows(ids, torch.tensor([ids.shape[1]]), torch.tensor([len(prompt)]))
            with torch.no_grad():
                outs = recipe.unroll(rows, target.run(ids, recipe.aux_layers), depth)
                at = torch.tensor([prefix - 1])
                predicted = [int(recipe.predicted_ids(o.logits(at))[0]) for o in outs]
            assert predicted == chain, f"committed length {prefix}"
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_served_accept_lengths_equal_the_walked_estimate(algorithm, bigram_target, trained):
    depth, draft = DEPTH[algorithm], trained[algorithm]["draft"]
    prompts = random_prompts(seed=7, n=3)
    plain, _ = serve(engine_config(bigram_target), prompts)
    outputs, served = serve(engine_config(bigram_target, algorithm, draft, depth), prompts)
    assert outputs == plain

    target = Target(bigram_target, "cpu", torch.float32)
    recipe = build_recipe(algorithm, target, None, depth, init_from=draft)
    recipe.training = False
    walked_all = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt + plain[f"r{i}"]])
        rows = Rows(ids, torch.tensor([ids.shape[1]]), torch.tensor([len(prompt)]))
        with torch.no_grad():
            agree = recipe.chain_agreement(rows, target.run(ids, recipe.aux_layers), depth)
        run = chain_runs(agree, depth).reshape(rows.shape).numpy()
        walked = walk_rows(rows, run, depth)
        # the last walked iteration may end past the served tokens (its bonus is cut there)
        assert served[f"r{i}"][: len(walked) - 1] == walked[:-1], f"request {i}"
        walked_all += walked
    assert min(walked_all) == 1 and max(walked_all) > 2, "the draft should agree only sometimes"


def test_training_raises_the_estimate_over_an_untrained_draft(bigram_target, greedy_data, trained):
    from training.build import split_indices
    from training.estimate import estimate_accept_length
    from training.tokens import TokenFile

    data = TokenFile.load(greedy_data)
    _, dev = split_indices(data)
    target = Target(bigram_target, "cpu", torch.float32)
    for algorithm in ALGORITHMS:
        untrained = build_recipe(algorithm, target, data, DEPTH[algorithm], draft_vocab=200)
        before = estimate_accept_length(untrained, target, data, dev, 5, 640, 2048)
        after = trained[algorithm]["result"]
        assert after["iterations"] > 0
        assert after["accept_length"] > before["accept_length"] + 0.25, algorithm


def test_a_shorter_chain_is_estimated_as_a_draft_of_that_depth(bigram_target, greedy_data, trained):
    """Walking 2 steps of a 3-step draft must not depend on its third step (whose missing
    tokens at the end of each sequence once counted as rejections)."""
    from training.build import split_indices
    from training.estimate import estimate_accept_length

    data = TokenFile.load(greedy_data)
    _, dev = split_indices(data)
    target = Target(bigram_target, "cpu", torch.float32)
    draft = trained["eagle3"]["draft"]
    deep = build_recipe("eagle3", target, None, 3, init_from=draft)
    shallow = build_recipe("eagle3", target, None, 2, init_from=draft)
    a = estimate_accept_length(deep, target, data, dev, 2, 640, 2048)
    b = estimate_accept_length(shallow, target, data, dev, 2, 640, 2048)
    assert a == b and a["depth"] == 2 and a["iterations"] > 0


def test_repeated_share_counts_tokens_that_close_an_earlier_ngram():
    """Response [1 2 3 1 2 3 4] after a 2-token prompt, trigrams: (1 2 3) comes back once, so 1
    of 7 response tokens repeats; a prompt's n-grams do not count, nor another response's."""
    from training.estimate import answers_repeated_share
    from training.repetition import repeated_share

    data = TokenFile.from_sequences([[1, 2, 1, 2, 3, 1, 2, 3, 4], [5, 6, 7, 8]], [2, 1])
    assert answers_repeated_share(data, np.array([0]), n=3) == pytest.approx(1 / 7)
    assert answers_repeated_share(data, np.array([1]), n=3) == 0.0
    assert answers_repeated_share(data, np.array([0, 1]), n=3) == pytest.approx(1 / 10)
    echo = TokenFile.from_sequences([[1, 2, 3, 1, 2, 3, 4]], [3])  # the prompt's trigram again
    assert answers_repeated_share(echo, np.array([0]), n=3) == 0.0
    # the first 5 response tokens [1 2 3 1 2] hold no repeated trigram; 6 hold (1 2 3) again
    assert answers_repeated_share(data, np.array([0]), n=3, response_tokens=5) == 0.0
    assert answers_repeated_share(data, np.array([0]), n=3, response_tokens=6) == 1 / 6
    assert repeated_share([[1, 2, 3], [1, 2, 3]], n=3) == 0.0  # each response on its own
    assert repeated_share([[7] * 5], n=2) == pytest.approx(3 / 5)
    assert repeated_share([]) == 0.0


def test_estimate_walks_the_answers_asked_for(bigram_target, greedy_data, trained, tmp_path):
    """--answers ended / cut walk the dev answers that ended by a stop token / were cut (the
    data's `finished` flag), which together are every dev answer."""
    from training.build import split_indices
    from training.estimate import EstimateConfig, estimate

    data = TokenFile.load(greedy_data)
    _, dev = split_indices(data)
    finished = np.zeros(len(data), dtype=bool)
    finished[dev[::3]] = True  # a third of the dev answers "ended"
    marked = str(tmp_path / "marked.npz")
    TokenFile(
        data.tokens, data.offsets, data.prompt_lens, {**data.extra, "finished": finished}
    ).save(marked)

    def walked(**options) -> dict:
        draft = trained["eagle3"]["draft"]
        config = EstimateConfig("eagle3", bigram_target, draft, marked, 2, device="cpu", **options)
        return estimate(config)

    results = {answers: walked(answers=answers) for answers in ("all", "ended", "cut")}
    assert results["ended"]["sequences"] == len(dev[::3]) > 0
    assert results["ended"]["sequences"] + results["cut"]["sequences"] == len(dev)
    assert results["ended"]["iterations"] > 0 and results["cut"]["iterations"] > 0
    ended, cut, every = (results[a]["iterations"] for a in ("ended", "cut", "all"))
    assert ended + cut == every
    tokens = {a: r["accept_length"] * r["iterations"] for a, r in results.items()}
    assert tokens["ended"] + tokens["cut"] == pytest.approx(tokens["all"])
    assert 0.0 <= results["all"]["repeated_share"] <= 1.0
    # The first 4 tokens of each answer: at most 4 iterations an answer, fewer in all.
    first = walked(response_tokens=4)
    assert first["sequences"] == len(dev) and first["response_tokens"] == 4
    assert len(dev) <= first["iterations"] <= 4 * len(dev) < every


def test_estimate_refuses_answers_it_cannot_choose(greedy_data, tmp_path, capsys):
    """--answers ended needs the `finished` flag and at least one such answer; an unknown
    value is refused on the command line."""
    from training.__main__ import main
    from training.estimate import EstimateConfig, estimate

    data = TokenFile.load(greedy_data)
    bare = str(tmp_path / "bare.npz")
    TokenFile(data.tokens, data.offsets, data.prompt_lens, {"dev": data.extra["dev"]}).save(bare)
    with pytest.raises(ValueError, match="--answers ended needs a data file written by"):
        estimate(EstimateConfig("eagle3", "unused", "unused", bare, answers="ended"))
    none_ended = str(tmp_path / "none_ended.npz")
    TokenFile(
        data.tokens,
        data.offsets,
        data.prompt_lens,
        {**data.extra, "finished": np.zeros(len(data), bool)},
    ).save(none_ended)
    with pytest.raises(ValueError, match="none of the .* answers to walk was ended"):
        estimate(EstimateConfig("eagle3", "unused", "unused", none_ended, answers="ended"))
    with pytest.raises(SystemExit):
        main(
            [
                "estimate",
                "eagle3",
                "--model",
                "m",
                "--draft",
                "d",
                "--data",
                bare,
                "--answers",
                "some",
            ]
        )
    assert "invalid choice: 'some'" in capsys.readouterr().err
