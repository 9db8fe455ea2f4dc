"""Run the chaos matrix against the real local cluster and write the report table.

    python -m tests.chaos.run_matrix                      # every scenario → docs/chaos.md
    python -m tests.chaos.run_matrix --seeds 0,1          # the matrix twice, other random moments
    python -m tests.chaos.run_matrix --only drop_done,restart_redis --report /tmp/chaos.md
    python -m tests.chaos.run_matrix --ci                 # the short subset CI runs

Each scenario gets a fresh cluster (1 prefill + 2 decode workers, the tiny model) in one Ray, the
same concurrent load (whose `generate` outputs are computed once up front), its fault at a random
point (seeded), and the checks of harness.check plus its own metric. The network scenarios are
skipped, with the reason, where network namespaces cannot be made. Exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import platform
import random
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

from tests.chaos.harness import Bed, BedConfig, Load, Observed, check, make_load, metric, references, two_waves
from tests.chaos.host_scenarios import HOST_SCENARIOS
from tests.chaos.hosts_bed import HostsRig
from tests.chaos.scenarios import RETARGETS, SCENARIOS, Scenario

MATRIX = SCENARIOS + HOST_SCENARIOS

REQUESTS = 10  # concurrent requests per scenario
LONG_SHARE = 0.7  # of them with prompts long enough for remote prefill: transfers to break


@dataclass
class Row:
    scenario: Scenario
    observed: Observed
    problems: list[str]
    counted: tuple[bool, str]

    skipped: str = ""  # why it could not run here

    @property
    def passed(self) -> bool:
        return not self.skipped and not self.problems and self.counted[0]


def run_scenario(ckpt: Path, scenario: Scenario, load: Load, refs: dict[str, list[int]], seed: int = 0,
                 config: BedConfig = BedConfig(), rig=None) -> Row:
    """One scenario on a fresh cluster; a host scenario on `rig`'s hosts (hosts_bed.HostsRig:
    built here, and removed after, when not given)."""
    rng = random.Random(seed * 1_000_003 + zlib.crc32(scenario.name.encode()))
    if scenario.hosts:
        from tests.chaos.hosts_bed import HostsRig
        from tests.multihost.hosts import unavailable

        why = unavailable()
        if why is not None:
            return Row(scenario, Observed([], {}, {}, [], note="not run"), [], (False, "-"), skipped=why)
        own = rig is None
        rig = rig or HostsRig(ckpt)
        try:
            return rig.run(scenario, load, refs, seed, config)
        finally:
            if own:
                rig.down()
    if scenario.split:
        from tests.chaos.netns import unavailable

        why = unavailable()
        if why is not None:
            return Row(scenario, Observed([], {}, {}, [], note="not run"), [], (False, "-"), skipped=why)

    async def go() -> Observed:
        bed = Bed(ckpt, replace(config, split=scenario.split, supervised=scenario.supervised))
        await bed.start()
        try:
            return await bed.run(two_waves(load, scenario.waves_s) if scenario.waves_s else load, scenario.inject, rng)
        finally:
            await bed.stop()

    try:
        observed = asyncio.run(go())
    except Exception as e:  # the harness itself broke: a failed row, and the matrix goes on
        observed = Observed([], {}, {}, [], note=f"harness error: {type(e).__name__}: {e}"[:300])
        return Row(scenario, observed, [observed.note], (False, "-"))
    return Row(scenario, observed, check(observed, refs, scenario.allow_errors), scenario.counted(observed))


def tiny_checkpoint(out: Path) -> Path:
    """The tests' tiny checkpoint (tests/conftest.py): index_topk covers every compressed entry."""
    from model.checkpoint import expected_shapes, write_checkpoint
    from model.tiny import random_weights, tiny_config

    cfg = tiny_config(index_topk=128)
    return write_checkpoint(out, cfg, random_weights(expected_shapes(cfg, with_mtp=True), cfg, seed=0), "official")


def table(rows: list[Row]) -> str:
    head = ("| scenario | fault | injected | requests ok / failed | outputs = generate | pages idle | "
            "fault counted | retargeted migrate / repull / recompute | s | result |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        o = r.observed
        if r.skipped:
            lines.append(f"| {r.scenario.name} | {r.scenario.fault} | not run: {r.skipped} | | | | | | | SKIP |")
            continue
        ok = sum(x.outcome in ("stop", "length") for x in o.results)
        failed = [x.outcome for x in o.results if x.outcome not in ("stop", "length")]
        differ = sum("differs" in p for p in r.problems)
        leaked = [p for p in r.problems if "pages not back" in p]
        retargets = " / ".join(f"{metric(o, RETARGETS, path=p):g}" for p in ("migrate", "repull", "recompute"))
        lines.append(f"| {r.scenario.name} | {r.scenario.fault} | {o.note} | {ok} / {len(failed)}"
                     f"{' (' + ', '.join(sorted(set(failed))) + ')' if failed else ''} | "
                     f"{'yes' if not differ else f'NO ({differ})'} | "
                     f"{'yes' if not leaked else 'NO'} ({len(o.workers)} workers"
                     f"{', dead: ' + ', '.join(o.dead) if o.dead else ''}) | {r.counted[1]} | {retargets} | "
                     f"{o.seconds:.0f} | {'PASS' if r.passed else 'FAIL'} |")
    problems = [f"- {r.scenario.name}: {p}" for r in rows for p in r.problems]
    return head + "\n".join(lines) + "\n" + ("\nProblems:\n\n" + "\n".join(problems) + "\n" if problems else "")


def report(runs: dict[int, list[Row]], total_s: float) -> str:
    rows = [r for rs in runs.values() for r in rs]
    passed, skipped = sum(r.passed for r in rows), sum(bool(r.skipped) for r in rows)
    body = "".join(f"\n## Seed {seed}\n\n" + table(rs) for seed, rs in runs.items())
    return ("# Chaos matrix report\n\n"
            "Generated by `python -m tests.chaos.run_matrix` (see `tests/chaos/`): each scenario runs a fresh "
            "local cluster (1 prefill + 2 decode Ray actors, Valkey registry, NIXL over UCX, the tiny model, "
            f"lease 3 s) under {REQUESTS} concurrent requests (local and remote prefill, greedy and seeded "
            "sampling) with its fault injected at a random point (the seed picks the moments). Checks: every "
            "request finishes or fails with a reason code within its deadline; finished outputs equal "
            "`v4serve generate`; page accounting returns to idle on every surviving worker; the named metric "
            "counts the fault. The network scenarios put decode-1 on a second Ray node inside its own "
            "network namespace behind a veth pair, UCX over TCP on it (`tests/chaos/netns.py`). In "
            "`kill9_replaced` the bed runs the supervisor of `v4serve up` (`cluster/supervisor.py`): the "
            "processes of prefill-0 and decode-0 are SIGKILLed while decode-0 decodes, both must be replaced "
            "under their names and registered again within 30 s, the requests they held end with the tokens of "
            "`generate` (or a reason code), and the second wave starts 9 s later, by when they should be back.\n\n"
            f"Run: {datetime.date.today().isoformat()}, {platform.machine()} with {_cpus()} CPU cores (shared "
            f"with other jobs), {total_s / 60:.1f} min in all. **{passed} of {len(rows) - skipped} scenario "
            f"runs passed**{f', {skipped} skipped' if skipped else ''}. Column s: seconds from the first "
            "request to the last page back.\n" + body)


HOSTS_BEGIN, HOSTS_END = "<!-- host faults: python -m tests.chaos.run_matrix --hosts-only -->", "<!-- /host faults -->"


def hosts_report(runs: dict[int, list[Row]], total_s: float) -> str:
    """The section of the report on host and network faults (hosts_bed.py), between markers."""
    rows = [r for rs in runs.values() for r in rs]
    passed, skipped = sum(r.passed for r in rows), sum(bool(r.skipped) for r in rows)
    body = "".join(f"\n### Host faults, seed {seed}\n\n" + table(rs) for seed, rs in runs.items())
    return (f"{HOSTS_BEGIN}\n## Host and network faults\n\n"
            "Generated by `python -m tests.chaos.run_matrix --hosts-only --seeds ...`: the same load and checks "
            "on five hosts, each a network namespace on a bridge (`tests/chaos/hosts_bed.py`): host 0 the Ray "
            "head and the router (with the supervisor of `v4serve up`), host 1 Valkey, host 2 prefill-0, hosts 3 "
            "and 4 a decode worker each, pinned by custom resources, KV over UCX TCP. Each host has room for one "
            "worker of its pool, so a worker whose host went is replaced only once the host is back: a crashed "
            "host restarts its Ray 2 s after the crash; the head declares a node dead after 10 missed health "
            "checks a second apart. Partitions drop the packets between two hosts silently. Beyond the checks "
            "above, the pools must be whole again (every worker registered, a replaced one under a new epoch, "
            "and answering) within 90 s: `recovered in` is the time from the fault to that.\n\n"
            f"Run: {datetime.date.today().isoformat()}, {platform.machine()} with {_cpus()} CPU cores (shared "
            f"with other jobs), {total_s / 60:.1f} min in all. **{passed} of {len(rows) - skipped} host scenario "
            f"runs passed**{f', {skipped} skipped' if skipped else ''}.\n" + body + f"\n{HOSTS_END}\n")


def splice(path: Path, section: str) -> str:
    """`path`'s text with its host-faults section replaced by `section` (appended if it has none)."""
    text = path.read_text() if path.exists() else ""
    if HOSTS_BEGIN in text and HOSTS_END in text:
        head, rest = text.split(HOSTS_BEGIN, 1)
        return head + section + rest.split(HOSTS_END, 1)[1].lstrip("\n")
    return text.rstrip("\n") + "\n\n" + section


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.run_matrix")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--ci", action="store_true", help="only the CI subset")
    parser.add_argument("--seeds", default="0", help="comma-separated: the matrix once per seed")
    parser.add_argument("--hosts-only", action="store_true", help="only the host and network faults")
    parser.add_argument("--report", type=Path, default=Path(__file__).resolve().parents[2] / "docs" / "chaos.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    names = {n for n in args.only.split(",") if n}
    unknown = names - {s.name for s in MATRIX}
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}")
    chosen = [s for s in MATRIX if (not names or s.name in names) and (not args.ci or s.ci)
              and (not args.hosts_only or s.hosts)]
    t0 = time.monotonic()
    runs: dict[int, list[Row]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_checkpoint(Path(tmp))
        rig = HostsRig(ckpt)  # the hosts, built once for every host scenario of the run
        try:
            _run_all(args, chosen, ckpt, rig, runs)
        finally:
            rig.down()
    took = time.monotonic() - t0
    local = {seed: [r for r in rs if not r.scenario.hosts] for seed, rs in runs.items()}
    host = {seed: [r for r in rs if r.scenario.hosts] for seed, rs in runs.items()}
    if args.hosts_only:  # only its section of the report: the rest stays as it was
        args.report.write_text(splice(args.report, hosts_report(host, took)))
    else:
        args.report.write_text(report(local, took) + ("\n" + hosts_report(host, took) if any(host.values()) else ""))
    print(f"report: {args.report}")
    return 0 if all(r.passed or r.skipped for rs in runs.values() for r in rs) else 1


def _run_all(args, chosen: list[Scenario], ckpt: Path, rig, runs: dict[int, list[Row]]) -> None:
    for seed in [int(x) for x in args.seeds.split(",")]:
        load = make_load(seed, REQUESTS, long_share=LONG_SHARE)
        refs = references(ckpt, load)
        runs[seed] = []
        for s in chosen:
            row = run_scenario(ckpt, s, load, refs, seed, rig=rig)
            runs[seed].append(row)
            print(f"seed {seed} {s.name}: {'SKIP ' + row.skipped if row.skipped else 'PASS' if row.passed else 'FAIL'}"
                  f" {row.counted[1]} {row.observed.note} {row.problems[:3]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
