"""A lean tree-attention runtime for Llama-family models, gpt-fast style.

It runs the decoder layers of a loaded transformers model (the same weights and modules,
so DeepSpeed AutoTP's sharded linears drop in) over a preallocated KV cache with one slot
per sequence. One ``forward`` call serves prefill chunks, tree verification and incremental
decoding: queries of row b are written to the cache at ``offsets[b] + j`` and attend to the
keys their boolean visibility matrix allows (the topology-aware tree mask).

Compared with calling the transformers model with a 4-D mask, this skips its mask and cache
bookkeeping, reads the cache in place, and computes the vocabulary head only for the rows
that need it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specinfer import native
from specinfer.layers import Norm, Projections, activation, fused, rotary, signed, sliding_windows
from specinfer.placement import Placement
from specinfer.tree import additive_mask

log = logging.getLogger(__name__)


class KVCache:
    """Keys and values of every layer: ``[layers, slots, slot_len, kv_heads, head_dim]``."""

    def __init__(self, layers: int, slots: int, slot_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        shape = (layers, slots, slot_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def slot_len(self) -> int:
        return self.k.shape[2]

    def compact(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Move positions ``src`` to ``dst`` in every layer (the accepted path, kept
        contiguous after the prefix). ``src[i] >= dst[i]``, ascending."""
        if src == dst:
            return
        s = torch.tensor(src, device=self.k.device)
        d = torch.tensor(dst, device=self.k.device)
        self.k[:, slot, d] = self.k[:, slot, s]
        self.v[:, slot, d] = self.v[:, slot, s]

    def copy(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Positions ``[0, length)`` of ``src_slot`` into ``dst_slot``, every layer (a
        cached prefix reused by another sequence)."""
        self.k[:, dst_slot, :length] = self.k[:, src_slot, :length]
        self.v[:, dst_slot, :length] = self.v[:, src_slot, :length]


def packed_queries(lengths: torch.Tensor, queries: int) -> torch.Tensor | None:
    """The flat indices (into ``B * queries``) of each row's first ``lengths[b]`` queries,
    or None when no row is padded. A batch of rows of unequal length (a tree beside a row
    decoding one token, a prefill chunk beside both) then pays its linears for its real
    queries only: on a CPU, where a forward's cost grows with its tokens, padding cost a
    partial step more than its trees (4 rows, two of 17 queries: 68 tokens for 36)."""
    if int(lengths.min()) >= queries:
        return None
    real = torch.arange(queries)[None, :] < lengths[:, None]
    return real.flatten().nonzero().squeeze(1)


@dataclass
class _Rows:
    """One padded batch of rows as attention reads it (``LlamaRuntime._rows``)."""

    b: int
    q: int
    cos: torch.Tensor  # [B, Q, 1, D]
    sin: torch.Tensor  # signed for ``rotary``: its first half negated
    slots: torch.Tensor  # [B]: the slot each row reads
    write_slot: torch.Tensor  # [B, Q]: where each query's K/V goes
    write_pos: torch.Tensor  # [B, Q]
    key_len: int
    mask: torch.Tensor | None
    window_masks: dict
    packed: torch.Tensor | None  # the real queries' flat indices; None: all of them
    single: bool


class LlamaRuntime:
    """Runs layers ``[first_layer, last_layer)`` of a Llama-family model.

    A full model is one stage; pipeline parallel gives each stage a contiguous layer range.
    Stage 0 embeds tokens; the last stage applies the final norm and the vocabulary head.
    The parts are a transformers model's modules (``from_model``) or any modules of the
    same kinds (a draft head's one layer over the LLM's embedding, norm and rotary table).
    ``placement`` says where weights, cache and activations live and in what format; the
    modules are moved there (on a GPU in place, so a model's weights exist once).
    """

    def __init__(self, config, layers: list[torch.nn.Module], embed_tokens: torch.nn.Module,
                 rotary_emb: torch.nn.Module, norm: torch.nn.Module, lm_head: torch.nn.Module,
                 slots: int, slot_len: int, first_layer: int = 0,
                 last_layer: int | None = None, placement: Placement | None = None,
                 measure: bool = True) -> None:
        self.placement = placement = placement or Placement()
        self.device, self.dtype = placement.device, placement.dtype
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.first_layer = first_layer
        self.last_layer = self.num_layers if last_layer is None else last_layer
        if len(layers) == config.num_hidden_layers:  # a full model: take this stage's range
            layers = layers[first_layer : self.last_layer]
        elif len(layers) != self.last_layer - first_layer:
            raise ValueError("the model holds neither all layers nor exactly this stage's")
        self.head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        self.vocab_size = config.vocab_size
        # Local KV heads (fewer under tensor parallel): read off the k projection's shape.
        k_weight = layers[0].self_attn.k_proj.weight
        k_weight = k_weight() if callable(k_weight) else k_weight  # fbgemm modules: a method
        kv_heads = k_weight.shape[0] // self.head_dim
        if placement.cuda:  # cuBLAS reads the modules' own weights: move them, no copies
            for m in [*layers, embed_tokens, norm, lm_head]:
                m.to(placement.device, placement.dtype)
        rotary_emb.to(placement.device)  # its frequencies stay float32
        # On the CPU the linears are rebuilt in the placement's format first (int8 scales
        # come from the original weights), then the rest of each module is converted.
        self.proj = [Projections(layer, placement, measure) for layer in layers]
        self.head_linear = None
        if self.last_layer == self.num_layers:
            self.head_linear = self.linear(lm_head, measure)
        if not placement.cuda and placement.dtype != torch.float32:
            for m in [*layers, embed_tokens, norm]:  # fbgemm's SSM linears: float32 only
                m.to(placement.dtype)
        self.windows = sliding_windows(config, first_layer, len(layers))
        self.embed_tokens, self.rotary_emb, self.norm = embed_tokens, rotary_emb, norm
        self.lm_head = lm_head
        # The batch-invariant formats' attention and norms as native operators where they
        # are built (not under torch.compile, which cannot trace them).
        self.batch_invariant = not placement.cuda and self.dtype != torch.float32
        self._native = native.library() if self.batch_invariant and not placement.compile \
            else None
        # Attention (rotary, KV cache, scores) on a GPU runs in the placement's dtype (flash
        # kernels); on the CPU in float32 (bfloat16 attention is 4-6x slower there): for
        # the CPU's bfloat16 and int8 formats by the native operator, whose rows are
        # batch-invariant by construction, else in float64 (see _attention), with a
        # float64 cache that spares converting every key at every step.
        self.attn_dtype = self.dtype if placement.cuda else \
            torch.float64 if self.batch_invariant and self._native is None else torch.float32
        self.layers = layers
        self.norms = [(Norm(layer.input_layernorm, self._native),
                       Norm(layer.post_attention_layernorm, self._native)) for layer in layers]
        self.acts = [activation(layer.mlp) for layer in layers]
        self.final = Norm(norm, self._native)
        # One more slot takes the K/V writes of padding (CUDA graphs' bucketed shapes).
        self.scratch_slot = slots
        self.cache = KVCache(len(self.layers), slots + 1, slot_len, kv_heads, self.head_dim,
                             self.attn_dtype, self.device)
        self._native_loop = self._native_loop_args()
        self._graphs = None
        self.model: torch.nn.Module | None = None  # the transformers model, with from_model
        self._compiled = None
        if placement.compile and not placement.cuda:
            self._compiled = torch.compile(self.layer_loop, dynamic=True)
        log.info("runtime ready", extra={"placement": placement.describe(),
                                         "layers": [self.first_layer, self.last_layer]})

    @classmethod
    def from_model(cls, model, slots: int, slot_len: int, first_layer: int = 0,
                   last_layer: int | None = None, placement: Placement | None = None
                   ) -> LlamaRuntime:
        """The runtime over a loaded transformers model (its own modules, so DeepSpeed
        AutoTP's sharded linears drop in)."""
        body = model.model
        runtime = cls(model.config, list(body.layers), body.embed_tokens, body.rotary_emb,
                      body.norm, model.lm_head, slots, slot_len, first_layer, last_layer,
                      placement)
        runtime.model = model
        return runtime

    @property
    def packs(self) -> bool:
        """Whether padded rows run their linears on their real queries only (``packed``)
        and batches can share a pass (``segments_forward``): on the CPU, eager. (A GPU pads
        cheaply and replays graphs of fixed shapes; inductor failed to lower the packed
        loop's dynamic shapes.)"""
        return not self.placement.cuda and self._compiled is None

    def linear(self, module: torch.nn.Module, measure: bool = True):
        """``module`` as this runtime runs a linear (in its placement's format)."""
        return fused([module], self.placement, measure)

    @property
    def is_first(self) -> bool:
        return self.first_layer == 0

    @property
    def is_last(self) -> bool:
        return self.last_layer == self.num_layers

    def to_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A host tensor (ids, positions, masks) on this runtime's device."""
        if t is None or t.device == self.device:
            return t
        return t.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    @torch.inference_mode()
    def layers_forward(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       offsets: torch.Tensor, visible: torch.Tensor | None,
                       key_len: int | None = None, packed: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """Run this stage's layers. ``hidden [B, Q, H]``; ``positions [B, Q]`` rotary
        positions; ``slots [B]`` cache slots; ``offsets [B]`` where query 0's K/V is written;
        ``offsets [B, Q]`` gives every query's own cache position instead.
        ``visible [B, Q, K]`` bool, or None when every query sees every key up to its own
        position (a single row decoding one token). Index tensors may be on the host: they
        are moved here. ``key_len``: keys to attend over (K, or with no ``visible`` the last
        write position + 1; pass it to spare a device-to-host read).

        ``packed``: the flat indices (into ``B * Q``) of the real queries when rows are
        padded (``packed_queries``): the linears then run on those ``[N, H]`` only and the
        result is ``[N, H]``; padding only takes part in attention (zero keys and values
        past its row's real queries, which no real query sees)."""
        positions, slots, offsets = (self.to_device(t) for t in (positions, slots, offsets))
        packed = self.to_device(packed)
        if visible is not None:
            key_len = visible.shape[-1]
            visible = self.to_device(visible)
        elif key_len is None:
            key_len = int(offsets.max()) + (1 if offsets.dim() == 2 else hidden.shape[1])
        if packed is None and self._graphs is not None and \
                self._graphs.fits(hidden.shape[0], hidden.shape[1]):
            return self._graphs(hidden, positions, slots, offsets, visible, key_len)
        step = self._compiled or self.layer_loop
        return step(hidden, positions, slots, offsets, visible, key_len, packed)

    def capture_graphs(self, max_queries: int) -> None:
        """With a compiled placement on a GPU: capture the layer loop for every bucket of
        batch rows and queries up to ``max_queries`` per row (a tree and its root)."""
        if self.placement.cuda and self.placement.compile:
            from specinfer.graphs import GraphedLayers

            self._graphs = GraphedLayers(self, max_queries)

    def layer_loop(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   offsets: torch.Tensor, visible: torch.Tensor | None, key_len: int,
                   packed: torch.Tensor | None = None) -> torch.Tensor:
        """The layer loop itself, eager: device tensors only, no host reads, so CUDA graphs
        capture it and ``torch.compile`` compiles it (``layers_forward`` picks which runs).
        ``slots`` may also be ``[B, Q]``: each query's write slot (graph padding).
        ``packed``: see ``layers_forward`` (eager only: ``_layers``, whose per-part
        bookkeeping inductor failed to lower with dynamic shapes)."""
        b, q, width = hidden.shape
        rows = self._rows(hidden, positions, slots, offsets, visible, key_len, packed)
        if packed is not None:
            return self._layers(hidden.reshape(b * q, width).index_select(0, packed), [rows])
        if self._native_loop is not None:
            return self._layers(hidden, [rows])
        for i, (proj, (norm_in, norm_post), act_fn) in enumerate(zip(
                self.proj, self.norms, self.acts, strict=True)):
            heads = proj.qkv(norm_in(hidden)).view(b, q, -1, self.head_dim)  # [q | k | v]
            hidden = hidden + proj.o(self._attend(i, heads, rows))
            hidden = hidden + proj.down(self._gated(act_fn, proj.gate_up(norm_post(hidden))))
        return hidden

    @torch.inference_mode()
    def segments_forward(self, parts: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        """Several batches in one pass over the weights (the CPU, eager): each part is
        ``(hidden [B, Q, H], positions, slots, offsets, visible, key_len, packed)`` as
        ``layers_forward`` takes them, ``packed`` required (None: all of its B * Q queries).
        The linears run once over every part's real queries; attention runs per part, so a
        prefill chunk of many queries beside rows of one or a tree pads neither. Returns
        each part's ``[N_i, H]`` (its real queries)."""
        streams, rows = [], []
        for hidden, positions, slots, offsets, visible, key_len, packed in parts:
            b, q, width = hidden.shape
            positions, slots, offsets, packed = (self.to_device(t) for t in (
                positions, slots, offsets, packed))
            visible = self.to_device(visible)
            rows.append(self._rows(hidden, positions, slots, offsets, visible, key_len,
                                   packed))
            flat = hidden.reshape(b * q, width)
            streams.append(flat if packed is None else flat.index_select(0, packed))
        out = self._layers(torch.cat(streams), rows)
        return list(out.split([len(s) for s in streams]))

    def _rows(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              offsets: torch.Tensor, visible: torch.Tensor | None, key_len: int,
              packed: torch.Tensor | None) -> _Rows:
        """What attention needs of one padded batch of rows, computed once per forward."""
        b, q, _ = hidden.shape
        attn_dtype = self.attn_dtype
        cos, sin = self.rotary_emb(hidden[:, :, :1].to(attn_dtype), positions)
        write_pos = offsets if offsets.dim() == 2 else \
            offsets[:, None] + torch.arange(q, device=hidden.device)[None, :]
        if slots.dim() == 2:  # per-query write slots (graph padding); rows read query 0's
            write_slot, slots = slots, slots[:, 0]
        else:
            write_slot = slots[:, None].expand(b, q).contiguous()  # laid out once, not per layer
        mask = None if visible is None else self._mask(visible)
        window_masks = {w: self._mask(self._window_visible(
            visible, positions, slots, write_slot, write_pos, key_len, w))
            for w in set(self.windows) if w is not None and key_len > w}
        sin = signed(sin)
        return _Rows(b, q, cos[:, :, None, :], sin[:, :, None, :], slots, write_slot,
                     write_pos, key_len, mask, window_masks, packed,
                     single=b == 1 and not hidden.is_cuda)  # (a device scalar index syncs)

    def _native_loop_args(self) -> dict | None:
        """The weights as the native decoder loop (``csrc/decoder_layers.cpp``) takes them,
        where every part of every layer is one it runs (our norms and attention, SiLU,
        linears that are our int8 or bfloat16 AMX kernels or oneDNN's packed one, one for
        every row count); else None and the Python loop runs."""
        if self._native is None or not hasattr(self._native, "decoder_layers"):
            return None
        forms = [getattr(lin, "native", None) for p in self.proj
                 for lin in (p.qkv, p.o, p.gate_up, p.down)]
        norms = [n for pair in self.norms for n in pair]
        if any(f is None for f in forms) or any(a is not F.silu for a in self.acts) or \
                any(n.eps is None or n.eps != norms[0].eps for n in norms):
            return None
        return {"weights": [f.weight for f in forms], "scales": [f.scale for f in forms],
                "biases": [f.bias for f in forms], "kinds": [f.kind for f in forms],
                "outs": [f.out for f in forms], "rows": [f.rows for f in forms],
                "norms": [n.native_weight for n in norms], "eps": norms[0].eps,
                "hq": forms[0].out // self.head_dim - 2 * self.cache.k.shape[3],
                "head_dim": self.head_dim}

    def _layers(self, hidden: torch.Tensor, parts: list[_Rows]) -> torch.Tensor:
        """The layers over ``hidden``: ``[B, Q, H]`` for one part unpacked, else the parts'
        real queries one after another, ``[N, H]``. Where the native decoder loop runs,
        the same operators in one call (no Python between them: the same bits)."""
        if self._native_loop is not None:
            return self._native_layers(hidden, parts)
        bounds = [0, 0]  # each part's queries in ``hidden`` (one part: all of them)
        if len(parts) > 1:
            bounds = [0]
            for rows in parts:
                bounds.append(bounds[-1] + (rows.b * rows.q if rows.packed is None
                                            else rows.packed.shape[0]))
        for i, (proj, (norm_in, norm_post), act_fn) in enumerate(zip(
                self.proj, self.norms, self.acts, strict=True)):
            heads = proj.qkv(norm_in(hidden))
            outs = []
            for rows, lo, hi in zip(parts, bounds[:-1], bounds[1:], strict=True):
                b, q = rows.b, rows.q
                part = heads if len(parts) == 1 else heads[lo:hi]
                if rows.packed is not None:  # padding's q, k and v are zero
                    part = part.new_zeros(b * q, part.shape[-1]).index_copy_(
                        0, rows.packed, part)
                out = self._attend(i, part.view(b, q, -1, self.head_dim), rows)
                if rows.packed is not None:
                    out = out.reshape(b * q, -1).index_select(0, rows.packed)
                elif hidden.dim() == 2:  # beside other parts, or packed by the caller
                    out = out.reshape(b * q, -1)
                outs.append(out)
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            hidden = hidden + proj.o(out)
            hidden = hidden + proj.down(self._gated(act_fn, proj.gate_up(norm_post(hidden))))
        return hidden

    def _gated(self, act_fn: Callable[[torch.Tensor], torch.Tensor],
               gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up from the gate | up projection: for SiLU in the batch-invariant
        formats by the native operator (as the native decoder loop runs it), else torch's."""
        if act_fn is F.silu and self._native is not None:
            return self._native.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, -1)
        return act_fn(gate) * up

    def _native_layers(self, hidden: torch.Tensor, parts: list[_Rows]) -> torch.Tensor:
        """``_layers`` as one native call: each part's tables, each layer's mask."""
        masks = [rows.window_masks.get(w, rows.mask) for rows in parts for w in self.windows]
        return self._native.decoder_layers(
            hidden, **self._native_loop, cos=[r.cos for r in parts], sin=[r.sin for r in parts],
            write_slot=[r.write_slot for r in parts], write_pos=[r.write_pos for r in parts],
            slots=[r.slots for r in parts], key_lens=[r.key_len for r in parts],
            part_b=[r.b for r in parts], part_q=[r.q for r in parts],
            packed=[r.packed for r in parts], masks=masks, cache_k=self.cache.k,
            cache_v=self.cache.v)

    def _attend(self, i: int, heads: torch.Tensor, rows: _Rows) -> torch.Tensor:
        """Layer ``i``'s attention for ``heads [B, Q, Hq + 2 Hkv, D]`` (the q | k | v
        projections): rotary on q and k, the new keys and values into the cache, attention
        over the cache; ``[B, Q, Hq * D]`` in ``heads``' dtype. The batch-invariant formats
        run it as one native operator where it is built (every (query, head) row on its
        own by its own loops, in float32; ~40 torch operators fewer a layer), else by
        torch's operators in float64."""
        mask = rows.window_masks.get(self.windows[i], rows.mask)
        ck, cv = self.cache.k[i], self.cache.v[i]
        kv_heads = ck.shape[2]
        split = heads.shape[2] - kv_heads
        if self._native is not None:
            return self._native.attention(heads, rows.cos, rows.sin, ck, cv, rows.write_slot,
                                          rows.write_pos, rows.slots, rows.key_len, mask,
                                          split - kv_heads)
        b, q = rows.b, rows.q
        part = heads.to(self.attn_dtype)
        qk = rotary(part[:, :, :split], rows.cos, rows.sin)  # rotary on q and k at once
        qs, ks, vs = qk[:, :, : split - kv_heads], qk[:, :, split - kv_heads :], \
            part[:, :, split:]
        ck[rows.write_slot, rows.write_pos] = ks
        cv[rows.write_slot, rows.write_pos] = vs
        key_len, slots = rows.key_len, rows.slots
        if rows.single:  # a view, no copy
            keys, values = ck[slots[0], :key_len][None], cv[slots[0], :key_len][None]
        else:
            keys, values = ck[slots, :key_len], cv[slots, :key_len]
        out = self._attention(qs.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                              mask)
        return out.transpose(1, 2).reshape(b, q, -1).to(heads.dtype)

    def _mask(self, visible: torch.Tensor) -> torch.Tensor:
        """Attention's mask over ``visible [B, Q, K]``: the native operator takes it as it
        is; else additive, SDPA's ``[B, 1, Q, K]``, or for the batch-invariant torch path
        already laid out as its grouped scores ``[B * Hkv, G * Q, K]`` (made once per
        forward, not once per layer)."""
        if self._native is not None:
            return visible.contiguous()
        mask = additive_mask(visible, self.attn_dtype)
        if not self.batch_invariant:
            return mask
        b, _, q, keys = mask.shape
        hkv = self.cache.k.shape[3]
        g = self.config.num_attention_heads // self.config.num_key_value_heads
        return mask[:, :, None].expand(b, hkv, g, q, keys).reshape(b * hkv, g * q, keys)

    @staticmethod
    def _window_visible(visible: torch.Tensor | None, positions: torch.Tensor,
                        slots: torch.Tensor, write_slot: torch.Tensor, write_pos: torch.Tensor,
                        key_len: int, window: int) -> torch.Tensor:
        """``visible`` (or the causal pattern) less the keys ``window`` or more positions
        before each query. A committed key's position is its cache index (the accepted path
        is kept contiguous); a key written in this call has its query's position (a tree
        node's depth, not its index). Queries writing another slot (graph padding) do not
        count: their writes go to a spare column."""
        b, q = positions.shape
        key_pos = torch.arange(key_len + 1, device=positions.device).expand(b, -1).clone()
        own = write_slot == slots[:, None]
        key_pos.scatter_(1, torch.where(own, write_pos, key_len), positions)
        key_pos = key_pos[:, :key_len]
        in_window = positions[:, :, None] - key_pos[:, None, :] < window
        if visible is None:
            keys = torch.arange(key_len, device=positions.device)
            visible = keys[None, None, :] <= write_pos[:, :, None]
        return visible & in_window

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
        """``q [B, Hq, Q, D]`` over ``k, v [B, Hkv, K, D]``. In float32 SDPA's kernels
        round differently for 1 query and for a tree's many (a row's result depends on the
        batch shape, at the last bit); that is harmless in float32 but flips bfloat16
        roundings downstream, so the CPU's bfloat16 and int8 formats compute scores and
        softmax in float64, where every row comes out the same (rounded to float32) whatever
        the shape: speculative output then equals plain decoding."""
        if not self.batch_invariant:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        b, hq, nq, d = q.shape  # all float64 here
        hkv = k.shape[1]
        g, keys = hq // hkv, k.shape[2]
        grouped = q.reshape(b * hkv, g * nq, d)  # q head h reads kv head h // g
        keys_t = k.reshape(b * hkv, keys, d).transpose(1, 2)
        if mask is None:
            scores = torch.bmm(grouped, keys_t).mul_(d ** -0.5)
        else:  # scaled and masked inside the product (``_mask``): one op, not three
            scores = torch.baddbmm(mask, grouped, keys_t, alpha=d ** -0.5)
        return torch.bmm(scores.softmax(-1), v.reshape(b * hkv, keys, d)).view(b, hq, nq, d)

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's output, normed: the vocabulary head's input (the features a
        draft head reads)."""
        return self.final(hidden)

    @torch.inference_mode()
    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """Float32 logits (the AMX kernels give them unrounded, so greedy's argmax is not
        decided by bfloat16's rounding of near-equal logits)."""
        return self.head_linear.float32(normed)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.final_norm(hidden))
