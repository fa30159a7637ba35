"""A soak run: a real server under mixed traffic for a given time, sampled at intervals.

    python -m bench.soak --duration-s 3600 --rate 2 --out soak/        # starts its own server
    python -m bench.soak --url http://127.0.0.1:30000 --pid PID --duration-s 600 --out soak/
    python -m bench.soak --url URL --requests 40 --rate 8 --out soak/   # 40 arrivals, however long

Requests arrive as a Poisson process at `--rate` a second, each of a kind drawn from `KINDS`:
native and OpenAI routes, streaming and not, `n` = 2, logprobs, JSON schemas (a bounded set,
and some unique ones, which the grammar cache must not keep forever), regexes, forced tool
calls, clients that leave mid-stream, aborts, client timeouts, and bursts over the queue bound
(a server started here gets `--max-queued-requests 16`); each asks for 8 to `--max-new-tokens`
new tokens. Expected refusals (a 503 of a full queue) are counted apart; anything else that is
not a 2xx is a failure.

Every `--interval-s` it records, per server process (the main one and its children, read
from /proc): RSS, open file descriptors and threads; the scheduler's KV token usage and
queue; TTFT and TPOT percentiles of the streams finished in the interval. At the end the
traffic stops, the server is left idle until its KV integrity check has run, and the run
writes `soak.json`, `soak.md` (a table per interval and the integrity verdict) and
`soak.png` (each series over time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.launch import start_radixrt, stop
from bench.soak_report import write_report

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]},
    {"type": "array", "items": {"type": "number"}, "maxItems": 4},
]
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no)", r"[a-z]+@[a-z]+\.com"]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while")
# Kind -> weight. Streams carry the latency figures; the rest exercise the other paths.
KINDS = {
    "native_stream": 5,
    "native_logprobs": 2,
    "chat_stream": 5,
    "chat_n2": 2,
    "json_schema": 2,
    "json_schema_unique": 1,
    "regex": 1,
    "tool_call": 1,
    "disconnect": 1,
    "abort": 1,
    "timeout": 1,
    "burst": 0.2,
}
BURST = 24  # requests of a burst, over the queue bound of a server started here
QUEUE_BOUND = 16


@dataclass
class Outcome:
    kind: str
    status: str  # "ok", "expected" (a refusal the kind asks for), or what failed
    ttft: float | None = None
    tpot: float | None = None
    end: float = field(default_factory=time.monotonic)


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64)))


async def _stream(resp: aiohttp.ClientResponse, started: float, leave_after: int = 0):
    """(ttft, tpot) of an SSE stream; stops reading after `leave_after` events if set."""
    first = last = None
    events = 0
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        now = time.monotonic()
        first = first or now
        last, events = now, events + 1
        if leave_after and events >= leave_after:
            break
    if first is None:
        return None, None
    tpot = (last - first) / (events - 1) if events > 1 else None
    return first - started, tpot


async def one(
    session: aiohttp.ClientSession, url: str, kind: str, rng: random.Random, max_new: int = 48
) -> Outcome:
    text, n_new = prompt(rng), rng.randint(min(8, max_new), max_new)
    chat = {"model": "default", "messages": [{"role": "user", "content": text}]}
    native = {"text": text, "sampling_params": {"max_new_tokens": n_new}}
    started = time.monotonic()
    try:
        if kind in ("native_stream", "disconnect", "abort"):
            rid = f"soak-{rng.getrandbits(48):x}"
            body = {**native, "stream": True, "rid": rid}
            async with session.post(f"{url}/generate", json=body) as resp:
                if resp.status != 200:
                    return Outcome(kind, f"http {resp.status}")
                if kind == "abort":
                    await resp.content.readline()
                    async with session.post(f"{url}/abort_request", json={"rid": rid}) as r:
                        return Outcome(kind, "ok" if r.status == 200 else f"abort {r.status}")
                leave = 2 if kind == "disconnect" else 0
                ttft, tpot = await _stream(resp, started, leave)
                return Outcome(kind, "ok", ttft, tpot)
        if kind == "chat_stream":
            body = {**chat, "stream": True, "max_tokens": n_new}
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                if resp.status != 200:
                    return Outcome(kind, f"http {resp.status}")
                ttft, tpot = await _stream(resp, started)
                return Outcome(kind, "ok", ttft, tpot)
        if kind == "timeout":
            body = {**native, "sampling_params": {"max_new_tokens": 256, "ignore_eos": True}}
            limit = aiohttp.ClientTimeout(total=0.2)
            try:
                async with session.post(f"{url}/generate", json=body, timeout=limit) as resp:
                    await resp.read()
            except TimeoutError:
                return Outcome(kind, "expected")
            return Outcome(kind, "ok")
        path, body = _request(kind, chat, native, n_new, rng)
        async with session.post(f"{url}{path}", json=body) as resp:
            await resp.read()
            if resp.status == 503 and kind == "burst":
                return Outcome(kind, "expected")
            return Outcome(kind, "ok" if resp.status == 200 else f"http {resp.status}")
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
        return Outcome(kind, f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - a reply we could not read is a failure too
        return Outcome(kind, f"unreadable reply: {e!r}")


def _request(kind: str, chat: dict, native: dict, n_new: int, rng: random.Random):
    if kind == "native_logprobs":
        return "/generate", {**native, "return_logprob": True, "top_logprobs_num": 2}
    if kind == "regex":
        params = {"max_new_tokens": n_new, "regex": rng.choice(REGEXES)}
        return "/generate", {**native, "sampling_params": params}
    body = {**chat, "max_tokens": n_new}
    if kind == "tool_call":  # room for the call's JSON, but not the context's worth
        return "/v1/chat/completions", {**body, "tools": [TOOL], "tool_choice": "required",
                                        "max_tokens": 96}  # fmt: skip
    if kind == "chat_n2":
        return "/v1/chat/completions", {**body, "n": 2, "temperature": 0.8}
    schema = rng.choice(SCHEMAS)
    if kind == "json_schema_unique":  # a schema no other request asks for
        key = f"k{rng.getrandbits(32):x}"
        schema = {"type": "object", "properties": {key: {"type": "string"}}, "required": [key]}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    return "/v1/chat/completions", {**body, "response_format": fmt}  # json_schema, burst


def processes(main_pid: int) -> dict[int, str]:
    """The server's main process and its children (pid -> name)."""
    named = {main_pid: "main"}
    for pid, (ppid, args) in _proc_table().items():
        if ppid == main_pid and b"resource_tracker" not in args:
            named[pid] = f"child {pid}"
    return named


def grammar_processes(main_pid: int) -> dict[str, float]:
    """How many grammar compile processes (the zygote and its workers, below the
    scheduler) run, and their RSS in all: workers come and go, so they are counted
    together."""
    table = _proc_table()
    below, frontier = [], {main_pid}
    while frontier:
        frontier = {pid for pid, (ppid, _) in table.items() if ppid in frontier}
        below += frontier
    rss = 0.0
    count = 0
    for pid in below:
        if b"zygote_main" in table[pid][1]:
            try:
                rss += process_sample(pid)["rss_mb"]
            except OSError:
                continue
            count += 1
    return {"count": count, "rss_mb": rss}


def _proc_table() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line) of every process."""
    table = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            table[int(entry)] = (int(stat[1]), Path(f"/proc/{entry}/cmdline").read_bytes())
        except OSError:
            continue
    return table


def process_sample(pid: int) -> dict[str, float]:
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return {
        "rss_mb": int(status["VmRSS"].split()[0]) / 1024,
        "threads": int(status["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    s = sorted(values)
    return {"p50": s[len(s) // 2], "p99": s[min(len(s) - 1, int(len(s) * 0.99))]}


async def server_state(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/get_server_info") as resp:
        info = await resp.json()
    state = info["internal_states"][0]
    return {
        "token_usage": state["token_usage"],
        "running": state["num_running_reqs"],
        "queued": state["num_queue_reqs"],
        "grammar_cache": state.get("grammar_cache_entries"),
        "memory_integrity": info["memory_integrity"],
    }


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    kinds, weights = zip(*KINDS.items(), strict=True)
    outcomes: list[Outcome] = []
    samples: list[dict[str, Any]] = []
    tasks: set[asyncio.Task] = set()
    start = time.monotonic()
    next_sample = start + args.interval_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        def launch(kind: str) -> None:
            seeded = random.Random(rng.random())
            task = asyncio.create_task(one(session, args.url, kind, seeded, args.max_new_tokens))
            task.add_done_callback(lambda t: outcomes.append(t.result()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        launched = 0
        while not arrivals_done(args, launched, (now := time.monotonic()) - start):
            kind = rng.choices(kinds, weights)[0]
            for _ in range(BURST if kind == "burst" else 1):
                launch(kind)
                launched += 1
            await asyncio.sleep(min(rng.expovariate(args.rate), max(0.0, next_sample - now)))
            if time.monotonic() >= next_sample:
                samples.append(await sample(session, args, outcomes, samples, start))
                next_sample += args.interval_s
        await asyncio.gather(*tasks)
        samples.append(await sample(session, args, outcomes, samples, start))
        verdict = await idle_integrity(session, args.url, args.idle_timeout_s)
    failures = [o for o in outcomes if o.status not in ("ok", "expected")]
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "requests": len(outcomes),
        "expected_refusals": sum(o.status == "expected" for o in outcomes),
        "by_kind": dict(Counter(o.kind for o in outcomes)),
        "failures": [asdict(o) for o in failures],
        # Every stream's (end, TTFT, TPOT), so that the report can pool whole windows.
        "streams": [(o.end - start, o.ttft, o.tpot) for o in outcomes if o.ttft is not None],
        "samples": samples,
        "memory_integrity": verdict,
    }


def arrivals_done(args: argparse.Namespace, launched: int, elapsed_s: float) -> bool:
    """`--requests N` ends the traffic after N arrivals (the same mix of kinds for a seed, on
    any machine); otherwise it ends after `--duration-s`."""
    if args.requests is not None:
        return launched >= args.requests
    return elapsed_s >= args.duration_s


async def sample(session, args, outcomes: list[Outcome], samples: list, start: float) -> dict:
    since = start + (samples[-1]["t"] if samples else 0.0)
    recent = [o for o in outcomes if o.end >= since]
    row: dict[str, Any] = {"t": time.monotonic() - start, "finished": len(recent)}
    row["failed"] = sum(o.status not in ("ok", "expected") for o in recent)
    row["ttft"] = percentiles([o.ttft for o in recent if o.ttft is not None])
    row["tpot"] = percentiles([o.tpot for o in recent if o.tpot is not None])
    row["server"] = await server_state(session, args.url)
    row["processes"] = {}
    row["grammar_processes"] = grammar_processes(args.pid) if args.pid else None
    if args.pid:
        for pid, name in processes(args.pid).items():
            try:
                row["processes"][name] = process_sample(pid)
            except OSError:
                continue  # a process that just ended
    print(json.dumps({k: row[k] for k in ("t", "finished", "failed", "ttft")}), flush=True)
    return row


async def idle_integrity(session, url: str, timeout_s: float) -> dict[str, Any]:
    """Wait for the server to be idle; an idle scheduler runs its KV integrity check when
    asked for its state, so the check read then covers the whole run."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        asked = time.time()
        state = await server_state(session, url)
        check = state["memory_integrity"]
        idle = state["running"] == 0 and state["queued"] == 0
        if idle and check.get("ok") is not None and (check.get("time") or 0) >= asked - 1:
            return {**check, "token_usage_idle": state["token_usage"]}
        await asyncio.sleep(0.5)
    return {"ok": None, "error": f"not idle with a fresh check within {timeout_s} s"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="a running server; default: start one")
    p.add_argument("--pid", type=int, help="its main process (for the per-process figures)")
    # On a CPU the KV pool's pages are mapped lazily and written first as the radix cache
    # fills, so the scheduler's RSS grows until the pool is full. A pool the traffic fills in
    # its first minutes makes later growth mean a leak, and keeps eviction busy for the run.
    p.add_argument(
        "--server-args",
        default="--dtype float32 --max-total-tokens 32768",
        help="for a server started here",
    )
    p.add_argument("--duration-s", type=float, default=3600)
    p.add_argument("--requests", type=int, help="stop after this many arrivals, not a duration")
    p.add_argument("--interval-s", type=float, default=60)
    p.add_argument("--rate", type=float, default=2.0, help="requests a second (Poisson)")
    p.add_argument(
        "--max-new-tokens", type=int, default=48, help="a request's new tokens: 8 up to this"
    )
    p.add_argument("--idle-timeout-s", type=float, default=120)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("soak"))
    args = p.parse_args(argv)
    server = None
    if args.url is None:
        bound = ["--max-queued-requests", str(QUEUE_BOUND)]
        server, args.url = start_radixrt([*args.server_args.split(), *bound])
        args.pid = server.pid
    try:
        record = asyncio.run(soak(args))
    finally:
        if server is not None:
            stop(server)
    write_report(record, args.out)
    print((args.out / "soak.md").read_text())
    if record["failures"] or record["memory_integrity"].get("ok") is not True:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
