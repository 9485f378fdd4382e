"""The runtime's linear layers, one kernel choice per number format and device.

A small model's decode step reads every weight once per token, so its speed is bytes per
weight and per-call overhead. Measured on the reference 2-core EPYC (AVX-512 BF16), per
call for SmolLM2's shapes: oneDNN with weights packed once at load beats the default BLAS
from 1 row on the big matrices (the 49152-row vocabulary head: 4.3 vs 10 ms in float32);
bfloat16 packed halves that again, and on CPUs with AMX our own bfloat16 kernel
(``AmxBf16Linear``) reads the weights nearer the memory's speed still (SmolLM2's linears
at one row: 10.5 against oneDNN's 16.2 ms); weight-only int8 has kernels of its own
(``specinfer.int8``: integer AMX tiles where the CPU has them, else torch's). In
float32 BLAS and oneDNN both serve, crossing at a row count measured once per matrix at
load; bfloat16 and int8 use one kernel for every row count, so that a row's output never
depends on the rows beside it (speculation then reproduces plain decoding bit for bit).

Every kernel takes ``x [..., in]`` and returns ``[..., out]`` in the activation dtype.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from specinfer import int8, native
from specinfer.placement import Placement

log = logging.getLogger(__name__)

Kernel = Callable[[torch.Tensor], torch.Tensor]  # flat [rows, in] -> [rows, out]


# A bfloat16 row's bits must not depend on the rows beside it. oneDNN's AMX kernels
# (Sapphire Rapids and later) give every row the bits it has alone up to 32 rows per call
# (two 16-row tiles), at every reduction length, and other last bits from 33 rows on
# (measured: SmolLM2's and TinyLlama's shapes, 1 and 2 threads); so calls are cut into
# 32-row pieces. Its AVX-512 BF16 kernels (CPUs without AMX) keep a row's bits at every
# row count up to a 1024-long reduction and block longer ones differently for one row
# than for many; so their reductions are cut into 1024-long parts. Which of the two holds
# is probed once per process (``bfloat16_plan``), on the kernels this CPU runs; where
# neither does, every row runs alone (exact, slow).
INVARIANT_K = 1024
AMX_ROWS = 32


class Plan(NamedTuple):
    """How a bfloat16 linear is cut so that its rows are batch-invariant."""

    k_part: int  # reduction length per call (0: whole)
    rows: int  # rows per call (0: all)


_plan: Plan | None = None


def bfloat16_plan() -> Plan:
    """The first of (32-row pieces; 1024-long reductions) under which rows of a probe
    weight come out the same at every row count as alone, else one row per call."""
    global _plan
    if _plan is None:
        gen = torch.Generator().manual_seed(0)
        k = 2 * INVARIANT_K + 256  # a reduction of more than two parts
        # Big enough to see rare differences: on an AMD EPYC (AVX-512, no AMX) 32-row
        # pieces of a 2304-long reduction differ from rows alone in 1-10 of 49,152
        # outputs here, which a 64 x 40 probe missed (and chose them).
        weight = (torch.randn(512, k, generator=gen) * 0.05).to(torch.bfloat16)
        x = (torch.randn(3 * AMX_ROWS, k, generator=gen) * 3).to(torch.bfloat16)
        _plan = Plan(0, 1)
        for plan in (Plan(0, AMX_ROWS), Plan(INVARIANT_K, 0)):
            run = _packed(weight, None, plan=plan)
            if run is None:
                break
            alone = torch.cat([run(x[i : i + 1]) for i in range(len(x))])
            if all(torch.equal(run(x[:m]), alone[:m]) for m in (2, 7, 16, 17, AMX_ROWS, len(x))):
                _plan = plan
                break
        log.info("bfloat16 linears", extra={"k_part": _plan.k_part, "rows": _plan.rows})
    return _plan


# bfloat16 on AMX by our own kernel (``csrc/bf16_linear.cpp``): the hardware computes each
# output from its row, its column and the k order alone, and the kernel's k order does not
# change with the row count, so rows are batch-invariant without cutting calls, and up to
# 16 rows cost about what one does. A probe checks that on this CPU before use.
BF16_KERNELS = ("amx", "onednn")
_bf16_kernel: str | None = None


def bf16_tiles(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` as AMX bfloat16 B tiles ``[out/16, in/32, 16, 16, 2]``
    (zero-padded): tile (b, t) row p holds the pairs k = 32t + 2p, 32t + 2p + 1 of the 16
    columns of block b."""
    out, k = weight.shape
    padded = F.pad(weight, (0, -k % 32, 0, -out % 16))
    blocks, tiles = padded.shape[0] // 16, padded.shape[1] // 32
    return padded.view(blocks, 16, tiles, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


class AmxBf16Linear:
    """``x @ weight.T (+ bias)`` in bfloat16 by our AMX kernel (bias added in float32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.tiles = bf16_tiles(weight.to(torch.bfloat16))
        self.bias = None if bias is None else bias.float().contiguous()
        self.out = weight.shape[0]
        self.ops = native.library()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.bf16_amx_linear(x, self.tiles, self.bias, self.out)

    def float32(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 sums, not rounded to bfloat16 (the logits)."""
        return self.ops.bf16_amx_linear(x, self.tiles, self.bias, self.out, True)


def bfloat16_kernel() -> str:
    """``amx`` (ours) where the CPU has AMX's bfloat16 and the native library builds and a
    probe finds its rows batch-invariant and its results close to float64's; else
    ``onednn`` (oneDNN's packed kernels, cut by ``bfloat16_plan``).
    ``SPECINFER_BF16_KERNEL=onednn`` forces the latter."""
    global _bf16_kernel
    if _bf16_kernel is None:
        forced = os.environ.get("SPECINFER_BF16_KERNEL", "")
        if forced and forced not in BF16_KERNELS:
            raise ValueError(f"SPECINFER_BF16_KERNEL must be one of {', '.join(BF16_KERNELS)}; "
                             f"got {forced!r}")
        _bf16_kernel = "onednn"
        wanted = {"amx_tile", "amx_bf16", "avx512bw", "avx512vl"}
        if forced != "onednn" and wanted <= native.cpu_flags():
            ops = native.library()
            if ops is not None and ops.amx_enable() and _bf16_amx_agrees():
                _bf16_kernel = "amx"
        log.info("bfloat16 linears kernel", extra={"kernel": _bf16_kernel})
    return _bf16_kernel


def _bf16_amx_agrees() -> bool:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(72, 600, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(72, generator=gen)
    x = (torch.randn(40, 600, generator=gen) * 3).to(torch.bfloat16)
    run = AmxBf16Linear(weight, bias)
    alone = torch.cat([run(x[i : i + 1]) for i in range(len(x))])
    want = x.double() @ weight.double().t() + bias.double()
    close = bool(((alone.double() - want).abs() <= 2 ** -6 * want.abs() + 1e-2).all())
    return close and all(torch.equal(run(x[:m]), alone[:m]) for m in (2, 7, 16, 17, 33, 40))


def _packed(weight: torch.Tensor, bias: torch.Tensor | None, compiled: bool = False,
            plan: Plan | None = None) -> Kernel | None:
    """oneDNN with the weight reordered once (float32 or bfloat16), or None without it
    (or when compiled: inductor cannot lower the packed op with dynamic shapes). In
    bfloat16 calls are cut by ``bfloat16_plan`` so that a row's output does not depend on
    how many rows come with it."""
    if compiled:
        return None
    k = weight.shape[1]
    if plan is None:
        plan = Plan(0, 0) if weight.dtype == torch.float32 else bfloat16_plan()
    parts = -(-k // plan.k_part) if plan.k_part else 1
    bounds = [k * i // parts for i in range(parts + 1)]
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(weight[:, a:b].contiguous(), 16)
                  for a, b in zip(bounds, bounds[1:], strict=False)]
    except (AttributeError, RuntimeError):  # a torch without oneDNN
        return None

    def one(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed[0], bias, "none", [], "")

    def summed(x: torch.Tensor) -> torch.Tensor:  # the reduction cut into parts
        out = bias
        for w, a, b in zip(packed, bounds, bounds[1:], strict=False):
            part = torch.ops.mkldnn._linear_pointwise(x[:, a:b], w, None, "none", [], "")
            out = part if out is None else out + part
        return out

    run = one if parts == 1 else summed
    if plan.rows:
        def pieces(x: torch.Tensor) -> torch.Tensor:  # at most plan.rows rows a call
            if x.shape[0] <= plan.rows:
                return run(x)
            return torch.cat([run(p) for p in x.split(plan.rows)])
    else:
        pieces = run
    if parts == 1:
        pieces.native = NativeForm(2, packed[0], None, bias, weight.shape[0], plan.rows)
    return pieces


class NativeForm(NamedTuple):
    """A linear as the native decoder loop calls it (``csrc/decoder_layers.cpp``)."""

    kind: int  # 1: our int8 AMX kernel; 2: oneDNN's packed kernel; 3: our bfloat16 AMX
    weight: torch.Tensor  # the AMX tiles, or oneDNN's packed weight
    scale: torch.Tensor | None  # int8: the per-output scale
    bias: torch.Tensor | None  # ours: float32
    out: int
    rows: int  # oneDNN: the most rows a call takes (0: all)


class Linear:
    """One projection (possibly several fused, e.g. q/k/v): ``small`` serves up to
    ``small_rows`` rows, ``large`` the rest. ``native``: the same kernel as the native
    decoder loop calls it, where it can."""

    def __init__(self, out_features: int, small: Kernel, large: Kernel | None = None,
                 small_rows: int = 0, native: NativeForm | None = None) -> None:
        self.out_features = out_features
        self.small, self.large = small, large or small
        self.small_rows = small_rows if large is not None else 1 << 30
        self.native = native

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, False)

    def float32(self, x: torch.Tensor) -> torch.Tensor:
        """The outputs in float32: unrounded where the kernel gives them so (our AMX
        kernels: the logits keep what bfloat16 would round away), else widened."""
        return self._run(x, True)

    def _run(self, x: torch.Tensor, float32: bool) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1])
        kernel = self.small if rows <= self.small_rows else self.large
        if not float32:
            out = kernel(flat)
        elif hasattr(kernel, "float32"):
            out = kernel.float32(flat)
        else:
            out = kernel(flat).float()
        return out.reshape(*x.shape[:-1], out.shape[-1])


class ModuleLinear:
    """A module called as it is: DeepSpeed's all-reducing tensor-parallel shards, fbgemm's
    quantized SSM linears."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def float32(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x).float()


def plain(module: torch.nn.Module) -> bool:
    """A linear this module can rebuild from its weight (not a sharded or quantized one)."""
    return type(module) is torch.nn.Linear


def build(modules: list[torch.nn.Linear], placement: Placement, measure: bool = True
          ) -> Linear:
    """One ``Linear`` computing the plain ``modules`` side by side (their outputs
    concatenated), in the placement's format on its device."""
    weight = torch.cat([m.weight.detach() for m in modules]).float()
    biases = [m.bias for m in modules]
    bias = None if all(b is None for b in biases) else torch.cat([
        b.detach().float() if b is not None else torch.zeros(m.out_features)
        for m, b in zip(modules, biases, strict=True)])
    out = weight.shape[0]
    act, dev = placement.dtype, placement.device
    if bias is not None:
        bias = bias.to(dev, act)
    if placement.cuda:  # cuBLAS picks its own kernels; graphs take away the overhead
        w = weight.to(dev, act).contiguous()
        return Linear(out, lambda x: F.linear(x, w, bias))
    if placement.quantize == "int8":  # one kernel for every row count: batch-invariant
        kernel = int8.kernel(weight, bias, act)
        native = NativeForm(1, kernel.tiles, kernel.scale, kernel.bias, out, 0) \
            if isinstance(kernel, int8.AmxLinear) else None
        return Linear(out, kernel, native=native)
    w = weight.to(act).contiguous()
    if act == torch.float32:
        packed = _packed(w, bias, placement.compile)
        if packed is None:
            return Linear(out, _blas(w, bias))
        return _routed(out, _blas(w, bias), packed, weight.shape[1], act, measure)
    if act == torch.bfloat16:  # one kernel for every row count: batch-independent rows
        if not placement.compile and bfloat16_kernel() == "amx":
            kernel = AmxBf16Linear(w, bias)
            return Linear(out, kernel, native=NativeForm(3, kernel.tiles, None, kernel.bias,
                                                         out, 0))
        kernel = _packed(w, bias, placement.compile)
        if kernel is None:
            return Linear(out, _blas(w, bias))
        return Linear(out, kernel, native=getattr(kernel, "native", None))
    return Linear(out, _blas(w, bias))


def _blas(weight: torch.Tensor, bias: torch.Tensor | None) -> Kernel:
    return lambda x: F.linear(x, weight, bias)


def _routed(out: int, small: Kernel, large: Kernel, in_features: int, act: torch.dtype,
            measure: bool, max_rows: int = 8) -> Linear:
    """``small`` up to the most rows at which it is still faster than ``large``."""
    if not measure:
        return Linear(out, large)

    def best_of(kernel: Kernel, x: torch.Tensor, reps: int = 3) -> float:
        kernel(x)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            kernel(x)
            best = min(best, time.perf_counter() - start)
        return best

    rows = 0
    with torch.inference_mode():
        while rows < max_rows:
            x = torch.randn(rows + 1, in_features).to(act)
            if best_of(small, x) >= best_of(large, x):
                break
            rows += 1
    return Linear(out, small, large, rows)
