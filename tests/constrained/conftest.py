"""One driver with the default model (auto dtype, the device's default loop) for the whole
folder: loading it costs seconds, so the tests share it and batch their requests into few
`generate` calls."""

from __future__ import annotations

import pytest

from managers.inprocess import InProcessDriver
from tests.constrained.helpers import make_driver


@pytest.fixture(scope="package")
def default_driver() -> InProcessDriver:
    """The default configuration: the auto dtype, the device's default loop."""
    return make_driver()
