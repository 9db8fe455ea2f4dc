"""The host side of a decode graph's inputs (model/cuda_graph.py's `HostInputs`): after any
sequence of page-list changes, the staged tables equal tables built afresh from the lists.

The changes are those the pools make between steps: pages appended (`reserve`), SWA pages freed
in place to -1 (`trim_window`), a row taken by another request or by the padding scratch, a
request released (empty list), and lists longer than the graph's width (cut to it)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from model.batch import Segment
from model.cuda_graph import HostInputs, HostStaging
from model.kv_pool import ALL_KINDS, SeqKV


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


# --- HostStaging: the next step's inputs written during the current one ------------------------

WINDOW, PAGE = 128, 256
WIDTHS = [6, 3, 1, 3, 1, 1, 1, 1]  # one per kind of ALL_KINDS, swa first


def request(rng: random.Random, position: int) -> SeqKV:
    seq = SeqKV(num_tokens=position)
    for kind, width in zip(ALL_KINDS, WIDTHS):
        seq.pages[kind] = [rng.randrange(1000) for _ in range(width)]
    return seq


def assert_reads_match(host: HostInputs, rows: list[tuple[SeqKV, int]], ids: list[int]) -> None:
    """What a step over `rows` reads from `host` equals inputs built afresh: ids, positions, segment
    bounds, every table entry, but for SWA pages below the first one a row's window sees."""
    B = host.rows
    a = host.array
    positions = [p for _, p in rows]
    assert a[:B].tolist() == ids + [0] * (B - len(ids))
    assert a[B:2 * B].tolist() == positions and a[2 * B:3 * B].tolist() == positions
    assert a[3 * B:4 * B].tolist() == [p + 1 for p in positions]
    for k, width in enumerate(WIDTHS):
        want = fresh([seq.pages[ALL_KINDS[k]] for seq, _ in rows], width)
        got = host.table(k)
        for r, (_, p) in enumerate(rows):
            first = max(0, p - WINDOW + 1) // PAGE if ALL_KINDS[k] == "swa" else 0
            assert np.array_equal(got[r, first:], want[r, first:]), (k, r)


def test_staged_steps_read_what_a_fresh_load_would():
    """Engine-like steps: rows advance one position, requests join and leave, windows trim; each
    step reads the same inputs as a fresh load, and steps that continue the last one find them
    staged."""
    rng = random.Random(7)
    B = 4
    scratch = request(rng, 0)
    staging = HostStaging(B, WIDTHS, scratch, WINDOW, PAGE)
    running = [request(rng, rng.randrange(200, 900)) for _ in range(3)]
    hits = 0
    for step in range(200):
        change = rng.randrange(6)
        joined_or_left = False
        if change == 0 and len(running) < B:  # a request joins
            running.append(request(rng, rng.randrange(200, 900)))
            joined_or_left = True
        elif change == 1 and len(running) > 1:  # one finishes
            running.pop(rng.randrange(len(running)))
            joined_or_left = True
        elif change == 2:  # one finishes and another, at the very position staged, takes its row
            i = rng.randrange(len(running))
            running[i] = request(rng, running[i].num_tokens)
            joined_or_left = True
        rows = staging.rows([Segment(seq, seq.num_tokens, 1, i) for i, seq in enumerate(running)])
        ids = [rng.randrange(1000) for _ in running]
        expect_staged = step > 0 and not joined_or_left
        staged = staging.load(rows, ids)
        assert staged == expect_staged, step
        hits += staged
        assert_reads_match(staging.buffers[staging.current], rows, ids)
        if staged:
            staging.check(rows)
        staging.stage_next(rows)
        for seq in running:  # commit, then free what the next query's window no longer sees
            seq.num_tokens += 1
            first = max(0, seq.num_tokens - WINDOW + 1) // PAGE
            seq.pages["swa"][:first] = [-1] * len(seq.pages["swa"][:first])
    assert staging.hits == hits > 50


def test_a_staged_step_raises_when_a_page_it_reads_changed():
    rng = random.Random(8)
    scratch = request(rng, 0)
    for kind, index in (("c4", 0), ("swa", 5)):  # a compressed page; an SWA page inside the window
        staging = HostStaging(2, WIDTHS, scratch, WINDOW, PAGE)
        seq = request(rng, 1200)  # window from 1073: SWA pages 4 and 5 are read
        rows = staging.rows([Segment(seq, 1200, 1, 0)])
        staging.load(rows, [1])
        staging.stage_next(rows)
        seq.num_tokens = 1201
        seq.pages[kind][index] = -1
        rows = staging.rows([Segment(seq, 1201, 1, 0)])
        assert staging.load(rows, [2])
        with pytest.raises(RuntimeError, match=f"its {kind} pages changed"):
            staging.check(rows)
    seq.pages["swa"][5] = 77
    seq.pages["swa"][3] = -1  # below the window: allowed
    staging = HostStaging(2, WIDTHS, scratch, WINDOW, PAGE)
    rows = staging.rows([Segment(seq, 1201, 1, 0)])
    staging.load(rows, [1])
    staging.stage_next(rows)
    seq.pages["swa"][4] = -1  # page 4 holds 1024..1279: still inside the window of 1202
    rows = staging.rows([Segment(seq, 1202, 1, 0)])
    assert staging.load(rows, [2])
    with pytest.raises(RuntimeError, match="its swa pages changed"):
        staging.check(rows)


def test_verify_rows_of_several_tokens_are_laid_out_row_major_and_staged_for_all_accepted():
    """A verify graph's rows (`tokens_per_row` 3): ids and positions for every token, row-major,
    one segment [p, p+3) a row; the next step is staged 3 positions on, which a step that accepted
    every draft finds, and one that accepted fewer rewrites."""
    rng = random.Random(9)
    B, L = 3, 3
    staging = HostStaging(B, WIDTHS, request(rng, 0), WINDOW, PAGE, tokens_per_row=L)
    seqs = [request(rng, p) for p in (300, 517)]
    for step, advance in enumerate((L, 1, L, L)):  # accepted: all, none, all
        rows = staging.rows([Segment(seq, seq.num_tokens, L, i * L) for i, seq in enumerate(seqs)])
        ids = [rng.randrange(1000) for _ in range(len(seqs) * L)]
        assert staging.load(rows, ids) == (step in (1, 3))  # found staged after a step that accepted all
        a, n = staging.buffers[staging.current].array, B * L
        assert a[:n].tolist() == ids + [0] * L
        starts = [s.num_tokens for s in seqs] + [0]
        assert a[n:2 * n].tolist() == [p + j for p in starts for j in range(L)]
        assert a[2 * n:2 * n + B].tolist() == starts and a[2 * n + B:2 * n + 2 * B].tolist() == [p + L for p in starts]
        staging.stage_next(rows)
        for seq in seqs:
            seq.num_tokens += advance
