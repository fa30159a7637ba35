"""`ResponseStore`: the `/v1/responses` a later request may continue (`previous_response_id`)
or fetch (`GET /v1/responses/{id}`).

In memory, in the main process, bounded by count (`--response-store-size`, least recently
used evicted first). Each entry holds its whole conversation as chat messages (the stored
input, this input, this output) and the response object. A conversation must fit the model's
context to have been answered, so an entry is at most a context's worth of text, plus the
response object: the store holds at most `--response-store-size` of those. A response made
with `store: false`, or evicted, or made before a restart, is not found: a 404 naming
`previous_response_id`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResponse:
    conversation: list[dict[str, Any]]  # chat messages, without the request's instructions
    response: dict[str, Any]  # the response object as it was returned


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 0)
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def not_found(self, response_id: str) -> str:
        return (
            f"Response {response_id!r} not found: it was made with store false, evicted from "
            f"this server's store of the last {self.capacity} responses "
            "(--response-store-size), or made before the server restarted."
        )
