"""Request bodies to JSON values, with the cost of a hostile body bounded before the parser runs.

`json.loads` is C and holds the GIL for the whole parse, so its cost is everyone's: a thread does
not help the other clients while it runs. Two shapes make it slow or unsafe, and both are
refused from one linear scan of the raw bytes first (vectorised, so the scan itself is cheap on
the largest body the router accepts):

- nesting deeper than MAX_JSON_DEPTH: the C parser recurses once per level, and a body that
  reaches the interpreter's recursion limit leaves the thread's stack so deep that anything the
  collector finalises on the way out fails too. No OpenAI request nests anywhere near this (a
  tool's JSON schema is the deepest part, a dozen levels at most);
- more than MAX_JSON_CONTAINERS arrays and objects: each is a garbage-collected allocation, and
  millions of them make the parse take seconds in collector passes (8 MB of `[],` ≈ 1 s).
  A long chat is a few objects per message; a token-id prompt is one array.

Brackets inside strings do not count. The scan works on bytes: every JSON structural character
is ASCII, and no byte of a multi-byte UTF-8 sequence is.
"""

from __future__ import annotations

import json

import numpy as np

from router.errors import invalid

MAX_JSON_DEPTH = 128
MAX_JSON_CONTAINERS = 100_000
_CHUNK = 1 << 18  # bytes scanned per vectorised step: bounds the scan's scratch memory
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN, _CLOSE = (ord("["), ord("{")), (ord("]"), ord("}"))


def json_shape(body: bytes | str) -> tuple[int, int]:
    """(deepest nesting, number of arrays and objects) of a JSON text, brackets inside strings not
    counted. Exact for every prefix that is valid JSON; past the first syntax error the answer
    may be anything, and json.loads stops there."""
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    data = np.frombuffer(body, np.uint8)
    deepest = containers = depth = 0
    in_string, backslashes = False, 0  # carried over chunk boundaries
    for start in range(0, len(data), _CHUNK):
        c = data[start:start + _CHUNK]
        idx = np.arange(len(c), dtype=np.int64)
        slash = c == _BACKSLASH
        # backslashes ending at each position: a quote after an odd run of them is escaped
        last_other = np.where(slash, -1 - backslashes, idx)
        np.maximum.accumulate(last_other, out=last_other)
        run = idx - last_other
        before = np.empty_like(run)
        before[0], before[1:] = backslashes, run[:-1]
        quotes = (c == _QUOTE) & (before % 2 == 0)
        inside = (np.cumsum(quotes, dtype=np.int64) + in_string) % 2 == 1
        opens = ((c == _OPEN[0]) | (c == _OPEN[1])) & ~inside
        closes = ((c == _CLOSE[0]) | (c == _CLOSE[1])) & ~inside
        levels = np.cumsum(opens.astype(np.int64) - closes, dtype=np.int64) + depth
        deepest = max(deepest, int(levels.max()))
        containers += int(opens.sum())
        depth, in_string, backslashes = int(levels[-1]), bool(inside[-1]), int(run[-1])
    return deepest, containers


def nests_deeper_than(text: bytes | str, limit: int) -> bool:
    return json_shape(text)[0] > limit


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(body: bytes):
    """Strict JSON from raw bytes: UTF-8 only, no NaN/Infinity, at most MAX_JSON_DEPTH deep and
    MAX_JSON_CONTAINERS arrays and objects; raises APIError (invalid_request)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"the request body is not valid UTF-8 (byte {e.start})") from None
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        deepest = containers = 0  # too few opening brackets for either limit: the common case
    else:
        deepest, containers = json_shape(body)
    if deepest > MAX_JSON_DEPTH:
        raise invalid(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
    if containers > MAX_JSON_CONTAINERS:
        raise invalid(f"the request body holds more than {MAX_JSON_CONTAINERS} arrays and objects")
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
