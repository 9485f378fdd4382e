"""Corpus drafts (retrieval, after REST): what usually follows the last few tokens in a
large body of assistant text, with no model to run.

For every n from ``max_n`` down to 1 the datastore keeps, for each n-token context seen at
least ``min_count`` times in the corpus, its most frequent next token. Drafting walks a
chain: look up the longest context that is known, append its next token, repeat. Lookups
are binary searches over sorted 64-bit context hashes (a hash collision only makes a draft
wrong, never an output: verification is exact), so a draft costs microseconds.

The default corpus is the assistant turns of the ShareGPT conversations the boost-tune
pipeline trains on (MT-Bench questions removed), tokenized with the LLM's tokenizer; it is
built once per tokenizer (about a minute on 2 cores) and cached.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from specinfer.tree import ROOT, Draft, TokenTree

_MULT = 0x9E3779B97F4A7C15  # 64-bit golden-ratio multiplier
_MASK = (1 << 64) - 1


def _mix(h: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """One hashing step for many contexts at once (the build)."""
    with np.errstate(over="ignore"):
        return (h ^ (tokens.astype(np.uint64) + np.uint64(1))) * np.uint64(_MULT)


def context_hash(tokens: Sequence[int]) -> int:
    """The same hash for one context (a lookup): plain integers, wrapping at 64 bits."""
    h = 0
    for t in tokens:
        h = ((h ^ (t + 1)) * _MULT) & _MASK
    return h


class NgramDatastore:
    def __init__(self, tables: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
        """``tables[n] = (sorted context hashes uint64, next token int32)``."""
        self.tables = dict(sorted(tables.items(), reverse=True))  # longest context first
        self.max_n = max(self.tables, default=0)

    def __len__(self) -> int:
        return sum(len(keys) for keys, _ in self.tables.values())

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], max_n: int = 4,
              min_count: int = 2) -> NgramDatastore:
        seqs = [np.asarray(s, dtype=np.int64) for s in sequences if len(s) > 1]
        tables = {}
        for n in range(1, max_n + 1):
            keys, nexts = [], []
            for s in seqs:
                if len(s) <= n:
                    continue
                h = np.zeros(len(s) - n, dtype=np.uint64)
                for j in range(n):  # hash of s[i : i + n] for every i
                    h = _mix(h, s[j : len(s) - n + j])
                keys.append(h)
                nexts.append(s[n:])
            if keys:
                tables[n] = _most_frequent(np.concatenate(keys), np.concatenate(nexts),
                                           min_count)
        return cls(tables)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.npz")
        np.savez(tmp, **{f"keys{n}": k for n, (k, _) in self.tables.items()},
                 **{f"next{n}": v for n, (_, v) in self.tables.items()})
        tmp.replace(path)  # atomic: a reader never sees half a file

    @classmethod
    def load(cls, path: Path) -> NgramDatastore:
        with np.load(path) as z:
            orders = [int(name[4:]) for name in z.files if name.startswith("keys")]
            return cls({n: (z[f"keys{n}"], z[f"next{n}"]) for n in orders})

    def next_token(self, context: Sequence[int]) -> int | None:
        for n, (keys, nexts) in self.tables.items():
            if len(context) < n:
                continue
            h = np.uint64(context_hash(context[-n:]))
            i = int(np.searchsorted(keys, h))
            if i < len(keys) and keys[i] == h:
                return int(nexts[i])
        return None

    def draft(self, context: Sequence[int], depth: int) -> list[int]:
        ctx, out = list(context[-self.max_n:]), []
        for _ in range(depth):
            tok = self.next_token(ctx)
            if tok is None:
                break
            out.append(tok)
            ctx = (ctx + [tok])[-self.max_n:]
        return out

    def tree(self, context: Sequence[int], depth: int, source: int,
             vocab_size: int | None = None) -> TokenTree:
        """The draft as a chain; each node records a one-hot proposal (deterministic
        drafts are valid for greedy and stochastic verification alike). Tokens outside
        ``vocab_size`` (a datastore built for a larger tokenizer) end the chain."""
        tree, node = TokenTree(), ROOT
        for tok in self.draft(context, depth):
            if vocab_size is not None and tok >= vocab_size:
                break
            node = tree.add(node, tok, [Draft.one_hot(source, 0, tok)])
        return tree


def _most_frequent(keys: np.ndarray, nexts: np.ndarray,
                   min_count: int) -> tuple[np.ndarray, np.ndarray]:
    """Per distinct key, its most frequent next token (ties: the smallest id), keeping keys
    whose winner was seen at least ``min_count`` times."""
    order = np.lexsort((nexts, keys))
    keys, nexts = keys[order], nexts[order]
    starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (nexts[1:] != nexts[:-1])])
    counts = np.diff(np.r_[starts, len(keys)])
    pair_keys, pair_next = keys[starts], nexts[starts]
    # Within each key, the pair with the highest count first.
    best = np.lexsort((pair_next, -counts, pair_keys))
    pair_keys, pair_next, counts = pair_keys[best], pair_next[best], counts[best]
    first = np.r_[True, pair_keys[1:] != pair_keys[:-1]]
    keep = first & (counts >= min_count)
    return pair_keys[keep], pair_next[keep].astype(np.int32)


def sharegpt_datastore(tokenizer, max_tokens: int = 10_000_000, max_n: int = 4,
                       min_count: int = 2, cache_dir: Path | None = None) -> NgramDatastore:
    """The default corpus datastore for ``tokenizer``, built on first use and cached."""
    from specinfer.models import cache_root

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    ident = hashlib.sha256(repr((vocab, max_tokens, max_n, min_count)).encode()).hexdigest()
    path = (cache_dir or cache_root() / "datastore") / f"sharegpt-{ident[:16]}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Verifiers and speculators starting together build it once: the others wait.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return NgramDatastore.load(path)
        return _build_sharegpt(tokenizer, path, max_tokens, max_n, min_count)


def _build_sharegpt(tokenizer, path: Path, max_tokens: int, max_n: int,
                    min_count: int) -> NgramDatastore:
    from specinfer.data import select_conversations

    train, _ = select_conversations(prompts=10**9, heldout=0)
    texts = [t["value"] for conv in train for t in conv if t.get("from") == "gpt"]
    sequences, total = [], 0
    for start in range(0, len(texts), 1000):
        for ids in tokenizer(texts[start : start + 1000])["input_ids"]:
            sequences.append(ids)
            total += len(ids)
        if total >= max_tokens:
            break
    store = NgramDatastore.build(sequences, max_n=max_n, min_count=min_count)
    store.save(path)
    return store
