"""GPU packages are imported only by the backend / kernel call that needs them.

Stand-in `flashinfer` and `sgl_kernel` packages are put on the path so the check means
something on a machine without the real ones: they are findable (the "installed" branches
of backend selection run), yet importing the core must not load them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHECK = textwrap.dedent(
    """
    import sys
    import torch
    import srt
    import managers.scheduler
    import attention.registry
    import srt.model_executor.model_runner
    import srt.model_executor.cuda_graph_runner
    import srt.models.llama
    from attention.registry import is_package_installed, resolve_attention_backend

    assert is_package_installed("flashinfer") and is_package_installed("sgl_kernel")
    assert resolve_attention_backend("auto", "cpu", torch.bfloat16) == "cpu"
    # A CPU forward through the layers with fused kernels "installed".
    from srt.layers.layernorm import RMSNorm
    from srt.layers.activation import SiluAndMul
    RMSNorm(8)(torch.randn(2, 8), torch.randn(2, 8))
    SiluAndMul()(torch.randn(2, 8))
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("flashinfer", "sgl_kernel"))
    print("LOADED", loaded)
    assert not loaded, loaded
    """
)


def test_core_imports_no_gpu_package(tmp_path: Path) -> None:
    for name in ("flashinfer", "sgl_kernel"):
        pkg = tmp_path / name
        pkg.mkdir()
        (pkg / "__init__.py").write_text("IMPORTED = True\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", CHECK],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "LOADED []" in proc.stdout
