"""Tensor and pipeline parallelism for the verifier.

``--tp T --pp P`` runs ``T * P`` rank processes (rank 0 is the gRPC server; it starts the
others). Rank r serves pipeline stage ``r // T`` (a contiguous range of layers) as tensor
rank ``r % T`` of that stage's group, sharded by DeepSpeed AutoTP
(``deepspeed.init_inference``). Backend: gloo on CPU (nccl would serve CUDA).

Rank 0 drives every step: it broadcasts each executor call (forward or KV compaction) to
all ranks, then every rank runs its part. Hidden states flow stage to stage by
torch.distributed point-to-point between the stages' tensor-rank-0 processes (and are
broadcast inside a stage's tensor group); the batch is split into micro-batches so that
stage s works on micro-batch m while stage s+1 works on m-1. The last stage sends logits
back to rank 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from services.verifier.engine import EngineConfig, VerifierEngine, eos_ids, slot_len
from services.verifier.executor import ForwardArgs, LocalExecutor
from specinfer.drafting.model_free import ModelFreeDrafter
from specinfer.net import free_port
from specinfer.placement import Placement
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


class RankWorker:
    """One rank's share of the model and its part in each step."""

    def __init__(self, llm: str, config: EngineConfig, rank: int, tp: int, pp: int,
                 micro_batches: int, master_port: int, threads: int = 0) -> None:
        from specinfer.models import load_model

        self.rank, self.tp, self.pp = rank, tp, pp
        self.world = tp * pp
        self.stage, self.tp_rank = divmod(rank, tp)
        self.micro_batches = max(1, micro_batches)
        cores = os.cpu_count() or 1
        torch.set_num_threads(threads or max(1, cores // self.world))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port),
                          RANK=str(rank), WORLD_SIZE=str(self.world), LOCAL_RANK=str(rank),
                          LOCAL_SIZE=str(self.world))
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        _disable_deepspeed_shm_allreduce()
        import deepspeed

        # Followers wait in a broadcast between requests: an idle server must not time out.
        deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(days=365))
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
        self.stage_ranks = list(range(self.stage * tp, (self.stage + 1) * tp))
        self.stage_group = groups[self.stage]

        model = load_model(llm)
        self.eos_token_ids = eos_ids(model)
        first, last = layer_range(model.config.num_hidden_layers, pp, self.stage)
        model.model.layers = torch.nn.ModuleList(list(model.model.layers)[first:last])
        if tp > 1:
            engine = deepspeed.init_inference(
                model, dtype=torch.float32, replace_with_kernel_inject=False,
                tensor_parallel={"tp_size": tp, "mpu": _StageGroup(self.stage_group,
                                                                    self.stage_ranks)},
            )
            model = engine.module
        self.runtime = LlamaRuntime.from_model(model, config.slots, slot_len(config), first, last)
        self.hidden_size = model.config.hidden_size
        log.info("rank ready", extra={"rank": rank, "stage": self.stage, "tp_rank": self.tp_rank,
                                      "layers": [first, last]})

    # --- point-to-point between stages ----------------------------------------------

    def _stage_head(self, stage: int) -> int:
        return stage * self.tp

    def _recv_hidden(self, shape: tuple[int, ...]) -> torch.Tensor:
        buf = torch.empty(shape, dtype=self.runtime.dtype)
        if self.tp_rank == 0:
            dist.recv(buf, src=self._stage_head(self.stage - 1))
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
                hidden = rt.embed(tokens)
            else:
                hidden = self._recv_hidden((hi - lo, q, self.hidden_size))
            vis = None if args.visible is None else args.visible[lo:hi]
            hidden = rt.layers_forward(hidden, args.positions[lo:hi], args.slots[lo:hi],
                                       args.offsets[lo:hi], vis, args.key_len)
            if not rt.is_last:
                if self.tp_rank == 0:  # async, so this stage starts the next micro-batch
                    pending.append(dist.isend(hidden.contiguous(),
                                              dst=self._stage_head(self.stage + 1)))
                continue
            if args.last_only:
                hidden = hidden[:, -1:]
            out = rt.logits(hidden)
            if self.rank == 0:
                logits.append(out)
            elif self.tp_rank == 0:
                pending.append(dist.isend(out.contiguous(), dst=0))
        if self.rank == 0 and not rt.is_last:  # collect the last stage's logits
            q_out = 1 if args.last_only else args.tokens.shape[1]
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                buf = torch.empty((hi - lo, q_out, rt.vocab_size), dtype=torch.float32)
                dist.recv(buf, src=self._stage_head(self.pp - 1))
                logits.append(buf)
        for work in pending:
            work.wait()
        return torch.cat(logits) if self.rank == 0 else None

    def follow(self) -> None:
        """Follower loop: replay rank 0's calls until it says stop."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            op, payload = box[0]
            if op == "forward":
                self.forward(payload)
            elif op == "compact":
                self.runtime.cache.compact(*payload)
            elif op == "stop":
                break
        dist.destroy_process_group()


class ParallelExecutor:
    """Rank 0's executor: broadcasts each call, then does its own part."""

    def __init__(self, worker: RankWorker, procs: list[subprocess.Popen]) -> None:
        self.worker = worker
        self.procs = procs
        self.vocab_size = worker.runtime.vocab_size
        self.dtype = worker.runtime.placement.weight_format
        self.device = worker.runtime.device
        self.tp, self.pp = worker.tp, worker.pp
        self.closed = False

    def _check_followers(self) -> None:
        dead = [p.args for p in self.procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{len(dead)} verifier rank process(es) exited")

    def forward(self, args: ForwardArgs) -> torch.Tensor:
        self._check_followers()
        dist.broadcast_object_list([("forward", args)], src=0)
        return self.worker.forward(args)

    def compact(self, slot: int, src: list[int], dst: list[int]) -> None:
        if src == dst:
            return
        dist.broadcast_object_list([("compact", (slot, src, dst))], src=0)
        self.worker.runtime.cache.compact(slot, src, dst)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if all(p.poll() is None for p in self.procs):
            dist.broadcast_object_list([("stop", None)], src=0)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        dist.destroy_process_group()


def build_engine(llm: str, config: EngineConfig, tp: int = 1, pp: int = 1,
                 micro_batches: int = 2, threads: int = 0,
                 drafter: ModelFreeDrafter | None = None, head: str | None = None,
                 placement: Placement | None = None) -> VerifierEngine:
    """A verifier engine over ``tp * pp`` ranks; this process becomes rank 0. ``head``: a
    draft head directory (``specinfer train-head``; tp = pp = 1 only)."""
    placement = placement or Placement()
    if tp < 1 or pp < 1:
        raise ValueError("--tp and --pp must be >= 1")
    if head and tp * pp > 1:
        raise ValueError("a draft head needs --tp 1 --pp 1")
    if tp == 1 and pp == 1:
        from specinfer.drafting.head import FeatureDrafter, load_head
        from specinfer.models import load_model

        if threads:
            torch.set_num_threads(threads)
        model = load_model(llm)
        runtime = LlamaRuntime.from_model(model, config.slots, slot_len(config),
                                          placement=placement)
        drafts = None
        if head:
            drafts = FeatureDrafter(load_head(head, model), slots=config.slots,
                                    max_context=config.max_context,
                                    max_tree_nodes=config.max_tree_nodes, placement=placement)
        return VerifierEngine(LocalExecutor(runtime), config, llm, eos_ids(model), drafter,
                              drafts)
    port = free_port()
    spec = json.dumps({"llm": llm, "config": asdict(config), "tp": tp, "pp": pp,
                       "micro_batches": micro_batches, "master_port": port,
                       "threads": threads, "parent": os.getpid()})
    procs = [
        subprocess.Popen([sys.executable, "-m", "services.verifier.parallel", "--rank", str(r),
                          "--spec", spec])
        for r in range(1, tp * pp)
    ]
    try:
        worker = RankWorker(llm, config, 0, tp, pp, micro_batches, port, threads)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return VerifierEngine(ParallelExecutor(worker, procs), config, llm, worker.eos_token_ids,
                          drafter)


def _exit_with_parent(parent: int) -> None:
    """A follower blocked in a collective would outlive a killed rank 0: watch for it."""
    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    from specinfer.logs import setup_logging

    p = argparse.ArgumentParser(description="a follower rank of a parallel verifier")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--spec", required=True)
    args = p.parse_args()
    spec = json.loads(args.spec)
    setup_logging(f"verifier-rank{args.rank}")
    _exit_with_parent(spec["parent"])
    worker = RankWorker(spec["llm"], EngineConfig(**spec["config"]), args.rank, spec["tp"],
                        spec["pp"], spec["micro_batches"], spec["master_port"], spec["threads"])
    worker.follow()


if __name__ == "__main__":
    main()
