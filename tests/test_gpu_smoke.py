"""``bench/gpu_smoke.sh`` as a GPU machine runs it, as a dry run on the CPU (``DEVICE=cpu``):
every part of it (the wheels step skipped, the import check, ``bench.gpu_smoke`` on two
layers of SmolLM2's shape, the CUDA-marked tests' selection) runs and reports, so the one
GPU run a session may get does not fail on the script. On the CPU bfloat16 is
batch-invariant, so the dry run must find speculation exact and rows bitwise alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.processes  # the script, its Python and its pytest: subprocesses
def test_gpu_smoke_script_dry_run_on_the_cpu(tmp_path):
    env = os.environ | {"DEVICE": "cpu", "PYTHON": sys.executable, "OUT": str(tmp_path),
                        "WHEELS": str(tmp_path / "no-wheels")}
    run = subprocess.run(["bash", "bench/gpu_smoke.sh"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_smoke.json").read_text())
    ex = report["exactness"]
    for key in ("speculative_vs_plain_eager", "speculative_vs_plain_graphs",
                "graphs_vs_eager_plain"):
        assert ex[key]["identical"] == ex[key]["of"] == 3, (key, ex[key])
    assert ex["tokens_per_step_eager"] > 2.0  # the trees were accepted, not just verified
    for name in ("eager", "graphs"):
        assert all(r["bitwise"] for r in report["row_invariance"][name].values()), name
        cfg = report["configs"][name]
        assert all(cfg[k] > 0 for k in ("plain_b1_ms", "plain_b4_ms", "tree16_ms",
                                        "tree64_ms", "decode_b1_ms", "decode_b4_ms"))
    assert report["sampling"]["reproducible"]["identical"] == 3
    assert report["sampling"]["in_vocabulary"]
    assert report["transformers"]["generate_b1_ms"] > 0
    table = (tmp_path / "gpu_smoke_table.txt").read_text()
    for row in ("forward, graphs", "engine step, eager", "transformers generate",
                "tree step, graphs", "row invariance", "targets:", "untested here:"):
        assert row in table
    # The table is printed, and the CUDA-marked tests' summary under it.
    assert "ms per step" in run.stdout
    tests = (tmp_path / "cuda-tests.txt").read_text()
    assert "1 passed" in tests and "skipped" in tests, tests[-2000:]
