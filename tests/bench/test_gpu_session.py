"""bench/gpu_session (with gpu_plan and gpu_prepare): the printed device plan fits the device
tool's limits, and prepare's dry run names every package without touching the network."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_plan, gpu_prepare
from bench import gpu_session as gs

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_session.sh"
COMMAND_LIMIT = 2000  # characters, the device tool's limit per call


def run_script(*args: str) -> str:
    env = os.environ | {"PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, check=True
    )
    return proc.stdout


@pytest.fixture(scope="module")
def plan_text() -> str:
    return run_script("plan")


def test_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_plan_prints_every_call_verbatim(plan_text: str) -> None:
    assert len(gpu_plan.CALLS) >= 2
    for i, call in enumerate(gpu_plan.CALLS, 1):
        assert f"## Call {i}:" in plan_text
        assert call["command"] in plan_text.splitlines()
    assert "within 30 s" in plan_text


@pytest.mark.parametrize("index", range(len(gpu_plan.CALLS)))
def test_each_command_fits_and_parses(index: int) -> None:
    command = gpu_plan.CALLS[index]["command"]
    assert len(command) <= COMMAND_LIMIT
    subprocess.run(["bash", "-n", "-c", command], check=True)
    for needed in (
        "PYTHONPATH=$PWD:$HOME/gpu/site",
        "FLASHINFER_WORKSPACE_BASE=$HOME/gpu",
        "FLASHINFER_CUDA_ARCH_LIST=9.0a",
        "/opt/torch/.venv/bin/python3",
        "$OUT/",
    ):
        assert needed in command


def test_carry_lists_are_prepared_files_under_gpu() -> None:
    prepared = {"site.tar.xz", "model.part.aa", "model.part.ab", "model.sha256"}
    carried = set()
    for call in gpu_plan.CALLS:
        assert call["carry"] and len(call["carry"]) <= 8
        for path in call["carry"]:
            assert path.startswith(".gpu/") and ".." not in path
            carried.add(path.removeprefix(".gpu/"))
    assert carried == prepared
    # Call 1 brings the site; the model's second part comes while the first waits there.
    assert ".gpu/site.tar.xz" in gpu_plan.CALLS[0]["carry"]
    assert ".gpu/model.part.ab" in gpu_plan.CALLS[1]["carry"]


def test_guard_after_the_first_call() -> None:
    guard = "[ -d $HOME/gpu/site/flashinfer ] || exit 3"
    first, *rest = gpu_plan.CALLS
    assert guard not in first["command"] and "tar -xJf .gpu/site.tar.xz" in first["command"]
    assert all(call["command"].startswith(guard) for call in rest)


def test_plan_runs_what_the_gpu_issue_needs(plan_text: str) -> None:
    for path in re.findall(r"tests/[\w/]+\.py", plan_text):
        assert (REPO / path).is_file(), path
    for test in ("test_flashinfer_attention", "test_gpu_engine", "test_cuda_graph_gpu"):
        assert test in plan_text
    bench_src = (REPO / "bench" / "bench_gpu.py").read_text()
    for flag in ("--skip-checks", "--models", "--out"):
        assert f'"{flag}"' in bench_src
    assert "--models default" in plan_text and "--models qwen3-0.6b" in plan_text


def test_prepare_dry_run_lists_packages_without_network(monkeypatch, capsys) -> None:
    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"dry run ran {args}")

    monkeypatch.setattr(gs.subprocess, "run", no_subprocess)
    gs.main(["prepare", "--dry-run"])
    out = capsys.readouterr().out
    for spec in [gpu_prepare.FLASHINFER, *gpu_prepare.PACKAGES, gpu_prepare.MODEL_WHEEL]:
        assert spec in out
    for name in ("flashinfer-python", "apache-tvm-ffi", "gguf", "pyzmq", "fastapi", "xgrammar"):
        assert name in out
    assert "--python-version 3.12" in out and "manylinux_2_28_x86_64" in out
