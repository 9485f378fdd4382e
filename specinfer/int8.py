"""Weight-only int8 linears for the CPU, on the kernel this CPU runs best.

- ``amx`` (``csrc/int8_linear.cpp``, Sapphire Rapids and later): each row of x becomes
  24-bit fixed point (a scale per row, three int8 digits), AMX sums digits times weights in
  int32 exactly, and the digits' sums are combined in double. Integer sums make a row's
  result independent of the rows beside it by construction, and the weight goes from
  memory straight into AMX's tiles once per call, so a 16-row tree step costs about what
  one row does. ``reference`` computes the same numbers with ``torch._int_mm``, on any CPU.
- ``torch``: torch's ``aten._weight_int8pack_mm`` everywhere else (each output computed on
  its own, so batch-invariant too; its cost grows with every row).

The kernel is built on first use (``specinfer.native``); where it cannot be, or its
results differ from the reference on a probe, the process uses torch's kernel.
``SPECINFER_INT8_KERNEL=torch`` forces it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specinfer import native

log = logging.getLogger(__name__)

Kernel = Callable[[torch.Tensor], torch.Tensor]  # flat [rows, in] -> [rows, out]
KERNELS = ("amx", "torch")
TILE_COLS, TILE_K = 16, 64  # an AMX int8 B tile: 16 columns x 16 quads of k
FIXED_MAX = 8257536.0  # 2^23 - 2^17: a row's largest |x| in fixed point, top digit in int8

_chosen: dict[torch.dtype, str] = {}


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8, one float32 scale per output row."""
    w = weight.float()
    scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale


def amx_tiles(q: torch.Tensor) -> torch.Tensor:
    """``q [out, in]`` as AMX B tiles ``[out/16, in/64, 16, 16, 4]`` (zero-padded): tile
    (b, t) row r holds k = 64t + 4r .. 64t + 4r + 3 for the 16 columns of block b."""
    out, k = q.shape
    padded = F.pad(q, (0, -k % TILE_K, 0, -out % TILE_COLS))
    blocks, tiles = padded.shape[0] // TILE_COLS, padded.shape[1] // TILE_K
    return (padded.view(blocks, TILE_COLS, tiles, TILE_COLS, 4)
            .permute(0, 2, 3, 1, 4).contiguous())


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the AMX kernel computes, bit for bit, with torch's integer matmul."""
    xf = x.float()
    top = xf.abs().amax(1, keepdim=True)
    step = torch.where(top > 0, top / FIXED_MAX, torch.ones_like(top))
    fixed = torch.round(xf / step).to(torch.int32)
    whole = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float64)
    weight = q.t()
    for place in (1.0, 256.0, 65536.0):
        digit = ((fixed + 128) & 255) - 128
        fixed = (fixed - digit) >> 8
        whole += place * torch._int_mm(digit.to(torch.int8), weight).double()
    out = whole * step.double() * scale.double()
    return out.float().to(x.dtype)


class AmxLinear:
    """``x @ weight.T (+ bias)`` by our AMX kernel; its tiles and scales are what the
    native decoder loop (``csrc/decoder_layers.cpp``) calls it with."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.tiles, self.scale, self.bias, self.out = amx_tiles(q), scale, bias, q.shape[0]
        self.ops = native.library()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.int8_amx_linear(x, self.tiles, self.scale, self.out)
        return y if self.bias is None else y + self.bias

    def float32(self, x: torch.Tensor) -> torch.Tensor:
        """The outputs in float32, not rounded to x's dtype (the logits)."""
        y = self.ops.int8_amx_linear(x, self.tiles, self.scale, self.out, True)
        return y if self.bias is None else y + self.bias.float()


def _build(name: str, q: torch.Tensor, scale: torch.Tensor, act: torch.dtype,
           bias: torch.Tensor | None = None) -> Kernel:
    if name == "amx":
        return AmxLinear(q, scale, bias)
    if bias is not None:
        run = _build(name, q, scale, act)
        return lambda x: run(x) + bias
    scale_act = scale.to(act)
    pad = -q.shape[1] % 16  # torch's kernel reads past a reduction not a multiple of 16
    if pad:
        q = F.pad(q, (0, pad)).contiguous()
        return lambda x: torch.ops.aten._weight_int8pack_mm(F.pad(x, (0, pad)), q, scale_act)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scale_act)


def _wanted() -> str:
    """The kernel to try: ours where the CPU has AMX (or as forced), else torch's."""
    forced = os.environ.get("SPECINFER_INT8_KERNEL", "")
    if forced:
        if forced not in KERNELS:
            raise ValueError(f"SPECINFER_INT8_KERNEL must be one of {', '.join(KERNELS)}; "
                             f"got {forced!r}")
        return forced
    return "amx" if {"amx_tile", "amx_int8", "avx512bw", "avx512vl"} <= native.cpu_flags() \
        else "torch"


def _agrees(kernel: Kernel, q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> bool:
    """The kernel gives the reference's bits, for a batch and for each row alone."""
    want = reference(x, q, scale)
    alone = torch.cat([kernel(x[i : i + 1]) for i in range(len(x))])
    return torch.equal(alone, want) and all(torch.equal(kernel(x[:m]), want[:m])
                                            for m in (2, 16, 17, len(x)))


def chosen(act: torch.dtype) -> str:
    """The kernel this process uses for int8 weights with ``act`` activations."""
    if act not in _chosen:
        gen = torch.Generator().manual_seed(0)
        q, scale = quantize(torch.randn(72, 2 * TILE_K * 4 + 5, generator=gen) * 0.05)
        x = (torch.randn(40, q.shape[1], generator=gen) * 3).to(act)
        name = "torch"
        if _wanted() == "amx":
            ops = native.library()
            if ops is not None and ops.amx_enable() and _agrees(
                    _build("amx", q, scale, act), q, scale, x):
                name = "amx"
        _chosen[act] = name
        log.info("int8 kernel", extra={"activations": str(act), "kernel": name})
    return _chosen[act]


def kernel(weight: torch.Tensor, bias: torch.Tensor | None, act: torch.dtype) -> Kernel:
    """Weight-only int8 ``x @ weight.T + bias`` in ``act``, on this process's kernel."""
    q, scale = quantize(weight)
    return _build(chosen(act), q, scale, act, bias)
