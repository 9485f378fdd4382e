"""Speculation modes under load: one stack per router ``--speculation`` mode, N concurrent
MT-Bench streams each, runs interleaved (mode A, B, C, A, B, C, ...) so drift cancels.

Answers "does micro-batch overlap pay here": ``overlap`` drafts for one half of the batch
while the other half is verified; ``always`` drafts for the whole batch, then verifies it.
The mode ``off`` is a stack whose requests all ask for no speculation: the baseline. Also
prints each stack's share of steps by speculation mode (what ``adaptive`` chose).

    python -m bench.modes [--modes off,always,overlap,adaptive,lookup,head,merged] [--streams 4]
                          [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from bench.harness import Stack, mtbench_prompts, time_prompts


def _step_shares(stack: Stack) -> dict[str, float]:
    """The router's steps by speculation mode (``specinfer:steps_total``), as shares, over
    the whole run (warm-up included)."""
    text = urllib.request.urlopen(f"{stack.http}/metrics", timeout=10).read()
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
    prompts = mtbench_prompts(1)
    stacks: dict[str, Stack] = {}
    with ExitStack() as running:
        for mode in args.modes.split(","):  # one at a time: they share cores
            stacks[mode] = running.enter_context(Stack(
                ["--speculation", "adaptive" if mode == "off" else mode,
                 "--slots", str(max(8, args.streams))]))

        def rate(mode: str, first: int) -> float:
            """``args.streams`` requests at once, on the prompts from index ``first`` on."""
            batch = [prompts[(first + i) % len(prompts)] for i in range(args.streams)]
            return time_prompts(stacks[mode].addr, batch, streams=args.streams,
                                new_tokens=args.new_tokens,
                                speculation=mode != "off").tokens_per_s

        for mode in stacks:  # warm-up (and the policy's first tries)
            rate(mode, 0)
        rates: dict[str, list[float]] = {m: [] for m in stacks}
        for rep in range(args.reps):  # each run on the next prompts
            for mode in stacks:
                rates[mode].append(rate(mode, rep * args.streams))
        shares = {mode: _step_shares(stack) for mode, stack in stacks.items()}
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
