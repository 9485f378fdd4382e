"""Where a model's tensors live and in what number format: ``--device``, ``--dtype``,
``--quantize`` and ``--compile``, resolved once per process.

``auto`` picks CUDA in bfloat16 when a GPU is visible, else the CPU in float32: the CPU
default stays token-identical to transformers' float32 ``generate``. The faster CPU choices
(bfloat16, weight-only int8) are the user's, with the exactness README's "Devices and
number formats" states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specinfer.config import Flags, flag
from specinfer.models import ModelError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZE = ("none", "int8")
COMPILE = ("auto", "on", "off")


class PlacementError(ModelError):
    """A device/dtype/quantization combination this machine cannot run; says why."""


@dataclass(frozen=True)
class Placement:
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32  # weights (int8: the activations), KV cache
    quantize: str = "none"  # "int8": weight-only int8 linears, per-channel scales
    compile: bool = False  # captured steps (CUDA graphs on a GPU, torch.compile on a CPU)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        fmt = "int8" if self.quantize == "int8" else str(self.dtype).removeprefix("torch.")
        return f"{self.device} {fmt}" + (" compiled" if self.compile else "")

    @property
    def weight_format(self) -> str:
        """What ``Info.dtype`` reports: the weights' format (int8 with its activations')."""
        name = str(self.dtype).removeprefix("torch.")
        return f"int8-{name}" if self.quantize == "int8" else name


def resolve(device: str = "auto", dtype: str = "auto", quantize: str = "none",
            compile: str = "auto") -> Placement:
    """The placement the flags name, or ``PlacementError`` naming the flag."""
    if device == "auto":
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    else:
        try:
            dev = torch.device(device)
        except RuntimeError:
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            raise PlacementError(f"--device must be {DEVICE_CHOICES}; got {device!r}")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise PlacementError(f"--device {device}: no CUDA GPU is visible to this "
                                     "process (torch.cuda.is_available() is false)")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise PlacementError(f"--device {device}: only {torch.cuda.device_count()} "
                                     "GPU(s) visible")
    if dtype == "auto":
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    elif dtype in DTYPES:
        dt = DTYPES[dtype]
    else:
        raise PlacementError(f"--dtype must be auto or one of {', '.join(DTYPES)}; "
                             f"got {dtype!r}")
    if quantize not in QUANTIZE:
        raise PlacementError(f"--quantize must be one of {', '.join(QUANTIZE)}; "
                             f"got {quantize!r}")
    if quantize == "int8":
        if dev.type != "cpu":
            raise PlacementError("--quantize int8 runs on the CPU (torch's packed int8 "
                                 "kernels); on a GPU use --dtype bfloat16")
        if dtype == "auto":
            dt = torch.bfloat16  # the int8 kernels' fast activation format
        if dt == torch.float16:
            raise PlacementError("--quantize int8 takes --dtype bfloat16 or float32 "
                                 "activations")
    if compile not in COMPILE:
        raise PlacementError(f"--compile must be one of {', '.join(COMPILE)}; got {compile!r}")
    # auto: captured graphs on a GPU; on the CPU torch.compile measured no faster end to end
    # (docs/results.md), so eager.
    compiled = compile == "on" or (compile == "auto" and dev.type == "cuda")
    return Placement(dev, dt, quantize, compiled)


@dataclass(frozen=True)
class PlacementFlags(Flags):
    """The four flags on every command that holds a model."""

    device: str = flag("auto", f"{DEVICE_CHOICES} (auto: the first GPU if any, else the CPU)")
    dtype: str = flag("auto", "weights, activations and KV cache (auto: bfloat16 on a GPU, "
                      "float32 on the CPU, token-identical to transformers)",
                      choices=("auto", *DTYPES))
    quantize: str = flag("none", "int8: weight-only int8 linears on the CPU (fastest; greedy "
                         "output may differ from float32 at near-ties)", choices=QUANTIZE)
    compile: str = flag("auto", "captured steps: CUDA graphs on a GPU (auto: on there), "
                        "torch.compile on the CPU (auto: off there)", choices=COMPILE,
                        shortcuts=(("--no-compile", "off",
                                    "eager steps everywhere (same as --compile off)"),))

    def resolve(self) -> Placement:
        return resolve(self.device, self.dtype, self.quantize, self.compile)
