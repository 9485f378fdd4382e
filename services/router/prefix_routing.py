"""Which verifier a new sequence goes to: where its prompt's prefix is cached, weighed
against load.

Each verifier keeps finished sequences' KV and reuses it for prompts that share a prefix
(automatic prefix caching, in whole blocks of its ``Info.prefix_block_size`` tokens). The
router keeps, per replica, the block hashes (``specinfer.prefixes``) of the histories it
sent there: an approximate index, bounded by what the replica's KV can hold, least recently
used first out. A stale entry (the verifier evicted the prefix, or restarted) costs a miss,
never a wrong answer: the verifier checks its own index.

A new sequence goes to the replica holding the longest prefix of its prompt, unless that
replica's load (live sequences over capacity) exceeds the least loaded one's by more than
the margin (``--prefix-load-margin``); then, and with no prefix held anywhere, to the least
loaded one (ties broken by hashing the request's id, so equal replicas share the work).
A sequence of a session goes where its session's KV is (consistent hashing), as before.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from specinfer.prefixes import block_hashes, iter_block_hashes

SEED = "router"  # the router's own hashes: they never meet the verifiers'


class ReplicaPrefixes:
    """The block hashes the router believes one replica holds."""

    def __init__(self, block_size: int = 0, capacity_blocks: int = 0) -> None:
        self.block_size = block_size  # 0: the replica caches no prefixes
        self.capacity_blocks = capacity_blocks
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def matched(self, tokens: Sequence[int], salt: str) -> int:
        """Leading whole blocks of ``tokens`` (all but the last token) held, in tokens."""
        if not self.block_size:
            return 0
        n = 0
        for h in iter_block_hashes(tokens[:-1], self.block_size, SEED, salt):
            if h not in self.blocks:
                break
            n += 1
        return n * self.block_size

    def learn(self, tokens: Sequence[int], salt: str) -> None:
        """The replica holds (or is about to hold) the KV of ``tokens``' whole blocks."""
        if not self.block_size:
            return
        for h in block_hashes(tokens, self.block_size, SEED, salt):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        """The replica restarted (or rejoined): it holds nothing."""
        self.blocks.clear()


def choose(candidates: list, tokens: Sequence[int], salt: str, key: str,
           margin: float | None) -> tuple[object, str, int]:
    """The replica for a new sequence among ``candidates`` (each with ``prefixes``,
    ``live`` and ``capacity``; all with room), why ("prefix" or "load"), and the prompt
    tokens it is believed to hold. ``margin`` None: by load alone."""
    def load(r) -> float:
        return r.live / r.capacity

    def tie(r) -> bytes:
        return hashlib.sha256(f"{key}|{r.address}".encode()).digest()

    least = min(candidates, key=lambda r: (load(r), tie(r)))
    held = {r.address: r.prefixes.matched(tokens, salt) for r in candidates}
    best = max(candidates, key=lambda r: (held[r.address], -load(r)))
    if margin is not None and held[best.address] and load(best) <= load(least) + margin:
        return best, "prefix", held[best.address]
    return least, "load", held[least.address]
