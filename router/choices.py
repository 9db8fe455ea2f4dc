"""A request's choices: `n` per prompt, and a `/v1/completions` batch of prompts, each choice one
child `GenerateRequest` that the dispatcher runs (router/dispatch.py `execute_group`).

Choice k of a request is prompt p's choice i with k = p·n + i (prompt-major, as OpenAI indexes a
batch). Its child request:

- `request_id`: `<request id>-<k>` (the request's own id when it has a single choice);
- `seed`: `derive_seed(seed, i)`: choice 0 keeps the request's seed, choice i > 0 gets
  blake2b-64(seed as unsigned 64-bit little-endian ‖ i as 32-bit little-endian, person
  `v4serve-choice`) masked to 63 bits. A pure function of (seed, i): the same request with the
  same seed gives the same choices, each prompt of a batch the choices it would get alone, and
  choice i equals a single request sent with seed `derive_seed(seed, i)`. A request without a seed
  draws its base seed once (router/openai_protocol.py), so its choices still differ;
- `after`: the prompt's choice 0 runs first and its other choices start once it has streamed its
  first chunk. By then its prompt has been prefilled, and the KV is in the prefill worker's prefix
  cache (pages enter the cache when their prefill ends), so the other choices reuse it there
  instead of prefilling the same prompt n times in parallel. The cost: the other choices' first
  tokens come one prefill later.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, replace

from worker_runtime.wire import GenerateRequest, Usage

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def derive_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed` (see the module docstring)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(struct.pack("<QI", seed & _MASK64, index), digest_size=8,
                             person=b"v4serve-choice").digest()
    return int.from_bytes(digest, "little") & _MASK63


@dataclass(frozen=True)
class Child:
    index: int  # the choice's index in the response
    req: GenerateRequest
    after: int | None  # the choice whose first chunk it waits for (its prompt's first); None: at once


def plan_children(bases: list[GenerateRequest], n: int, request_id: str) -> tuple[Child, ...]:
    """One child per choice of each prompt's request in `bases` (in prompt order)."""
    if len(bases) == 1 and n == 1:
        return (Child(0, bases[0], None),)
    out = []
    for p, base in enumerate(bases):
        for i in range(n):
            k = p * n + i
            sampling = replace(base.sampling, seed=derive_seed(base.sampling.seed, i))
            out.append(Child(k, replace(base, request_id=f"{request_id}-{k}", sampling=sampling),
                             None if i == 0 else p * n))
    return tuple(out)


def merge_usage(usages: list[Usage], n: int) -> Usage:
    """The usage of a whole request from its choices' (in choice order): completion tokens summed,
    each prompt counted once (its first choice's prompt and cached tokens), speculative drafts summed."""
    firsts = usages[::n]
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in firsts),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=sum(u.cached_tokens for u in firsts),
                 spec_proposed=sum(u.spec_proposed for u in usages),
                 spec_accepted=sum(u.spec_accepted for u in usages))
