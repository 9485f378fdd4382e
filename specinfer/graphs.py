"""CUDA graphs for the runtime's layer loop: decode steps, tree verification and draft
levels replay a graph captured at startup instead of launching hundreds of small kernels.

Shapes are bucketed so there are few graphs: batch rows to a power of two up to the
cache's slots, queries per row to a power of two up to the widest tree (+ root). Every
graph attends over the whole slot (``key_len = slot_len``) with an explicit visibility
mask, so one graph serves every context length. Padding rows and padding queries write
their K/V to a scratch slot the runtime keeps for them and see one key (finite, ignored).
Prefill chunks wider than the widest bucket run eagerly. Off a GPU the same buckets and
padding run without capture (so CPU tests check them).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)


class LayerLoopRuntime(Protocol):
    """What graphs read of the runtime (``specinfer.runtime.LlamaRuntime``, which builds
    them: it is not imported here, so the two modules do not import each other)."""

    device: torch.device
    dtype: torch.dtype
    config: Any  # the model's config: hidden_size
    cache: Any  # the KV cache: slot_len, k
    placement: Any  # cuda
    scratch_slot: int

    def layer_loop(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   offsets: torch.Tensor, visible: torch.Tensor | None, key_len: int
                   ) -> torch.Tensor:
        ...


def buckets(limit: int) -> list[int]:
    """1, 2, 4, ... and ``limit`` itself."""
    out, n = [], 1
    while n < limit:
        out.append(n)
        n *= 2
    return out + [limit]


class _Graph:
    """One captured layer loop and its static inputs and output."""

    def __init__(self, runtime: LayerLoopRuntime, batch: int, queries: int, pool) -> None:
        rt = runtime
        dev, slot_len = rt.device, rt.cache.slot_len
        self.hidden = torch.zeros(batch, queries, rt.config.hidden_size, dtype=rt.dtype,
                                  device=dev)
        self.positions = torch.zeros(batch, queries, dtype=torch.long, device=dev)
        self.slots = torch.full((batch, queries), rt.scratch_slot, dtype=torch.long,
                                device=dev)
        self.write = torch.zeros(batch, queries, dtype=torch.long, device=dev)
        self.visible = torch.zeros(batch, queries, slot_len, dtype=torch.bool, device=dev)
        self.visible[..., 0] = True
        self.args = (self.hidden, self.positions, self.slots, self.write, self.visible,
                     slot_len)
        self.runtime, self.graph = rt, None
        if not self.hidden.is_cuda:  # on the CPU (tests): run, don't capture
            return
        args = self.args
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm up: lazy inits and autotuning happen outside capture
                rt.layer_loop(*args)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool), torch.inference_mode():
            self.out = rt.layer_loop(*args)

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.inference_mode():
                self.out = self.runtime.layer_loop(*self.args)


class GraphedLayers:
    """The runtime's ``layer_loop`` through captured graphs where a bucket fits."""

    def __init__(self, runtime: LayerLoopRuntime, max_queries: int) -> None:
        self.runtime = runtime
        self.batches = buckets(runtime.cache.k.shape[1] - 1)  # the last slot is scratch
        self.queries = buckets(max_queries)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        pool = torch.cuda.graph_pool_handle() if runtime.placement.cuda else None
        total = len(self.batches) * len(self.queries)
        start = time.perf_counter()
        # Largest first: later (smaller) graphs reuse the pool's memory.
        for b in reversed(self.batches):
            for q in reversed(self.queries):
                self.graphs[(b, q)] = _Graph(runtime, b, q, pool)
                log.info("capturing CUDA graphs", extra={"done": len(self.graphs),
                                                         "total": total})
        self.capture_s = time.perf_counter() - start  # start-up's share (bench.gpu_smoke)
        log.info("CUDA graphs captured", extra={"graphs": total,
                                                "seconds": round(self.capture_s, 2)})

    def fits(self, batch: int, queries: int) -> bool:
        return batch <= self.batches[-1] and queries <= self.queries[-1]

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 offsets: torch.Tensor, visible: torch.Tensor | None, key_len: int
                 ) -> torch.Tensor:
        """Same contract as ``LlamaRuntime.layer_loop`` (1-D ``slots``)."""
        b, q, _ = hidden.shape
        bb = next(n for n in self.batches if n >= b)
        qb = next(n for n in self.queries if n >= q)
        g = self.graphs[(bb, qb)]
        dev = hidden.device
        write = offsets if offsets.dim() == 2 else \
            offsets[:, None] + torch.arange(q, device=dev)[None, :]
        if visible is None:  # each query sees the keys up to its own position
            keys = torch.arange(key_len, device=dev)
            visible = keys[None, None, :] <= write[:, :, None]
        # Reset the padding, then write the real rows and queries.
        g.slots.fill_(self.runtime.scratch_slot)
        g.write.copy_(torch.arange(qb, device=dev)[None, :].expand(bb, qb))
        g.visible.zero_()
        g.visible[..., 0] = True
        g.hidden[:b, :q].copy_(hidden)
        g.positions[:b, :q].copy_(positions)
        g.slots[:b, :q] = slots[:, None]
        g.write[:b, :q].copy_(write)
        g.visible[:b, :q].zero_()
        g.visible[:b, :q, : visible.shape[-1]].copy_(visible)
        g.replay()
        return g.out[:b, :q]
