from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.distributed.tp_harness import TPRanks


@pytest.fixture(scope="session")
def tp2() -> Iterator[TPRanks]:
    """Two gloo ranks shared by the whole session (tests must leave them usable)."""
    ranks = TPRanks(2)
    yield ranks
    ranks.close()
