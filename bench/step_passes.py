"""Forward passes per router iteration on a mixed batch, per speculation mode: half the
streams speculate, half do not (the request's ``speculation`` field), so every step mixes
plain rows with tree or self-drafting rows. The verifier counts its Step calls' forward
passes (``specinfer:verifier_forward_passes_total``), the router its iterations
(``specinfer:steps_total``): one pass per iteration, two in the overlap modes (one per
micro-batch).

    python -m bench.step_passes [--modes always,overlap,lookup,head,merged] [--streams 4]
"""

from __future__ import annotations

import argparse
import asyncio

from bench.harness import Stack, mtbench_prompts, run_pass, scrape
from specinfer.client import AsyncClient
from specinfer.net import free_port

STEPS, PASSES = "specinfer:steps_total", "specinfer:verifier_forward_passes_total"


def overlapped(series: str) -> bool:
    """Whether a steps_total series is an overlap mode's (two micro-batches a step)."""
    return "overlap" in series


async def mixed_load(addr: str, prompts: list[str], streams: int, new_tokens: int) -> None:
    """``streams`` concurrent streams, half with speculation on, half off."""
    async with AsyncClient(addr, timeout=1800) as client:
        half = max(1, streams // 2)
        await asyncio.gather(
            run_pass(client, prompts, streams=half, new_tokens=new_tokens, speculation=True),
            run_pass(client, prompts, streams=streams - half or 1, new_tokens=new_tokens,
                     speculation=False))


def measure(mode: str, streams: int, prompts: list[str], new_tokens: int) -> dict:
    metrics_port = free_port()
    with Stack(["--speculation", mode, "--spec-max-batch", str(streams),
                "--metrics-port", str(metrics_port)]) as stack:
        router, verifier = f"{stack.http}/metrics", f"http://127.0.0.1:{metrics_port}/metrics"
        steps0 = scrape(router, STEPS)
        passes0 = sum(scrape(verifier, PASSES).values())
        asyncio.run(mixed_load(stack.addr, prompts, streams, new_tokens))
        steps = {k: v - steps0.get(k, 0.0) for k, v in scrape(router, STEPS).items()}
        passes = sum(scrape(verifier, PASSES).values()) - passes0
    two = sum(v for k, v in steps.items() if overlapped(k))
    return {"mode": mode, "iterations": sum(steps.values()), "overlapped": two,
            "forward_passes": passes, "expected": sum(steps.values()) + two}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="always,overlap,lookup,head,merged")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    prompts = mtbench_prompts(1)[: args.prompts]
    print("| --speculation | router iterations | of them overlapped | verifier forward "
          "passes | expected (1 per iteration, 2 overlapped) |")
    print("|---|---|---|---|---|")
    for mode in args.modes.split(","):
        r = measure(mode, args.streams, prompts, args.new_tokens)
        print(f"| {r['mode']} | {r['iterations']:.0f} | {r['overlapped']:.0f} | "
              f"{r['forward_passes']:.0f} | {r['expected']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
