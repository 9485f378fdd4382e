"""What a drafting step costs over the wire: unary ``Speculate`` (each sequence's whole
history every step) vs ``SpeculateStream`` (only the tokens accepted since the last step),
at contexts of 128, 1k and 4k tokens, measured from the router's side with the router's own
stream client (services/router/speculate_stream.py).

A real speculator process (``specinfer serve speculator``, the default SmolLM2 pool and
drafters) on loopback; per (RPC, context, tree): a batch of sequences whose contexts grow by
an accepted path of 1-4 tokens plus one each step. Prints bytes sent per step and the
median and p90 step latency, writes JSON and a plot.

    python -m bench.speculate_rpc [--contexts 128,1024,4096] [--steps 40] [--batch 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from types import SimpleNamespace

import grpc

from services.router.speculate_stream import SpeculatorStream
from services.stack import stop_processes, wait_serving
from specinfer.net import free_port
from specinfer.v1 import common_pb2, speculator_pb2, speculator_pb2_grpc

TREES = {"ssm": [1, 1, 1], "model-free": [0]}  # the SSM pool's default tree; lookup only


async def measure(addr: str, rpc: str, context: int, expansion: list[int], steps: int,
                  batch: int, seed: int) -> dict:
    rng = random.Random(seed)
    seqs = [SimpleNamespace(id=f"{rpc}-{context}-{'-'.join(map(str, expansion))}-{i}",
                            history=[rng.randrange(1, 49152) for _ in range(context)])
            for i in range(batch)]
    sampling = [common_pb2.SamplingParams() for _ in seqs]
    trees = [speculator_pb2.TreeConfig(expansion=expansion, max_nodes=16) for _ in seqs]
    latencies, sizes = [], []
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = speculator_pb2_grpc.SpeculatorStub(channel)
        stream = SpeculatorStream(stub)
        for step in range(steps + 3):  # 3 warm-up steps (the first sends whole contexts)
            if rpc == "stream":
                before = stream.bytes_sent
                began = time.perf_counter()
                await stream.speculate(seqs, sampling, trees, 30.0)
                took, size = time.perf_counter() - began, stream.bytes_sent - before
            else:
                msg = speculator_pb2.SpeculateRequest(items=[
                    speculator_pb2.SpeculateItem(sequence_id=s.id, context=s.history,
                                                 sampling=p, tree=t)
                    for s, p, t in zip(seqs, sampling, trees, strict=True)])
                began = time.perf_counter()
                await stub.Speculate(msg, timeout=30)
                took, size = time.perf_counter() - began, msg.ByteSize()
            if step >= 3:
                latencies.append(took)
                sizes.append(size)
            for s in seqs:  # an accepted path of 0-4 tokens plus the bonus token
                s.history += [rng.randrange(1, 49152) for _ in range(rng.randrange(5) + 1)]
        stream.close()
    latencies.sort()
    return {"rpc": rpc, "context": context, "tree": expansion, "batch": batch,
            "bytes_per_step": statistics.mean(sizes),
            "median_ms": 1000 * statistics.median(latencies),
            "p90_ms": 1000 * latencies[int(0.9 * (len(latencies) - 1))]}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for tree in TREES:
        for rpc, style in (("unary", "o-"), ("stream", "s--")):
            pts = [r for r in rows if r["rpc"] == rpc and r["tree_name"] == tree]
            xs = [r["context"] for r in pts]
            left.plot(xs, [r["bytes_per_step"] for r in pts], style, label=f"{rpc}, {tree}")
            right.plot(xs, [r["median_ms"] for r in pts], style, label=f"{rpc}, {tree}")
    for ax, title in ((left, "request bytes per step"), (right, "median step latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_title(title)
        ax.legend()
    left.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="128,1024,4096")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default=f"bench/results/speculate_rpc-{date.today()}")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services", "serve", "speculator",
                             "--port", str(port), "--max-context", str(max(contexts) + 512)],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    addr = f"127.0.0.1:{port}"
    rows = []
    try:
        if not wait_serving(addr, [proc], 600):
            sys.exit("the speculator did not start")
        for context in contexts:
            for tree, expansion in TREES.items():
                for rpc in ("unary", "stream"):
                    row = asyncio.run(measure(addr, rpc, context, expansion, args.steps,
                                              args.batch, seed=context))
                    row["tree_name"] = tree
                    rows.append(row)
                    print(f"{rpc:>6}  context {context:>5}  {tree:>10}  "
                          f"{row['bytes_per_step']:>8.0f} B/step  "
                          f"median {row['median_ms']:6.2f} ms  p90 {row['p90_ms']:6.2f} ms",
                          flush=True)
    finally:
        stop_processes([proc])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out}.json and {out}.png")


if __name__ == "__main__":
    main()
