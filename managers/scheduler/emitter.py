"""`Emitter`: tell the clients what happened to their requests.

Every part of the scheduler that finishes or advances a request (`Output`, `Intake`, the
`DecodePlanner`, the disaggregation `Port`) reports through one `Emitter`, which turns
requests into one `BatchTokenIDOut` for the detokenizer. It holds no scheduling state, so it
is built first and handed to each part's constructor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from managers.io_struct import BatchTokenIDOut, ReqOutput, finish_abort

if TYPE_CHECKING:
    from collections.abc import Callable

    from managers.req import Req


class Emitter:
    def __init__(
        self, sink: Callable[[BatchTokenIDOut], None], tokenizer: Any, context_len: int
    ) -> None:
        self.sink = sink
        self.tokenizer = tokenizer
        self.context_len = context_len

    def emit(self, reqs: list[Req]) -> None:
        if not reqs:
            return
        outputs: list[ReqOutput] = []
        append = outputs.append
        for req in reqs:
            out, logprobs = req.output_ids, req.logprobs
            # Positional: this runs for every streaming request every step.
            append(
                ReqOutput(
                    req.rid,
                    out[req.sent_output_len :],
                    req.finished_reason,
                    len(req.origin_input_ids),
                    len(out),
                    req.cached_tokens or 0,
                    req.decode_options(),
                    logprobs.take_delta() if logprobs is not None else None,
                    req.embed.vector if req.embed is not None else None,
                )
            )
            req.sent_output_len = len(out)
        self.sink(BatchTokenIDOut(outputs))

    def fail(self, req: Req, message: str, status_code: int | None = None) -> None:
        """Finish `req` with an error and tell the client (its KV is the caller's concern)."""
        req.finished_reason = finish_abort(message, status_code)
        self.emit([req])

    def tail_text(self, req: Req, n: int) -> str:
        """The last n output tokens as text (stop strings are checked against it)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(req.output_ids[-n:], skip_special_tokens=False)

    def check_finished(self, req: Req) -> None:
        """Apply the request's stop conditions to its latest token."""
        req.check_finished(self.context_len, self.tail_text)
