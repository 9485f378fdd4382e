"""Speculation on vs off through one stack, one request at a time: MT-Bench first turns
(one per category), each with speculation on, then all off, then all on again (the policy
has learnt by then), per-request figures and the medians.

    python bench/onoff.py [--speculation adaptive|lookup|always|overlap] [--new-tokens 64]
                          [--per-category 1] [--temperature 0] [--seed 0]

Also prints the mean accepted tokens per step (tokens / LLM steps, pooled over the requests)
of each pass: what ``specinfer up``'s defaults accept on prompts its drafters never saw.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from run import _wait  # noqa: E402

from specinfer.chat import chat_prompt_ids  # noqa: E402
from specinfer.client import Client  # noqa: E402
from specinfer.data import mtbench_first_turns  # noqa: E402
from specinfer.models import DEFAULT_LLM, load_tokenizer  # noqa: E402
from specinfer.net import free_port  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--speculation", default="adaptive")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--per-category", type=int, default=1, help="MT-Bench first turns per "
                    "category (8 categories; 10 = all 80)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--seed", type=int, default=0, help="per request: seed + its index")
    args = ap.parse_args()
    tok = load_tokenizer(DEFAULT_LLM)
    prompts = [tok.decode(chat_prompt_ids(tok, p))
               for _, p in mtbench_first_turns(args.per_category)]
    port = free_port()
    stack = subprocess.Popen([sys.executable, "-m", "services", "up", "--port", str(port),
                              "--http-port", "0", "--speculation", args.speculation],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rates: dict[str, list[float]] = {}
    accepted: dict[str, list[int]] = {}
    try:
        _wait(f"127.0.0.1:{port}", stack)
        with Client(f"127.0.0.1:{port}", timeout=900) as client:
            for name, spec in (("on-first", True), ("off", False), ("on", True)):
                for k, prompt in enumerate(prompts):
                    t = time.perf_counter()
                    out = client.generate(prompt, max_tokens=args.new_tokens, speculation=spec,
                                          temperature=args.temperature, seed=args.seed + k)
                    rate = out.completion_tokens / (time.perf_counter() - t)
                    rates.setdefault(name, []).append(rate)
                    acc = out.accepted_per_step
                    accepted.setdefault(name, []).extend(acc)
                    print(f"{name:<9} {rate:6.1f} tok/s  steps {len(acc):3d}  speculative "
                          f"{out.stats.speculative_steps:3d}  accepted/step "
                          f"{sum(acc) / len(acc):.2f}", flush=True)
    finally:
        stack.send_signal(signal.SIGTERM)
        stack.wait(timeout=60)
    off = statistics.median(rates["off"])
    for name, r in rates.items():
        acc = accepted[name]
        print(f"median {name:<9} {statistics.median(r):6.1f} tok/s  "
              f"{statistics.median(r) / off:.2f}x off  accepted/step {sum(acc) / len(acc):.2f}")


if __name__ == "__main__":
    main()
