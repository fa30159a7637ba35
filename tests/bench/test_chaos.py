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


def test_the_fleets_the_router_is_told_about() -> None:
    """Each mode's servers, the router's arguments naming them, and which one is killed."""
    dp, naming, victim = chaos.members("dp", ["--x"])
    assert [m.name for m in dp] == ["server-0", "server-1"] and victim == 0
    assert naming == ["--worker-urls", dp[0].url, dp[1].url, "--policy", "round_robin"]

    pd, naming, victim = chaos.members("pd-prefill", ["--x"])
    assert [m.name for m in pd] == ["prefill-0", "prefill-1", "decode-0"] and victim == 0
    bootstraps = [m.args[m.args.index("--disaggregation-bootstrap-port") + 1] for m in pd[:2]]
    assert len(set(bootstraps)) == 2
    assert naming == [
        "--pd-disaggregation",
        "--prefill", pd[0].url, bootstraps[0],
        "--prefill", pd[1].url, bootstraps[1],
        "--decode", pd[2].url,
    ]  # fmt: skip
    assert all(m.args[0] == "--x" for m in pd)

    pd, naming, victim = chaos.members("pd-decode", [])
    assert [m.name for m in pd] == ["prefill-0", "decode-0", "decode-1"]
    assert pd[victim].name == "decode-0"
    assert naming.count("--decode") == 2 and naming.count("--prefill") == 1
