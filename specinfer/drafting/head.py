"""A draft head that reads the LLM's own features (EAGLE-style): the verifier's drafter.

An SSM drafts from tokens alone. This head also reads, for each token, the LLM's normed
last hidden state (the vocabulary head's input) of the token before it: that state already
holds most of what the LLM will predict, so one decoder layer on top of it agrees with the
LLM more often than a 4-layer truncation does, at about half the cost per draft level
(figures in the bundled ``report.json``). Only the verifier holds those features, so the head
runs there and its trees need no Speculate call.

Input at position j: ``fc([feature(j-1); embed(token j)])``, then one Llama decoder layer,
then the LLM's final norm and the LLM's vocabulary head restricted to ``vocab_ids``. The
normed output stands in for the LLM's feature of token j when the tree grows deeper. Only
``fc`` and the layer are trained and stored; the embedding, norm and head rows are the LLM's.
Training lives in ``specinfer.training.head``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from specinfer.drafting import DraftRequest
from specinfer.drafting.ssm import SSMDrafter
from specinfer.models import ModelError, default_pool, quantize_linears
from specinfer.placement import Placement
from specinfer.runtime import LlamaRuntime
from specinfer.tree import TokenTree

HEAD_MANIFEST = "head.json"


class DraftHead(nn.Module):
    """``fc`` and one decoder layer (initialised from the LLM's last), over the LLM's
    embedding, final norm and vocabulary rows ``vocab_ids`` (borrowed, frozen)."""

    def __init__(self, llm, vocab_ids: torch.Tensor) -> None:
        super().__init__()
        hidden = llm.config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():  # start as feature + embedding
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden] = torch.eye(hidden)
            self.fc.weight[:, hidden:] = torch.eye(hidden)
        self.layer = copy.deepcopy(llm.model.layers[-1])
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=False)
        # Borrowed from the LLM; plain attributes, so they are neither trained nor stored.
        self.__dict__["llm"] = llm
        self.lm_head = nn.Linear(hidden, len(vocab_ids), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(llm.lm_head.weight[vocab_ids])
        self.lm_head.requires_grad_(False)


def load_head(path: str | Path, llm) -> DraftHead:
    """A head written by ``specinfer.training.head.save_head``, over the loaded LLM it was
    trained for."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    manifest = path / HEAD_MANIFEST
    if not manifest.exists():
        raise ModelError(f"draft head {str(path)!r}: no {HEAD_MANIFEST} there")
    spec = json.loads(manifest.read_text())
    if spec["hidden_size"] != llm.config.hidden_size:
        raise ModelError(f"draft head {str(path)!r} was trained for {spec['base']!r} "
                         f"(hidden size {spec['hidden_size']}), not this LLM "
                         f"(hidden size {llm.config.hidden_size})")
    state = load_file(str(path / spec["weights"]))
    head = DraftHead(llm, state.pop("vocab_ids").long())
    head.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    head.eval().requires_grad_(False)
    return head


def bundled_head(llm_ref: str) -> Path | None:
    """The head shipped with the package for ``llm_ref``, if there is one."""
    pool = default_pool(llm_ref)
    if not pool:
        return None
    path = Path(pool[0]).parent / "head"
    return path if (path / HEAD_MANIFEST).exists() else None


class HeadSource:
    """The draft head as the verifier's own draft source ``head`` (its drafts are sampled
    for stochastic sequences): its tree is dynamic (EAGLE-2 style: the most probable paths)
    for greedy sequences with ``dynamic``, else the static ``expansion``; at most
    ``max_nodes`` of a step's budget, so the model-free drafts keep the rest (they accept
    whole repeats the head rarely drafts)."""

    name = "head"
    sampled = True
    needs_features = True
    sources = 1

    def __init__(self, drafter: FeatureDrafter, expansion: tuple[int, ...] = (2, 1, 1, 1),
                 dynamic: bool = True, max_nodes: int = 8) -> None:
        self.drafter = drafter
        self.expansion = list(expansion)
        self.dynamic = dynamic
        self.max_nodes = max_nodes

    def feature_buffer(self, length: int) -> torch.Tensor:
        """Room for ``length`` tokens' LLM features, in the head's number format."""
        rt = self.drafter.runtime
        return torch.zeros(length, rt.config.hidden_size, dtype=rt.dtype, device=rt.device)

    def bind(self, source: int, vocab_size: int) -> None:
        self.drafter.source = source  # its vocabulary is the LLM's by construction

    def propose(self, requests: list[DraftRequest]) -> list[TokenTree]:
        return self.drafter.propose([dataclasses.replace(
            r, expansion=self.expansion, dynamic=self.dynamic,
            max_nodes=min(r.max_nodes, self.max_nodes)) for r in requests])

    def forget(self, sequence_id: str) -> None:
        self.drafter.forget(sequence_id)


class FeatureDrafter(SSMDrafter):
    """Drafts trees with a ``DraftHead`` on the tree-attention runtime. Requests carry the
    LLM's features of every context token but the root (``DraftRequest.features``): the
    head's sequence is the context without its first token, each token paired with the
    feature of the one before it. ``dtype`` as for SSMs; it converts the head's own linear
    modules in place, so the ``DraftHead`` is this drafter's afterwards."""

    def __init__(self, head: DraftHead, *, dtype: str = "fp16",
                 placement: Placement | None = None, **kwargs) -> None:
        if placement is None or placement == Placement():
            quantize_linears(head, dtype)
        super().__init__(head, vocab_ids=head.vocab_ids,
                         llm_vocab_size=head.llm.config.vocab_size, placement=placement,
                         **kwargs)
        self.fc = self.runtime.linear(head.fc)

    @staticmethod
    def _runtime(head: DraftHead, slots: int, slot_len: int, placement: Placement
                 ) -> LlamaRuntime:
        """The head's one layer over the LLM's embedding, rotary table and final norm (the
        verifier's runtime has placed those already)."""
        body = head.llm.model
        config = copy.copy(head.llm.config)
        config.num_hidden_layers = 1
        config.sliding_window = None  # trained attending to its whole context
        return LlamaRuntime(config, [head.layer], body.embed_tokens, body.rotary_emb,
                            body.norm, head.lm_head, slots, slot_len, placement=placement)

    def _inputs(self, tokens: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        if features is None:
            raise ValueError("a feature drafter needs the LLM's features")
        embedded = self.runtime.embed(self.runtime.to_device(tokens))
        return self.fc(torch.cat([features, embedded], -1))

    def propose(self, requests: list[DraftRequest]) -> list[TokenTree]:
        """Trees for requests in the caller's form: the whole context (at least 2 tokens)
        and the features of all its tokens but the root."""
        for i, req in enumerate(requests):
            if req.features is None or len(req.context) < 2 \
                    or req.features.shape[0] != len(req.context) - 1:
                raise ValueError(f"items[{i}].features: need the LLM's features of the "
                                 f"{len(req.context) - 1} context tokens before the root")
        return super().propose([dataclasses.replace(r, context=r.context[1:])
                                for r in requests])
