"""Operations: `/health`, `/health_generate`, `/get_load`, model and server info, and
`/metrics` (its own router, mounted only with `--enable-metrics`).

Clients see the served model name, never the model's local path; `/get_server_info` shows
local paths only when an API key guards it. Handlers reach the `TokenizerManager` and
`ServerArgs` through `app_state` dependencies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from fastapi import APIRouter, Response

from managers.errors import RequestError
from managers.io_struct import GenerateReqInput
from managers.server_status import combined_memory_integrity
from srt.entrypoints.app_state import ServerArgsDep, ShowLocalPathsDep, TokenizerManagerDep
from srt.entrypoints.http_errors import json_response

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
HEALTH_GENERATE_TIMEOUT_S = 20.0
# Server arguments that are local paths: shown by /get_server_info only behind an API key.
LOCAL_PATH_ARGS = ("model_path", "tokenizer_path", "chat_template", "cache_dir", "api_key_file")

router = APIRouter()
metrics_router = APIRouter()


@router.get("/health")
async def health(tm: TokenizerManagerDep) -> Response:
    """200 while the server can serve: 503 once it shuts down or a child died, and while
    the scheduler is silent for longer than one step may take (`--watchdog-timeout`)."""
    tm.ensure_started()  # the scheduler's heartbeats are read from here on
    if tm.dead_reason is not None or tm.scheduler_stalled() is not None:
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/get_load")
async def get_load(tm: TokenizerManagerDep) -> Response:
    """SGLang's shape, which sglang-router's load monitor (power_of_two) reads."""
    tm.ensure_started()
    return json_response(tm.load())


@router.get("/health_generate")
async def health_generate(tm: TokenizerManagerDep) -> Response:
    obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})

    async def one() -> None:
        async for _ in tm.generate_request(obj):
            pass

    try:
        await asyncio.wait_for(one(), HEALTH_GENERATE_TIMEOUT_S)
    except (asyncio.TimeoutError, RequestError) as e:
        logger.error("health_generate failed: %r", e)
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(tm: TokenizerManagerDep) -> Response:
    name = tm.served_model_name  # the local paths stay private (see the module docstring)
    return json_response(
        {
            "model_path": name,
            "tokenizer_path": name,
            "served_model_name": name,
            "is_generation": True,
            "context_length": tm.context_len,
        }
    )


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(
    tm: TokenizerManagerDep, server_args: ServerArgsDep, show_local_paths: ShowLocalPathsDep
) -> Response:
    states = await tm.get_internal_states()
    args = dataclasses.asdict(server_args)
    args.pop("api_key", None)
    # What the scheduler runs with where the field's default depends on the device.
    args["max_prefill_tokens"] = server_args.prefill_token_budget()
    args["disable_overlap_schedule"] = not server_args.overlap_schedule()
    if show_local_paths:
        args["model_path"] = tm.model_path
    else:
        args.update(dict.fromkeys(LOCAL_PATH_ARGS))
        args["model_path"] = tm.served_model_name
    return json_response(
        {
            **args,
            "version": VERSION,
            "served_model_name": tm.served_model_name,
            "max_total_num_tokens": tm.max_total_tokens,
            "internal_states": [dataclasses.asdict(state) for state in states],
            "memory_integrity": dataclasses.asdict(combined_memory_integrity(states)),
        }
    )


@metrics_router.get("/metrics")
async def metrics(tm: TokenizerManagerDep) -> Response:
    return Response(tm.metrics.render(), media_type="text/plain; version=0.0.4")
