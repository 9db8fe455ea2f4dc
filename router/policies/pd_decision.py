"""Decode-first P/D decision: does this request's prefill run on a prefill worker, or on the
decode worker already chosen for it?

Remote prefill pays a KV transfer and a second hop; it is worth it only when the tokens the
decode worker would otherwise compute itself — the prompt minus what the decode worker already
holds — reach `threshold`, and a (non-draining) prefill worker exists. Otherwise the decode
worker prefills locally (conditional disaggregation), which also keeps short requests alive when
the prefill pool is empty.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PDDecision:
    remote_prefill: bool
    reason: str  # "long_prompt" | "short_prompt" | "no_prefill_worker"


def decide_prefill(prompt_tokens: int, decode_cached_tokens: int, threshold: int,
                   prefill_available: bool) -> PDDecision:
    uncached = max(prompt_tokens - decode_cached_tokens, 0)
    if uncached < threshold:
        return PDDecision(False, "short_prompt")
    if not prefill_available:
        return PDDecision(False, "no_prefill_worker")
    return PDDecision(True, "long_prompt")
