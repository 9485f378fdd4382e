"""A small speculative model (SSM) that drafts token trees, batched over sequences.

The SSM runs on the same tree-attention runtime as the LLM, with a KV slot per sequence:
each call feeds only the context tokens the slot does not hold yet (the common prefix with
what it cached is reused; a miss or a stale entry simply costs more tokens, never a
different tree), then grows each sequence's tree level by level, one batched forward per
level, every new node attending to the context and its own ancestors.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specinfer.runtime import LlamaRuntime
from specinfer.sampling import SamplingParams, target_probs
from specinfer.tree import ROOT, TokenTree, TreeBatch, expand_level


@dataclass
class DraftRequest:
    sequence_id: str
    context: list[int]  # prompt + generated; the last token is the tree's root
    expansion: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None


class SSMDrafter:
    def __init__(self, model, source: int = 0, slots: int = 16, max_context: int = 2048,
                 max_tree_nodes: int = 64, draft_top_k: int = 32, chunk: int = 256) -> None:
        self.source = source
        self.max_context = max_context
        self.max_tree_nodes = max_tree_nodes
        self.draft_top_k = draft_top_k
        self.chunk = chunk
        self.runtime = LlamaRuntime(model, slots, max_context + max_tree_nodes + 1)
        self.slots = slots
        # sequence id -> (slot, tokens whose K/V the slot holds); LRU order.
        self.entries: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()

    # --- cache ------------------------------------------------------------------------

    def _slot(self, sequence_id: str) -> tuple[int, list[int]]:
        if sequence_id in self.entries:
            self.entries.move_to_end(sequence_id)
            return self.entries[sequence_id]
        used = {slot for slot, _ in self.entries.values()}
        free = [s for s in range(self.slots) if s not in used]
        if free:
            slot = free[0]
        else:
            _, (slot, _) = self.entries.popitem(last=False)
        self.entries[sequence_id] = (slot, [])
        return slot, []

    def forget(self, sequence_id: str) -> None:
        self.entries.pop(sequence_id, None)

    def _forward(self, tokens, positions, slots, offsets, visible,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of every query, or with ``rows`` ([B] query index) of one per row: the
        vocabulary head dominates a small model's cost."""
        rt = self.runtime
        hidden = rt.layers_forward(rt.embed(tokens), positions, slots, offsets, visible)
        if rows is not None:
            hidden = hidden[torch.arange(hidden.shape[0]), rows][:, None]
        return rt.logits(hidden)

    def _catch_up(self, slots: list[int], feeds: list[list[int]], starts: list[int]):
        """Feed each row's missing tokens (chunked); returns the logits after each row's
        last token, ``[B, V]``."""
        last = [None] * len(feeds)
        pos = [0] * len(feeds)
        while True:
            rows = [b for b in range(len(feeds)) if pos[b] < len(feeds[b])]
            if not rows:
                break
            chunks = [feeds[b][pos[b] : pos[b] + self.chunk] for b in rows]
            prefix = [starts[b] + pos[b] for b in rows]
            batch = TreeBatch.build([TokenTree.chain(c[1:]) for c in chunks],
                                    [c[0] for c in chunks], prefix)
            q = batch.tokens.shape[1]
            key_len = max(prefix) + q
            logits = self._forward(batch.tokens, batch.position_ids,
                                   torch.tensor([slots[b] for b in rows]), batch.prefix_lens,
                                   batch.visibility(key_len),
                                   rows=torch.tensor([len(c) - 1 for c in chunks]))
            for i, b in enumerate(rows):
                last[b] = logits[i, 0]
                pos[b] += len(chunks[i])
        return torch.stack(last)

    # --- drafting ---------------------------------------------------------------------

    def _draft_probs(self, logits: torch.Tensor, req: DraftRequest) -> torch.Tensor:
        if req.params.greedy:
            return logits.float().softmax(-1)
        k = min(req.params.top_k or self.draft_top_k, self.draft_top_k)
        params = SamplingParams(req.params.temperature, k, req.params.top_p, req.params.min_p)
        return target_probs(logits, params)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[TokenTree]:
        for i, req in enumerate(requests):
            if not req.context:
                raise ValueError(f"items[{i}].context is empty")
            if len(req.context) + sum(1 for _ in req.expansion) > self.max_context:
                raise ValueError(f"items[{i}].context is longer than max_context "
                                 f"{self.max_context}")
        slots, feeds, starts = [], [], []
        for req in requests:
            slot, cached = self._slot(req.sequence_id)
            common = 0
            limit = min(len(cached), len(req.context) - 1)  # always re-feed the root
            while common < limit and cached[common] == req.context[common]:
                common += 1
            slots.append(slot)
            feeds.append(req.context[common:])
            starts.append(common)
        root_logits = self._catch_up(slots, feeds, starts)
        for req, slot in zip(requests, slots, strict=True):
            self.entries[req.sequence_id] = (slot, list(req.context))

        trees = [TokenTree() for _ in requests]
        frontiers: list[list[int]] = [[ROOT] for _ in requests]
        logits_rows = [root_logits[b : b + 1] for b in range(len(requests))]
        depth = max((len(r.expansion) for r in requests), default=0)
        for level in range(depth):
            for b, req in enumerate(requests):
                width = req.expansion[level] if level < len(req.expansion) else 0
                budget = self.max_tree_nodes - len(trees[b])
                if width <= 0 or not frontiers[b] or budget <= 0:
                    frontiers[b] = []
                    continue
                width = min(width, budget)
                frontier = frontiers[b][: max(1, budget // width)]
                probs = self._draft_probs(logits_rows[b][: len(frontier)], req)
                frontiers[b] = expand_level(
                    trees[b], frontier, probs, width, source=self.source,
                    sample=not req.params.greedy, replacement=True, generator=req.generator,
                )
            if level + 1 < depth and any(frontiers):
                logits_rows = self._expand_forward(requests, slots, trees, frontiers)
        return trees

    def _expand_forward(self, requests, slots, trees, frontiers) -> list[torch.Tensor]:
        """Logits after each frontier node: one forward, the nodes as queries written at
        (root position + 1 + node index), each seeing the context and its ancestors."""
        rows = [b for b in range(len(requests)) if frontiers[b]]
        q = max(len(frontiers[b]) for b in rows)
        base = [len(requests[b].context) - 1 for b in rows]  # the root's cache position
        offsets = [base[i] + 1 + frontiers[b][0] for i, b in enumerate(rows)]
        key_len = max(o + q for o in offsets)
        tokens = torch.zeros(len(rows), q, dtype=torch.long)
        positions = torch.zeros(len(rows), q, dtype=torch.long)
        visible = torch.zeros(len(rows), q, key_len, dtype=torch.bool)
        for i, b in enumerate(rows):
            tree, nodes = trees[b], frontiers[b]
            anc = tree.ancestors()
            visible[i, :, : base[i] + 1] = True  # context and root
            for j, n in enumerate(nodes):
                tokens[i, j] = tree.tokens[n]
                positions[i, j] = base[i] + tree.depths[n]
                cols = base[i] + 1 + torch.nonzero(anc[n]).squeeze(1)
                visible[i, j, cols] = True
            for j in range(len(nodes), q):  # padding sees itself only
                positions[i, j] = base[i]
                visible[i, j, offsets[i] + j] = True
        logits = self._forward(tokens, positions, torch.tensor([slots[b] for b in rows]),
                               torch.tensor(offsets), visible)
        out: list[torch.Tensor] = [torch.empty(0)] * len(requests)
        for i, b in enumerate(rows):
            out[b] = logits[i, : len(frontiers[b])]
        return out
