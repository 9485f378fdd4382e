"""Automatic prefix caching: which token prefixes the verifier's KV slots hold.

Each slot's cached tokens (a live sequence's prompt and accepted tokens, or a finished
sequence's, kept until its slot is needed) are cut into blocks of ``block_size`` tokens and
hashed in a chain (``specinfer.prefixes``), seeded by everything that makes the same
tokens' KV differ: the model, its number format and quantization, and the request's
``cache_salt`` (tenants that salt differently never share).
A new sequence's prompt is hashed the same way; its longest run of leading blocks that a
slot holds is the prefix whose KV it reuses (the engine copies it into the new sequence's
slot, or takes a finished sequence's slot as it is). The slot's tokens are compared too, so
a hash collision costs a miss, never wrong KV. Draft-tree tokens never enter: a slot is
indexed by the tokens its sequence accepted, as it accepts them.

Only whole blocks are reused, and never a prompt's last token (its logits pick the first
generated token): a prompt shorter than a block plus one token misses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specinfer.prefixes import block_hashes, iter_block_hashes


@dataclass
class _Held:
    salt: str
    tokens: Sequence[int]  # the slot's tokens (a live list that grows, or a finished one's)
    hashes: list[bytes] = field(default_factory=list)  # of its first len(hashes) blocks


class PrefixIndex:
    """Block hashes of every slot's cached tokens, and the slots holding each block."""

    def __init__(self, block_size: int, seed: str) -> None:
        if block_size < 1:
            raise ValueError("the prefix cache's block size must be at least 1")
        self.block_size = block_size
        self.seed = seed
        self.by_hash: dict[bytes, set[int]] = {}
        self.held: dict[int, _Held] = {}

    def hashes(self, tokens: Sequence[int], salt: str, blocks: int,
               first: Sequence[bytes] = ()) -> list[bytes]:
        """The chained hashes of the first ``blocks`` blocks of ``tokens`` (``first``: those
        of its leading blocks, known already)."""
        return block_hashes(tokens, self.block_size, self.seed, salt, blocks, first)

    def index(self, slot: int, tokens: Sequence[int], cached: int, salt: str) -> None:
        """Index ``slot`` as holding the KV of ``tokens[:cached]``: its full blocks. Called
        again as a live sequence grows (only its new blocks are hashed)."""
        held = self.held.get(slot)
        if held is None or held.salt != salt or held.tokens is not tokens:
            self.drop(slot)
            held = self.held[slot] = _Held(salt, tokens)
        before = len(held.hashes)
        if cached // self.block_size == before:  # every step calls this: no new block yet
            return
        held.hashes = self.hashes(tokens, salt, cached // self.block_size, held.hashes)
        for h in held.hashes[before:]:
            self.by_hash.setdefault(h, set()).add(slot)

    def keep(self, slot: int, tokens: Sequence[int]) -> None:
        """The slot's sequence ended; ``tokens`` (its cached ones) stay indexed as they
        were, without hashing them again."""
        held = self.held.get(slot)
        if held is not None:
            held.tokens = tokens

    def drop(self, slot: int) -> None:
        """The slot's KV is about to change: it holds nothing reusable."""
        held = self.held.pop(slot, None)
        if held is None:
            return
        for h in held.hashes:
            slots = self.by_hash.get(h)
            if slots is not None:
                slots.discard(slot)
                if not slots:
                    del self.by_hash[h]

    def lookup(self, prompt: Sequence[int], salt: str) -> tuple[int, int | None]:
        """The longest cached prefix of ``prompt`` (whole blocks, never its last token):
        (its length in tokens, a slot holding it), or (0, None)."""
        matched, slots = 0, set()
        for b, h in enumerate(iter_block_hashes(prompt[:-1], self.block_size, self.seed,
                                                salt)):
            holding = self.by_hash.get(h)
            if not holding:  # hashing stops at the first miss
                break
            matched, slots = b + 1, holding
        length = matched * self.block_size
        for slot in sorted(slots):  # the tokens themselves, so a collision is a miss
            if list(self.held[slot].tokens[:length]) == list(prompt[:length]):
                return length, slot
        return 0, None
