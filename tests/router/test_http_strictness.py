"""Request fields and headers the router is strict about: out-of-range numbers are a 400 naming
the field (never a 500), every error response is counted, and a JSON body must say it is JSON
(so a web page cannot make a browser post one to a key-less router without a CORS preflight)."""

import json

import httpx
import pytest
from harness import RouterThread

from model.tokenizer import ByteTokenizer
from router.config import RouterConfig
from router.stub_backend import StubConfig

JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("field", ["temperature", "top_p", "top_k", "seed", "max_tokens"])
@pytest.mark.parametrize("sign", [1, -1])
def test_huge_integers_are_a_400_naming_the_field(router, field, sign):
    label = {"outcome": "error", "reason": "invalid_request"}
    before = router.metric("v4serve_requests_total", label)
    raw = '{"prompt": "x", "%s": %s%s}' % (field, "-" if sign < 0 else "", "9" * 400)
    r = httpx.post(router.http_url + "/v1/completions", content=raw.encode(), headers=JSON)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert router.metric("v4serve_requests_total", label) == before + 1


class _BrokenTokenizer(ByteTokenizer):
    """A tokenizer with a bug on one input: the router's last-resort 500 path."""

    def encode(self, text):
        if text == "trigger a bug":
            raise RuntimeError("tokenizer bug")
        return super().encode(text)


def test_a_500_is_answered_in_the_openai_shape_and_counted():
    r = RouterThread(RouterConfig(http_port=0, grpc_port=None), StubConfig(max_model_len=2048))
    r.stub.tokenizer = _BrokenTokenizer(512)
    try:
        label = {"outcome": "error", "reason": "internal"}
        resp = httpx.post(r.http_url + "/v1/completions", json={"prompt": "trigger a bug", "max_tokens": 2})
        assert resp.status_code == 500 and resp.json()["error"]["code"] == "internal"
        assert r.metric("v4serve_requests_total", label) == 1
        assert httpx.post(r.http_url + "/v1/completions", json={"prompt": "fine", "max_tokens": 2}).status_code == 200
    finally:
        r.close()


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                   "application/jsonp", "text/json"])
def test_a_json_body_must_be_declared_json(router, ctype):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    headers = {} if ctype is None else {"content-type": ctype}
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(router.http_url + path, content=body, headers=headers)
        assert r.status_code == 415, r.text
        err = r.json()["error"]
        assert err["code"] == "unsupported_media_type" and err["type"] == "invalid_request_error"
        assert "application/json" in err["message"]
    assert not router.stub.active


@pytest.mark.parametrize("ctype", ["application/json", "application/json; charset=utf-8", "Application/JSON",
                                   "application/json ;charset=UTF-8"])
def test_json_content_types_are_accepted(router, ctype):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    r = httpx.post(router.http_url + "/v1/completions", content=body, headers={"content-type": ctype})
    assert r.status_code == 200, r.text
