"""Start-up checks and failures that read as one line.

`v4serve up` and `v4serve router` check what they can before anything starts (the ports they will
listen on, the checkpoint's config.json), so a mistake costs a second, not a cluster start and a
weight load. What can only fail later (a worker that cannot be scheduled, a worker whose
construction raised) is turned into a `StartupError` whose message is the one useful line: the
worker, and Ray's reason or the exception that ended it, without Ray's traceback and colour codes.
"""

from __future__ import annotations

import errno
import re
import socket

from model.checkpoint import read_config

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class StartupError(RuntimeError):
    """Start-up failed for a reason the operator can act on; the message says which and what to do."""


def check_ports(host: str, ports: dict[str, int]) -> None:
    """Refuse to start if a port `flag → number` cannot be listened on at `host` (0: any free port)."""
    for flag, port in ports.items():
        if port == 0:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # the servers set SO_REUSEADDR too: a port in TIME_WAIT is free for them
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise StartupError(f"{flag} {port}: port {port} on {host} is already in use (another server, "
                                       f"or an earlier v4serve still stopping); pick a free one with {flag}, or "
                                       f"stop what listens there (`ss -ltnp 'sport = :{port}'`)") from None
                if e.errno == errno.EACCES:
                    raise StartupError(f"{flag} {port}: not allowed to listen on port {port} (ports below 1024 "
                                       f"need privileges); pick a port of 1024 or above with {flag}") from None
                raise StartupError(f"{flag} {port}: cannot listen on {host}:{port}: {e.strerror or e} (is "
                                   f"--host {host} an address of this machine?)") from None


def check_model(model_dir) -> None:
    """The checkpoint's config.json parses and is valid (CheckpointError names the field)."""
    read_config(model_dir)


def unschedulable_reason(demand: dict[str, float], capacity: dict[str, float], count: int) -> str | None:
    """Why `count` actors each asking `demand` cannot be placed on a Ray cluster whose nodes offer
    `capacity` in total (Ray's resource totals); None if the totals would hold them."""
    gpus = demand.get("GPU", 0.0)
    if gpus > 0 and capacity.get("GPU", 0.0) == 0:
        return "no GPU visible to Ray; pass --device cpu or run on a GPU node"
    short = {k: (v * count, capacity.get(k, 0.0)) for k, v in demand.items() if v * count > capacity.get(k, 0.0)}
    if short:
        return "; ".join(f"the workers need {need:g} {k}, the Ray cluster has {have:g}" for k, (need, have)
                         in sorted(short.items()))
    return None


def died_reason(error: BaseException) -> str:
    """The last line of what ended an actor (its exception, e.g. `CheckpointError: ...`), without
    Ray's traceback and colour codes."""
    text = _ANSI.sub("", getattr(error, "error_msg", None) or str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
