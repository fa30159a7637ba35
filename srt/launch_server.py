"""`launch_server` / `python -m srt.launch_server`: serve a model over HTTP.

launch_server                      # the default model on 127.0.0.1:30000
launch_server --model-path /models/Qwen3-0.6B --port 8000 --dtype bfloat16
"""

from __future__ import annotations

import sys

from srt.server_args_cli import prepare_server_args
from srt.utils.process import configure_logging


def main(argv: list[str] | None = None) -> int:
    server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    configure_logging(server_args.log_level, "server")
    from srt.entrypoints.serve import serve

    return serve(server_args)


if __name__ == "__main__":
    sys.exit(main())
