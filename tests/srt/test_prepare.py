"""`python -m srt.prepare`: a first start's one-time work done ahead of it. Run as a process
(what `tests/install.sh` runs), with an empty cache root, two tiny C sources in place of
`csrc/` (one of them broken) and a tiny GGUF model, so that it costs seconds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.tiny_gguf import save_tiny_gguf

# Runs the CLI with csrc/ pointed at the test's sources (argv[1]).
PREPARE = (
    "import sys; from pathlib import Path; from srt.kernels import build; from srt import prepare; "
    "build.CSRC = Path(sys.argv[1]); sys.exit(prepare.main(sys.argv[2:]))"
)


def _prepare(tmp_path: Path, csrc: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RADIXRT_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run(
        [sys.executable, "-c", PREPARE, str(csrc), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture
def csrc(tmp_path: Path) -> Path:
    folder = tmp_path / "csrc"
    folder.mkdir()
    (folder / "ok.c").write_text("int ok_value(void) { return 1; }\n")
    return folder


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no cc")
def test_prepare_builds_kernels_converts_the_model_and_snapshots_its_config(tmp_path, csrc):
    (csrc / "broken.c").write_text("this is not C\n")
    gguf = save_tiny_gguf("llama", tmp_path / "model")
    done = _prepare(tmp_path, csrc, "--model-path", str(gguf))
    assert done.returncode == 1  # a kernel that does not build fails the command ...
    assert "kernel broken.c: build failed" in done.stderr
    cache = tmp_path / "cache"
    [library] = (cache / "kernels").glob("ok-*.so")  # ... after the others are built
    assert f"kernel ok.c: {library}" in done.stdout
    assert "float32 matmuls: " in done.stdout  # the plan is measured and kept
    assert len(list((cache / "kernels").glob("f32-matmul-plan-*.json"))) == 1
    [converted] = [p for p in (cache / "gguf").iterdir() if p.is_dir()]  # and the model too
    assert (converted / "config.json").is_file() and f"model: {converted}" in done.stdout
    assert len(list((cache / "hf-configs").glob("*.pickle"))) == 1


def test_a_model_that_is_not_there_fails_with_why(tmp_path, csrc):
    done = _prepare(tmp_path, csrc, "--skip-kernels", "--model-path", str(tmp_path / "nothing"))
    assert done.returncode == 1
    assert "neither a local HF folder" in done.stderr
    assert not (tmp_path / "cache" / "kernels").exists()
