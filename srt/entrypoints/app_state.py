"""What the HTTP routes share, kept on `app.state` and handed to each handler as a FastAPI
dependency, so the route modules hold no closures over the server's objects.

`install_state` is called once by `http_server.create_app`; a handler names what it needs
with the `*Dep` annotations below.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, FastAPI, Request

from managers.tokenizer_manager import TokenizerManager
from srt.server_args import ServerArgs


def install_state(
    app: FastAPI, tm: TokenizerManager, server_args: ServerArgs, show_local_paths: bool
) -> None:
    """`show_local_paths`: whether `/get_server_info` may name local paths (behind an API
    key every reader is an operator)."""
    app.state.tokenizer_manager = tm
    app.state.server_args = server_args
    app.state.show_local_paths = show_local_paths


# The getters are coroutines: FastAPI runs a plain-function dependency in its thread pool,
# a thread hop on every request for an attribute read.
async def get_tokenizer_manager(request: Request) -> TokenizerManager:
    return request.app.state.tokenizer_manager


async def get_server_args(request: Request) -> ServerArgs:
    return request.app.state.server_args


async def get_show_local_paths(request: Request) -> bool:
    return request.app.state.show_local_paths


TokenizerManagerDep = Annotated[TokenizerManager, Depends(get_tokenizer_manager)]
ServerArgsDep = Annotated[ServerArgs, Depends(get_server_args)]
ShowLocalPathsDep = Annotated[bool, Depends(get_show_local_paths)]
