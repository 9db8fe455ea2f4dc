"""An expert-parallel group of workers, seen from one rank: rendezvous, lockstep steps, failure.

W workers of one role (Ray actors; one GPU each on GPUs) form a group: prefill workers
(`WorkerOptions.prefill_ep`) or decode workers (`WorkerOptions.decode_ep`). Each keeps its own
worker id, registry entry, KV pools and requests (attention is data-parallel), and holds 1/W of
the routed experts (`model.ep.shard_experts`). To the router, the other role and the transfer
layer a rank is an ordinary worker. The group steps the rank's engine, whichever role it has:
`plan()` → this step's batch or None, `shape(batch)` → what it needs (`StepShape`), `run(batch,
agreed)` → that step's outputs, `join_idle(agreed)` → join the step with no rows.

    rendezvous  the launcher asks rank 0 to `listen` (a TCPStore on a free port of its node) and
                hands every rank its `Seat` (that address, its rank, W). Each rank builds two
                standalone process groups from the store: `control` (gloo, CPU: the step
                agreement, and the failure detector) and `moe` (the MoE exchanges: the control
                group itself on CPU, NCCL on cuda). Neither is torch.distributed's default group,
                which stays free for anything else in the process.
    lockstep    each step every rank plans its batch (`engine.plan`), then all meet: one
                all_reduce (max) of what the step needs (`StepShape`: any batch, the most decode
                rows, whether it must run eagerly). Some work: a rank with a batch runs it
                (`engine.run`) and a rank without one joins every MoE layer's exchanges with no
                rows (`engine.join_idle`: `idle_step`, or its decode graph of the agreed bucket);
                neither role's forward runs the MTP block, so neither does the idle step;
                and they meet again at once. None: nobody runs anything, and the ranks wait
                before meeting again — up to `idle_tick_s`, or until a rank gets a request: it
                then wakes its peers (the workers' `ep_wake`, naming the meeting it wants, so a
                late wake is ignored) and all meet at once. An idle group thus costs one meeting
                per tick, and a request does not wait for the tick. A rank that meets before its
                peers waits in the collective, which blocks without spinning.
    failure     a collective that errs (a peer died: its sockets closed) or waits past
                `timeout_s` (a peer hangs) fails the group for good, as does any error inside a
                step: this rank aborts the group, so that its peers fail at once rather than at
                their timeout, and never calls it again — a rank out of lockstep would pair its
                collectives with the wrong ones of its peers. A prefill worker then fails its
                prefills with a reason code and leaves the registry (prefill_worker/actor.py); a
                decode worker leaves like a dead one, so that the routers move its requests on
                (decode_worker/actor.py); the group is restarted as a whole
                (`LocalCluster.restart_group`).

On NCCL a hung exchange is ended by NCCL's watchdog after `timeout_s`, which by default takes the
process down: the peers then see the control group's sockets close.
"""

from __future__ import annotations

import asyncio
import enum
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from model.dummy_weights import materialize_experts
from model.ep import ExpertParallelMoE, shard_experts
from model.transformer import Transformer
from worker_runtime.commands import Commands
from worker_runtime.options import ExpertParallelOptions
from worker_runtime.wire import StepShape

ABORT_WAIT_S = 5.0  # how long `fail` waits for each process group's abort


class GroupState(enum.Enum):
    ACTIVE = "active"  # in lockstep with every peer
    FAILED = "failed"  # broken for good: never called again


class GroupFailed(RuntimeError):
    """The group broke: a peer died or hung past the timeout, or this rank left lockstep."""


@dataclass(frozen=True)
class Seat:
    """Where one rank joins its group: rank 0's rendezvous store, and its place in the group."""

    host: str
    port: int
    rank: int
    world: int
    peers: tuple[str, ...]  # every rank's actor name, by rank (whom to wake)


def listen(options: ExpertParallelOptions) -> tuple[dist.TCPStore, str]:
    """Rank 0, in its actor: the group's rendezvous store on a free port of this node (its `.port`)
    and this node's address; the store must stay alive while the group forms."""
    import ray  # only the actors' entry points use Ray: the group itself runs without it (tests/gpu)

    host = ray.util.get_node_ip_address()
    return dist.TCPStore(host, 0, None, is_master=True, timeout=timedelta(seconds=options.timeout_s),
                         wait_for_workers=False), host


def join(seat: Seat, options: ExpertParallelOptions, device: str, model: Transformer,
         store: dist.Store | None = None) -> "ExpertParallelGroup":
    """A rank, in its actor: join the group at `seat` (its peers found by actor name) from this node."""
    import ray

    peers = [ray.get_actor(name) for r, name in enumerate(seat.peers) if r != seat.rank]
    return ExpertParallelGroup(seat, ray.util.get_node_ip_address(), options, device, model, peers, store)


class ExpertParallelGroup:
    def __init__(self, seat: Seat, host: str, options: ExpertParallelOptions, device: str, model: Transformer,
                 peers: list, store: dist.Store | None = None):
        """Join the group at `seat` (blocks until every rank has joined, at most `timeout_s`) and
        shard `model`'s routed experts over it, in place. `host`: this rank's node address, the one
        its peers reach it at; `peers`: the other ranks' actors. Rank 0 passes the store it `listen`s on."""
        timeout = timedelta(seconds=options.timeout_s)
        if store is None:
            store = dist.TCPStore(seat.host, seat.port, None, is_master=False, timeout=timeout)
        self.seat, self.options, self.model, self.store = seat, options, model, store
        self.control = _gloo(dist.PrefixStore("control", store), seat, host, timeout)
        self.moe = self.control if device == "cpu" else _nccl(dist.PrefixStore("moe", store), seat, timeout)
        shard_experts(model, self.moe, options.fp8_dispatch)
        materialize_experts(model)  # a dummy-weights replica makes its slice of the experts only now
        if device == "cuda":
            torch.cuda.empty_cache()  # the other ranks' experts were just dropped
        self.state = GroupState.ACTIVE
        self.failure: str | None = None
        self.meetings = 0  # step agreements completed (the same count on every rank)
        self.steps = 0  # steps this rank ran a batch in
        self.idle_steps = 0  # steps it only joined the exchanges of
        self.peers = peers
        self.wake_for = 0  # a peer asked to meet for this meeting number
        self.nudge = asyncio.Event()  # set by `woken`

    def step(self, engine) -> list | None:
        """One lockstep step of `engine` (a PrefillEngine or a DecodeEngine): its outputs of this
        step, or None when no rank had work (nothing ran). A collective: every rank must call it.
        Raises GroupFailed."""
        if self.state is not GroupState.ACTIVE:
            raise GroupFailed(self.failure)
        return self.run(engine, engine.plan())

    def run(self, engine, planned, layer_done: Callable[[int], None] | None = None) -> list | None:
        """`step` for a step planned already (`engine.plan()`, None: no work here), e.g. on the
        worker's loop thread; `layer_done`: the prefill engine's per-layer hook
        (prefill_worker/layer_stream.py), called after each of this rank's model layers."""
        if self.state is not GroupState.ACTIVE:
            raise GroupFailed(self.failure)
        try:
            shape = torch.tensor(engine.shape(planned).as_list())
            dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=self.control)  # the step every rank runs
            agreed = StepShape(*shape.tolist())
            self.meetings += 1
            if not agreed.busy:
                return None
            if planned is None:
                engine.join_idle(agreed)
                self.idle_steps += 1
                return []
            self.steps += 1
            return engine.run(planned, agreed) if layer_done is None else engine.run(planned, agreed, layer_done)
        except Exception as e:  # whatever it was, this rank may be out of lockstep now
            self.fail(f"{type(e).__name__}: {e}")
            raise GroupFailed(self.failure) from e

    # --- when an idle group meets again (on the worker's event loop) ------------------------
    def woken(self, meeting: int) -> None:
        """A peer got work while the group idled and asks to hold meeting number `meeting` now."""
        self.wake_for = max(self.wake_for, meeting)
        self.nudge.set()

    async def wait_idle(self, commands: Commands, transfers: Callable[[], bool],
                        has_work: Callable[[], bool] = lambda: False) -> None:
        """No rank had work: return when the next meeting is due — the idle tick, a peer's wake
        (unless it is for a meeting held already), or work of ours: a command, or `has_work()`
        turning true (the peers are then woken). `transfers()` polls the worker's transfers in
        flight and says whether any are left: they are polled every millisecond meanwhile (KV
        arriving is how a decode rank gets work without a command)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.idle_tick_s
        mine = lambda: bool(commands) or has_work()  # noqa: E731
        while not mine() and self.wake_for <= self.meetings and loop.time() < deadline:
            if transfers():
                await asyncio.sleep(0.001)
                continue
            self.nudge.clear()
            waits = [asyncio.ensure_future(commands.wait(deadline - loop.time())),
                     asyncio.ensure_future(self.nudge.wait())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
        if mine() and self.wake_for <= self.meetings:  # work of our own: the peers meet now too
            for peer in self.peers:
                peer.ep_wake.remote(self.meetings + 1)

    def fail(self, reason: str) -> None:
        """Leave the group for good; aborting it closes our connections, so peers fail now. Each
        abort runs on a thread of its own, waited for at most ABORT_WAIT_S: an NCCL abort can
        block on a peer's state, and the caller must get on with failing its requests."""
        if self.state is GroupState.FAILED:
            return
        self.state, self.failure = GroupState.FAILED, reason
        for group in {id(g): g for g in (self.control, self.moe)}.values():
            aborting = threading.Thread(target=_abort, args=(group,), daemon=True)
            aborting.start()
            aborting.join(ABORT_WAIT_S)

    def status(self) -> dict:
        """What this rank is and holds: its routed experts [first, first + n) and their parameters."""
        moes = [b.ffn for b in [*self.model.layers, *self.model.mtp] if isinstance(b.ffn, ExpertParallelMoE)]
        return {"state": self.state.value, "rank": self.seat.rank, "world": self.seat.world,
                "experts": (moes[0].first, moes[0].n_local) if moes else None,
                # float experts are parameters, packed (device-format) ones buffers
                "expert_params": sum(t.numel() for m in moes for t in [*m.experts.parameters(), *m.experts.buffers()]),
                "meetings": self.meetings, "steps": self.steps, "idle_steps": self.idle_steps, "failure": self.failure}


def _abort(group: dist.ProcessGroup) -> None:
    try:
        group.abort()
    except Exception:  # already torn down by the error that failed it
        pass


# ---------------------------------------------------------------------------------------
# standalone process groups (registered nowhere: torch.distributed's default group untouched)
# ---------------------------------------------------------------------------------------

def _gloo(store: dist.Store, seat: Seat, host: str, timeout: timedelta) -> dist.ProcessGroup:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # bound to the address peers reach this node at, not whatever its hostname resolves to
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return _wrap(store, seat, dist.ProcessGroupGloo(store, seat.rank, seat.world, options), torch.device("cpu"),
                 dist.ProcessGroup.BackendType.GLOO)


def _nccl(store: dist.Store, seat: Seat, timeout: timedelta) -> dist.ProcessGroup:
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return _wrap(store, seat, dist.ProcessGroupNCCL(store, seat.rank, seat.world, options),
                 torch.device("cuda", torch.cuda.current_device()), dist.ProcessGroup.BackendType.NCCL)


def _wrap(store: dist.Store, seat: Seat, backend, device: torch.device, kind) -> dist.ProcessGroup:
    """A ProcessGroup over one backend, as torch.distributed builds its own groups, minus the
    registration in its global tables."""
    backend._set_sequence_number_for_group()
    group = dist.ProcessGroup(store, seat.rank, seat.world)
    group._set_default_backend(kind)
    group._register_backend(device, kind, backend)
    return group
