"""Router configuration: one frozen dataclass, built once by the launcher and passed explicitly.

Nothing in `router/` reads environment variables or global settings; a test builds the config it
needs and a deployment builds it from its own flags. Ports may be 0 (the OS picks a free port;
`serve()` reports the actual one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.generation_defaults import GenerationDefaults


@dataclass(frozen=True)
class PlacementConfig:
    """Weights and thresholds of the placement policies (router/policies/)."""

    page_size: int = 256  # tokens per KV page; page hashes are computed at this granularity
    remote_prefill_threshold: int = 512  # uncached prompt tokens from which a prefill worker is used
    decode_load_weight: float = 1.0
    prefix_affinity_weight: float = 1.0
    waiting_weight: float = 2.0  # a waiting request costs a decode worker more than a running one
    # a request to be prefilled remotely waits at the router (up to its deadline) while every prefill
    # worker has more prompt tokens queued than this; None: never
    max_prefill_queue_tokens: int | None = None

    def __post_init__(self):
        if self.page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {self.page_size}")
        if self.remote_prefill_threshold < 0:
            raise ValueError(f"remote_prefill_threshold must be >= 0, got {self.remote_prefill_threshold}")
        if self.max_prefill_queue_tokens is not None and self.max_prefill_queue_tokens <= 0:
            raise ValueError(f"max_prefill_queue_tokens must be > 0 or None, got {self.max_prefill_queue_tokens}")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    http_port: int | None = 8000  # None: no HTTP server
    grpc_port: int | None = 50051  # None: no gRPC server
    model_name: str | None = None  # served model id; None: the backend's model_name
    model_aliases: tuple[str, ...] = ()  # further names a request's `model` may use
    tokenizer_dir: str | None = None  # the launcher's: whose tokenizer.json it loads (None: the checkpoint's)

    # --- auth and transport
    api_keys: tuple[str, ...] = ()  # empty: auth off; else every call needs one of them
    tls_cert: str | None = None  # PEM paths; both set: HTTPS and gRPC over TLS
    tls_key: str | None = None

    # --- limits
    max_body_bytes: int = 8 << 20
    body_read_timeout_s: float = 30.0  # a request body not complete by then is refused (400)
    max_header_bytes: int = 16384  # HTTP request line + headers; more → 431 (a longer URL alone → 414)
    max_headers: int = 100  # HTTP header lines; more → 431
    header_read_timeout_s: float = 10.0  # an HTTP request head not complete by then: 408, connection closed
    max_prompt_tokens: int | None = None  # None: the backend's max_model_len
    max_tokens_limit: int = 32768  # largest max_tokens a request may ask for
    default_max_tokens: int = 256  # when the request names none (capped by the context room)
    max_concurrent_requests: int = 4096  # in-flight generations; more → 429
    max_stop_strings: int = 16
    # a stop string is held back while the text could still grow into it: its length bounds that delay
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 64
    max_n: int = 16  # choices per prompt (`n`); more → 400
    max_batch_prompts: int = 32  # prompts in one /v1/completions batch; more → 400
    request_timeout_s: float | None = 600.0  # per-request deadline; None: none
    overload_retry_after_s: float = 1.0  # Retry-After when the concurrency limit is hit

    # --- sampling defaults for unset fields (the checkpoint's generation_config.json, else OpenAI's:
    # temperature 1); a seed is drawn when none is given
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    default_seed: int | None = None  # None: a fresh random seed per request that names none

    # --- serving
    log_level: str = "warning"
    # one INFO line per HTTP request (logger uvicorn.access) and per gRPC call (v4serve.router.grpc.access)
    access_log: bool = False
    shutdown_grace_s: float = 5.0
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    def __post_init__(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.http_port is None and self.grpc_port is None:
            raise ValueError("at least one of http_port and grpc_port must be set")
        for name in ("max_body_bytes", "max_tokens_limit", "default_max_tokens", "max_concurrent_requests",
                     "max_header_bytes", "max_headers", "header_read_timeout_s", "body_read_timeout_s", "max_n",
                     "max_batch_prompts"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if any(not k for k in self.api_keys):
            raise ValueError("api_keys must not contain empty keys")
        if not isinstance(self.api_keys, tuple):
            raise TypeError("api_keys must be a tuple")
        if not isinstance(self.model_aliases, tuple) or any(not a for a in self.model_aliases):
            raise ValueError("model_aliases must be a tuple of non-empty names")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None
