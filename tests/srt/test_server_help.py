"""`launch_server --help`: every flag in one of the named groups, in field order, and the
default shown where the help text does not already give it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from srt.server_args import ServerArgs
from srt.server_args_cli import HELP_GROUPS


def help_text() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "srt.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout


def test_help_is_grouped_by_concern_with_defaults() -> None:
    text = help_text()
    names = [f.name for f in dataclasses.fields(ServerArgs)]
    firsts = [first for _, first in HELP_GROUPS]
    assert names[0] == firsts[0] and firsts == [n for n in names if n in firsts]
    sections = [text.index(f"\n{title}:\n") for title, _ in HELP_GROUPS]
    assert sections == sorted(sections)  # in order, each present once
    for title, first in HELP_GROUPS:
        start = text.index(f"\n{title}:\n")
        assert text.index("--" + first.replace("_", "-"), start) > start
    assert "--port PORT" in text and "(default: 30000)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
