"""`POST /v1/embeddings` (a server started with `--is-embedding`): one request per input, run
concurrently; each is a prompt that generates nothing and comes back pooled
(`srt/layers/pooler.py`). A prefix shared with an earlier input is read from the radix cache
when the model pools the last token.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

from fastapi import Request, Response

from managers.errors import RequestError
from managers.io_struct import EmbedOptions, GenerateReqInput
from managers.validation import check_batch_size
from srt.entrypoints.http_errors import json_response
from srt.entrypoints.openai.protocol import EmbeddingRequest
from srt.entrypoints.openai.serving_completions import split_prompts
from srt.entrypoints.openai.serving_utils import (
    TokenizerManagerLike,
    collect_final,
    finish_reason,
    response_model,
)


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64 format: the vector's little-endian float32 bytes, as the openai
    client decodes them (`numpy.frombuffer(..., dtype="float32")`)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class OpenAIServingEmbedding:
    def __init__(self, tm: TokenizerManagerLike, max_batch_size: int) -> None:
        self.tm = tm
        self.max_batch_size = max_batch_size

    async def handle(self, body: dict[str, Any], raw_request: Request) -> Response:
        req = EmbeddingRequest.model_validate(body)
        prompts = split_prompts(req.input)
        check_batch_size(len(prompts), len(prompts), self.max_batch_size, "input")
        embed = EmbedOptions(req.dimensions)
        gens = [
            self.tm.generate_request(
                GenerateReqInput(
                    **({"text": p} if isinstance(p, str) else {"input_ids": p}),
                    sampling_params={"max_new_tokens": 0},
                    embed=embed,
                ),
                raw_request,
            )
            for p in prompts
        ]
        finals = await collect_final(gens, 1, "")
        data, prompt_tokens = [], 0
        for i in range(len(prompts)):
            out = finals[(i, 0)]
            finish_reason(out)  # raises for a refused or failed input
            if "embedding" not in out:
                raise RequestError("The request was aborted before its embedding was done.")
            data.append(
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": encode_vector(out["embedding"], req.encoding_format),
                }
            )
            prompt_tokens += out["meta_info"].get("prompt_tokens", 0)
        return json_response(
            {
                "object": "list",
                "data": data,
                "model": response_model(self.tm, req.model),
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            }
        )
