"""bench_all_reduce needs one GPU per rank; without them it says so instead of starting ranks
that would fail one by one. Its measurements run on the device (`python3 -m benchmarks tp`)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_all_reduce


def test_too_few_gpus_is_refused_with_the_count(capsys: pytest.CaptureFixture) -> None:
    world = torch.cuda.device_count() + 1
    with pytest.raises(SystemExit) as e:
        bench_all_reduce.main(["--world", str(world), "--sizes-kib", "8"])
    assert f"--world {world} needs that many GPUs" in str(e.value.code)


def test_help_names_the_defaults(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        bench_all_reduce.main(["--help"])
    assert "8,16,32" in capsys.readouterr().out
