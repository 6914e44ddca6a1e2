"""The session's tiny checkpoints, one per family, written on first use (see families.py)."""

import pytest
from families import Checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> Checkpoint, written on first use."""
    made: dict[str, Checkpoint] = {}

    def get(family: str) -> Checkpoint:
        if family not in made:
            made[family] = Checkpoint(family, tmp_path_factory.mktemp(f"tiny-{family}"))
        return made[family]

    return get
