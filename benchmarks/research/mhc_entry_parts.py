"""Where the one-launch mHC entry of a batch-1 decode step spends its time (no hardware counters).

    python benchmarks/research/mhc_entry_parts.py --out parts.json

`mhc_kernels._entry_small_kernel` runs in two phases: 128 programs each settle and mix their 32
columns and publish a partial; the last to arrive sums the partials, derives pre, collapses the
streams and RMSNorms the row, and stores the full mixes, from which `_post_comb_kernel` derives
post and the Sinkhorn comb. Variants (the kernel's source edited into a scratch copy of
`mhc_kernels` where parts are cut out, launched by a scratch copy of `mhc` that imports it; outputs
wrong, timing only) are timed in CUDA graphs of 30 entries over 30 layers' fn weights, as a
15-layer step meets them:

* in_order: the entry, then the post / comb kernel on the same stream;
* beside: the post / comb kernel on a side stream (`mhc.EntryScratch`), joined once after the 30
  entries: the entries' own chain, as a decode step's critical path has it (one mixes buffer
  for all 30: their values race, which the timing does not depend on);
* no_tail: the last program stops after zeroing the counter (post / comb beside);
* no_collapse: no collapse and norm (nor the output row; post / comb beside);
* sinkhorn_iters_0: in order, with no Sinkhorn iterations.

Differences between rows place the time of each part.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_ceilings import bench_graph  # noqa: E402
from model.kernels import arrival_counter
from model.kernels.mhc import (
    mhc,  # noqa: E402
    mhc_kernels,  # noqa: E402
)

HC, D, MIX, LAYERS = 4, 4096, 24, 30
TAIL = "    # every partial in one load (a fixed-shape sum: deterministic)\n"
COLLAPSE = "    _collapse(total"


def variant_source(name: str) -> str:
    src = Path(mhc_kernels.__file__).read_text()
    start = src.index("def _entry_small_kernel(")
    end = src.index("@triton.jit", start)
    body = src[start:end]
    if name == "no_tail":
        body = body[:body.index(TAIL)] + "\n\n"
    elif name == "no_collapse":
        body = body[:body.index(COLLAPSE)] + "\n\n"
    return src[:start] + body + src[end:]


def load_module(name: str, source: str, folder: Path) -> ModuleType:
    """`source` as module `name`, from a file in `folder` (Triton reads a kernel's source back)."""
    path = folder / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # importable by the copy of `mhc` that launches its kernels
    spec.loader.exec_module(module)
    return module


def load_variant(name: str, folder: Path) -> ModuleType:
    """A copy of `mhc` whose kernels come from a copy of `mhc_kernels` with variant `name`'s edit."""
    kernels = f"mhc_kernels_{name}"
    load_module(kernels, variant_source(name), folder)
    src = Path(mhc.__file__).read_text()
    imports = "from model.kernels.mhc.mhc_kernels import"
    assert imports in src, f"{mhc.__name__} no longer imports its kernels as `{imports}`"
    return load_module(f"mhc_{name}", src.replace(imports, f"from {kernels} import"), folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    fns = [torch.randn(MIX, HC * D, device="cuda", generator=g) / (HC * D) ** 0.5 for _ in range(LAYERS)]
    base, scale = 0.5 * torch.randn(MIX, device="cuda", generator=g), 0.5 + torch.rand(3, device="cuda", generator=g)
    res = mhc.Residual(torch.randn(1, HC, D, device="cuda", generator=g).bfloat16(),
                       torch.randn(1, D, device="cuda", generator=g).bfloat16(),
                       2 * torch.rand(1, HC, device="cuda", generator=g),
                       torch.softmax(torch.randn(1, HC, HC, device="cuda", generator=g), -1))
    w = 1 + 0.1 * torch.randn(D, device="cuda", generator=g)
    arrivals = arrival_counter("cuda")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        variants = {name: load_variant(name, Path(tmp)) for name in ("no_tail", "no_collapse")}
        scratch = mhc.EntryScratch.beside(mhc.mixes_buffer("cuda"))
        for _ in range(args.rounds):
            for name in ("in_order", "beside", "no_tail", "no_collapse", "sinkhorn_iters_0"):
                module = variants.get(name, mhc)
                iters = 0 if name == "sinkhorn_iters_0" else 20
                beside = scratch if name not in ("in_order", "sinkhorn_iters_0") else None

                def step():
                    for fn in fns:
                        module.sublayer_input(res, fn, base, scale, w, 1e-6, HC, iters, 1e-6, 1e-6, "triton",
                                              arrivals, scratch=beside)
                    scratch.join()

                us = bench_graph(step, calls=1, reps=20) / LAYERS * 1e6
                rows.append({"variant": name, "us_per_entry": round(us, 2)})
                print(f"{name:18s} {us:6.2f} us an entry", flush=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
