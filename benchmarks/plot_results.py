"""Plots of the recorded results in docs/results/ → docs/img/*.png: the figures of docs/results.md
(the current decode step, KV hand-off and served P/D against aggregated) and those the journal
(docs/journal/) shows. CPU only: it reads JSON and draws with matplotlib.

    python benchmarks/plot_results.py
    python benchmarks/plot_results.py --latency-load serve_pd.json serve_agg.json --out load.png

The second draws only the latency and SLO attainment against request rate of serve_bench.py runs
(its Poisson levels), several deployments on one figure.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS, IMG = ROOT / "docs" / "results", ROOT / "docs" / "img"

# The decode-step runs docs/results.md quotes: the newest valid run of each card and batch.
# (card, result file, batches taken from it)
DECODE_RUNS = (
    ("H100", "decode_step_h100_v44_a8tile_new_1.json", (1,)),
    ("H100", "decode_step_h100_v40_15layers.json", (64, 256)),
    ("H200", "decode_step_h200_v40_b1_new.json", (1,)),
    ("H200", "decode_step_h200_v40_33layers_new.json", (64, 256)),
)
DECODE_TARGET = 0.60  # of the bytes roofline


def power() -> None:
    """SM clock and board power on both cards (benchmarks/power_probe.py), the loops' windows side by
    side (the model building between them left out): the MoE layers and the batch-256 step hold
    the 700 W cap on both."""
    fig, axes = plt.subplots(2, 1, figsize=(9, 6))
    for ax, card in zip(axes, ("h200", "h100")):
        r = json.loads((RESULTS / f"power_probe_{card}_v41.json").read_text())
        clock = ax.twinx()
        offset = 0.0
        for i, w in enumerate(r["windows"]):
            part = [s for s in r["samples"] if w["start"] - 0.3 <= s[0] <= w["end"]]
            t = [s[0] - w["start"] + offset for s in part]
            ax.plot(t, [s[2] for s in part], color="tab:red", label="board power" if i == 0 else None)
            clock.plot(t, [s[1] for s in part], color="tab:blue", label="SM clock" if i == 0 else None)
            end = offset + w["end"] - w["start"]
            ax.axvspan(offset, end, color="grey", alpha=0.06 + 0.06 * (i % 2))
            ax.text((offset + end) / 2, 30, f"{w['label']}\n{w['ms']:.2f} ms a call\n{w['power_w']:.0f} W, "
                    f"{w['clock_mhz']:.0f} MHz", ha="center", fontsize=6.5)
            offset = end + 0.6
        ax.axhline(700, color="tab:red", linestyle=":", linewidth=0.8)
        ax.set_ylabel("board power (W)", color="tab:red")
        ax.set_ylim(0, 760)
        clock.set_ylabel("SM clock (MHz)", color="tab:blue")
        clock.set_ylim(1300, 2050)
        ax.set_xticks([])
        ax.set_title(r["device"], fontsize=9)
    fig.suptitle("Power and SM clock while decode work loops (journal, round v41)", fontsize=10)
    fig.tight_layout()
    fig.savefig(IMG / "power_decode_h200_h100.png", dpi=110)


def decode_step() -> None:
    """Fraction of the bytes roofline of a decode step by batch and context on both cards, from the
    runs in DECODE_RUNS, against the 60% target."""
    rows: dict[str, dict[tuple[int, int], dict]] = {}
    layers: dict[str, set[int]] = {}
    for card, name, batches in DECODE_RUNS:
        r = json.loads((RESULTS / name).read_text())
        for d in r["decode"]:
            if d["batch"] in batches:
                rows.setdefault(card, {})[(d["batch"], d["context"])] = d
                layers.setdefault(card, set()).add(r["layers"])
    keys = sorted({k for card in rows.values() for k in card})
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.38
    for j, card in enumerate(sorted(rows)):
        xs = [i + (j - 0.5) * width for i in range(len(keys))]
        fr = [rows[card][k]["fraction_of_roofline"] for k in keys]
        ax.bar(xs, fr, width, label=f"{card} ({' / '.join(map(str, sorted(layers[card])))} layers)")
        for x, k, f in zip(xs, keys, fr):
            ax.text(x, f + 0.01, f"{f:.0%}\n{rows[card][k]['ms_per_layer']:.2f}", ha="center", va="bottom",
                    fontsize=6.5)
    ax.axhline(DECODE_TARGET, color="k", linestyle="--", linewidth=0.8, zorder=0, label="target: 60% of the bytes roofline")
    ax.set_xticks(range(len(keys)), [f"batch {b}\n{c // 1024}K" for b, c in keys])
    ax.set_ylabel("bytes roofline / step time")
    ax.set_ylim(0, 1.0)
    ax.set_title("V4-Flash decode step (W8A8 projections, FP4 experts, fp8_pack pools, CUDA graph);\n"
                 "on each bar: fraction of the roofline, ms per layer", fontsize=9)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(IMG / "decode_step_h200_h100.png", dpi=110)


def decode_step_v21() -> None:
    """The journal's round-v21 plot of the H100 step against its roofline (W8A16 then)."""
    r = json.loads((RESULTS / "decode_step_h100_v21.json").read_text())
    rows = r["decode"]
    labels = [f"B={d['batch']}\n{d['context'] // 1024}K" for d in rows]
    x = range(len(rows))
    n = r["layers"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.27 for i in x], [d["ms_per_layer"] for d in rows], 0.27, label="step (inputs staged, graph replayed)")
    ax.bar(list(x), [d["replay_ms"] / n for d in rows], 0.27, label="graph replay alone")
    ax.bar([i + 0.27 for i in x], [d["roofline_ms"] / n for d in rows], 0.27, label="bytes roofline")
    for i, d in zip(x, rows):
        ax.text(i - 0.27, d["ms_per_layer"], f"{d['fraction_of_roofline']:.0%}", ha="center", va="bottom", fontsize=7)
        ax.text(i, d["replay_ms"] / n, f"{d['roofline_ms'] / d['replay_ms']:.0%}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms per layer")
    ax.set_title(f"V4-Flash decode step, {r['layers']} full-width layers, {r['ceilings']['device']}")
    ax.set_ylim(0, max(d["ms_per_layer"] for d in rows) * 1.12)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(IMG / "decode_step_h100.png", dpi=110)


def kv_transfer() -> None:
    r = json.loads((RESULTS / "kv_transfer_2xh200.json").read_text())
    ipc = [s for s in r["sizes"] if s["path"] == "ipc"]
    ucx = [s for s in r["sizes"] if s["path"] == "ucx"]
    mb = [s["bytes"] / 1e6 for s in ipc]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(mb, [s["torch_copy_GBps"] for s in ipc], "k--", marker="o", label="plain D2D copy (GPU time)")
    ax.plot(mb, [s["bytes"] / s["gpu_write_s_median"] / 1e9 for s in ipc], marker="o",
            label="kvtransfer CUDA IPC, GPU time")
    ax.plot(mb, [s["write_GBps"] for s in ipc], marker="o", label="kvtransfer CUDA IPC, wall (send → landed)")
    ax.plot(mb, [s["write_GBps"] for s in ucx], marker="o", label="kvtransfer UCX, wall")
    for s, m in zip(ipc, mb):
        ax.annotate(f"{s['tokens'] // 1024}K", (m, s["torch_copy_GBps"]), textcoords="offset points", xytext=(0, 6))
    ax.set_xscale("log")
    ax.set_xlabel("bytes per hand-off (MB)")
    ax.set_ylabel("GB/s")
    ax.set_title("One V4-Flash request GPU0 → GPU1 (2× H200)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(IMG / "kv_transfer_2xh200.png", dpi=110)


def serve_flash() -> None:
    """V4-Flash served on 4× H200, P/D against aggregated: rate per GPU and ITL by concurrency."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label, style in (("pd", "P/D: prefill EP2 + decode EP2", "o-"), ("agg", "aggregated: 2 × EP2", "s-")):
        run = json.loads((RESULTS / f"serve_flash_4xh200_{key}.json").read_text())
        rows = [d for d in run["levels"] if d["mode"] == "closed"]
        c = [d["concurrency"] for d in rows]
        left.plot(c, [d["total_tok_s_per_gpu"] for d in rows], style, label=label)
        right.plot(c, [d["itl_ms"]["p50"] for d in rows], style, label=f"{label}, p50")
        right.plot(c, [d["itl_ms"]["p99"] for d in rows], style, alpha=0.45, label=f"{label}, p99")
    left.plot([1, 64], [607, 2758], "k^", label="SGLang TP4 FP4 H200 (published)")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (one wave: requests = concurrency)")
    left.set_ylabel("total (prompt + output) tok/s per GPU")
    right.set_yscale("log")
    right.set_ylabel("inter-token latency (ms)")
    left.set_title("V4-Flash, ISL 8192 / OSL 1024, 4× H200")
    right.set_title("inter-token latency, p50 and p99")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(IMG / "serve_flash_4xh200.png", dpi=110)


def overlap_headroom() -> None:
    """A decode step's time against the HBM rate a streamer took beside it
    (benchmarks/overlap_headroom_probe.py), both cards: batch 1 slows by a tenth from the first
    streamer on and by 27-29% at ~1 TB/s; batch 64 (bandwidth-bound) leaves it almost nothing."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, card in zip(axes, ("h200", "h100")):
        r = json.loads((RESULTS / f"overlap_headroom_{card}_v43.json").read_text())
        for step, style in zip(r["steps"], ("o-", "s--", "^:")):
            rates = [0.0] + [c["streamer_tb_s"] for c in step["beside"]]
            slow = [0.0] + [100 * c["slowdown"] for c in step["beside"]]
            ax.plot(rates, slow, style, label=f"batch {step['batch']}, {step['context'] // 1024}K "
                                            f"({step['step_ms']:.2f} ms alone)")
        ax.set_xlabel("streamer's HBM rate beside the step (TB/s)")
        ax.set_title(f"{r['device']} (copy {r['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("step slower than alone (%)")
    fig.suptitle("Decode step of 15 layers beside an HBM streamer (journal, round v43)", fontsize=10)
    fig.tight_layout()
    fig.savefig(IMG / "overlap_headroom_h200_h100.png", dpi=110)


def latency_vs_load(paths: list[Path], out: Path):
    """TTFT p90, ITL p99 (every gap of a level) and each tier's SLO attainment against the Poisson
    request rate, for serve_bench.py runs (e.g. P/D and aggregated on the same GPUs) on one figure:
    a colour per run, a line style per tier; the tiers' targets (the first run's) and the
    attainment target drawn across, and each run's goodput per tier in the legend. → the figure."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    styles = ("-", "--", ":", "-.")
    fig, (ttft, itl, att) = plt.subplots(1, 3, figsize=(16, 4.8))
    for k, (path, r) in enumerate(zip(paths, runs)):
        levels = sorted((lv for lv in r["levels"] if lv["mode"] == "poisson"), key=lambda lv: lv["rate"])
        rates = [lv["rate"] for lv in levels]
        name = f"{r['label'] or Path(path).stem} ({r['gpus']} GPU{'' if r['gpus'] == 1 else 's'})"
        ms = [[float("nan") if v is None else v for v in (lv["ttft_ms"]["p90"], lv["itl_ms"]["p99"])] for lv in levels]
        ttft.plot(rates, [m[0] for m in ms], "o-", color=f"C{k}", label=name)
        itl.plot(rates, [m[1] for m in ms], "o-", color=f"C{k}", label=name)
        for j, tier in enumerate(t["name"] for t in r["slo"]["tiers"]):
            g = r["goodput"].get(tier)
            good = f": goodput {g['requests_per_s']:.3g} req/s, {g['requests_per_s_per_gpu']:.3g}/GPU" if g else ""
            att.plot(rates, [lv["attainment"][tier] for lv in levels], marker="o", markersize=4,
                     linestyle=styles[j % len(styles)], color=f"C{k}", label=f"{name}, {tier}{good}")
    slo = runs[0]["slo"]
    for j, t in enumerate(slo["tiers"]):
        style = {"color": "grey", "linewidth": 0.9, "linestyle": styles[j % len(styles)]}
        ttft.axhline(1e3 * t["ttft_s"], **style, label=f"{t['name']} SLO: TTFT ≤ {t['ttft_s']:g} s")
        itl.axhline(t["itl_p99_ms"], **style, label=f"{t['name']} SLO: ITL p99 ≤ {t['itl_p99_ms']:g} ms")
    att.axhline(slo["target"], color="k", linewidth=0.9, linestyle=":", label=f"target: {slo['target']:.0%} of requests")
    for ax, ylabel in ((ttft, "TTFT p90 (ms)"), (itl, "ITL p99 (ms)"), (att, "share of requests meeting the tier")):
        ax.set_xlabel("request rate, Poisson arrivals (requests/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ttft.set_yscale("log")
    itl.set_yscale("log")
    att.set_ylim(0, 1.05)
    shapes = sorted({f"ISL {r['isl']} / OSL {r['osl']}" for r in runs})
    fig.suptitle(f"Latency and SLO attainment against load, {', '.join(shapes)}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return fig


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency-load", type=Path, nargs="+", metavar="SERVE_JSON",
                    help="draw only latency and attainment against request rate of these serve_bench.py results")
    ap.add_argument("--out", type=Path, default=IMG / "serve_latency_load.png", help="where --latency-load draws")
    args = ap.parse_args()
    if args.latency_load:
        latency_vs_load(args.latency_load, args.out)
    else:
        IMG.mkdir(parents=True, exist_ok=True)
        decode_step()  # docs/results.md
        kv_transfer()
        serve_flash()
        decode_step_v21()  # docs/journal/
        power()
        overlap_headroom()
