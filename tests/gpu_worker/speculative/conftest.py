"""Shared fixtures of the speculative tests: tiny targets and drafts, made once per session."""

from __future__ import annotations

import pytest

from tests.gpu_worker.checkpoints import make_tiny_checkpoint
from tests.gpu_worker.draft_checkpoints import (
    make_agreeing_eagle_draft,
    make_bigram_target,
    make_tiny_eagle3_draft,
    make_tiny_eagle_draft,
)

VOCAB = 384


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("spec-models")
    target = make_tiny_checkpoint(
        str(root / "target"), "llama", vocab_size=VOCAB, max_position_embeddings=512
    )
    bigram = make_bigram_target(str(root / "bigram"), vocab_size=VOCAB)
    return {
        "target": target,
        "eagle": make_tiny_eagle_draft(str(root / "eagle"), target),
        "eagle3": make_tiny_eagle3_draft(str(root / "eagle3"), target, draft_vocab_size=200),
        "bigram": bigram,
        "agreeing": make_agreeing_eagle_draft(str(root / "agreeing"), bigram),
        # its distribution is the bigram target's own (logits at the same scale)
        "matching": make_agreeing_eagle_draft(str(root / "matching"), bigram, confidence=1.0),
    }
