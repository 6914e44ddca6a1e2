"""When the Triton kernels launch as programmatic dependents (PDL): where it can run (a compiled
kernel on a GPU of compute capability 9.0 or newer), unless switched off (INFER_PDL=0)."""

import pytest
import torch

pytest.importorskip("triton")

from infer.kernels import (
    pdl,  # noqa: E402
    triton_pdl,  # noqa: E402
)


@pytest.fixture(autouse=True)
def fresh():
    pdl.reset()
    yield
    pdl.reset()


def test_off_when_switched_off(monkeypatch):
    monkeypatch.setenv("INFER_PDL", "0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    assert not triton_pdl.use_pdl(torch.device("cuda", 0))
    assert triton_pdl.kernel_args(torch.device("cuda", 0)) == {"USE_PDL": False}


@pytest.mark.parametrize("setting", [None, "1"])
def test_on_by_default_on_hopper_only(monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv("INFER_PDL", raising=False)
    else:
        monkeypatch.setenv("INFER_PDL", setting)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    assert triton_pdl.use_pdl(torch.device("cuda", 0))
    assert triton_pdl.kernel_args(torch.device("cuda", 0)) == {"USE_PDL": True, "launch_pdl": True}
    assert not triton_pdl.use_pdl(torch.device("cpu"))
    pdl.reset()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))  # A100: no PDL
    assert not triton_pdl.use_pdl(torch.device("cuda", 0))


def test_never_under_the_interpreter(monkeypatch):
    # the interpreter has no gdc_wait: the kernels there always take the plain path
    monkeypatch.setenv("INFER_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    assert not triton_pdl.use_pdl(torch.device("cuda", 0))
