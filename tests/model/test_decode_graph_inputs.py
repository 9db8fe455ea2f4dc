"""The host side of a decode graph's inputs (model/cuda_graph.py's `HostInputs`): after any
sequence of page-list changes, the staged tables equal tables built afresh from the lists.

The changes are those the pools make between steps: pages appended (`reserve`), SWA pages freed
in place to -1 (`trim_window`), a row taken by another request or by the padding scratch, a
request released (empty list), and lists longer than the graph's width (cut to it)."""

from __future__ import annotations

import random

import numpy as np

from model.cuda_graph import HostInputs


def fresh(rows: list[list[int]], width: int) -> np.ndarray:
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for r, pages in enumerate(rows):
        pages = pages[:width]
        out[r, :len(pages)] = pages
    return out


def test_tables_follow_every_kind_of_page_change():
    rng = random.Random(5)
    widths, B = [6, 3, 1], 5
    requests = [[[rng.randrange(1000) for _ in range(rng.randrange(w + 2))] for w in widths] for _ in range(8)]
    host = HostInputs(B, widths)
    rows = list(range(B))  # which request each row decodes
    for step in range(300):
        change = rng.randrange(5)
        req = requests[rng.randrange(len(requests))]
        kind = rng.randrange(len(widths))
        if change == 0:
            req[kind].append(rng.randrange(1000))
        elif change == 1 and req[kind]:
            req[kind][rng.randrange(len(req[kind]))] = -1
        elif change == 2:
            rows[rng.randrange(B)] = rng.randrange(len(requests))
        elif change == 3:
            req[kind] = []
        pages = [[requests[q][k] for q in rows] for k in range(len(widths))]
        host.update_tables(pages)
        for k, w in enumerate(widths):
            assert np.array_equal(host.table(k), fresh(pages[k], w)), (step, change, k)
    assert host.array.shape == (4 * B + B * sum(widths),) and host.array.dtype == np.int32
