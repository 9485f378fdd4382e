"""What the soak (``bench.soak``) watches besides its own requests: the stack it runs
(``specinfer up`` and its service processes), their resident memory and its slope, the
restarts ``up`` logged, the verifiers' live sequences, and the memory plot."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc

from specinfer.v1 import verifier_pb2, verifier_pb2_grpc


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def slope_mib_per_min(points: list[tuple[float, float]], warmup_s: float) -> float | None:
    """Least-squares slope of one process's (seconds, MiB) samples, those ``warmup_s`` after
    its first (a restarted process warms up too); None if too few remain."""
    pts = [(t, m) for t, m in points if t >= points[0][0] + warmup_s]
    if len(pts) < 5 or pts[-1][0] - pts[0][0] < 20:
        return None
    n = len(pts)
    mt, mm = sum(t for t, _ in pts) / n, sum(m for _, m in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    return 60 * sum((t - mt) * (m - mm) for t, m in pts) / var


async def live_sequences(verifiers: list[str], wait_s: float) -> dict[str, int | None]:
    """Each verifier's live sequences, polled until all are 0 or ``wait_s`` passes."""
    deadline, live = time.monotonic() + wait_s, {}
    while True:
        for addr in verifiers:
            async with grpc.aio.insecure_channel(addr) as channel:
                try:
                    info = await verifier_pb2_grpc.VerifierStub(channel).Info(
                        verifier_pb2.InfoRequest(), timeout=5)
                    live[addr] = info.live_sequences
                except grpc.aio.AioRpcError:
                    live[addr] = None
        if all(n == 0 for n in live.values()) or time.monotonic() > deadline:
            return live
        await asyncio.sleep(1.0)


def metrics_live(port: int) -> float | None:
    """``specinfer:verifier_sequences{state="live"}`` from a verifier's /metrics."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("specinfer:verifier_sequences{") and 'state="live"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def heap_sample(url: str) -> dict[str, float] | None:
    """A process's heap series from its /metrics (``specinfer.metrics.HeapCollector``), in
    MiB (Python's blocks in thousands); None if it does not answer."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        if line.startswith("specinfer:process_heap_bytes{"):
            state = line.split('state="', 1)[1].split('"', 1)[0]
            out[f"heap_{state}_mib"] = float(line.rsplit(" ", 1)[1]) / 2**20
        elif line.startswith("specinfer:process_python_blocks"):
            out["python_kblocks"] = float(line.rsplit(" ", 1)[1]) / 1000
    return out or None


def restarts_logged(log: Path) -> dict[str, int]:
    """Services ``up`` restarted, by role, from its structured log."""
    counts: dict[str, int] = {}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"service exited; restarting it"' in line:
            try:
                role = json.loads(line).get("role", "?")
            except json.JSONDecodeError:
                continue
            counts[role] = counts.get(role, 0) + 1
    return counts


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, points in sorted(report["memory_samples"].items()):
        slope = report["memory_slope_mib_per_min"][name]
        label = name if slope is None else f"{name}: {slope:+.1f} MiB/min"
        ax.plot([t / 60 for t, _ in points], [m for _, m in points], label=label)
    ax.axvspan(0, report["memory_warmup_s"] / 60, color="0.9", label="warm-up")
    for k in report["kills"]:
        ax.axvline(k["at_s"] / 60, color="red", linestyle=":", linewidth=1)
    ax.set_xlabel("minutes")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_title(f"soak: {report['args']['llm']}, {report['requests']} requests"
                 + (f", {report['args']['kill']} killed every {report['args']['kill_every']} s"
                    if report["args"]["kill"] else ""))
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
