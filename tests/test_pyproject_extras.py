"""A cheap guard on pyproject.toml: `pip install -e .[test]` or `.[gpu]` must not replace torch.

sgl-kernel wheels are each built for one torch (0.3.21: 2.9.1) and pip swaps the installed
torch to satisfy them, so sgl-kernel may only be an opt-in extra of its own. Any torch pin
those extras bring in must be the project's own, 2.13.0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
TORCH_PIN = "==2.13.0"
GUARDED_EXTRAS = ("test", "gpu")


def _project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def _requirements(project: dict, extras: tuple[str, ...]) -> list[Requirement]:
    """The base dependencies plus `extras`, following self-references (`radixrt[bench]`)."""
    name = canonicalize_name(project["name"])
    optional = project.get("optional-dependencies", {})
    found = [Requirement(r) for r in project["dependencies"]]
    pending, seen = list(extras), set()
    while pending:
        extra = pending.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in optional[extra]:
            req = Requirement(line)
            if canonicalize_name(req.name) == name:
                pending.extend(req.extras)
            else:
                found.append(req)
    return found


def test_test_and_gpu_extras_keep_torch_2_13_and_no_sgl_kernel() -> None:
    project = _project()
    for extra in GUARDED_EXTRAS:
        reqs = _requirements(project, (extra,))
        names = {canonicalize_name(r.name) for r in reqs}
        assert "sgl-kernel" not in names, f"[{extra}] pulls in sgl-kernel"
        torch_pins = [str(r.specifier) for r in reqs if canonicalize_name(r.name) == "torch"]
        assert torch_pins and all(pin == TORCH_PIN for pin in torch_pins), (extra, torch_pins)


def test_guard_sees_through_self_references() -> None:
    """The walk follows `radixrt[x]` entries, so hiding sgl-kernel behind one is caught."""
    project = {
        "name": "radixrt",
        "dependencies": ["torch==2.13.0"],
        "optional-dependencies": {
            "gpu": ["radixrt[kernels]"],
            "kernels": ["sgl-kernel", "torch==2.9.1"],
        },
    }
    names = [canonicalize_name(r.name) for r in _requirements(project, ("gpu",))]
    assert names == ["torch", "sgl-kernel", "torch"]
