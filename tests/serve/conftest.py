"""Serving tests run an engine thread beside the event loop (and, for the app, a server thread and
its clients): one intra-op torch thread keeps them from spinning against each other on a small machine."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
