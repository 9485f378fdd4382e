"""A verifier's sequences (live, or kept for a session's prefix reuse) and the engine's
settings: the state ``engine`` and ``own_drafts`` share."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specinfer.sampling import SamplingParams
from specinfer.tree import TokenTree

if TYPE_CHECKING:
    from specinfer.grammar import SequenceGrammar


@dataclass
class EngineConfig:
    max_context: int = 2048  # prompt + output tokens of one sequence
    slots: int = 8  # sequences (live or kept for a session) held at once
    max_tree_nodes: int = 64
    prefill_chunk: int = 256
    # While sequences are live: a prefill's engine time between two of their steps, as a
    # multiple of the step time (0: the whole prompt at once, steps wait for it).
    prefill_step_ratio: float = 0.5
    # A live sequence no call has touched for this long is freed: its router died (a
    # router steps every sequence it holds far more often). 0 = never.
    sequence_lease_s: float = 30.0
    # The draft head's tree (the ``head`` draft source): dynamic (EAGLE-2 style: the most
    # probable paths) for greedy sequences, the static expansion for sampled ones and with
    # ``head_dynamic`` off; at most ``head_nodes`` of the item's node budget, so the
    # model-free drafts keep the rest (they accept whole repeats the head rarely drafts).
    head_expansion: tuple[int, ...] = (2, 1, 1, 1)
    head_dynamic: bool = True
    head_nodes: int = 8
    # Automatic prefix caching: finished sequences' KV kept and indexed by blocks of
    # ``block_size`` tokens, reused by new sequences sharing a prefix (prefix_cache.py).
    prefix_caching: bool = True
    block_size: int = 16


@dataclass
class SequenceState:
    id: str
    slot: int
    tokens: list[int]  # the whole sequence; all but the last are in the cache
    params: SamplingParams
    generator: torch.Generator | None
    session_id: str = ""
    prompt_length: int = 0  # tokens[:prompt_length] are the prompt, the rest generated
    created: float = field(default_factory=time.monotonic)
    touched: float = field(default_factory=time.monotonic)  # the last call on it
    # The last tree of deterministic sources drafted for it: (their names, token count it
    # was drafted for, node budget, tree). A shadow draft is the next step's tree: drafted
    # once, not twice.
    kept_draft: tuple[tuple[str, ...], int, int, TokenTree] | None = None
    # With a draft head: the LLM's normed last hidden state of every cached token.
    features: torch.Tensor | None = None
    # Structured output: the constraint's matcher, after every generated token.
    grammar: SequenceGrammar | None = None
    cache_salt: str = ""  # its prefix is shared only with sequences of the same salt

    @property
    def cached(self) -> int:
        return len(self.tokens) - 1

    @property
    def root(self) -> int:
        return self.tokens[-1]


@dataclass
class SessionEntry:
    """A finished sequence's slot, kept for its prefix."""

    slot: int
    tokens: list[int]  # tokens whose K/V the slot holds, in order
    features: torch.Tensor | None = None  # theirs, with a draft head
    salt: str = ""  # the sequence's cache salt
