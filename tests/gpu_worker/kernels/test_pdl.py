"""When kernels launch with programmatic dependent launch (`kernels.pdl`): on a capable CUDA
device, for launches of at most MAX_ROWS rows, unless switched off. (That the launches give the
same results as plain ones is tested on CUDA: test_cuda.py; that every kernel waits in its PTX:
test_cuda_compile.py.)"""

from __future__ import annotations

import torch

from gpu_worker.kernels import pdl

CUDA0 = torch.device("cuda", 0)


def test_never_on_cpu():
    assert pdl.launch_args(torch.device("cpu"), 1) == {"USE_PDL": False, "launch_pdl": False}


def test_on_for_small_launches_of_a_capable_device_unless_switched_off(monkeypatch):
    monkeypatch.setitem(pdl._capable, 0, True)  # as an H100 reports (compute capability 9.0)
    monkeypatch.delenv(pdl.ENV, raising=False)
    assert pdl.launch_args(CUDA0, 1) == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.launch_args(CUDA0, pdl.MAX_ROWS)["USE_PDL"]  # a chain S=3's verify
    assert not pdl.launch_args(CUDA0, pdl.MAX_ROWS + 1)["USE_PDL"]  # library GEMMs around it
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.enabled(CUDA0)
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.enabled(CUDA0)
    monkeypatch.setattr(pdl, "FORCE_OFF", True)
    assert not pdl.enabled(CUDA0)


def test_off_before_compute_capability_9(monkeypatch):
    monkeypatch.setitem(pdl._capable, 0, False)  # e.g. an A100 (8.0)
    monkeypatch.delenv(pdl.ENV, raising=False)
    assert not pdl.launch_args(CUDA0, 1)["launch_pdl"]


def test_it_covers_the_launches_whose_small_projections_are_our_kernels():
    from gpu_worker.kernels import small_m_linear

    assert small_m_linear.choose_config(pdl.MAX_ROWS, 960, 576, prologue=True) is not None
    assert small_m_linear.choose_config(pdl.MAX_ROWS + 1, 960, 576, prologue=True) is None
