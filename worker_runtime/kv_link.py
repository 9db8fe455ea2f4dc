"""Glue between a worker's `KVPools` and `kvtransfer`: the layout it publishes, the buffers its
NIXL agent registers, and the small header that travels with a request's pages."""

from __future__ import annotations

import torch

from kvtransfer.layout import LayoutDescriptor, PoolLayout
from model.kv_pool import KVPools


def pool_buffers(pools: KVPools) -> dict[str, torch.Tensor]:
    """The buffers to register: every kind that holds layers of this model."""
    return {kind: pools.buffers[kind] for kind in pools.kinds_for()}


def layout_of(pools: KVPools) -> LayoutDescriptor:
    kinds = pools.kinds_for()
    return LayoutDescriptor(
        model_hash=pools.cfg.digest(),
        storage_format=pools.page_encoding,
        page_tokens=pools.page_size,
        pools=tuple(PoolLayout(k, pools.specs[k].page_bytes, pools.specs[k].num_pages) for k in kinds),
        layer_map=tuple((k, pools.specs[k].layers) for k in kinds),
    )
