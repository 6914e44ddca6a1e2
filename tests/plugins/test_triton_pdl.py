"""When the Triton kernels launch as programmatic dependents (PDL): only where it is asked for
(INFER_PDL=1) and can run (a compiled kernel on a GPU of compute capability 9.0 or newer)."""

import pytest
import torch

pytest.importorskip("triton")

from infer.core import pdl  # noqa: E402
from infer.plugins import triton_pdl  # noqa: E402


@pytest.fixture(autouse=True)
def fresh():
    pdl.reset()
    yield
    pdl.reset()


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv("INFER_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    assert not triton_pdl.use_pdl(torch.device("cuda", 0))
    assert triton_pdl.kernel_args(torch.device("cuda", 0)) == {"USE_PDL": False}


def test_on_when_asked_on_hopper_only(monkeypatch):
    monkeypatch.setenv("INFER_PDL", "1")
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
