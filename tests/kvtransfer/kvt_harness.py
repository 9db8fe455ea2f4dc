"""Cross-process test harness: each Worker is a spawned OS process with its own NIXL agent,
pools of random bytes, a real page allocator, a Sender and a Receiver, driven over a Pipe.

The worker runs an event loop like a real one: between commands it polls its Sender and Receiver
and records their events; as the caller of Sender, it frees a request's source pages when the
Sender releases them (that is the page-holding discipline under test).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
import traceback

import torch

from kvtransfer import (Agent, AgentDirectory, FaultPlan, LayoutDescriptor, LocalAgent, PoolLayout,
                        Receiver, Sender, decode_target, page_checksum)

KINDS = {"swa": 4096, "c4": 2336, "c128": 1168, "state_c4": 1024}   # page_bytes
LAYER_MAP = (("swa", (0, 1, 2, 3)), ("c4", (1, 3)), ("c128", (2,)), ("state_c4", (1, 3)))


def make_layout(num_pages: int = 32, page_bytes: dict | None = None,
                storage_format: str = "fp8_pack", model_hash: str = "m0") -> LayoutDescriptor:
    sizes = dict(KINDS, **(page_bytes or {}))
    return LayoutDescriptor(model_hash, storage_format, 256,
                            tuple(PoolLayout(k, b, num_pages) for k, b in sizes.items()),
                            LAYER_MAP)


class PageAllocator:
    """Lowest-id-first allocator per kind; refuses double frees and foreign ids."""

    def __init__(self, layout: LayoutDescriptor):
        self.total = {p.kind: p.num_pages for p in layout.pools}
        self._free = {p.kind: set(range(p.num_pages)) for p in layout.pools}

    def alloc(self, kind: str, n: int) -> list[int]:
        free = self._free[kind]
        if n > len(free):
            raise RuntimeError(f"pool {kind!r}: out of pages")
        ids = sorted(free)[:n]
        free.difference_update(ids)
        return ids

    def take(self, kind: str, ids) -> list[int]:
        """Allocate exactly these ids (to build scattered page lists)."""
        if not set(ids) <= self._free[kind]:
            raise RuntimeError(f"pool {kind!r}: pages {sorted(set(ids) - self._free[kind])} busy")
        self._free[kind].difference_update(ids)
        return list(ids)

    def free(self, kind: str, ids) -> None:
        ids = set(ids)
        if ids & self._free[kind] or any(not 0 <= i < self.total[kind] for i in ids):
            raise RuntimeError(f"pool {kind!r}: double or foreign free of {sorted(ids)}")
        self._free[kind] |= ids

    def num_free(self, kind: str) -> int:
        return len(self._free[kind])


def random_pools(layout: LayoutDescriptor, seed: int) -> dict[str, torch.Tensor]:
    """CPU pools of random bytes for `layout` (in-process tests)."""
    g = torch.Generator().manual_seed(seed)
    return {p.kind: torch.randint(0, 256, (p.num_pages, p.page_bytes), dtype=torch.uint8,
                                  generator=g) for p in layout.pools}


def agent_factory(transport: str):
    """(name, pools) -> a new in-process agent: "nixl" (UCX loopback, no progress thread: the
    polls move the bytes) or "local" (LocalAgent; those of one factory share a directory)."""
    if transport == "nixl":
        return lambda name, pools: Agent(name, pools, progress_thread=False)
    if transport == "local":
        directory = AgentDirectory()
        return lambda name, pools: LocalAgent(name, pools, directory)
    raise ValueError(f"unknown transport {transport!r}")


def pump(sender, receiver, until, timeout=5.0):
    """Poll both sides (one process) until until(sender_events, receiver_events) is true;
    return the events."""
    s_ev, r_ev = [], []
    deadline = time.time() + timeout
    while time.time() < deadline:
        s_ev += sender.poll()
        r_ev += receiver.poll()
        if until(s_ev, r_ev):
            return s_ev, r_ev
        time.sleep(0.001)
    raise AssertionError(f"timed out: sender {s_ev} receiver {r_ev}")


def digest(pool: torch.Tensor, ids) -> str:
    if not len(ids):
        return hashlib.sha256(b"").hexdigest()
    rows = pool.index_select(0, torch.as_tensor(list(ids), device=pool.device))
    return hashlib.sha256(rows.cpu().numpy().tobytes()).hexdigest()


# --------------------------------------------------------------------------- worker process

class _Worker:
    def __init__(self, name, layout, device, seed, sender_faults, receiver_faults, grace_s,
                 progress_thread, cuda_ipc=True):
        if str(device).startswith("cuda"):
            torch.cuda.set_device(torch.device(device))   # one GPU per worker process
        gen = torch.Generator().manual_seed(seed)
        self.layout = layout
        pools = {p.kind: torch.randint(0, 256, (p.num_pages, p.page_bytes), dtype=torch.uint8,
                                       generator=gen).to(device) for p in layout.pools}
        self.gen = gen
        self.agent = Agent(name, pools, progress_thread=progress_thread, cuda_ipc=cuda_ipc)
        self.alloc = PageAllocator(layout)
        self.grace_s = grace_s
        self.peers: dict[str, tuple[bytes, bytes]] = {}
        self.src: dict[str, dict[str, list[int]]] = {}    # request -> kind -> source pages
        self.events: list[tuple] = []
        self._build(sender_faults, receiver_faults)

    def _build(self, sender_faults, receiver_faults):
        self.sender = Sender(self.agent, self.layout, faults=sender_faults, post_margin_s=0.05)
        self.receiver = Receiver(self.agent, self.alloc, self.layout, faults=receiver_faults,
                                 grace_s=self.grace_s)
        for name, (md, lay) in self.peers.items():
            self.sender.handshake(name, md, LayoutDescriptor.from_bytes(lay))

    def pump(self):
        for ev in self.sender.poll():
            mine = self.src.pop(ev.request_id, {})
            assert all(tuple(mine.get(k, ())) == ids for k, ids in ev.src_pages), ev
            for kind, ids in mine.items():       # the caller frees what it had allocated
                self.alloc.free(kind, ids)
            self.events.append(("sender", ev.request_id, ev.reason, b"", ""))
        for ev in self.receiver.poll():
            self.events.append(("receiver", ev.request_id, ev.kind, ev.header, ev.detail))

    # commands (cmd_*) -------------------------------------------------------------

    def cmd_handshake(self, name, md, layout_bytes):
        self.sender.handshake(name, md, LayoutDescriptor.from_bytes(layout_bytes))
        self.peers[name] = (md, layout_bytes)

    def cmd_add_peer(self, name, md):
        self.agent.add_peer(name, md)

    def cmd_rebuild(self, sender_faults=None, receiver_faults=None):
        """New Sender and Receiver with these fault plans (after aborting anything left)."""
        for rid in list(self.receiver.held()):
            self.receiver.abort(rid)
        for rid in self.sender.holding():
            self.sender.abort(rid)
        self.cmd_settle(timeout=5.0)
        self.events = []
        self._build(sender_faults, receiver_faults)

    def cmd_prepare(self, rid, counts=None, explicit=None):
        """Allocate source pages (lowest first, or exactly `explicit`) and fill them with fresh
        random bytes. Returns kind -> page ids."""
        pages = {}
        for kind, n in (counts or {}).items():
            pages[kind] = self.alloc.alloc(kind, n)
        for kind, ids in (explicit or {}).items():
            pages[kind] = self.alloc.take(kind, ids)
        for kind, ids in pages.items():
            pool = self.agent.pools[kind]
            fresh = torch.randint(0, 256, (len(ids), pool.shape[1]), dtype=torch.uint8,
                                  generator=self.gen).to(pool.device)
            pool[torch.as_tensor(ids, device=pool.device)] = fresh
        self.src[rid] = pages
        return pages

    def cmd_drop_source(self, rid):
        """Free source pages of a request the sender never took (e.g. send() was refused)."""
        for kind, ids in self.src.pop(rid, {}).items():
            self.alloc.free(kind, ids)

    def cmd_reserve(self, rid, counts, lease_s):
        return self.receiver.reserve(rid, counts, lease_s).to_bytes()

    def cmd_send(self, target, rid, byte_range=None, kinds=None):
        pages = {k: v for k, v in self.src[rid].items() if kinds is None or k in kinds}
        posted = self.sender.send(decode_target(target), pages, page_byte_range=byte_range)
        return posted.descriptors, posted.nbytes

    def cmd_finish(self, target, header):
        self.sender.finish(decode_target(target), header)

    def cmd_sender_abort(self, rid):
        return self.sender.abort(rid)

    def cmd_abort(self, rid):
        return self.receiver.abort(rid)

    def cmd_release(self, rid):
        return self.receiver.release(rid)

    def cmd_claim(self, rid):
        """Claim a ready request, digest its pages, then free them (the request 'decoded')."""
        pages = self.receiver.claim(rid)
        out = {k: digest(self.agent.pools[k], ids) for k, ids in pages.items()}
        for k, ids in pages.items():
            self.alloc.free(k, ids)
        return out

    def cmd_digest(self, kind, ids):
        return digest(self.agent.pools[kind], ids)

    def cmd_checksums(self, kind, ids):
        """(checksum on the pool's device, checksum of a CPU copy) of pages `ids`."""
        pool = self.agent.pools[kind]
        return page_checksum(pool, ids), page_checksum(pool.cpu(), ids)

    def cmd_events(self, want=(), timeout=10.0):
        """Wait until every (side, rid, kind) in `want` was seen; return and clear all events."""
        deadline = time.time() + timeout
        while True:
            seen = {e[:3] for e in self.events}
            if all(tuple(w) in seen for w in want) or time.time() > deadline:
                break
            self.pump()
            time.sleep(0.002)
        out, self.events = self.events, []
        return out

    def cmd_settle(self, timeout=10.0):
        """Pump until nothing is held on either side; return free pages per kind."""
        deadline = time.time() + timeout
        while (not self.receiver.idle() or self.sender.holding()) and time.time() < deadline:
            self.pump()
            time.sleep(0.002)
        return self.cmd_state()

    def cmd_state(self):
        return {"free": {k: self.alloc.num_free(k) for k in self.alloc.total},
                "total": dict(self.alloc.total), "held": self.receiver.held(),
                "holding": self.sender.holding()}

    def cmd_metrics(self):
        return {"sender": self.sender.metrics.snapshot(),
                "receiver": self.receiver.metrics.snapshot()}

    def cmd_epoch(self):
        return self.agent.epoch

    def cmd_paths(self):
        """Which data path writes took, IPC mapping counters, live imported CUDA storages."""
        from kvtransfer.cuda_ipc import live_imports

        return {"writes": dict(self.agent.writes_by_path), "ipc": self.agent.ipc_stats(),
                "live_imports": live_imports() if torch.cuda.is_available() else 0}

    def cmd_transport(self, peer):
        return self.agent.transport(peer)


def _main(conn, name, layout_bytes, device, seed, sender_faults, receiver_faults, grace_s,
          progress_thread, cuda_ipc=True):
    w = _Worker(name, LayoutDescriptor.from_bytes(layout_bytes), device, seed, sender_faults,
                receiver_faults, grace_s, progress_thread, cuda_ipc)
    conn.send(("ready", (w.agent.metadata(), layout_bytes)))
    while True:
        # Block on the pipe while nothing is in flight, so idle workers leave the (2) cores to
        # the others; poll tightly while transfers are under way.
        busy = not w.receiver.idle() or w.sender.holding()
        if conn.poll(0.001 if busy else 0.05):
            cmd, args, kwargs = conn.recv()
            if cmd == "exit":
                w.agent.close()
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", getattr(w, "cmd_" + cmd)(*args, **kwargs)))
            except Exception as e:
                conn.send(("err", (type(e).__name__, str(e), traceback.format_exc())))
        w.pump()


# --------------------------------------------------------------------------- test side

class WorkerError(RuntimeError):
    def __init__(self, kind, msg, tb):
        super().__init__(f"{kind}: {msg}\n{tb}")
        self.kind, self.msg = kind, msg


class Worker:
    """Handle on a spawned worker process."""

    def __init__(self, name, layout=None, *, device="cpu", seed=0,
                 sender_faults: FaultPlan | None = None,
                 receiver_faults: FaultPlan | None = None, grace_s: float = 0.3,
                 progress_thread: bool = False, cuda_ipc: bool = True):
        self.name = name
        self.layout = layout or make_layout()
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, daemon=True,
                                args=(child, name, self.layout.to_bytes(), device, seed,
                                      sender_faults, receiver_faults, grace_s,
                                      progress_thread, cuda_ipc))
        self.proc.start()
        self.metadata = None

    def wait_ready(self, timeout=60.0):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker {self.name} did not start")
        _, (self.metadata, _) = self.conn.recv()
        return self

    def call(self, cmd, *args, timeout=60.0, **kwargs):
        self.conn.send((cmd, args, kwargs))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker {self.name}: {cmd} timed out")
        status, value = self.conn.recv()
        if status == "err":
            raise WorkerError(*value)
        return value

    def close(self):
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except (OSError, EOFError, TimeoutError):
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def start(*workers: Worker) -> list[Worker]:
    """Wait for workers started in parallel."""
    return [w.wait_ready() for w in workers]


def connect(a: Worker, b: Worker) -> None:
    """Full mutual handshake (each can send to the other, and acks flow back)."""
    a.call("handshake", b.name, b.metadata, b.layout.to_bytes())
    b.call("handshake", a.name, a.metadata, a.layout.to_bytes())
