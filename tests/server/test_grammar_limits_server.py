"""Grammar limits on a live server: a schema over a cap is a 400 naming
its field before it reaches the scheduler, and neither it nor a slow schema under the caps
holds up a simple constrained request. Orderings are compared, never absolute times."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import pytest
import requests

pytestmark = pytest.mark.slow

TIMEOUT_S = 120


def nested_schema(levels: int) -> str:
    return (
        '{"type": "object", "properties": {"a": ' * levels + '{"type": "integer"}' + "}}" * levels
    )


def generate(url: str, sampling_params: dict[str, Any], stream: bool = False) -> requests.Response:
    body = {"text": "Numbers:", "sampling_params": {"temperature": 0, **sampling_params}}
    return requests.post(url + "/generate", json={**body, "stream": stream}, timeout=TIMEOUT_S)


def run_together(*calls: Any) -> list[tuple[float, Any]]:
    """Run the calls on threads released at one moment; (finish time, result) of each."""
    start = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        start.wait()
        out = calls[i]()
        results[i] = (time.monotonic(), out)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    return results


def test_a_30_level_schema_is_a_400_while_a_simple_constrained_request_completes(
    url: str,
) -> None:
    (_, deep), (_, simple) = run_together(
        lambda: generate(url, {"max_new_tokens": 8, "json_schema": nested_schema(30)}),
        lambda: generate(url, {"max_new_tokens": 8, "regex": "[0-9]+"}),
    )
    assert deep.status_code == 400, deep.text
    error = deep.json()["error"]
    assert error["param"] == "json_schema" and "--grammar-max-depth" in error["message"]
    assert simple.status_code == 200, simple.text
    assert re.fullmatch("[0-9]+", simple.json()["text"])


def test_caps_answer_400_on_every_route_naming_the_field(url: str) -> None:
    r = generate(url, {"max_new_tokens": 8, "json_schema": nested_schema(30)}, stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "json_schema", r.text
    r = generate(url, {"max_new_tokens": 8, "regex": "a" * 70_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "regex", r.text
    many = {"type": "object", "properties": {f"p{i}": {} for i in range(1001)}}
    r = generate(url, {"max_new_tokens": 8, "json_schema": json.dumps(many)})
    assert r.status_code == 400 and "--grammar-max-properties" in r.text, r.text

    fmt = {"type": "json_schema", "json_schema": {"schema": json.loads(nested_schema(30))}}
    for stream in (False, True):
        body = {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 8,
            "response_format": fmt,
            "stream": stream,
        }
        r = requests.post(url + "/v1/chat/completions", json=body, timeout=TIMEOUT_S)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "response_format", r.text
    assert requests.get(url + "/health_generate", timeout=30).status_code == 200


def test_a_slow_schema_under_the_caps_does_not_delay_a_trivial_one(url: str) -> None:
    """The probe's scenario, cheaply: a schema at the property cap (1000 optional
    properties, seconds to compile) is sent first, a regex after it; the regex request
    finishes first and the slow one still completes."""
    slow_schema = {"type": "object", "properties": {f"s{i}": {} for i in range(1000)}}
    slow_params = {"max_new_tokens": 4, "json_schema": json.dumps(slow_schema)}

    def trivial() -> requests.Response:
        time.sleep(0.5)  # after the slow one has reached the scheduler
        return generate(url, {"max_new_tokens": 4, "regex": "[0-9]{1,3}"})

    (slow_done, slow), (trivial_done, fast) = run_together(
        lambda: generate(url, slow_params), trivial
    )
    assert fast.status_code == 200 and re.fullmatch("[0-9]{1,3}", fast.json()["text"]), fast.text
    assert slow.status_code == 200, slow.text
    assert trivial_done < slow_done
