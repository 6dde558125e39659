"""benchmarks/plot_serving.py: which lines the plots draw, and what their legends say."""

from __future__ import annotations

import pytest

from benchmarks.plot_serving import series


def row(algorithm: str, concurrency: int, **extra) -> dict:
    return {
        "algorithm": algorithm,
        "overlap": True,
        "concurrency": concurrency,
        "output_tok_s": 10.0 + len(str(concurrency)),
        **extra,
    }


def test_a_speculative_line_names_its_draft():
    rows = [
        row("plain", 4),
        row("plain", 1),
        row("EAGLE3", 1, draft="shipped draft"),
        row("plain", "poisson32"),
    ]
    assert series(rows, "output_tok_s") == {
        "plain, overlap on": ([1, 4], [11.0, 11.0]),
        "EAGLE3 (shipped draft), overlap on": ([1], [11.0]),
    }


def test_a_speculative_row_without_its_draft_is_refused():
    with pytest.raises(ValueError, match="needs a 'draft' field"):
        series([row("EAGLE3", 1)], "output_tok_s")
