"""Chained block hashes of token prefixes, as prefix caching indexes them.

A token sequence is cut into blocks of ``block_size`` tokens; block i's hash is SHA-256 of
block i-1's hash and block i's tokens, and block 0's chains from a root of ``seed`` and a
salt. Two sequences share block i's hash exactly when (up to a SHA-256 collision) they share
their first i + 1 blocks and seed and salt. The verifier indexes the KV its slots hold this
way (seeded by its model and number format); the router hashes prompts the same way to know
which verifier holds which prefix.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence


def root_hash(seed: str, salt: str) -> bytes:
    return hashlib.sha256(f"{seed}\0{salt}".encode()).digest()


def next_hash(prev: bytes, block: Sequence[int]) -> bytes:
    """A block's hash after the previous block's (or the root's) ``prev``."""
    return hashlib.sha256(prev + struct.pack(f"<{len(block)}i", *block)).digest()


def iter_block_hashes(tokens: Sequence[int], block_size: int, seed: str, salt: str,
                      blocks: int | None = None, first: Sequence[bytes] = ()
                      ) -> Iterator[bytes]:
    """The hashes of ``tokens``' whole blocks (at most ``blocks``), lazily: a caller that
    stops at the first one it does not know hashes no further. ``first``: the hashes of the
    leading blocks, known already (yielded as they are)."""
    whole = len(tokens) // block_size if blocks is None else min(blocks,
                                                                 len(tokens) // block_size)
    prev = root_hash(seed, salt)
    for b in range(whole):
        prev = first[b] if b < len(first) else next_hash(
            prev, tokens[b * block_size : (b + 1) * block_size])
        yield prev


def block_hashes(tokens: Sequence[int], block_size: int, seed: str, salt: str,
                 blocks: int | None = None, first: Sequence[bytes] = ()) -> list[bytes]:
    return list(iter_block_hashes(tokens, block_size, seed, salt, blocks, first))
