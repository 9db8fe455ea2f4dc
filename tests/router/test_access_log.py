"""Access logs are optional: with RouterConfig.access_log every HTTP request is one INFO line of
the logger uvicorn.access (method, path, status); without it, none."""

from __future__ import annotations

import logging

import httpx
import pytest
from harness import RouterThread

from router.config import RouterConfig


@pytest.mark.parametrize("on", [False, True])  # off first: a router without them must not silence a later one
def test_access_log_lines(caplog, on):
    r = RouterThread(RouterConfig(http_port=0, grpc_port=None, access_log=on))
    try:
        with caplog.at_level(logging.INFO):
            assert httpx.get(f"{r.http_url}/health", timeout=10).status_code == 200
            assert httpx.get(f"{r.http_url}/nope", timeout=10).status_code == 404
        # pytest hangs its capture handler on a logger that does not propagate, as uvicorn.access was
        # while the router before ran without access lines: the same record can arrive twice
        records = {id(rec): rec for rec in caplog.records if rec.name == "uvicorn.access"}.values()
        lines = [rec.getMessage() for rec in records]
    finally:
        r.close()
    if on:
        assert len(lines) == 2 and '"GET /health HTTP/1.1" 200' in lines[0] and '"GET /nope HTTP/1.1" 404' in lines[1]
    else:
        assert lines == []
