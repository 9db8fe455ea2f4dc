"""API-key auth shared by both front doors: `Authorization: Bearer <key>` (HTTP header or gRPC
metadata). Off when no keys are configured; keys are compared in constant time.

A key is also the caller's identity: with keys on, a request belongs to the key it was made with,
and only that key may abort it (`identify`)."""

from __future__ import annotations

import hmac


class KeyChecker:
    def __init__(self, keys: tuple[str, ...]):
        self._keys = tuple(k.encode() for k in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | bytes | None) -> bool:
        """True when auth is off, or `authorization` is 'Bearer <a configured key>'."""
        return not self._keys or self.identify(authorization) is not None

    def identify(self, authorization: str | bytes | None) -> str | None:
        """'key-<n>' for the n-th configured key that `authorization` carries; None when it carries
        none of them, or auth is off."""
        if not self._keys or authorization is None:
            return None
        if isinstance(authorization, str):
            authorization = authorization.encode("utf-8", "replace")
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        token = token.strip()
        # compare against every key so the time taken does not say which one was close
        hits = [hmac.compare_digest(token, k) for k in self._keys]
        return f"key-{hits.index(True)}" if any(hits) else None
