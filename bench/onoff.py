"""Speculation on vs off through one stack, per request (its ``speculation`` field): the
aggregate output tokens/s of MT-Bench first turns at each number of concurrent streams,
off and on interleaved, after one warm-up pass with speculation on (what an adaptive router
learns). Prints a Markdown table (tokens/s, on/off, accepted tokens per LLM step, TTFT,
TPOT, and for greedy runs how many outputs are identical with and without speculation);
writes JSON with ``--out``.

    python -m bench.onoff [--streams 1,2,4,8] [--new-tokens 128] [--per-category 1]
                          [--reps 1] [--temperature 0] [--seed 0] [--out FILE]
                          [--up "--speculation lookup ..."] [--code DIR]

The default stack is ``specinfer up`` with its defaults; ``--up`` adds flags to it;
``--code`` runs it from another checkout (before/after a change: ``git worktree add DIR
COMMIT``).
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from bench.harness import Stack, format_on_off, mtbench_prompts, speculation_on_off


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--streams", default="1,2,4,8", help="concurrent streams, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=128, help="max_tokens of each request")
    ap.add_argument("--per-category", type=int, default=1, help="MT-Bench first turns per "
                    "category (8 categories; 10 = all 80)")
    ap.add_argument("--prompts", type=int, default=0,
                    help="only the first this many of them (0: all)")
    ap.add_argument("--reps", type=int, default=1, help="passes per level and setting")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--seed", type=int, default=0, help="per request: seed + its index")
    ap.add_argument("--up", default="", help="more flags for specinfer up, one string")
    ap.add_argument("--out", type=Path, default=None, help="JSON of the rows")
    ap.add_argument("--log", type=Path, default=None,
                    help="keep the stack's log here (the policy's choices are in it)")
    ap.add_argument("--code", type=Path, default=None,
                    help="run the stack from this checkout (default: this one)")
    args = ap.parse_args()
    prompts = mtbench_prompts(args.per_category)[: args.prompts or None]
    levels = [int(n) for n in args.streams.split(",")]
    with Stack(shlex.split(args.up), args.log, code=args.code) as stack:
        rows = speculation_on_off(stack.addr, prompts, levels, new_tokens=args.new_tokens,
                                  reps=args.reps, temperature=args.temperature,
                                  seed=args.seed if args.temperature > 0 else None,
                                  metrics_url=f"{stack.http}/metrics")
    print(f"\n{len(prompts)} MT-Bench first turns x {args.new_tokens} tokens, temperature "
          f"{args.temperature}, {args.reps} pass(es) per cell, specinfer up {args.up}".rstrip())
    print(format_on_off(rows))
    for row in rows:
        print(f"{row['streams']} streams, router iterations by mode: off "
              f"{row['off'].get('steps_by_mode')}, on {row['on'].get('steps_by_mode')}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "prompts": len(prompts), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
