"""plot_results.py's latency-against-load figure, drawn from two small serve_bench.py results."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")  # the `bench` extra

from benchmarks import plot_results  # noqa: E402


def run(label: str, gpus: int, knee: float) -> dict:
    """A serve_bench.py result whose latency climbs past `knee` requests/s."""
    def level(rate):
        over = max(0.0, rate - knee)
        return {"mode": "poisson", "rate": rate, "ttft_ms": {"p50": 200, "p90": 300 + 900 * over, "p99": 400 + 2000 * over},
                "itl_ms": {"p50": 10, "p90": 12, "p99": 20 + 15 * over},
                "attainment": {"interactive": max(0.0, 1 - 0.2 * over), "batch": max(0.0, 1 - 0.05 * over)}}
    levels = [level(r) for r in (4.0, 1.0, 2.0, 3.0, 6.0)]  # in the order run, not by rate
    levels.append({"mode": "closed", "concurrency": 16, "ttft_ms": {"p50": 1, "p90": 1, "p99": 1},
                   "itl_ms": {"p50": 1, "p90": 1, "p99": 1}, "attainment": {"interactive": 1.0, "batch": 1.0}})
    levels[-2]["ttft_ms"]["p90"] = None  # a level whose requests all failed has no percentiles
    return {"label": label, "gpus": gpus, "isl": 8192, "osl": 1024,
            "slo": {"target": 0.9, "tiers": [{"name": "interactive", "ttft_s": 1.5, "itl_p99_ms": 30.0},
                                             {"name": "batch", "ttft_s": 4.0, "itl_p99_ms": 100.0}]},
            "goodput": {"interactive": {"requests_per_s": knee, "requests_per_s_per_gpu": knee / gpus}},
            "levels": levels}


def test_latency_against_load_draws_both_deployments_their_slo_lines_and_the_target(tmp_path):
    paths = [tmp_path / "serve_pd.json", tmp_path / "serve_agg.json"]
    paths[0].write_text(json.dumps(run("pd", 2, 3.0)))
    paths[1].write_text(json.dumps(run("agg", 2, 1.5)))
    out = tmp_path / "img" / "load.png"
    fig = plot_results.latency_vs_load(paths, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    ttft, itl, att = fig.axes
    for ax in (ttft, itl):
        curves = [line for line in ax.get_lines() if line.get_label() in ("pd (2 GPUs)", "agg (2 GPUs)")]
        assert [list(line.get_xdata()) for line in curves] == [[1.0, 2.0, 3.0, 4.0, 6.0]] * 2  # Poisson levels only
    assert sorted(y for line in ttft.get_lines() if len(set(line.get_ydata())) == 1 for y in set(line.get_ydata())) \
        == [1500.0, 4000.0]  # the tiers' TTFT targets, in ms
    labels = [line.get_label() for line in att.get_lines()]
    assert "pd (2 GPUs), interactive: goodput 3 req/s, 1.5/GPU" in labels and "agg (2 GPUs), batch" in labels
    assert "target: 90% of requests" in labels
    plot_results.plt.close(fig)
