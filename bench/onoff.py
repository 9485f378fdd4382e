"""Speculation on vs off through one stack, one request at a time: MT-Bench first turns
(one per category), each with speculation on, then all off, then all on again (the policy
has learnt by then), per-request figures and the medians.

    python bench/onoff.py [--speculation adaptive|lookup|always|overlap] [--new-tokens 64]
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
    args = ap.parse_args()
    tok = load_tokenizer(DEFAULT_LLM)
    prompts = [tok.decode(chat_prompt_ids(tok, p)) for _, p in mtbench_first_turns(1)]
    port = free_port()
    stack = subprocess.Popen([sys.executable, "-m", "services", "up", "--port", str(port),
                              "--http-port", "0", "--speculation", args.speculation],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rates: dict[str, list[float]] = {}
    try:
        _wait(f"127.0.0.1:{port}", stack)
        with Client(f"127.0.0.1:{port}", timeout=900) as client:
            for name, spec in (("on-first", True), ("off", False), ("on", True)):
                for prompt in prompts:
                    t = time.perf_counter()
                    out = client.generate(prompt, max_tokens=args.new_tokens, speculation=spec)
                    rate = out.completion_tokens / (time.perf_counter() - t)
                    rates.setdefault(name, []).append(rate)
                    acc = out.accepted_per_step
                    print(f"{name:<9} {rate:6.1f} tok/s  steps {len(acc):3d}  speculative "
                          f"{out.stats.speculative_steps:3d}  accepted/step "
                          f"{sum(acc) / len(acc):.2f}", flush=True)
    finally:
        stack.send_signal(signal.SIGTERM)
        stack.wait(timeout=60)
    off = statistics.median(rates["off"])
    for name, r in rates.items():
        print(f"median {name:<9} {statistics.median(r):6.1f} tok/s  "
              f"{statistics.median(r) / off:.2f}x off")


if __name__ == "__main__":
    main()
