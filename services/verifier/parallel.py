"""Tensor and pipeline parallelism for the verifier.

``--tp T --pp P`` runs ``T * P`` rank processes. Rank r serves pipeline stage ``r // T``
(a contiguous range of layers) as tensor rank ``r % T`` of that stage's group, sharded by
DeepSpeed AutoTP (``deepspeed.init_inference``). Backend: NCCL on CUDA (one process per
GPU), gloo on the CPU; control messages always on gloo.

On one machine rank 0 (the gRPC server) starts every other rank. Across machines or pods
each pipeline stage is one node started by its own command (``--node-rank N
--master-addr H``, or the environment a LeaderWorkerSet or torchrun-style launcher sets:
``Rendezvous``); node N runs ranks ``N*T .. N*T+T-1``. Only rank 0 serves gRPC; the other
nodes take the model and config from it, and its health reports theirs: collectives time
out (``--rank-timeout``), rank 0 pings when idle, so a lost rank makes the verifier answer
UNAVAILABLE and report NOT_SERVING within seconds, and the other ranks exit.

Rank 0 drives every step: it broadcasts each executor call (forward, KV compaction or
prefix copy) to all ranks, then every rank runs its part. Hidden states flow stage to stage by
torch.distributed point-to-point between the stages' tensor-rank-0 processes (and are
broadcast inside a stage's tensor group); the batch is split into micro-batches so that
stage s works on micro-batch m while stage s+1 works on m-1. The last stage sends logits
back to rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from services.parent import child_env, follow_parent
from services.verifier.engine import EngineConfig, eos_ids, slot_len
from services.verifier.executor import ForwardArgs
from specinfer.errors import ServiceError, Unavailable
from specinfer.models import ModelError
from specinfer.net import free_port
from specinfer.placement import Placement, resolve
from specinfer.runtime import LlamaRuntime

log = logging.getLogger(__name__)


def _disable_deepspeed_shm_allreduce() -> None:
    """DeepSpeed's CPU shared-memory all-reduce op segfaults on these machines: make it
    fall back to the process group's (gloo) all-reduce. ``deepspeed.comm.torch`` must be
    patched through ``sys.modules``: ``import deepspeed.comm.torch`` binds PyTorch's torch."""
    import deepspeed.comm.torch  # noqa: F401  (loads the module)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


class _StageGroup:
    """The ``mpu`` interface DeepSpeed reads: this stage's tensor-parallel group."""

    def __init__(self, group, ranks: list[int]) -> None:
        self.group, self.ranks = group, ranks

    def get_model_parallel_group(self):
        return self.group

    def get_model_parallel_rank(self) -> int:
        return self.ranks.index(dist.get_rank())

    def get_model_parallel_world_size(self) -> int:
        return len(self.ranks)

    def get_data_parallel_group(self):
        return None

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1


def layer_range(num_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """Contiguous, as even as possible: earlier stages take the remainder."""
    base, extra = divmod(num_layers, pp)
    first = stage * base + min(stage, extra)
    return first, first + base + (1 if stage < extra else 0)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one verifier meet. On one machine (``node_rank`` None) rank 0
    starts every other rank itself; across machines or pods each node (pipeline stage) is
    started by its own command and runs ``tp`` ranks, one per GPU."""

    master_addr: str = "127.0.0.1"
    master_port: int = 0
    node_rank: int | None = None
    # Collectives that wait longer than this fail: a lost rank turns into UNAVAILABLE (rank
    # 0) or an exit (the others). Rank 0 pings the others every quarter of it when idle.
    timeout_s: float = 30.0
    # The first meeting waits this long: pods load their stage at different speeds.
    startup_timeout_s: float = 600.0


def rendezvous_from(node_rank: int | None, master_addr: str | None, master_port: int | None,
                    pp: int, timeout_s: float = 30.0,
                    environ: dict[str, str] | None = None) -> Rendezvous | None:
    """The multi-node rendezvous the flags or the environment name, or None (one machine;
    always with a single pipeline stage unless flags say otherwise). Flags win; then a
    LeaderWorkerSet's ``LWS_LEADER_ADDRESS``/``LWS_WORKER_INDEX``/
    ``LWS_GROUP_SIZE``; then ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``, where
    RANK and WORLD_SIZE count nodes (pipeline stages), not processes."""
    env = os.environ if environ is None else environ
    if pp == 1 and node_rank is None and master_addr is None:
        return None  # one stage: one node; a launcher's environment is not ours to read
    lws = "LWS_LEADER_ADDRESS" in env
    addr = master_addr or env.get("LWS_LEADER_ADDRESS") or env.get("MASTER_ADDR")
    if node_rank is None:
        index = env.get("LWS_WORKER_INDEX") if lws else env.get("RANK")
        node_rank = int(index) if index not in (None, "") else None
    if node_rank is None and master_addr is None and not lws:
        return None
    if addr is None:
        raise ModelError("--node-rank needs --master-addr (or MASTER_ADDR / "
                         "LWS_LEADER_ADDRESS): the address of node 0")
    if node_rank is None:
        raise ModelError("--master-addr needs --node-rank (or RANK / LWS_WORKER_INDEX)")
    size = env.get("LWS_GROUP_SIZE") if lws else env.get("WORLD_SIZE")
    if size not in (None, "") and int(size) != pp:
        raise ModelError(f"{'LWS_GROUP_SIZE' if lws else 'WORLD_SIZE'}={size} nodes, but "
                         f"--pp {pp}: each node serves one pipeline stage")
    if not 0 <= node_rank < pp:
        raise ModelError(f"--node-rank must be in 0..{pp - 1} (--pp {pp}); got {node_rank}")
    port = master_port or int(env.get("MASTER_PORT") or 29500)
    return Rendezvous(addr, port, node_rank, timeout_s)


class RankWorker:
    """One rank's share of the model and its part in each step. Every rank takes the
    model, engine config and number format from rank 0 at the first meeting, so the
    commands of other nodes need only the layout flags (``--tp --pp --node-rank``)."""

    def __init__(self, spec: dict, rank: int, tp: int, pp: int, meet: Rendezvous,
                 threads: int = 0, cuda: bool = False) -> None:
        self.rank, self.tp, self.pp = rank, tp, pp
        self.world = tp * pp
        self.stage, self.tp_rank = divmod(rank, tp)
        local_ranks = self.world if meet.node_rank is None else tp
        cores = os.cpu_count() or 1
        torch.set_num_threads(threads or max(1, cores // local_ranks))
        # torch.distributed and DeepSpeed read the rendezvous from the environment; it is
        # set only while this rank initialises (a process that builds an engine in-process
        # must not hand it to the services it starts later).
        rendezvous_env = dict(MASTER_ADDR=meet.master_addr, MASTER_PORT=str(meet.master_port),
                              RANK=str(rank), WORLD_SIZE=str(self.world),
                              LOCAL_RANK=str(rank % local_ranks), LOCAL_SIZE=str(local_ranks))
        saved = {k: os.environ.get(k) for k in rendezvous_env}
        os.environ.update(rendezvous_env)
        try:
            self._init(spec, meet, cuda)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _init(self, spec: dict, meet: Rendezvous, cuda: bool) -> None:
        from specinfer.models import load_model

        rank, tp, pp = self.rank, self.tp, self.pp
        if cuda:
            torch.cuda.set_device(self.tp_rank)
        else:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            _disable_deepspeed_shm_allreduce()
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo",
                                   timeout=datetime.timedelta(seconds=meet.startup_timeout_s))
        # Everything after the first meeting runs in groups with the short timeout.
        timeout = datetime.timedelta(seconds=meet.timeout_s)
        self.group = dist.new_group(list(range(self.world)), timeout=timeout)
        # Control messages (pickled calls) always travel on gloo, on the host.
        self.control = self.group if not cuda else \
            dist.new_group(list(range(self.world)), timeout=timeout, backend="gloo")
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp)), timeout=timeout)
                  for s in range(pp)]
        self.stage_ranks = list(range(self.stage * tp, (self.stage + 1) * tp))
        self.stage_group = groups[self.stage]
        box = [spec]
        dist.broadcast_object_list(box, src=0, group=self.control)
        spec = box[0]
        self.micro_batches = max(1, spec["micro_batches"])
        config = EngineConfig(**spec["config"])
        device = f"cuda:{self.tp_rank}" if cuda else "cpu"
        placement = resolve(device, spec["dtype"], spec["quantize"], spec["compile"])

        model = load_model(spec["llm"])
        self.eos_token_ids = eos_ids(model)
        first, last = layer_range(model.config.num_hidden_layers, pp, self.stage)
        model.model.layers = torch.nn.ModuleList(list(model.model.layers)[first:last])
        if tp > 1:
            engine = deepspeed.init_inference(
                model, dtype=placement.dtype if cuda else torch.float32,
                replace_with_kernel_inject=False,
                tensor_parallel={"tp_size": tp, "mpu": _StageGroup(self.stage_group,
                                                                    self.stage_ranks)},
            )
            model = engine.module
        self.runtime = LlamaRuntime.from_model(model, config.slots, slot_len(config), first,
                                               last, placement)
        self.runtime.capture_graphs(config.max_tree_nodes + 1)
        self.hidden_size = model.config.hidden_size
        log.info("rank ready", extra={"rank": rank, "stage": self.stage, "tp_rank": self.tp_rank,
                                      "layers": [first, last],
                                      "placement": placement.describe()})

    # --- point-to-point between stages ----------------------------------------------

    def _stage_head(self, stage: int) -> int:
        return stage * self.tp

    def _recv_hidden(self, shape: tuple[int, ...]) -> torch.Tensor:
        buf = torch.empty(shape, dtype=self.runtime.dtype, device=self.runtime.device)
        if self.tp_rank == 0:
            dist.recv(buf, src=self._stage_head(self.stage - 1), group=self.group)
        if self.tp > 1:
            dist.broadcast(buf, src=self.stage_ranks[0], group=self.stage_group)
        return buf

    def forward(self, args: ForwardArgs) -> torch.Tensor | None:
        """This rank's part of one forward; rank 0 returns the logits."""
        rt = self.runtime
        b = args.tokens.shape[0]
        bounds = torch.linspace(0, b, min(self.micro_batches, b) + 1).round().long().tolist()
        pending, logits = [], []
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            tokens, q = args.tokens[lo:hi], args.tokens.shape[1]
            if rt.is_first:
                hidden = rt.embed(rt.to_device(tokens))
            else:
                hidden = self._recv_hidden((hi - lo, q, self.hidden_size))
            vis = None if args.visible is None else args.visible[lo:hi]
            hidden = rt.layers_forward(hidden, args.positions[lo:hi], args.slots[lo:hi],
                                       args.offsets[lo:hi], vis, args.key_len)
            if not rt.is_last:
                if self.tp_rank == 0:  # async, so this stage starts the next micro-batch
                    # A copy: under CUDA graphs ``hidden`` may be the graph's own output,
                    # which the next micro-batch's replay overwrites while this send reads.
                    pending.append(dist.isend(hidden.clone(memory_format=torch.contiguous_format),
                                              dst=self._stage_head(self.stage + 1),
                                              group=self.group))
                continue
            if args.last_only:
                hidden = hidden[:, -1:]
            out = rt.logits(hidden)
            if self.rank == 0:
                logits.append(out)
            elif self.tp_rank == 0:
                pending.append(dist.isend(out.contiguous(), dst=0, group=self.group))
        if self.rank == 0 and not rt.is_last:  # collect the last stage's logits
            q_out = 1 if args.last_only else args.tokens.shape[1]
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                buf = torch.empty((hi - lo, q_out, rt.vocab_size), dtype=torch.float32,
                                  device=rt.device)
                dist.recv(buf, src=self._stage_head(self.pp - 1), group=self.group)
                logits.append(buf)
        for work in pending:
            work.wait()
        return torch.cat(logits) if self.rank == 0 else None

    def follow(self) -> None:
        """Follower loop: replay rank 0's calls until it says stop. Rank 0 pings at least
        every quarter of the timeout, so a wait that times out means rank 0 is gone: exit
        non-zero (the pod restarts; a local rank's parent is gone anyway)."""
        while True:
            box = [None]
            try:
                dist.broadcast_object_list(box, src=0, group=self.control)
                op, payload = box[0]
                if op == "forward":
                    self.forward(payload)
                elif op == "compact":
                    self.runtime.cache.compact(*payload)
                elif op == "copy":
                    self.runtime.cache.copy(*payload)
                elif op == "stop":
                    break
            except RuntimeError as exc:  # gloo/NCCL: a peer closed or timed out
                log.error("lost rank 0 or a peer stage; exiting",
                          extra={"rank": self.rank, "error": str(exc)[:300]})
                os._exit(3)
        dist.destroy_process_group()


class ParallelExecutor:
    """Rank 0's executor: broadcasts each call, then does its own part. A failed
    collective (a rank died, or timed out) breaks it for good: every later call answers
    UNAVAILABLE, so routers fail over, and the health check reports NOT_SERVING."""

    def __init__(self, worker: RankWorker, procs: list[subprocess.Popen],
                 heartbeat_s: float = 5.0) -> None:
        self.worker = worker
        self.procs = procs
        self.vocab_size = worker.runtime.vocab_size
        self.dtype = worker.runtime.placement.weight_format
        self.device = worker.runtime.device
        self.tp, self.pp = worker.tp, worker.pp
        self.eos_token_ids = worker.eos_token_ids
        self.features: torch.Tensor | None = None  # never kept: the draft head needs tp = pp = 1
        self.closed = False
        self.broken: str | None = None
        self.lock = threading.Lock()
        self.last_call = time.monotonic()
        self._stop = threading.Event()
        self._pinger = threading.Thread(target=self._ping_loop, args=(heartbeat_s,),
                                        daemon=True, name="rank-heartbeat")
        self._pinger.start()

    @property
    def healthy(self) -> bool:
        return self.broken is None and not self.closed

    def _ping_loop(self, every: float) -> None:
        """Keep the other ranks' waits short of their timeout, and find a lost rank while
        no request is in flight."""
        while not self._stop.wait(every / 2):
            if time.monotonic() - self.last_call >= every:
                try:
                    self._call("ping", None)
                except ServiceError:
                    return

    def _call(self, op: str, payload, local=None):
        """Broadcast one call and do rank 0's part, under the lock; a failure breaks the
        executor."""
        with self.lock:
            if self.broken is not None:
                raise Unavailable(f"this verifier lost a rank ({self.broken}); it must be "
                                  "restarted")
            if self.closed:
                raise Unavailable("this verifier is stopping")
            try:
                dead = [p.pid for p in self.procs if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"rank process(es) {dead} exited")
                dist.broadcast_object_list([(op, payload)], src=0, group=self.worker.control)
                out = local() if local is not None else None
            except RuntimeError as exc:  # a peer closed its connection or timed out
                self.broken = str(exc)[:200] or type(exc).__name__
                log.error("verifier rank lost: answering UNAVAILABLE from now on",
                          extra={"error": self.broken})
                raise Unavailable(f"this verifier lost a rank ({self.broken}); it must be "
                                  "restarted") from exc
            finally:
                self.last_call = time.monotonic()
            return out

    def forward(self, args: ForwardArgs) -> torch.Tensor:
        if args.features:
            raise ValueError("features need the whole model in one process (tp = pp = 1)")
        return self._call("forward", args, lambda: self.worker.forward(args))

    def compact(self, slot: int, src: list[int], dst: list[int]) -> None:
        if src == dst:
            return
        self._call("compact", (slot, src, dst),
                   lambda: self.worker.runtime.cache.compact(slot, src, dst))

    def copy(self, src_slot: int, dst_slot: int, length: int) -> None:
        self._call("copy", (src_slot, dst_slot, length),
                   lambda: self.worker.runtime.cache.copy(src_slot, dst_slot, length))

    def close(self) -> None:
        if self.closed:
            return
        self._stop.set()
        with self.lock:
            self.closed = True
            if self.broken is None and all(p.poll() is None for p in self.procs):
                with contextlib.suppress(RuntimeError):
                    dist.broadcast_object_list([("stop", None)], src=0,
                                               group=self.worker.control)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.broken is None:
            dist.destroy_process_group()


def _spawn_followers(ranks: range, tp: int, pp: int, meet: Rendezvous, threads: int,
                     cuda: bool) -> list[subprocess.Popen]:
    """This node's other ranks, as child processes."""
    spec = json.dumps({"tp": tp, "pp": pp, "meet": asdict(meet), "threads": threads,
                       "cuda": cuda})
    return [subprocess.Popen([sys.executable, "-m", "services.verifier.parallel",
                              "--rank", str(r), "--spec", spec], env=child_env())
            for r in ranks]


def start_ranks(llm: str, config: EngineConfig, tp: int, pp: int, micro_batches: int,
                threads: int, placement: Placement, meet: Rendezvous | None
                ) -> ParallelExecutor:
    """This process as rank 0 of ``tp * pp`` ranks, the others started here (all of them,
    or with ``meet`` this node's): rank 0's executor once every rank holds its part."""
    meet = meet or Rendezvous(master_port=free_port())
    local = range(1, tp) if meet.node_rank is not None else range(1, tp * pp)
    spec = {"llm": llm, "config": asdict(config), "micro_batches": micro_batches,
            "device": placement.device.type, "dtype": _name(placement.dtype),
            "quantize": placement.quantize, "compile": "on" if placement.compile else "off"}
    procs = _spawn_followers(local, tp, pp, meet, threads, placement.cuda)
    try:
        worker = RankWorker(spec, 0, tp, pp, meet, threads, placement.cuda)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return ParallelExecutor(worker, procs, heartbeat_s=meet.timeout_s / 4)


def run_stage(tp: int, pp: int, meet: Rendezvous, threads: int = 0, cuda: bool = False
              ) -> int:
    """A node other than 0: its stage's ``tp`` ranks (on this node's GPUs with ``cuda``),
    following rank 0 until it stops (exit 0) or is lost (exit 3). The model, engine config
    and number format come from rank 0."""
    first = meet.node_rank * tp
    procs = _spawn_followers(range(first + 1, first + tp), tp, pp, meet, threads, cuda)
    log.info("pipeline stage starting", extra={"stage": meet.node_rank, "ranks": tp,
                                               "master": f"{meet.master_addr}:"
                                                         f"{meet.master_port}"})
    try:
        RankWorker({}, first, tp, pp, meet, threads, cuda).follow()
    finally:
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def main() -> None:
    from specinfer.logs import setup_logging

    p = argparse.ArgumentParser(description="a follower rank of a parallel verifier")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--spec", required=True)
    args = p.parse_args()
    spec = json.loads(args.spec)
    setup_logging(f"verifier-rank{args.rank}")
    # A follower blocked in a collective would outlive a killed verifier: it ends with it
    # (a short grace: it has nothing to drain; the verifier may start it from a thread
    # that ends, so no kernel signal).
    follow_parent(grace_s=1.0, kernel=False)
    worker = RankWorker({}, args.rank, spec["tp"], spec["pp"], Rendezvous(**spec["meet"]),
                        spec["threads"], spec["cuda"])
    worker.follow()


if __name__ == "__main__":
    main()
