"""API-key auth shared by both front doors: `Authorization: Bearer <key>` (HTTP header or gRPC
metadata). Off when no keys are configured; keys are compared in constant time."""

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
        if not self._keys:
            return True
        if authorization is None:
            return False
        if isinstance(authorization, str):
            authorization = authorization.encode("utf-8", "replace")
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        # compare against every key so the time taken does not say which one was close
        return sum(hmac.compare_digest(token, k) for k in self._keys) > 0
