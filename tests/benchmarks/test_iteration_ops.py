"""iteration_ops lists the launches of one greedy EAGLE-3 chain iteration outside the decoder
layers, by stage and source line (tiny random target and draft, Triton's interpreter)."""

from __future__ import annotations

import collections
import json

from benchmarks import iteration_ops
from tests.gpu_worker.checkpoints import make_tiny_checkpoint
from tests.gpu_worker.draft_checkpoints import make_tiny_eagle3_draft


def test_a_greedy_chain_iteration_by_stage(tmp_path, capsys):
    model = make_tiny_checkpoint(
        str(tmp_path / "model"), "llama", vocab_size=384, max_position_embeddings=512
    )
    draft = make_tiny_eagle3_draft(str(tmp_path / "draft"), model, draft_vocab_size=200)
    out = tmp_path / "ops.json"
    launches = iteration_ops.main(
        ["--model-path", model, "--draft-path", draft, "--shape", "3,1,4", "--json", str(out)]
    )
    assert json.loads(out.read_text())["launches"] == launches
    stages = collections.Counter(x["stage"] for x in launches)
    assert set(stages) == {"host", "draft and verify, greedy", "draft extend"}
    ops = collections.Counter(x["op"] for x in launches)
    # the LM heads of 2 draft steps, the verify and the draft extend, fused with the argmax
    assert ops["triton _block_max_kernel"] == ops["triton _reduce_kernel"] == 4
    assert "argmax" not in ops and ops["triton _greedy_accept_kernel"] == 1
    # nothing from inside the layers (their attention), and every launch has its line
    assert not any("attention/" in x["line"] or x["line"] == "?" for x in launches)
    assert f"{len(launches)} launches outside the decoder layers" in capsys.readouterr().out
