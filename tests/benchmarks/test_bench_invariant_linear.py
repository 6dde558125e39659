"""benchmarks/bench_invariant_linear.py on CPU (Triton in the interpreter) at tiny shapes: every
launch shape of the grid timed at every row count, the chosen one first, and the bit check
catching a shape whose row changes with the row count."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_invariant_linear as bench
from gpu_worker.kernels import batch_invariant as bi
from tests.devices import skip_unless_triton_runs_on

ARGV = [
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--shapes",
    "t.qkv=40x48,t.down=24x32",
    "--rows",
    "1,3,70",
    "--block-n",
    "16",
    "--block-k",
    "32,64",
    "--warps",
    "4",
    "--stages",
    "2",
    "--block-m",
    "64,16",
    "--rotate-mb",
    "0",
]


def test_every_shape_at_every_row_count(tmp_path, capsys):
    skip_unless_triton_runs_on("cpu")
    output = tmp_path / "inv.json"
    bench.main(ARGV + ["--output", str(output)])
    rows = json.loads(output.read_text())
    for name, (n, k) in (("t.qkv", (40, 48)), ("t.down", (24, 32))):
        mine = [r for r in rows if r["shape"] == name]
        configs = [tuple(r["config"].values()) for r in mine]
        assert configs[0] == tuple(bi.config_for(n, k)) and mine[0]["chosen"]
        assert set(configs[1:]) == {(16, bk, 4, 2, bm) for bk in (32, 64) for bm in (64, 16)}
        for r in mine:
            assert r["row_invariant"], r["config"]
            assert set(r["us"]) == set(r["default_us"]) == {"1", "3", "70"}
    assert "best invariant" in capsys.readouterr().out


def test_a_shape_whose_rows_change_with_the_count_is_flagged(monkeypatch, capsys):
    """A launch that adds the row count to every output: row 0 differs at 3 and 70 rows, and
    from the chosen shape's."""
    skip_unless_triton_runs_on("cpu")
    linear = bi.linear
    bad = bi.Config(16, 32, 4, 2, 16)

    def drifting(x, w, bias=None, config=None):
        out = linear(x, w, bias, config)
        return out + x.shape[0] if config == bad else out

    monkeypatch.setattr(bi, "linear", drifting)
    rows = bench.main(ARGV[:5] + ["t.o=16x16"] + ARGV[6:])
    flags = {tuple(r["config"].values()): r["row_invariant"] for r in rows}
    chosen = tuple(bi.config_for(16, 16))
    others = {(16, bk, 4, 2, bm): True for bk in (32, 64) for bm in (64, 16)}
    assert flags == {chosen: True, **others, (16, 32, 4, 2, 16): False}
    as_chosen = {tuple(r["config"].values()): r["same_bits_as_chosen"] for r in rows}
    assert not as_chosen[(16, 32, 4, 2, 16)] and as_chosen[chosen]
    assert "NOT INVARIANT" in capsys.readouterr().out


def test_shape_names_say_the_prologue():
    assert bench.parse_shapes("a.o=8x4,135m.qkv") == {"a.o": (8, 4), "135m.qkv": (960, 576)}
    with pytest.raises(SystemExit, match="ends in one of"):
        bench.parse_shapes("a.lm_head=8x4")
