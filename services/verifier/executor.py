"""Executors run the LLM's forward pass for the engine: in this process, or across
tensor-/pipeline-parallel rank processes (``services.verifier.parallel``).

The engine only ever asks for three things — a forward over some queries, a KV
compaction and a KV prefix copy — so a parallel executor replays exactly these calls on
every rank. ``Executor``
is all the engine and the server read of one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specinfer.runtime import LlamaRuntime, packed_queries


@dataclass
class ForwardArgs:
    tokens: torch.Tensor  # [B, Q] int64
    positions: torch.Tensor  # [B, Q] int64
    slots: torch.Tensor  # [B] int64
    offsets: torch.Tensor  # [B] int64: cache position of query 0
    visible: torch.Tensor | None  # [B, Q, K] bool
    last_only: bool = False  # logits of the last query only (prefill)
    # Keep every query's normed last hidden state as ``executor.features`` (the draft head's
    # input); the local executor only (a parallel one refuses).
    features: bool = False
    # [B] int64: each row's real queries (the rest of it padding), so the local CPU executor
    # runs the linears on those only (``runtime.packed_queries``); None: every query is real.
    # Padding's logits (and features) come back as zeros.
    lengths: torch.Tensor | None = None

    @property
    def key_len(self) -> int:
        """Keys the queries attend over (read on the host: the step never syncs for it)."""
        if self.visible is not None:
            return self.visible.shape[-1]
        return int(self.offsets.max()) + self.tokens.shape[1]


@runtime_checkable
class Executor(Protocol):
    """The LLM's forward pass as the engine drives it, wherever the model runs."""

    vocab_size: int
    dtype: str  # the weights' format, as Info reports it (``Placement.weight_format``)
    device: torch.device  # where ``forward`` returns its logits
    tp: int  # tensor-parallel degree
    pp: int  # pipeline-parallel degree
    # Every query's normed last hidden state ``[B, Q, H]`` of the last forward that asked
    # for them (``ForwardArgs.features``), else None.
    features: torch.Tensor | None

    @property
    def healthy(self) -> bool:
        """False once the executor can serve no more calls (a parallel one lost a rank, or
        was closed): the verifier then reports NOT_SERVING."""
        ...

    def forward(self, args: ForwardArgs) -> torch.Tensor:
        """Float32 logits ``[B, Q or 1, V]`` on ``device``."""
        ...

    def compact(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Move a slot's K/V from cache positions ``src`` to ``dst`` (``KVCache.compact``)."""
        ...

    def copy(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy a slot's first ``length`` positions' K/V into another (``KVCache.copy``)."""
        ...

    def close(self) -> None:
        ...


def unpack(rows: torch.Tensor, packed: torch.Tensor | None, b: int, q: int) -> torch.Tensor:
    """``rows [N, D]`` of the real queries laid out as ``[B, Q, D]``, zero at padding
    (``packed`` None: ``rows`` are all ``B * Q`` queries already)."""
    if packed is None:
        return rows.view(b, q, -1)
    out = rows.new_zeros(b * q, rows.shape[-1]).index_copy_(0, packed, rows)
    return out.view(b, q, -1)


class LocalExecutor:
    """The whole model in this process."""

    def __init__(self, runtime: LlamaRuntime) -> None:
        self.runtime = runtime
        self.vocab_size = runtime.vocab_size
        self.dtype = runtime.placement.weight_format
        self.device = runtime.device
        self.tp = 1
        self.pp = 1
        self.features: torch.Tensor | None = None  # [B, Q, H], of the last forward asking
        # A prefill chunk rides in a step's forward (forward_with_chunk) on the CPU; a GPU
        # runs steps through graphs of fixed shapes, and pads cheaply anyway.
        self.rides_prefill = runtime.packs
        self.chunk_features: torch.Tensor | None = None  # [1, C, H]: the chunk's, if asked

    @property
    def healthy(self) -> bool:
        return True  # nothing to lose: no other process holds a part of the model

    def forward(self, args: ForwardArgs) -> torch.Tensor:
        """Float32 logits ``[B, Q or 1, V]`` on the runtime's device."""
        rt = self.runtime
        b, q = args.tokens.shape
        packed = None
        if args.lengths is not None and not args.last_only and rt.packs:
            packed = packed_queries(args.lengths, q)
        hidden = rt.layers_forward(rt.embed(rt.to_device(args.tokens)), args.positions,
                                   args.slots, args.offsets, args.visible, args.key_len,
                                   packed)
        if packed is not None:  # [N, H]: the real queries'; padding's rows come back zero
            return self._outputs(rt.final_norm(hidden), packed, b, q, args.features)
        if args.last_only and not args.features:
            hidden = hidden[:, -1:]
        normed = rt.final_norm(hidden)
        self.features = normed if args.features else None
        if args.last_only:
            normed = normed[:, -1:]
        return rt.head(normed)

    def forward_with_chunk(self, args: ForwardArgs, chunk: ForwardArgs
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward(args)`` and a prefill chunk's forward (one causal row, ``last_only``)
        in one pass over the weights: the linears run over both batches' real queries at
        once, attention per batch. Returns ``args``' logits as ``forward`` does and the
        chunk's last query's ``[1, 1, V]``; features as asked (``features``,
        ``chunk_features``)."""
        rt = self.runtime
        b, q = args.tokens.shape
        packed = packed_queries(args.lengths, q) if args.lengths is not None else None
        main, ride = rt.segments_forward([
            (rt.embed(rt.to_device(args.tokens)), args.positions, args.slots, args.offsets,
             args.visible, args.key_len, packed),
            (rt.embed(rt.to_device(chunk.tokens)), chunk.positions, chunk.slots,
             chunk.offsets, chunk.visible, chunk.key_len, None)])
        chunk_normed = rt.final_norm(ride)
        self.chunk_features = chunk_normed[None] if chunk.features else None
        return (self._outputs(rt.final_norm(main), packed, b, q, args.features),
                rt.head(chunk_normed[-1:])[None])

    def _outputs(self, normed: torch.Tensor, packed: torch.Tensor | None, b: int, q: int,
                 features: bool) -> torch.Tensor:
        """Logits ``[B, Q, V]`` from the real queries' normed states ``[N, H]`` (features
        kept as ``[B, Q, H]`` if asked)."""
        self.features = unpack(normed, packed, b, q) if features else None
        return unpack(self.runtime.head(normed), packed, b, q)

    def compact(self, slot: int, src: list[int], dst: list[int]) -> None:
        self.runtime.cache.compact(slot, src, dst)

    def copy(self, src_slot: int, dst_slot: int, length: int) -> None:
        self.runtime.cache.copy(src_slot, dst_slot, length)

    def close(self) -> None:
        """Nothing to stop: no other process holds part of the model, and its memory goes
        with this object."""
