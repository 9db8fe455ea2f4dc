"""The benchmarks a user runs (the top level of benchmarks/) each answer `--help` on a machine
without a GPU, with their docstring (what they measure, against which ceiling) and their main
options, and the top level holds nothing else but the helpers they import."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

MAIN_OPTIONS = {
    "serve_bench": ["--url", "--isl", "--osl", "--concurrency", "--rates", "--goodput", "--slo", "--attainment",
                    "--gpus", "--out"],
    "kv_transfer_bench": ["--device", "--tokens", "--path", "--per-layer", "--out"],
    "decode_step_bench": ["--out", "--layers", "--batches", "--contexts", "--activations"],
    "kernel_bench": ["--out", "--batch", "--context", "--only"],
    "moe_bench": ["--out", "--fmt", "--quick", "--tokens"],
    "model_cpu_bench": ["--batch", "--kv-dtype", "--prompt", "--steps", "--out"],
    "pd_bench": ["--requests", "--rate", "--max-tokens", "--out"],
    "router_bench": ["--setups", "--concurrency", "--duration", "--workers", "--routers-python"],
    "placement_bench": ["--conversations", "--turns", "--n-workers", "--routers", "--json"],
    "pd_gpu_slice": ["--out", "--layers", "--requests", "--concurrency"],
    "stub_http_worker": ["--port", "--delay-ms"],
}
HELPERS = {"gpu_ceilings", "flash_model", "plot_results", "serving_load"}  # imported or run on results, no --help


def test_the_top_level_holds_the_benchmarks_and_their_helpers_only():
    assert {p.stem for p in BENCHMARKS.glob("*.py")} == set(MAIN_OPTIONS) | HELPERS


@pytest.mark.slow  # a Python process per benchmark: CI runs it, the fast tier does not
@pytest.mark.parametrize("name", sorted(MAIN_OPTIONS))
def test_help_prints_the_docstring_and_the_main_options_without_a_gpu(name):
    script = BENCHMARKS / f"{name}.py"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU, even on a host that has one
    run = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    usage = run.stdout
    assert usage.startswith(f"usage: {script.name}")
    missing = [opt for opt in MAIN_OPTIONS[name] if opt not in usage]
    assert not missing, f"--help of {script.name} lacks {missing}"
    first_line = ast.get_docstring(ast.parse(script.read_text())).splitlines()[0]
    assert " ".join(first_line.split()) in " ".join(usage.split()), "--help does not show the module docstring"
