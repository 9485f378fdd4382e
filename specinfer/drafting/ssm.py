"""A small speculative model (SSM) that drafts token trees, batched over sequences.

The SSM runs on the same tree-attention runtime as the LLM, with a KV slot per sequence:
each call feeds only the context tokens the slot does not hold yet (the common prefix with
what it cached is reused; a miss or a stale entry costs more tokens, never a different
tree), then grows each sequence's tree level by level, one batched forward per level, every
node written at cache position (root + 1 + node index) and attending to the context and
its own ancestors.

Trees are static (the paper's expansion configs, e.g. ⟨1,1,3,1,1,1,1,1⟩) or dynamic
(EAGLE-2 style, greedy only: expand the ``beam`` nodes with the highest path probability at
each level, then keep the ``max_nodes`` most probable nodes).

An SSM may carry a reduced vocabulary (``vocab_ids``): its head scores only those LLM token
ids, so its drafts' proposals have exactly that support.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from specinfer.drafting import DraftRequest
from specinfer.errors import check_token_ids
from specinfer.grammar import token_bits
from specinfer.placement import Placement
from specinfer.runtime import LlamaRuntime
from specinfer.sampling import SamplingParams, target_probs
from specinfer.tree import ROOT, TokenTree, TreeBatch, expand_level

# A constrained node's children come from the drafter's likeliest tokens the grammar allows
# among this many (SSMDrafter._masked).
GRAMMAR_CANDIDATES = 64


class SSMDrafter:
    @classmethod
    def load(cls, ref: str, source: int = 0, *, dtype: str = "fp16",
             llm_vocab_size: int | None = None, placement: Placement | None = None,
             **kwargs) -> SSMDrafter:
        """An SSM from any reference ``load_ssm`` accepts. In the default placement (CPU,
        float32) its linears are fbgemm's in ``dtype`` (see ``models.quantize_linears``);
        any other placement runs them in its own format."""
        from specinfer.models import load_ssm, quantize_linears

        model, vocab_ids = load_ssm(ref)
        if placement is None or placement == Placement():
            quantize_linears(model, dtype)
        return cls(model, source, vocab_ids=vocab_ids, llm_vocab_size=llm_vocab_size,
                   placement=placement, **kwargs)

    def __init__(self, model, source: int = 0, slots: int = 16, max_context: int = 2048,
                 max_tree_nodes: int = 64, draft_top_k: int = 32, chunk: int = 256,
                 vocab_ids: torch.Tensor | None = None, llm_vocab_size: int | None = None,
                 dynamic_beam: int = 4, dynamic_top_k: int = 4, dynamic_depth: int = 6,
                 placement: Placement | None = None) -> None:
        self.source = source
        self.max_context = max_context
        self.max_tree_nodes = max_tree_nodes
        self.draft_top_k = draft_top_k
        self.chunk = chunk
        self.runtime = self._runtime(model, slots, max_context + max_tree_nodes + 1,
                                     placement or Placement())
        self.runtime.capture_graphs(max_tree_nodes + 1)
        self.slots = slots
        self.vocab_ids = vocab_ids
        self.vocab_size = llm_vocab_size or self.runtime.vocab_size
        self.column_of: torch.Tensor | None = None  # LLM token id -> head column
        if vocab_ids is not None:
            self.column_of = torch.full((self.vocab_size,), -1, dtype=torch.long)
            self.column_of[vocab_ids] = torch.arange(len(vocab_ids))
        self.dynamic_beam, self.dynamic_top_k = dynamic_beam, dynamic_top_k
        self.dynamic_depth = dynamic_depth
        # sequence id -> (slot, tokens whose K/V the slot holds); LRU order.
        self.entries: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()

    @staticmethod
    def _runtime(model, slots: int, slot_len: int, placement: Placement) -> LlamaRuntime:
        return LlamaRuntime.from_model(model, slots, slot_len, placement=placement)

    # --- cache ------------------------------------------------------------------------

    def _slot(self, sequence_id: str) -> tuple[int, list[int]]:
        if sequence_id in self.entries:
            self.entries.move_to_end(sequence_id)
            return self.entries[sequence_id]
        used = {slot for slot, _ in self.entries.values()}
        free = [s for s in range(self.slots) if s not in used]
        slot = free[0] if free else self.entries.popitem(last=False)[1][0]
        self.entries[sequence_id] = (slot, [])
        return slot, []

    def forget(self, sequence_id: str) -> None:
        self.entries.pop(sequence_id, None)

    def _inputs(self, tokens: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """The first layer's input for ``tokens [B, Q]``: their embeddings. A feature
        drafter also reads each query's feature ``[B, Q, H]``."""
        return self.runtime.embed(self.runtime.to_device(tokens))

    def _forward(self, tokens, positions, slots, offsets, visible,
                 rows: torch.Tensor | None = None, features: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head logits (columns: ``vocab_ids`` when the SSM has a reduced vocabulary) and
        the normed hidden states (the head's input) of every query, or with ``rows`` ([B]
        query index) of one query per row: the vocabulary head dominates a small model's
        cost."""
        rt = self.runtime
        hidden = rt.layers_forward(self._inputs(tokens, features), positions, slots, offsets,
                                   visible)
        if rows is not None:
            rows = rt.to_device(rows)
            hidden = hidden[torch.arange(hidden.shape[0], device=rows.device), rows][:, None]
        normed = rt.final_norm(hidden)
        return rt.head(normed), normed

    def _column(self, token: int) -> int:
        return token if self.column_of is None else int(self.column_of[token])

    def _catch_up(self, slots: list[int], feeds: list[list[int]], starts: list[int],
                  features: list[torch.Tensor] | None = None):
        """Feed each row's missing tokens (chunked; with ``features``, each token's feature
        row); the logits and normed hidden state after each row's last token."""
        last: list[torch.Tensor | None] = [None] * len(feeds)
        last_normed: list[torch.Tensor | None] = [None] * len(feeds)
        pos = [0] * len(feeds)
        while True:
            rows = [b for b in range(len(feeds)) if pos[b] < len(feeds[b])]
            if not rows:
                break
            chunks = [feeds[b][pos[b] : pos[b] + self.chunk] for b in rows]
            prefix = [starts[b] + pos[b] for b in rows]
            batch = TreeBatch.build([TokenTree.chain(c[1:]) for c in chunks],
                                    [c[0] for c in chunks], prefix)
            key_len = max(prefix) + batch.tokens.shape[1]
            feats = None
            if features is not None:
                feats = torch.zeros(*batch.tokens.shape, features[0].shape[-1],
                                    dtype=features[0].dtype, device=features[0].device)
                for i, b in enumerate(rows):
                    feats[i, : len(chunks[i])] = features[b][pos[b] : pos[b] + len(chunks[i])]
            logits, normed = self._forward(batch.tokens, batch.position_ids,
                                           torch.tensor([slots[b] for b in rows]),
                                           batch.prefix_lens, batch.visibility(key_len),
                                           rows=torch.tensor([len(c) - 1 for c in chunks]),
                                           features=feats)
            for i, b in enumerate(rows):
                last[b], last_normed[b] = logits[i, 0], normed[i, 0]
                pos[b] += len(chunks[i])
        return torch.stack(last), torch.stack(last_normed)

    # --- drafting ---------------------------------------------------------------------

    def _masked(self, logits: torch.Tensor, tree: TokenTree, frontier: list[int],
                req: DraftRequest) -> tuple[torch.Tensor, list[int]]:
        """The frontier rows' logits restricted to what the request's grammar allows after
        each node: its ``GRAMMAR_CANDIDATES`` likeliest tokens that the grammar allows (all
        of them where it allows none of those), the rest at -inf; without the rows where it
        allows none of this drafter's tokens; and the frontier nodes kept. Any proposal
        keeps MSS exact as long as it is the one sampled from and recorded; the candidates'
        bits are read from the mask, not a whole vocabulary's."""
        words = torch.stack([req.allowed(tree.path_tokens(u) if u != ROOT else [])
                             for u in frontier])
        logits = logits.float()
        columns = torch.topk(logits, min(GRAMMAR_CANDIDATES, logits.shape[-1]), dim=-1).indices
        ok = token_bits(words, self._token_ids(columns.cpu())).to(logits.device)
        masked = torch.full_like(logits, float("-inf")).scatter_(
            1, columns, logits.gather(1, columns).masked_fill(~ok, float("-inf")))
        for row in (~ok.any(-1)).nonzero().flatten().tolist():  # rare: every column
            every = torch.arange(logits.shape[-1])
            allowed = token_bits(words[row], self._token_ids(every)).to(logits.device)
            masked[row] = logits[row].masked_fill(~allowed, float("-inf"))
        keep = torch.isfinite(masked).any(-1).nonzero().flatten()
        return masked[keep], [frontier[i] for i in keep.tolist()]

    def _token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """The LLM token ids of head columns (a reduced vocabulary maps them)."""
        return columns if self.vocab_ids is None else self.vocab_ids[columns]

    def _draft_probs(self, logits: torch.Tensor, req: DraftRequest) -> torch.Tensor:
        if req.params.greedy:
            return logits.float().softmax(-1)
        k = min(req.params.top_k or self.draft_top_k, self.draft_top_k)
        params = SamplingParams(req.params.temperature, k, req.params.top_p, req.params.min_p)
        return target_probs(logits, params)

    def validate(self, requests: list[DraftRequest]) -> None:
        for i, req in enumerate(requests):
            if not req.context:
                raise ValueError(f"items[{i}].context is empty")
            check_token_ids(f"items[{i}].context", req.context, self.vocab_size)
            if len(req.context) > self.max_context:
                raise ValueError(f"items[{i}].context is longer than max_context "
                                 f"{self.max_context}")

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[TokenTree]:
        self.validate(requests)
        slots, feeds, starts = [], [], []
        for req in requests:
            slot, cached = self._slot(req.sequence_id)
            limit = min(len(cached), len(req.context) - 1)  # always re-feed the root
            common = limit if req.context[:limit] == cached[:limit] else 0  # the usual case
            while common < limit and cached[common] == req.context[common]:
                common += 1
            slots.append(slot)
            feeds.append(req.context[common:])
            starts.append(common)
        features = None
        if requests[0].features is not None:  # a feature drafter's requests all carry them
            features = [r.features[s:] for r, s in zip(requests, starts, strict=True)]
        root_logits, root_normed = self._catch_up(slots, feeds, starts, features)
        for req, slot in zip(requests, slots, strict=True):
            self.entries[req.sequence_id] = (slot, list(req.context))

        n = len(requests)
        dynamic = [r.dynamic and r.params.greedy for r in requests]
        budget = [min(r.max_nodes or self.max_tree_nodes, self.max_tree_nodes)
                  for r in requests]
        depth_of = [self.dynamic_depth if dyn else len(r.expansion)
                    for r, dyn in zip(requests, dynamic, strict=True)]
        trees = [TokenTree() for _ in requests]
        scores: list[list[float]] = [[] for _ in requests]  # path log-prob per node
        expand: list[list[int]] = [[ROOT] for _ in requests]  # nodes to expand next
        logits_of: list[dict[int, torch.Tensor]] = [{ROOT: root_logits[b]} for b in range(n)]
        # Feature drafters only: each node's normed hidden state, its children's feature.
        normed_of = None if features is None else [{ROOT: root_normed[b]} for b in range(n)]
        for level in range(max(depth_of, default=0)):
            new_nodes: list[list[int]] = [[] for _ in requests]
            for b, req in enumerate(requests):
                if level >= depth_of[b] or not expand[b]:
                    continue
                width = self.dynamic_top_k if dynamic[b] else req.expansion[level]
                # Dynamic trees draw up to 4x the budget in candidates, then prune.
                room = (4 if dynamic[b] else 1) * budget[b] - len(trees[b])
                width = min(width, room)
                if width <= 0:
                    continue
                frontier = expand[b][: max(1, room // width)]
                logits = torch.stack([logits_of[b][u] for u in frontier])
                if req.allowed is not None:  # drafted from what the grammar allows
                    logits, frontier = self._masked(logits, trees[b], frontier, req)
                    if not frontier:
                        continue
                probs = self._draft_probs(logits, req).cpu()  # drafts are sampled on the host
                before = len(trees[b])
                expand_level(trees[b], frontier, probs, width, source=self.source,
                             sample=not req.params.greedy, replacement=True,
                             generator=req.generator, token_ids=self.vocab_ids)
                row = {u: i for i, u in enumerate(frontier)}
                for node in range(before, len(trees[b])):
                    parent = trees[b].parents[node]
                    p = float(probs[row[parent], self._column(trees[b].tokens[node])])
                    base = scores[b][parent] if parent != ROOT else 0.0
                    scores[b].append(base + math.log(max(p, 1e-30)))
                new_nodes[b] = list(range(before, len(trees[b])))
            # Choose what the next level expands, then score those nodes' children.
            for b in range(n):
                if dynamic[b]:
                    ranked = sorted(new_nodes[b], key=lambda u, b=b: -scores[b][u])
                    expand[b] = ranked[: self.dynamic_beam]
                else:
                    expand[b] = new_nodes[b]
                if level + 1 >= depth_of[b]:
                    expand[b] = []
            if any(expand):
                outs = self._expand_forward(requests, slots, trees, expand, normed_of)
                for b, (rows, normed) in enumerate(outs):
                    logits_of[b] = dict(zip(expand[b], rows, strict=True))
                    if normed_of is not None:
                        normed_of[b] = dict(zip(expand[b], normed, strict=True))
        return [self._prune(t, s, budget[b]) if dynamic[b] else t
                for b, (t, s) in enumerate(zip(trees, scores, strict=True))]

    @staticmethod
    def _prune(tree: TokenTree, scores: list[float], budget: int) -> TokenTree:
        """Keep the ``budget`` most probable nodes. A child's path probability never
        exceeds its parent's, so (ties broken by depth) the kept set holds its ancestors."""
        if len(tree) <= budget:
            return tree
        keep = sorted(range(len(tree)), key=lambda u: (-scores[u], tree.depths[u], u))[:budget]
        kept, remap = TokenTree(), {ROOT: ROOT}
        for u in sorted(keep):
            remap[u] = kept.add(remap[tree.parents[u]], tree.tokens[u], tree.drafts[u])
        return kept

    def _expand_forward(self, requests, slots, trees, expand, normed_of=None
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Logits and normed hidden states after each node in ``expand`` (per row): one
        forward, each node written at (root position + 1 + node index) and seeing the
        context and its ancestors; with ``normed_of`` (feature drafters) a node's feature
        is its parent's normed hidden state."""
        rows = [b for b in range(len(requests)) if expand[b]]
        q = max(len(expand[b]) for b in rows)
        base = [len(requests[b].context) - 1 for b in rows]  # the root's cache position
        key_len = max(base[i] + 2 + max(expand[b]) for i, b in enumerate(rows))
        key_len = max(key_len, max(base) + 1 + q)
        tokens = torch.zeros(len(rows), q, dtype=torch.long)
        positions = torch.zeros(len(rows), q, dtype=torch.long)
        write = torch.zeros(len(rows), q, dtype=torch.long)
        visible = torch.zeros(len(rows), q, key_len, dtype=torch.bool)
        feats = None
        if normed_of is not None:
            feats = torch.zeros(len(rows), q, self.runtime.config.hidden_size,
                                dtype=self.runtime.dtype, device=self.runtime.device)
        for i, b in enumerate(rows):
            tree, nodes = trees[b], expand[b]
            anc = tree.ancestors()
            visible[i, :, : base[i] + 1] = True  # context and root
            for j, u in enumerate(nodes):
                if feats is not None:
                    feats[i, j] = normed_of[b][tree.parents[u]]
                tokens[i, j] = tree.tokens[u]
                positions[i, j] = base[i] + tree.depths[u]
                write[i, j] = base[i] + 1 + u
                visible[i, j, base[i] + 1 + torch.nonzero(anc[u]).squeeze(1)] = True
            # Padding queries rewrite the last real node's K/V with identical values.
            for j in range(len(nodes), q):
                last = len(nodes) - 1
                tokens[i, j], positions[i, j] = tokens[i, last], positions[i, last]
                write[i, j], visible[i, j] = write[i, last], visible[i, last]
                if feats is not None:
                    feats[i, j] = feats[i, last]
        logits, normed = self._forward(tokens, positions, torch.tensor([slots[b] for b in rows]),
                                       write, visible, features=feats)
        empty = torch.empty(0)
        out = [(empty, empty)] * len(requests)
        for i, b in enumerate(rows):
            out[b] = (logits[i, : len(expand[b])], normed[i, : len(expand[b])])
        return out
