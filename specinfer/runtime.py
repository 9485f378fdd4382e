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
import time

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


class KVCache:
    """Keys and values of every layer: ``[layers, slots, slot_len, kv_heads, head_dim]``."""

    def __init__(self, layers: int, slots: int, slot_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32) -> None:
        shape = (layers, slots, slot_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)

    @property
    def slot_len(self) -> int:
        return self.k.shape[2]

    @property
    def bytes_per_token(self) -> int:
        _, _, _, heads, dim = self.k.shape
        return 2 * self.k.shape[0] * heads * dim * self.k.element_size()

    def compact(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Move positions ``src`` to ``dst`` in every layer (the accepted path, kept
        contiguous after the prefix). ``src[i] >= dst[i]``, ascending."""
        if src == dst:
            return
        s, d = torch.tensor(src), torch.tensor(dst)
        self.k[:, slot, d] = self.k[:, slot, s]
        self.v[:, slot, d] = self.v[:, slot, s]


class Gemm:
    """Linear layers for this runtime. Up to ``blas_rows`` rows go to the default BLAS,
    which reads each weight once as a GEMV-like kernel; more rows (trees, prefill) go to
    oneDNN with weights packed once at load. Where the two cross over depends on the CPU
    (on the reference 2-core EPYC: BLAS is flat up to 3 rows, then oneDNN is 20% faster), so
    it is measured once at load on this model's own weights. Modules other than a plain
    ``nn.Linear`` (e.g. DeepSpeed's all-reducing shards, fbgemm fp16) are called."""

    def __init__(self, modules: list[torch.nn.Module], enabled: bool) -> None:
        self.packed: dict[int, torch.Tensor] = {}
        self.blas_rows = 1
        if not enabled:
            return
        try:
            for m in modules:
                if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32:
                    self.packed[id(m)] = torch.ops.mkldnn._reorder_linear_weight(m.weight, 16)
        except (AttributeError, RuntimeError):  # no oneDNN in this torch build
            self.packed.clear()
        if self.packed:
            self.blas_rows = self._crossover([m for m in modules if id(m) in self.packed])

    def _crossover(self, modules: list[torch.nn.Linear], max_rows: int = 8) -> int:
        """The most rows for which BLAS still beats oneDNN (1 if it never does)."""
        def best_of(rows: int, packed: bool, reps: int = 3) -> float:
            xs = {m.in_features: torch.randn(rows, m.in_features) for m in modules}
            best = float("inf")
            for _ in range(reps):
                start = time.perf_counter()
                for m in modules:
                    x = xs[m.in_features]
                    self._onednn(m, x) if packed else F.linear(x, m.weight, m.bias)
                best = min(best, time.perf_counter() - start)
            return best

        with torch.inference_mode():
            rows = 1
            while rows < max_rows and best_of(rows + 1, False) < best_of(rows + 1, True):
                rows += 1
        log.info("linear layers: BLAS up to the measured crossover, oneDNN beyond",
                 extra={"blas_rows": rows})
        return rows

    def _onednn(self, module: torch.nn.Linear, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(flat, self.packed[id(module)], module.bias,
                                                  "none", [], "")

    def __call__(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if id(module) not in self.packed or rows <= self.blas_rows:
            return module(x)
        out = self._onednn(module, x.reshape(rows, x.shape[-1]))
        return out.reshape(*x.shape[:-1], out.shape[-1])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaRuntime:
    """Runs layers ``[first_layer, last_layer)`` of a Llama-family model.

    A full model is one stage; pipeline parallel gives each stage a contiguous layer range.
    Stage 0 embeds tokens; the last stage applies the final norm and the vocabulary head.
    The parts are a transformers model's modules (``from_model``) or any modules of the
    same kinds (a draft head's one layer over the LLM's embedding, norm and rotary table).
    """

    def __init__(self, config, layers: list[torch.nn.Module], embed_tokens: torch.nn.Module,
                 rotary_emb: torch.nn.Module, norm: torch.nn.Module, lm_head: torch.nn.Module,
                 slots: int, slot_len: int, first_layer: int = 0,
                 last_layer: int | None = None, onednn: bool = True) -> None:
        self.config = config
        self.embed_tokens, self.rotary_emb, self.norm = embed_tokens, rotary_emb, norm
        self.lm_head = lm_head
        self.num_layers = config.num_hidden_layers
        self.first_layer = first_layer
        self.last_layer = self.num_layers if last_layer is None else last_layer
        if len(layers) == config.num_hidden_layers:  # a full model: take this stage's range
            layers = layers[first_layer : self.last_layer]
        elif len(layers) != self.last_layer - first_layer:
            raise ValueError("the model holds neither all layers nor exactly this stage's")
        self.layers = layers
        self.head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        self.vocab_size = config.vocab_size
        self.dtype = embed_tokens.weight.dtype
        # Local KV heads (fewer under tensor parallel): read off the k projection's shape.
        k_weight = self.layers[0].self_attn.k_proj.weight
        k_weight = k_weight() if callable(k_weight) else k_weight  # fbgemm modules: a method
        kv_heads = k_weight.shape[0] // self.head_dim
        self.cache = KVCache(len(self.layers), slots, slot_len, kv_heads, self.head_dim,
                             self.dtype)
        linears = [m for layer in self.layers for m in layer.modules()
                   if isinstance(m, torch.nn.Linear)]
        if self.is_last:
            linears.append(lm_head)
        self.gemm = Gemm(linears, onednn)
        self.model: torch.nn.Module | None = None  # the transformers model, with from_model

    @classmethod
    def from_model(cls, model, slots: int, slot_len: int, first_layer: int = 0,
                   last_layer: int | None = None, onednn: bool = True) -> LlamaRuntime:
        """The runtime over a loaded transformers model (its own modules, so DeepSpeed
        AutoTP's sharded linears drop in)."""
        body = model.model
        runtime = cls(model.config, list(body.layers), body.embed_tokens, body.rotary_emb,
                      body.norm, model.lm_head, slots, slot_len, first_layer, last_layer,
                      onednn)
        runtime.model = model
        return runtime

    @property
    def is_first(self) -> bool:
        return self.first_layer == 0

    @property
    def is_last(self) -> bool:
        return self.last_layer == self.num_layers

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    @torch.inference_mode()
    def layers_forward(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       offsets: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
        """Run this stage's layers. ``hidden [B, Q, H]``; ``positions [B, Q]`` rotary
        positions; ``slots [B]`` cache slots; ``offsets [B]`` where query 0's K/V is written;
        ``offsets [B, Q]`` gives every query's own cache position instead.
        ``visible [B, Q, K]`` bool, or None when every query sees every key up to its own
        position (a single row decoding one token)."""
        b, q, _ = hidden.shape
        cos, sin = self.rotary_emb(hidden, positions)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, Q, 1, D]
        write_pos = offsets if offsets.dim() == 2 else offsets[:, None] + torch.arange(q)[None, :]
        write_slot = slots[:, None].expand(b, q)
        key_len = int(write_pos.max()) + 1 if visible is None else visible.shape[-1]
        mask = None
        if visible is not None:
            mask = torch.zeros(visible.shape, dtype=hidden.dtype)
            mask.masked_fill_(~visible, torch.finfo(hidden.dtype).min)
            mask = mask[:, None]
        single = b == 1
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            gemm = self.gemm
            qs = gemm(attn.q_proj, x).view(b, q, -1, self.head_dim)
            ks = gemm(attn.k_proj, x).view(b, q, -1, self.head_dim)
            vs = gemm(attn.v_proj, x).view(b, q, -1, self.head_dim)
            qs = qs * cos + rotate_half(qs) * sin
            ks = ks * cos + rotate_half(ks) * sin
            ck, cv = self.cache.k[i], self.cache.v[i]
            ck[write_slot, write_pos] = ks
            cv[write_slot, write_pos] = vs
            if single:  # a view, no copy
                keys, values = ck[slots[0], :key_len][None], cv[slots[0], :key_len][None]
            else:
                keys, values = ck[slots, :key_len], cv[slots, :key_len]
            out = F.scaled_dot_product_attention(
                qs.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=mask, enable_gqa=True,
                is_causal=False,
            )
            hidden = hidden + gemm(attn.o_proj, out.transpose(1, 2).reshape(b, q, -1))
            hidden = hidden + self._mlp(layer.mlp, layer.post_attention_layernorm(hidden))
        return hidden

    def _mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        gemm = self.gemm
        return gemm(mlp.down_proj, mlp.act_fn(gemm(mlp.gate_proj, x)) * gemm(mlp.up_proj, x))

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's output, normed: the vocabulary head's input (the features a
        draft head reads)."""
        return self.norm(hidden)

    @torch.inference_mode()
    def head(self, normed: torch.Tensor) -> torch.Tensor:
        return self.gemm(self.lm_head, normed).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.final_norm(hidden))
