"""Grammar compiles that can be stopped, on the session's tiny server (compile timeout 5 s,
two pending grammars a client; `tiny_server` in tests/conftest.py).

A short JSON schema whose `pattern` would take minutes to compile is refused at its timeout
while other constrained requests complete (it leaves the small lane after a second), and the
process that compiled it is killed: the server's grammar processes are no more, and hold no
more memory, than before, and the scheduler holds no more memory either. A client over its share of pending grammars gets a 429 at once;
a request for a grammar it already waits for, and another client, do not."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import TINY_SERVER_COMPILE_TIMEOUT_S, TINY_SERVER_KEY

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {TINY_SERVER_KEY}"}
TIMEOUT_S = 120
# Inside a JSON string, where `.` also spans escapes, nested bounded repetitions cost the
# compiler minutes (`(.{1,10}){1,10}` alone takes ~30 s with the default vocabulary), though
# the schema is 100 bytes: small by every measure of size, so it starts on the small lane.
SLOW_PATTERN = "(.{1,50}){1,50}"


def slow_schema(tag: str) -> str:
    props = {tag: {"type": "string", "pattern": SLOW_PATTERN}}
    return json.dumps({"type": "object", "properties": props, "required": [tag]})


# Five patterns: not a small grammar, so it takes a general worker, yet compiles at once.
QUICK_BIG = json.dumps(
    {
        "type": "object",
        "properties": {f"q{i}": {"type": "string", "pattern": "[a-z]"} for i in range(5)},
    }
)


def generate(client: httpx.Client, url: str, **constraint: str) -> httpx.Response:
    body = {
        "text": "Hi",
        "sampling_params": {"max_new_tokens": 16, "temperature": 0, **constraint},
    }
    return client.post(url + "/generate", json=body, headers=AUTH, timeout=TIMEOUT_S)


def in_thread(call: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append((call(), time.monotonic())))
    thread.start()
    return thread, out


def grammar_processes(server_pid: int) -> dict[int, int]:
    """pid -> RSS in bytes of the server's grammar zygote and its workers."""
    out = {}
    for pid in descendants(server_pid):
        try:
            if b"zygote_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out[pid] = rss(pid)
        except OSError:  # ended meanwhile
            continue
    return out


def descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parents.items() if p in frontier]
        found += children
        frontier = children
    return found


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def scheduler_pid(server_pid: int) -> int:
    (pid,) = [
        p
        for p in descendants(server_pid)
        if b"zygote_main" not in Path(f"/proc/{p}/cmdline").read_bytes()
        and rss(p) > 200 << 20  # the detokenizer is smaller
    ]
    return pid


def test_a_compile_past_its_timeout_is_killed_while_others_complete(tiny_server) -> None:
    url, server_pid = tiny_server.url, tiny_server.proc.pid
    with httpx.Client() as client:
        # Start the small lane's and a general lane's worker.
        assert generate(client, url, regex="[0-9]{1,3}").status_code == 200
        assert generate(client, url, json_schema=QUICK_BIG).status_code == 200
        before = grammar_processes(server_pid)
        scheduler = scheduler_pid(server_pid)
        scheduler_rss = rss(scheduler)

        started = time.monotonic()
        slow, slow_out = in_thread(lambda: generate(client, url, json_schema=slow_schema("a")))
        compiling = busiest(server_pid)
        # Small constrained requests complete meanwhile.
        for i in range(3):
            r = generate(client, url, regex=f"[0-9]{{{i + 1}}}")
            assert r.status_code == 200 and re.fullmatch(f"[0-9]{{{i + 1}}}", r.json()["text"])
            small = json.dumps(
                {"type": "object", "properties": {"n": {"const": i}}, "required": ["n"]}
            )
            r = generate(client, url, json_schema=small)
            assert r.status_code == 200 and json.loads(r.json()["text"]) == {"n": i}
        slow.join(TIMEOUT_S)
        ((response, ended),) = slow_out
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert f"did not finish within {TINY_SERVER_COMPILE_TIMEOUT_S:g} s" in message
        assert ended - started >= TINY_SERVER_COMPILE_TIMEOUT_S

        # The process that compiled it is gone; the grammar processes are no more, and hold
        # no more memory, than before (the small lane's worker was replaced when the slow
        # grammar left it).
        deadline = time.monotonic() + 10
        while compiling in (after := grammar_processes(server_pid)):
            assert time.monotonic() < deadline, f"{compiling} still runs: {after}"
            time.sleep(0.1)
        assert len(after) <= len(before), f"{before} -> {after}"
        assert sum(after.values()) <= sum(before.values()) + (16 << 20), f"{before} -> {after}"
        assert rss(scheduler) < scheduler_rss + (32 << 20)
        # The next big grammar compiles (in a new worker if it needs one).
        assert generate(client, url, json_schema=QUICK_BIG.replace("q0", "r0")).status_code == 200


def busiest(server_pid: int) -> int:
    """The grammar process that uses the most CPU over half a second, once the slow
    grammar has left the small lane."""
    time.sleep(1.5)
    first = {pid: cpu_ticks(pid) for pid in grammar_processes(server_pid)}
    time.sleep(0.5)
    used = {
        pid: cpu_ticks(pid) - t for pid, t in first.items() if pid in grammar_processes(server_pid)
    }
    return max(used, key=used.__getitem__)


def cpu_ticks(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    utime, stime = stat[stat.rindex(")") + 2 :].split()[11:13]
    return int(utime) + int(stime)


def test_a_client_over_its_share_of_pending_grammars_gets_a_429(tiny_server) -> None:
    url = tiny_server.url
    other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    with httpx.Client() as client, other:
        pending = [
            in_thread(lambda t=t: generate(client, url, json_schema=slow_schema(t)))
            for t in ("b", "c")
        ]
        wait_compiling(client, url, 2)
        started = time.monotonic()
        third = generate(client, url, json_schema=slow_schema("d"))
        assert third.status_code == 429, third.text
        assert third.headers["retry-after"] == "1"
        assert "--grammar-max-pending-per-client" in third.json()["error"]["message"]
        assert time.monotonic() - started < TINY_SERVER_COMPILE_TIMEOUT_S
        # The same grammar again adds no compile: it waits (and times out) with the first.
        same, same_out = in_thread(lambda: generate(client, url, json_schema=slow_schema("b")))
        # Another client is not held to this one's share.
        r = generate(other, url, regex="[a-c]{2}")
        assert r.status_code == 200 and re.fullmatch("[a-c]{2}", r.json()["text"]), r.text
        for thread, out in [*pending, (same, same_out)]:
            thread.join(TIMEOUT_S)
            assert out[0][0].status_code == 400, out[0][0].text


def wait_compiling(client: httpx.Client, url: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        info = client.get(url + "/server_info", headers=AUTH, timeout=30).json()
        if info["internal_states"][0]["num_grammar_queue_reqs"] >= n:
            return
        assert time.monotonic() < deadline, "the requests never reached the grammar queue"
        time.sleep(0.05)
