"""Speculation modes under load: one stack per router ``--speculation`` mode, N concurrent
MT-Bench streams each, runs interleaved (mode A, B, C, A, B, C, ...) so drift cancels.

Answers "does micro-batch overlap pay here": ``overlap`` drafts for one half of the batch
while the other half is verified; ``always`` drafts for the whole batch, then verifies it.
The mode ``off`` is a stack whose requests all ask for no speculation: the baseline. Also
prints each stack's share of steps by speculation mode (what ``adaptive`` chose).

    python bench/modes.py [--modes off,always,overlap,adaptive,lookup,head,merged] [--streams 4]
                          [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from run import _wait  # noqa: E402

from specinfer.chat import chat_prompt_ids  # noqa: E402
from specinfer.client import AsyncClient  # noqa: E402
from specinfer.data import mtbench_first_turns  # noqa: E402
from specinfer.models import DEFAULT_LLM, load_tokenizer  # noqa: E402
from specinfer.net import free_port  # noqa: E402


async def _load(addr: str, prompts: list[str], streams: int, new_tokens: int,
                speculation: bool = True, first: int = 0) -> float:
    """Output tokens per second of ``streams`` concurrent greedy requests, on the prompts
    from index ``first`` on."""
    async with AsyncClient(addr, timeout=1800) as client:
        t = time.perf_counter()
        outs = await asyncio.gather(*(client.generate(prompts[(first + i) % len(prompts)],
                                                      max_tokens=new_tokens,
                                                      speculation=speculation)
                                      for i in range(streams)))
        return sum(o.completion_tokens for o in outs) / (time.perf_counter() - t)


def _step_shares(http_port: int) -> dict[str, float]:
    """The router's steps by speculation mode (``specinfer:steps_total``), as shares, over
    the whole run (warm-up included)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read()
    steps: dict[str, float] = {}
    for line in text.decode().splitlines():
        if line.startswith("specinfer:steps_total{"):
            mode = line.split('mode="', 1)[1].split('"', 1)[0]
            steps[mode] = steps.get(mode, 0.0) + float(line.rsplit(" ", 1)[1])
    total = sum(steps.values()) or 1.0
    return {m: n / total for m, n in sorted(steps.items(), key=lambda kv: -kv[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--modes", default="always,overlap,adaptive")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/results/modes.json")
    args = ap.parse_args()
    tok = load_tokenizer(DEFAULT_LLM)
    prompts = [tok.decode(chat_prompt_ids(tok, p)) for _, p in mtbench_first_turns(1)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stacks, http_ports, shares = {}, {}, {}
    try:
        for mode in args.modes.split(","):
            port, http_ports[mode] = free_port(), free_port()
            stacks[mode] = (port, subprocess.Popen(
                [sys.executable, "-m", "services", "up", "--port", str(port),
                 "--http-port", str(http_ports[mode]),
                 "--speculation", "adaptive" if mode == "off" else mode,
                 "--slots", str(max(8, args.streams))],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            _wait(f"127.0.0.1:{port}", stacks[mode][1])  # one at a time: they share cores
        for mode, (port, _) in stacks.items():  # warm-up (and the policy's first tries)
            asyncio.run(_load(f"127.0.0.1:{port}", prompts, args.streams, args.new_tokens,
                              mode != "off"))
        rates: dict[str, list[float]] = {m: [] for m in stacks}
        for rep in range(args.reps):  # each run on the next prompts
            for mode, (port, _) in stacks.items():
                rates[mode].append(asyncio.run(_load(f"127.0.0.1:{port}", prompts,
                                                     args.streams, args.new_tokens,
                                                     mode != "off", rep * args.streams)))
        shares = {mode: _step_shares(http_ports[mode]) for mode in stacks}
    finally:
        for _, proc in stacks.values():
            proc.send_signal(signal.SIGTERM)
        for _, proc in stacks.values():
            proc.wait(timeout=60)
    print(f"{args.streams} streams x {args.new_tokens} tokens, greedy, {args.reps} runs each")
    print(f"{'mode':<10} {'out tok/s':>10} {'spread':>13}")
    rows = []
    for mode, r in rates.items():
        rows.append({"mode": mode, "output_tokens_per_s": statistics.median(r),
                     "spread": [min(r), max(r)], "runs": r})
        print(f"{mode:<10} {statistics.median(r):>10.1f} {min(r):>6.1f}–{max(r):<6.1f}  "
              "steps: " + ", ".join(f"{m} {100 * v:.0f}%" for m, v in shares[mode].items()))
        rows[-1]["step_shares"] = shares[mode]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"streams": args.streams, "new_tokens":
                                          args.new_tokens, "modes": rows}, indent=2))


if __name__ == "__main__":
    main()
