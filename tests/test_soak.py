"""A one-minute soak (``python -m bench.soak``) of `specinfer up` on the tiny models: every
request is answered once, completely or with the status its kind expects; the verifier's KV
slots are all free at the end; no service died; memory does not climb."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Generous: a minute is mostly warm-up (the verifier grew up to ~50 MiB/min in its first
# minute, ~11 MiB/min over five, decelerating); a leaked KV slot or logits row per request
# (~300 KiB / 200 KiB, ~12 requests a second here) would climb 140-200 MiB/min or more.
SLOPE_MIB_PER_MIN = 100.0
REFUSED = {"invalid_argument", "not_found"}  # a bad request's answers (a model not served)


@pytest.mark.slow
@pytest.mark.processes  # `specinfer up` under bench/soak.py
def test_one_minute_soak_loses_nothing(tiny_chat_llm, tmp_path):
    out = tmp_path / "soak"
    run = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--minutes", "1", "--llm",
         tiny_chat_llm, "--ssm", f"{tiny_chat_llm}#layers=1", "--datastore", "none",
         "--draft-head", "none", "--slots", "8", "--max-context", "512", "--out", str(out)],
        capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert (out / "soak.json").exists(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "soak.json").read_text())
    assert report["checks"] == {
        "every request answered once": True, "every outcome as expected": True,
        "verifier slots free at the end": True, "no service died but those killed": True,
        "up stopped cleanly": True}, report["unexpected"]
    assert run.returncode == 0 and report["passed"]
    outcomes = report["outcomes"]
    assert report["requests"] > 100 and report["unexpected_count"] == 0
    assert not report["lost_in_flight"] and report["up_exit_code"] == 0
    assert set(report["live_sequences_at_end"].values()) == {0}
    # The mix ran: completions of every good kind, refusals of every bad one.
    for kind in ("stream", "unary", "sampled", "http"):
        assert outcomes[kind].get("complete", 0) > 0, (kind, outcomes[kind])
    assert outcomes["cancel"].get("cancelled", 0) > 0
    assert outcomes["bad"] and set(outcomes["bad"]) <= REFUSED
    assert outcomes["http_bad"] and set(outcomes["http_bad"]) <= REFUSED
    assert report["speculative_steps"] > 0  # the quiet spell: the router speculated
    slopes = report["memory_slope_mib_per_min"]
    assert {name.split("[")[0] for name in slopes} == {"up", "router", "speculator",
                                                       "verifier"}
    for name, slope in slopes.items():
        assert slope is not None and abs(slope) < SLOPE_MIB_PER_MIN, (name, slope)
    assert (out / "memory.png").stat().st_size > 0


def test_the_linears_per_shape_caches_are_bounded():
    """A packed linear keeps a oneDNN/ideep cache entry per row count it runs at; the
    capacities specinfer sets (``specinfer/__init__.py``) bound that: 2 weight shapes at
    300 new row counts grow the C heap by well under what the libraries' defaults
    allowed."""
    import torch

    from specinfer import linears
    from specinfer.metrics import _mallinfo2
    from specinfer.placement import resolve

    mallinfo = _mallinfo2()
    if mallinfo is None:
        pytest.skip("not glibc: no mallinfo2")

    def in_use() -> float:
        info = mallinfo()
        return (info.uordblks + info.hblkhd) / 2**20

    placement = resolve("cpu", "float32")
    kernels = [linears.build([torch.nn.Linear(576, n, bias=False)], placement, measure=False)
               for n in (576, 1728)]
    before = in_use()
    with torch.inference_mode():
        for rows in range(1000, 1300):  # row counts no other test ran
            x = torch.randn(rows, 576)
            for kernel in kernels:
                kernel(x)
    assert in_use() - before < 250
