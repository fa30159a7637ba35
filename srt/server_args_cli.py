"""`launch_server`'s command line, generated from `ServerArgs`' fields: one flag per field,
its help and choices from the field's metadata, in `--help` groups by concern."""

from __future__ import annotations

import argparse
import dataclasses
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

from srt.server_args import ServerArgs

# `launch_server --help` in groups: (title, the first field of the group, in field order).
HELP_GROUPS = (
    ("model and tokenizer", "model_path"),
    ("network", "host"),
    ("request limits", "max_request_bytes"),
    ("admission and time limits", "max_queued_requests"),
    ("memory", "mem_fraction_static"),
    ("scheduling", "max_running_requests"),
    ("tensor parallelism", "tp_size"),
    ("prefill/decode disaggregation", "disaggregation_mode"),
    ("constrained decoding", "grammar_backend"),
    ("backends", "attention_backend"),
    ("observability", "log_level"),
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """One flag per field, in `HELP_GROUPS` (a field belongs to the group whose first
    field it follows)."""
    hints = get_type_hints(ServerArgs)
    starts = {first: title for title, first in HELP_GROUPS}
    group: Any = parser
    for f in dataclasses.fields(ServerArgs):
        if f.name in starts:
            group = parser.add_argument_group(starts[f.name])
        flag = "--" + f.name.replace("_", "-")
        base = _base_type(hints[f.name])
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "default": f.default,
            "help": f.metadata["help"],
        }
        if base is bool:
            group.add_argument(flag, action="store_true", **kwargs)
            negative = f.metadata["negative"]
            if negative is not None:
                group.add_argument(negative[0], dest=f.name, action="store_false", help=negative[1])
            continue
        choices = ServerArgs.choices(f.name)
        if choices:
            kwargs["choices"] = choices
        group.add_argument(flag, type=base, **kwargs)


def from_cli_args(args: argparse.Namespace) -> ServerArgs:
    return ServerArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerArgs)})


def _base_type(hint: Any) -> type:
    """`int | None` -> int; `str` -> str."""
    if get_origin(hint) in (Union, types.UnionType):
        return next(a for a in get_args(hint) if a is not type(None))
    return hint


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless its help already says it, or it is unset / off."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action) or text


def prepare_server_args(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser(
        prog="launch_server",
        description="RadixRT server",
        formatter_class=_HelpFormatter,
    )
    add_cli_args(parser)
    try:
        return from_cli_args(parser.parse_args(argv))
    except ValueError as e:  # a value the type allows but the server cannot use
        parser.error(str(e))
