"""bench/chaos.py's reading of a stream, against the `FakeStreamingServer` test double: a
complete stream, an error event, a refusal before the stream, and a connection cut after the
headers are each told apart, and the summary counts them. (The fleet itself, two servers and
the router, runs only in the benchmark.)"""

from __future__ import annotations

import asyncio

import aiohttp

from bench import chaos
from tests.bench.fake_server import FakeStreamingServer, Script

NEW_TOKENS = 4


def test_each_outcome_is_told_apart() -> None:
    scripts = {
        chaos.PROMPTS[0]: Script(chunks=[1] * NEW_TOKENS),
        chaos.PROMPTS[1]: Script(chunks=[1] * NEW_TOKENS, fail="event"),
        chaos.PROMPTS[2]: Script(fail="http"),
        chaos.PROMPTS[3]: Script(chunks=[1] * NEW_TOKENS, fail="drop"),
    }

    async def run(url: str) -> list[chaos.Stream]:
        async with aiohttp.ClientSession() as session:
            return [await chaos.one_stream(session, url, i, NEW_TOKENS) for i in range(4)]

    with FakeStreamingServer(scripts) as server:
        streams = asyncio.run(run(server.url))
    assert [s.outcome for s in streams] == [
        "complete",
        "error_event",
        "failed_before_start",
        "broken_transfer",
    ], [(s.outcome, s.detail) for s in streams]
    assert streams[0].tokens == NEW_TOKENS and streams[2].status == 503

    rec = chaos.Record(streams=streams, kill_at=streams[0].started_at)
    summary = chaos.summarize(rec, t0=streams[0].started_at, retries=0.0)
    assert summary["streams"] == 4 and summary["failed_before_start"] == 1
    assert summary["broken_transfers"] == 1 and summary["silent_truncations"] == 0
    assert summary["corrupted_or_duplicated"] == 0 and len(summary["failures"]) == 3
