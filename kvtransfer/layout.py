"""Layout descriptors: what a worker's KV pools look like, agreed on before any byte moves.

A worker owns one contiguous uint8 buffer per pool kind, shape [num_pages, page_bytes]; page i of
a pool lives at byte offset i * page_bytes. Two workers may exchange pages only when everything
that decides the meaning of a page's bytes matches: model hash, storage format, tokens per page,
the set of pool kinds, each pool's page_bytes, and which model layers each pool holds. Only
num_pages may differ (peers are sized independently), so it is left out of the layout id.

kvtransfer treats kinds and layer ids as opaque; `model/` fills them in.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class PoolLayout:
    """One pool: `num_pages` pages of `page_bytes` bytes each, named by `kind` (e.g. "c4")."""

    kind: str
    page_bytes: int
    num_pages: int

    def __post_init__(self) -> None:
        if not self.kind:
            raise ValueError("pool kind must be a non-empty string")
        if self.page_bytes <= 0 or self.num_pages < 0:
            raise ValueError(f"pool {self.kind!r}: bad sizes page_bytes={self.page_bytes} "
                             f"num_pages={self.num_pages}")


@dataclass(frozen=True)
class LayoutDescriptor:
    """Everything two peers must agree on before pages move between them.

    model_hash:     hash of the model config (set by `model/`; opaque here).
    storage_format: e.g. "fp32", "bf16", "fp8_pack/index-split": the encoding and its byte layout.
    page_tokens:    tokens covered by one page of the full-position pools (256 for V4).
    pools:          one PoolLayout per kind, kinds unique.
    layer_map:      per kind, the model layer ids whose data the kind's pages hold, in page order.
    """

    model_hash: str
    storage_format: str
    page_tokens: int
    pools: tuple[PoolLayout, ...]
    layer_map: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        kinds = [p.kind for p in self.pools]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"duplicate pool kinds in layout: {kinds}")
        mapped = [k for k, _ in self.layer_map]
        if len(set(mapped)) != len(mapped):
            raise ValueError(f"duplicate kinds in layer_map: {mapped}")

    # --- lookup

    def pool(self, kind: str) -> PoolLayout:
        for p in self.pools:
            if p.kind == kind:
                return p
        raise KeyError(f"no pool {kind!r} in layout (have {[p.kind for p in self.pools]})")

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(p.kind for p in self.pools)

    # --- identity

    def _identity(self) -> dict:
        # num_pages is deliberately absent: peers size their pools independently.
        return {
            "model_hash": self.model_hash,
            "storage_format": self.storage_format,
            "page_tokens": self.page_tokens,
            "pools": sorted([p.kind, p.page_bytes] for p in self.pools),
            "layer_map": sorted([k, list(ids)] for k, ids in self.layer_map),
        }

    @cached_property        # immutable: computed once (send() checks it on every call)
    def layout_id(self) -> str:
        """Stable 16-hex-digit hash of everything that must match between peers."""
        blob = json.dumps(self._identity(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def mismatches(self, other: LayoutDescriptor) -> list[str]:
        """Human-readable differences that forbid transfers between `self` and `other`.

        Empty list means compatible. Each entry names the field, e.g.
        "pool 'c4' page_bytes 37376 != 18688".
        """
        out: list[str] = []
        for field in ("model_hash", "storage_format", "page_tokens"):
            a, b = getattr(self, field), getattr(other, field)
            if a != b:
                out.append(f"{field} {a!r} != {b!r}")
        mine = {p.kind: p for p in self.pools}
        theirs = {p.kind: p for p in other.pools}
        for kind in sorted(mine.keys() - theirs.keys()):
            out.append(f"pool {kind!r} missing on peer")
        for kind in sorted(theirs.keys() - mine.keys()):
            out.append(f"pool {kind!r} present on peer only")
        for kind in sorted(mine.keys() & theirs.keys()):
            if mine[kind].page_bytes != theirs[kind].page_bytes:
                out.append(f"pool {kind!r} page_bytes {mine[kind].page_bytes} != "
                           f"{theirs[kind].page_bytes}")
        lm_a, lm_b = dict(self.layer_map), dict(other.layer_map)
        for kind in sorted(lm_a.keys() | lm_b.keys()):
            a, b = lm_a.get(kind), lm_b.get(kind)
            if a != b:
                out.append(f"layer_map {kind!r} {list(a) if a is not None else None} != "
                           f"{list(b) if b is not None else None}")
        return out

    # --- wire form

    def to_bytes(self) -> bytes:
        return json.dumps({
            "model_hash": self.model_hash,
            "storage_format": self.storage_format,
            "page_tokens": self.page_tokens,
            "pools": [[p.kind, p.page_bytes, p.num_pages] for p in self.pools],
            "layer_map": [[k, list(ids)] for k, ids in self.layer_map],
        }, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LayoutDescriptor:
        d = json.loads(data)
        return cls(
            model_hash=d["model_hash"],
            storage_format=d["storage_format"],
            page_tokens=int(d["page_tokens"]),
            pools=tuple(PoolLayout(k, int(b), int(n)) for k, b, n in d["pools"]),
            layer_map=tuple((k, tuple(int(i) for i in ids)) for k, ids in d["layer_map"]),
        )

    def check_pools(self, pools: dict) -> None:
        """Raise ValueError unless `pools` (kind -> tensor) matches this layout exactly.

        Each tensor must be uint8, contiguous, shape [num_pages, page_bytes].
        """
        if set(pools) != set(self.kinds):
            raise ValueError(f"pool kinds {sorted(pools)} != layout kinds {sorted(self.kinds)}")
        for p in self.pools:
            t = pools[p.kind]
            shape = tuple(t.shape)
            if shape != (p.num_pages, p.page_bytes):
                raise ValueError(f"pool {p.kind!r} tensor shape {shape} != layout "
                                 f"({p.num_pages}, {p.page_bytes})")
            if str(t.dtype) != "torch.uint8" or not t.is_contiguous():
                raise ValueError(f"pool {p.kind!r} must be a contiguous uint8 tensor")
