"""What tracing costs, and how fast ``/metrics`` answers under load: two stacks of the
default models side by side (``specinfer up``), one with tracing off, one exporting every
span over OTLP/gRPC to a real receiver in this process. Rounds alternate between them (the
order flips each round, so drift on a noisy machine falls on both); each round measures
tokens/s at batch 1 (MT-Bench first turns, one at a time) and at 8 concurrent streams,
while a thread scrapes the router's ``/metrics`` every 0.2 s.

    python -m bench.tracing [--rounds 3] [--new-tokens 64] [--streams 8]

Writes bench/results/tracing-<date>.json and .png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from bench.harness import Stack, mtbench_prompts, time_prompts
from bench.otlp_receiver import OtlpReceiver

RESULTS = Path(__file__).parent / "results"


class Scraper(threading.Thread):
    """Scrapes a /metrics URL every ``every`` seconds; keeps each answer's latency."""

    def __init__(self, url: str, every: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.url, self.every = url, every
        self.latencies: list[float] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            t = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=10) as resp:
                resp.read()
            self.latencies.append(time.perf_counter() - t)
            self.done.wait(self.every)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8, help="MT-Bench first turns at batch 1")
    ap.add_argument("--speculation", default="always",
                   help="the same mode in both stacks (adaptive would choose by timings, "
                        "which differ by noise)")
    args = ap.parse_args()
    prompts = mtbench_prompts(1)[: args.prompts]
    receiver = OtlpReceiver().start()
    flags = {"off": [], "on": ["--otlp-traces-endpoint", receiver.endpoint]}
    figures = {name: {"batch1": [], "streams": [], "scrape_ms": []} for name in flags}
    with ExitStack() as running:
        running.callback(receiver.stop)
        stacks = {name: running.enter_context(Stack(["--speculation", args.speculation, *f]))
                  for name, f in flags.items()}
        for stack in stacks.values():  # warm: first requests pay one-time costs
            time_prompts(stack.addr, prompts[:1], new_tokens=8)
        for r in range(args.rounds):
            for name in list(stacks) if r % 2 == 0 else list(stacks)[::-1]:
                stack = stacks[name]
                b1 = time_prompts(stack.addr, prompts, new_tokens=args.new_tokens).tokens_per_s
                scraper = Scraper(f"{stack.http}/metrics")
                scraper.start()
                work = (prompts * args.streams)[: args.streams]
                st = time_prompts(stack.addr, work, streams=args.streams,
                                  new_tokens=args.new_tokens).tokens_per_s
                scraper.done.set()
                scraper.join()
                f = figures[name]
                f["batch1"].append(b1)
                f["streams"].append(st)
                f["scrape_ms"] += [x * 1e3 for x in scraper.latencies]
                print(f"round {r + 1} tracing {name:<3}  batch 1 {b1:6.1f} tok/s   "
                      f"{args.streams} streams {st:6.1f} tok/s   /metrics p50 "
                      f"{statistics.median(scraper.latencies) * 1e3:5.1f} ms  max "
                      f"{max(scraper.latencies) * 1e3:5.1f} ms", flush=True)
    summary = {}
    for name, f in figures.items():
        ms = sorted(f["scrape_ms"])
        summary[name] = {"batch1_tok_s": statistics.median(f["batch1"]),
                         "streams_tok_s": statistics.median(f["streams"]),
                         "metrics_p50_ms": ms[len(ms) // 2],
                         "metrics_p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
                         "metrics_max_ms": ms[-1], "scrapes": len(ms)}
    on, off = summary["on"], summary["off"]
    cost = {k: 1 - on[k] / off[k] for k in ("batch1_tok_s", "streams_tok_s")}
    print(f"\nmedians over {args.rounds} rounds (tokens/s; cost = 1 - on/off):")
    print(f"  batch 1     off {off['batch1_tok_s']:6.1f}  on {on['batch1_tok_s']:6.1f}  "
          f"cost {cost['batch1_tok_s']:+.1%}")
    print(f"  {args.streams} streams   off {off['streams_tok_s']:6.1f}  on "
          f"{on['streams_tok_s']:6.1f}  cost {cost['streams_tok_s']:+.1%}")
    for name in ("off", "on"):
        s = summary[name]
        print(f"  /metrics under load (tracing {name}): p50 {s['metrics_p50_ms']:.1f} ms  "
              f"p99 {s['metrics_p99_ms']:.1f} ms  max {s['metrics_max_ms']:.1f} ms "
              f"({s['scrapes']} scrapes)")
    print(f"  spans received: {len(receiver.spans)}")
    date = datetime.date.today().isoformat()
    RESULTS.mkdir(exist_ok=True)
    out = {"date": date, "args": vars(args), "rounds": figures, "summary": summary,
           "cost": cost, "spans_received": len(receiver.spans)}
    (RESULTS / f"tracing-{date}.json").write_text(json.dumps(out, indent=2) + "\n")
    _plot(figures, args.streams, RESULTS / f"tracing-{date}.png")


def _plot(figures: dict, n: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, title in ((axes[0], "batch1", "batch 1"), (axes[1], "streams",
                                                              f"{n} streams")):
        for i, name in enumerate(("off", "on")):
            values = figures[name][key]
            ax.bar(i, statistics.median(values), color=("#888", "#3a7")[i])
            ax.plot([i] * len(values), values, "k.", ms=4)
        ax.set_xticks([0, 1], ["tracing off", "tracing on"])
        ax.set_title(title)
        ax.set_ylabel("tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
