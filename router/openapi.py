"""`GET /openapi.json`: the OpenAPI 3.1 document of the HTTP API, its request bodies generated
from the typed models the router validates with (router/request_models.py), so the published
schema is the one enforced."""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from router.request_models import ChatCompletionRequest, CompletionRequest

_ERROR = {"description": "an OpenAI-style error", "content": {"application/json": {"schema": {
    "type": "object", "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": "string"}}}}}}}}


def _post(summary: str, schema_ref: str) -> dict:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": schema_ref}}}},
        "responses": {"200": {"description": "a completion, or an SSE stream when `stream` is true"},
                      "4XX": _ERROR, "5XX": _ERROR}}}


def openapi_document(version: str = "0.1.0") -> dict:
    refs, schema = models_json_schema([(CompletionRequest, "validation"), (ChatCompletionRequest, "validation")],
                                      ref_template="#/components/schemas/{model}")
    simple = {"get": {"responses": {"200": {"description": "OK"}}}}
    token_body = {"post": {"responses": {"200": {"description": "OK"}, "4XX": _ERROR}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "v4serve", "version": version},
        "paths": {
            "/v1/completions": _post("Create a completion", refs[(CompletionRequest, "validation")]["$ref"]),
            "/v1/chat/completions": _post("Create a chat completion",
                                          refs[(ChatCompletionRequest, "validation")]["$ref"]),
            "/v1/models": simple, "/health": simple, "/metrics": simple,
            "/tokenize": token_body, "/detokenize": token_body,
        },
        "components": {"schemas": schema.get("$defs", {})},
    }
