"""The one registry shape behind every pluggable part, and the CLI choices it generates."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attention.registry import ATTENTION_BACKENDS
from constrained import GRAMMAR_BACKENDS
from disagg.transfer import TRANSFER_BACKENDS, create_transfer_backend
from mem_cache.evict_policy import EVICTION_POLICIES
from mem_cache.registry import PREFIX_CACHES
from srt.sampling.registry import SAMPLERS
from srt.server_args import ServerArgs
from srt.server_args_cli import prepare_server_args
from srt.utils.registry import Registry

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A throwaway importable module `radixrt_test_plugin` with a class `Plugin`."""
    name = "radixrt_test_plugin"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            class Plugin:
                def __init__(self, *args, **kwargs):
                    self.args = args
                    self.kwargs = kwargs
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_target_is_imported_only_on_get(plugin_module: str) -> None:
    reg: Registry[object] = Registry("plugin")
    reg.register("p", f"{plugin_module}:Plugin")
    assert reg.names() == ["p"] and "p" in reg
    assert plugin_module not in sys.modules
    cls = reg.get("p")
    assert plugin_module in sys.modules and cls.__name__ == "Plugin"
    made = reg.create("p", 1, x=2)
    assert isinstance(made, cls) and made.args == (1,) and made.kwargs == {"x": 2}


def test_object_targets_and_registration_order() -> None:
    reg: Registry[int] = Registry("number")
    reg.register("b", lambda: 2)
    reg.register("a", lambda: 1)
    assert reg.names() == ["b", "a"]
    assert reg.create("a") == 1
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a", lambda: 3)
    with pytest.raises(ValueError, match="module:attr"):
        reg.register("c", "no_colon_here")


def test_unknown_name_lists_the_choices() -> None:
    reg: Registry[object] = Registry("widget backend")
    reg.register("one", object)
    reg.register("two", object)
    with pytest.raises(
        ValueError, match=r"unknown widget backend 'x'; choose one of \['one', 'two'\]"
    ):
        reg.get("x")


def test_missing_requirement_names_the_package(plugin_module: str) -> None:
    reg: Registry[object] = Registry("plugin")
    reg.register("p", f"{plugin_module}:Plugin", requires="no_such_pkg_xyz", hint="pip install it")
    with pytest.raises(ImportError, match="'no_such_pkg_xyz' package.*pip install it"):
        reg.get("p")
    assert plugin_module not in sys.modules  # checked before the import


def test_unknown_transfer_backend_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown transfer backend 'nope'; choose one of"):
        create_transfer_backend("nope", None, "127.0.0.1")  # type: ignore[arg-type]


def test_prefix_caches() -> None:
    from mem_cache.chunk_cache import ChunkCache
    from mem_cache.radix_cache import RadixCache

    assert PREFIX_CACHES.names() == ["radix", "chunk"]
    assert PREFIX_CACHES.get("radix") is RadixCache
    assert PREFIX_CACHES.get("chunk") is ChunkCache


@pytest.mark.parametrize(
    ("field", "registry", "extra"),
    [
        ("attention_backend", ATTENTION_BACKENDS, ["auto"]),
        ("disaggregation_transfer_backend", TRANSFER_BACKENDS, []),
        ("grammar_backend", GRAMMAR_BACKENDS, []),
        ("sampling_backend", SAMPLERS, []),
        ("radix_eviction_policy", EVICTION_POLICIES, []),
    ],
)
def test_server_args_choices_are_the_registry_names(
    field: str, registry: Registry[object], extra: list[str]
) -> None:
    assert ServerArgs.choices(field) == [*extra, *registry.names()]
    default = getattr(ServerArgs(), field)
    assert default in ServerArgs.choices(field)
    flag = "--" + field.replace("_", "-")
    with pytest.raises(SystemExit):
        prepare_server_args([flag, "no_such_choice"])


def test_server_args_import_stays_cheap() -> None:
    """Importing server_args (and its command line) loads no registry package (they import
    torch); parsing does."""
    check = textwrap.dedent(
        """
        import sys
        import srt.server_args_cli
        assert "torch" not in sys.modules, "torch imported"
        args = srt.server_args_cli.prepare_server_args(["--grammar-backend", "none"])
        assert args.grammar_backend == "none"
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", check],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
