"""The pieces of one decoder layer as the runtime (``specinfer.runtime``) calls them: the
projections fused per format, RMSNorm by the fused op, the MLP's activation, rotary
embedding, and each layer's attention window. Each is bit for bit what the transformers
module computes in float32, with fewer Python-level operations per call (a 30-layer step
makes a few thousand)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from specinfer import linears
from specinfer.placement import Placement


class Projections:
    """One layer's linears as this runtime calls them: q/k/v and gate/up each as one matrix
    (``[q | k | v]`` and ``[gate | up]`` outputs)."""

    def __init__(self, layer: torch.nn.Module, placement: Placement, measure: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = fused([attn.q_proj, attn.k_proj, attn.v_proj], placement, measure)
        self.gate_up = fused([mlp.gate_proj, mlp.up_proj], placement, measure)
        self.o = fused([attn.o_proj], placement, measure)
        self.down = fused([mlp.down_proj], placement, measure)


def fused(modules: list[torch.nn.Module], placement: Placement, measure: bool
          ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The modules' outputs side by side: one fused linear for plain modules on the CPU;
    on a GPU (graphs take away the launch cost; the modules' own weights, no copies) and
    for sharded or quantized modules, the modules called one by one."""
    if not placement.cuda and all(linears.plain(m) for m in modules):
        return linears.build(modules, placement, measure)
    if placement.cuda:  # in place (a no-op for modules the runtime moved already)
        for m in modules:
            m.to(placement.device, placement.dtype)
    if len(modules) == 1:
        return linears.ModuleLinear(modules[0])
    each = [linears.ModuleLinear(m) for m in modules]
    return lambda x: torch.cat([f(x) for f in each], dim=-1)


class Norm:
    """A Llama-family RMSNorm module as the runtime calls it, by the fused op: in float32
    bitwise the module's own (normalised, cast back, scaled); in other formats in one op
    that accumulates in float32 and rounds once (one op costs less than four at one row):
    the native one where given (bfloat16: ~8 torch operators fewer, each row in one fixed
    order), else torch's. Its weight and epsilon are read once: a module's attribute
    lookups at every call cost ~0.3 ms a step."""

    def __init__(self, module: torch.nn.Module, native=None) -> None:
        self.module = module
        self.eps = getattr(module, "variance_epsilon", None)
        self.weight = module.weight if self.eps is not None else None
        self.native = native
        # the native norm scales in float32: its weight converted once, not per call
        self.native_weight = None if self.weight is None else self.weight.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.eps is None:
            return self.module(x)
        if x.dtype == torch.bfloat16 and self.native is not None:
            return self.native.rms_norm(x, self.native_weight, self.eps)
        if x.dtype != torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)


def activation(mlp: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's activation: SiLU as the function itself (the module call around it cost
    ~0.8 ms a step), any other as its module."""
    act = mlp.act_fn
    return F.silu if type(act).__name__ in ("SiLU", "SiLUActivation") else act


def sliding_windows(config, first_layer: int, count: int) -> list[int | None]:
    """Each layer's attention window (None: the whole context), as transformers applies
    it: Mistral's ``sliding_window`` on every layer, Qwen2's on the layers its
    ``layer_types`` mark ``sliding_attention``. A query at position p sees keys at
    positions > p - window."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * count
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * count
    return [window if types[first_layer + i] == "sliding_attention" else None
            for i in range(count)]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def signed(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: what ``rotary`` takes (once per forward)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` bit for bit, in one op fewer than four:
    ``rotate_half(x)`` is ``x`` rolled by half with its first half negated, and
    ``(-a) * s == a * (-s)`` exactly, so the sign goes on ``sin`` (``signed``), once
    per forward."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin
