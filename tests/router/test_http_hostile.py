"""Hostile request bodies over HTTP: one client's expensive body must not stall the router's other
clients (health probes, token streams); it is refused in time linear in its size."""

import json
import threading
import time

import httpx
import pytest

from router.errors import APIError
from router.json_body import MAX_JSON_CONTAINERS, json_shape, parse_json

JSON = {"content-type": "application/json"}


def hostile(n_escapes: int) -> bytes:
    """Deeply opened, then one string that never closes: `\\"` pairs the old depth check's
    string regex backtracked over, once per quote."""
    return ("[" * 129 + '"' + '\\"' * n_escapes).encode()


def _fastest(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def test_depth_check_is_linear_on_unterminated_strings():
    def refuse(body):
        def run():
            with pytest.raises(APIError):
                parse_json(body)
        return run

    small, large = hostile(6_000), hostile(24_000)  # 12 KB and 48 KB
    t_small, t_large = _fastest(refuse(small)), _fastest(refuse(large), repeat=1)
    assert t_large < 8 * t_small + 0.02, (t_small, t_large)  # 4x the body: far from 16x the time
    assert t_large < 0.25, t_large


def _reference_shape(text: str) -> tuple[int, int]:
    """The JSON grammar's view, one character at a time."""
    deepest = containers = depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth, containers = depth + 1, containers + 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest, containers


def test_shape_scan_matches_the_grammar_across_chunk_boundaries():
    """Random texts of brackets, separators and strings (escaped quotes and backslashes, brackets
    and multi-byte characters inside), the last string possibly unterminated."""
    import random
    rng = random.Random(3)
    inner = ["[", "]", "{", "}", "a", "é", "€", '\\"', "\\\\", "\\n"]

    def string():
        return '"' + "".join(rng.choice(inner) for _ in range(rng.randrange(6))) + '"'

    for n in (1, 7, 60, 3000, 300_000):  # the last spans several vectorised chunks
        text = "".join(rng.choice(["[", "]", "{", "}", ",", ":", "1", string()]) for _ in range(n))
        if rng.random() < 0.5:
            text += '"[[' + '\\"[' * rng.randrange(3)  # an unterminated string to the end
        assert json_shape(text) == _reference_shape(text), n
    text = json.dumps({"p": '\\"[{' * 100_000, "x": [[{"y": "]]]"}]] * 50_000})  # escapes straddle chunks
    assert json_shape(text) == _reference_shape(text) == (4, 2 + 100_000)


def test_too_many_containers_are_refused_before_parsing():
    at_limit = "[" + ",".join(["[]"] * (MAX_JSON_CONTAINERS - 1)) + "]"
    assert len(parse_json(at_limit.encode())) == MAX_JSON_CONTAINERS - 1
    with pytest.raises(APIError, match="arrays and objects"):
        parse_json(("[" + at_limit + "]").encode())
    assert parse_json(json.dumps({"prompt": "[]" * MAX_JSON_CONTAINERS}).encode())  # in a string: none


def _probe_health(url: str, stop: threading.Event, worst: list) -> None:
    with httpx.Client(timeout=10) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            assert c.get(url + "/health").status_code == 200
            worst[0] = max(worst[0], time.perf_counter() - t0)
            time.sleep(0.01)


@pytest.mark.parametrize("body", [hostile(24_000), hostile(4_000_000), b"[" + b"[]," * 2_600_000 + b"[]]",
                                  b"[" + b"1," * 3_900_000 + b"1]"],
                         ids=["48KB", "8MB", "8MB of arrays", "8MB of ints"])
def test_hostile_body_is_refused_quickly_while_health_answers(router, body):
    stop, worst = threading.Event(), [0.0]
    prober = threading.Thread(target=_probe_health, args=(router.http_url, stop, worst))
    prober.start()
    try:
        time.sleep(0.05)
        t0 = time.perf_counter()
        r = httpx.post(router.http_url + "/v1/completions", content=body, headers=JSON, timeout=30)
        elapsed = time.perf_counter() - t0
    finally:
        stop.set()
        prober.join()
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    # json.loads holds the GIL while it parses (8 MB of small ints: ~0.25 s on an idle core), so
    # the bound on the probes leaves room for that and for a loaded machine
    assert elapsed < 1.5 and worst[0] < 0.75, (elapsed, worst[0])


def test_many_chat_messages_do_not_stall_other_clients(router):
    """8,000 system messages and no user turn: rendered in linear time, off the event loop."""
    body = {"messages": [{"role": "system", "content": ""}] * 8000, "max_tokens": 1}
    stop, worst = threading.Event(), [0.0]
    prober = threading.Thread(target=_probe_health, args=(router.http_url, stop, worst))
    prober.start()
    try:
        time.sleep(0.05)
        t0 = time.perf_counter()
        r = httpx.post(router.http_url + "/v1/chat/completions", json=body, timeout=30)
        elapsed = time.perf_counter() - t0
    finally:
        stop.set()
        prober.join()
    assert r.status_code == 200, r.text
    assert elapsed < 1.5 and worst[0] < 0.5, (elapsed, worst[0])
