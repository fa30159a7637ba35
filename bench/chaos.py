"""Chaos behind sglang-router: RadixRT servers behind the router, steady streaming load
through it, then `kill -9` of one server mid-run and a restart on its ports. `--mode`:

- `dp`: two servers in data-parallel; one is killed.
- `pd-prefill`: prefill/decode disaggregation (`--disaggregation-transfer-backend`, mooncake
  by default) with two prefill servers and one decode server; a prefill server is killed.
- `pd-decode`: one prefill server and two decode servers; a decode server is killed.

It reports what a client saw: requests that failed before their stream started (the router
should retry those), streams that started and then failed (each must end with an explicit
error event, never a silent truncation), any stream whose snapshots went backwards or
repeated a token, the router's own retry count, and how long after the restart the server
was serving again.

    python -m bench.chaos                                  # the default model, 60 s
    python -m bench.chaos --mode pd-prefill                # then pd-decode
    python -m bench.chaos --server-args "--model-path /models/tiny" --duration-s 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.launch import free_port, router_command, start_radixrt, stop, wait_healthy

PROMPTS = [
    "Tell me about the history of the sea.",
    "Write a short poem about lighthouses.",
    "Explain how a CPU cache works.",
    "List some facts about the moon.",
]


@dataclass
class Stream:
    started_at: float
    status: int | None = None
    tokens: int = 0
    # complete | error_event | failed_before_start | broken_transfer | truncated | corrupted
    outcome: str = ""
    detail: str = ""


@dataclass
class Record:
    streams: list[Stream] = field(default_factory=list)
    kill_at: float | None = None
    restart_at: float | None = None
    serving_again_at: float | None = None


async def one_stream(session: aiohttp.ClientSession, url: str, i: int, new: int) -> Stream:
    s = Stream(started_at=time.monotonic())
    body = {
        "text": PROMPTS[i % len(PROMPTS)],
        "sampling_params": {"max_new_tokens": new, "ignore_eos": True, "temperature": 0},
        "stream": True,
    }
    last_ids: list[int] = []
    try:
        async with session.post(url + "/generate", json=body) as r:
            s.status = r.status
            if r.status != 200:
                s.outcome, s.detail = "failed_before_start", (await r.text())[:200]
                return s
            done = False
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: ") :]
                if data == b"[DONE]":
                    done = True
                    break
                item = json.loads(data)
                if "error" in item:
                    s.outcome, s.detail = "error_event", str(item["error"])[:200]
                    return s
                ids = item.get("output_ids", [])
                if ids[: len(last_ids)] != last_ids or len(ids) < len(last_ids):
                    s.outcome, s.detail = "corrupted", "a snapshot did not extend the last"
                    return s
                last_ids = ids
            s.tokens = len(last_ids)
            if done and len(last_ids) == new:
                s.outcome = "complete"
            else:
                s.outcome, s.detail = "truncated", f"{len(last_ids)} of {new} tokens, done={done}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        # After the headers, a connection cut mid-body is an incomplete chunked transfer:
        # the client's HTTP library raises, so it is not silent, but it is no error event.
        s.outcome = "failed_before_start" if s.status is None else "broken_transfer"
        s.detail = repr(e)[:200]
    return s


async def load(args: argparse.Namespace, router_url: str, rec: Record, stop_at: float) -> None:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client(c: int) -> None:
            i = c
            while time.monotonic() < stop_at:
                rec.streams.append(await one_stream(session, router_url, i, args.output_len))
                i += args.concurrency

        await asyncio.gather(*(client(c) for c in range(args.concurrency)))


def serving(url: str) -> bool:
    """Whether the (restarted) server has run a forward step: the router sends it traffic.
    A prefill server's requests pass too quickly to be caught running."""
    try:
        with urllib.request.urlopen(url + "/server_info", timeout=5) as r:
            info = json.loads(r.read())
    except (OSError, ValueError):
        return False
    return info["internal_states"][0]["forward_ct"] > 0


def router_metric(port: int, needle: str) -> float:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    except OSError:
        return float("nan")
    total = 0.0
    for line in text.decode().splitlines():
        if not line.startswith("#") and needle in line.split("{")[0].split(" ")[0]:
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Member:
    """One server of the fleet: its arguments and ports, and how the router names it."""

    args: list[str]
    port: int
    name: str
    router_args: list[str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def members(mode: str, server_args: list[str]) -> tuple[list[Member], list[str], int]:
    """The fleet of `mode`, the router's arguments that name it, and which one to kill."""
    if mode == "dp":
        fleet = [Member(server_args, free_port(), f"server-{k}", []) for k in range(2)]
        urls = [m.url for m in fleet]
        return fleet, ["--worker-urls", *urls, "--policy", "round_robin"], 0
    n_prefill, n_decode = (2, 1) if mode == "pd-prefill" else (1, 2)
    fleet = []
    for k in range(n_prefill):
        bootstrap = str(free_port())
        args = [*server_args, "--disaggregation-mode", "prefill"]
        args += ["--disaggregation-bootstrap-port", bootstrap]
        port = free_port()
        named = ["--prefill", f"http://127.0.0.1:{port}", bootstrap]
        fleet.append(Member(args, port, f"prefill-{k}", named))
    for k in range(n_decode):
        port = free_port()
        args = [*server_args, "--disaggregation-mode", "decode"]
        fleet.append(Member(args, port, f"decode-{k}", ["--decode", f"http://127.0.0.1:{port}"]))
    router = ["--pd-disaggregation", *(a for m in fleet for a in m.router_args)]
    return fleet, router, 0 if mode == "pd-prefill" else 1


class Fleet:
    """Servers behind sglang-router (its default retries and health checks, `router_args`
    added)."""

    def __init__(
        self, fleet: list[Member], naming: list[str], router_args: list[str], out: Path
    ) -> None:
        self.members, self.out = fleet, out
        self.urls = [m.url for m in fleet]
        self.servers = []
        for m in fleet:
            self.servers.append(start_radixrt(m.args, out / f"{m.name}.log", m.port)[0])
        self.router_port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.router_port}"
        self.router_log = open(out / "router.log", "w")  # noqa: SIM115 - closed in close()
        cmd = router_command(
            *naming,
            "--host", "127.0.0.1", "--port", str(self.router_port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            *router_args,
        )  # fmt: skip
        self.router = subprocess.Popen(
            cmd, stdout=self.router_log, stderr=subprocess.STDOUT, start_new_session=True
        )
        if not wait_healthy(self.router, self.url, 120):
            self.close()
            raise SystemExit("the router did not start")

    def kill(self, k: int) -> None:
        os.killpg(self.servers[k].pid, signal.SIGKILL)
        self.servers[k].wait()

    def restart(self, k: int) -> None:
        m = self.members[k]
        log = self.out / f"{m.name}-restarted.log"
        self.servers[k], _ = start_radixrt(m.args, log, m.port)

    def close(self) -> None:
        if self.router.poll() is None:
            os.killpg(self.router.pid, signal.SIGTERM)
            self.router.wait(30)
        self.router_log.close()
        for s in self.servers:
            stop(s)


async def timeline(args: argparse.Namespace, fleet: Fleet, rec: Record) -> float:
    """Load from the start; the kill and the restart on their schedule. The run's start."""
    t0 = time.monotonic()
    stop_at = t0 + args.duration_s
    load_task = asyncio.ensure_future(load(args, fleet.url, rec, stop_at))
    await asyncio.sleep(args.kill_after_s)
    rec.kill_at = time.monotonic()
    await asyncio.to_thread(fleet.kill, args.victim)
    await asyncio.sleep(args.restart_after_s)
    rec.restart_at = time.monotonic()
    await asyncio.to_thread(fleet.restart, args.victim)
    while time.monotonic() < stop_at and rec.serving_again_at is None:
        if await asyncio.to_thread(serving, fleet.urls[args.victim]):
            rec.serving_again_at = time.monotonic()
        await asyncio.sleep(0.5)
    await load_task
    return t0


def chaos(args: argparse.Namespace) -> dict[str, Any]:
    server_args = [*args.server_args.split(), "--enable-metrics"]
    if args.mode != "dp":
        server_args += ["--disaggregation-transfer-backend", args.transfer_backend]
    fleet_members, naming, args.victim = members(args.mode, server_args)
    fleet = Fleet(fleet_members, naming, args.router_args.split(), args.out)
    rec = Record()
    try:
        t0 = asyncio.run(timeline(args, fleet, rec))
        retries = router_metric(fleet.metrics_port, "retr")
    finally:
        fleet.close()
    return {"mode": args.mode, "killed": fleet_members[args.victim].name} | summarize(
        rec, t0, retries
    )


def summarize(rec: Record, t0: float, retries: float) -> dict[str, Any]:
    outcomes = Counter(s.outcome for s in rec.streams)
    around_kill = [
        s for s in rec.streams if rec.kill_at is not None and s.started_at <= rec.kill_at + 5
    ]
    return {
        "streams": len(rec.streams),
        "outcomes": dict(outcomes),
        "failed_before_start": outcomes["failed_before_start"],
        "broken_transfers": outcomes["broken_transfer"],
        "silent_truncations": outcomes["truncated"],
        "corrupted_or_duplicated": outcomes["corrupted"],
        "errors_around_kill": Counter(s.outcome for s in around_kill if s.outcome != "complete"),
        "router_retries_metric": retries,
        "kill_at_s": None if rec.kill_at is None else rec.kill_at - t0,
        "restart_at_s": None if rec.restart_at is None else rec.restart_at - t0,
        "serving_again_s_after_restart": None
        if rec.serving_again_at is None or rec.restart_at is None
        else rec.serving_again_at - rec.restart_at,
        "failures": [asdict(s) for s in rec.streams if s.outcome != "complete"][:20],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=["dp", "pd-prefill", "pd-decode"], default="dp")
    p.add_argument("--transfer-backend", default="mooncake", help="PD modes: how KV moves")
    p.add_argument("--server-args", default="--dtype float32 --max-total-tokens 16384")
    # The router's circuit breaker retries an open circuit after 60 s by default; 10 s here, so
    # that a restarted server's rejoin is measured within a short run.
    p.add_argument("--router-args", default="--cb-timeout-duration-secs 10")
    p.add_argument("--duration-s", type=float, default=60)
    p.add_argument("--kill-after-s", type=float, default=15)
    p.add_argument("--restart-after-s", type=float, default=5)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-timeout-s", type=float, default=120)
    p.add_argument("--out", type=Path, default=Path("chaos"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    record = chaos(args)
    (args.out / "chaos.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "failures"}, indent=2, default=str))
    return record


if __name__ == "__main__":
    main()
