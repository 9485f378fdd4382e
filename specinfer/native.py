"""The project's own CPU kernels (``specinfer/csrc/*.cpp``), built on first use.

torch compiles them with the machine's C++ compiler (about 27 s on 2 cores, once per
version of the sources, cached under ``TORCH_EXTENSIONS_DIR``) and registers them as
``torch.ops.specinfer.*``: the int8 and bfloat16 AMX linears (``specinfer.int8``,
``specinfer.linears``), and the batch-invariant formats' attention, RMSNorm and decoder
loop (``specinfer.runtime``, ``specinfer.layers``).
Where they cannot be built (no compiler, as in the container image) every caller runs
torch's operators instead, exact within the format too, slower.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = sorted(str(p) for p in (Path(__file__).parent / "csrc").glob("*.cpp"))
HEADERS = sorted(str(p) for p in (Path(__file__).parent / "csrc").glob("*.h"))

_ops = None
_loaded = False


def library():
    """``torch.ops.specinfer``, built on first use; None where it cannot be."""
    global _ops, _loaded
    if not _loaded:
        _loaded = True
        try:
            from torch.utils.cpp_extension import load
            start = time.perf_counter()
            # torch runs `ninja` by name: the one pip installs beside this Python (make
            # setup's venv) when none is on PATH (a venv used without activating it).
            here = str(Path(sys.executable).parent)
            if shutil.which("ninja") is None and shutil.which("ninja", path=here):
                os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
            # -fopenmp: at::parallel_for runs on one thread without it; -ffp-contract=off:
            # products and sums round one by one, as torch's elementwise operators do
            # One build per version of the sources: checkouts of other commits (a
            # benchmark's A/B worktree) keep theirs instead of rebuilding over each other.
            digest = hashlib.sha256(b"".join(Path(p).read_bytes()
                                             for p in SOURCES + HEADERS))
            load(name=f"specinfer_native_{digest.hexdigest()[:12]}", sources=SOURCES,
                 extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"],
                 extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
            _ops = torch.ops.specinfer
            log.info("native kernels loaded",
                     extra={"seconds": round(time.perf_counter() - start, 1)})
        except Exception as exc:  # no compiler, ninja or headers: torch's operators
            log.warning("native kernels unavailable, using torch's operators",
                        extra={"error": str(exc)[:200]})
    return _ops


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``): which of our kernels may run here."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())
