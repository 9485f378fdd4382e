"""Prefix caching, prefix-aware routing and chunked prefill, through ``specinfer up``.

1. Shared system prompt: N users (32) share one system prompt of ~1,000 tokens, each asks
   a short question (an MT-Bench first turn), 64 tokens generated, 4 streams: prefix
   caching on against ``--no-prefix-caching`` (its own stack): time to first token p50,
   aggregate tokens/s, hit rate, outputs identical.
2. No speculation tax: on the caching stack, the same workload once with speculation on
   and once off (per request; each pass its own ``cache_salt``, so each starts cold):
   the hit rates.
3. Routing: two verifiers, four shared prefixes, the users of each spread over the run,
   4 streams: ``--routing prefix`` against ``--routing load``: the share of prompt tokens
   cached after each prefix's first request, and tokens/s.
4. Chunked prefill: 4 streams generating while a ~2,000-token prompt is admitted
   (``--max-context 4096``): the streams' inter-token gaps p90 without the admission and
   during it, with the default ``--prefill-step-ratio`` (a prefill computes about half a
   step's time between two steps) and with ``0`` (the whole prompt at once, the steps
   waiting for it: as before chunked prefill).
5. ``copy``, in process: what reusing a cached prefix costs (the KV copy between slots)
   against computing it.

    python -m bench.prefix_cache [--users 32] [--parts 1,2,3,4,copy] [--flags "..."]

Writes bench/results/prefix-cache-<date>/report.json (and prints the tables)."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import time
from datetime import date
from pathlib import Path

from bench.harness import Stack, mtbench_prompts, write_report
from specinfer.client import AsyncClient
from specinfer.models import DEFAULT_LLM, load_tokenizer


def system_prompt(tokens: int) -> str:
    """Real text of about ``tokens`` tokens: MT-Bench questions as an assistant's notes."""
    tok = load_tokenizer(DEFAULT_LLM)
    text = "You are a careful assistant. Reference notes follow; use them when relevant.\n"
    for i, turn in enumerate(mtbench_prompts(10)):
        if len(tok.encode(text)) >= tokens:
            break
        text += f"Note {i + 1}: {turn}\n"
    return text


async def ask(client: AsyncClient, system: str, question: str, max_tokens: int, *,
              salt: str = "", speculation: bool = True, ignore_eos: bool = False) -> dict:
    """One streamed chat request: its tokens, time to first token, the gaps between its
    chunks (start, end, per token), and its usage."""
    sent = time.perf_counter()
    ids, gaps, first, last, end = [], [], None, None, None
    async for chunk in client.stream(messages=[{"role": "system", "content": system},
                                               {"role": "user", "content": question}],
                                     max_tokens=max_tokens, cache_salt=salt,
                                     speculation=speculation, ignore_eos=ignore_eos):
        now = time.perf_counter()
        if chunk.token_ids:
            if last is not None:
                gaps += [(last, now, (now - last) / len(chunk.token_ids))] * \
                    len(chunk.token_ids)
            first = now - sent if first is None else first
            last = now
        ids += chunk.token_ids
        end = chunk if chunk.finish_reason else end
    return {"ids": ids, "ttft_s": first, "gaps": gaps, "prompt": end.prompt_tokens,
            "cached": end.cached_prompt_tokens}


async def workload(addr: str, jobs: list[tuple[str, str]], streams: int, max_tokens: int,
                   **kw) -> dict:
    """``jobs`` (system prompt, question) sent in order by ``streams`` clients."""
    results: list[dict | None] = [None] * len(jobs)
    queue = iter(enumerate(jobs))
    async with AsyncClient(addr, timeout=1800) as client:
        async def worker() -> None:
            for k, (system, question) in queue:
                results[k] = await ask(client, system, question, max_tokens, **kw)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        wall = time.perf_counter() - start
    prompt = sum(r["prompt"] for r in results)
    return {"tokens_per_s": sum(len(r["ids"]) for r in results) / wall,
            "ttft_p50_s": statistics.median(r["ttft_s"] for r in results),
            "hit_rate": sum(r["cached"] for r in results) / prompt,
            "prompt_tokens": prompt, "requests": results}


def shared_prompt(users: int, flags: list[str]) -> dict:
    system = system_prompt(1000)
    jobs = [(system, q) for q in mtbench_prompts(10)[:users]]
    out = {}
    for name, extra in (("on", []), ("off", ["--no-prefix-caching"])):
        with Stack(flags + extra) as stack:
            out[name] = asyncio.run(workload(stack.addr, jobs, 4, 64))
            if name == "on":  # 2: the same stack, speculation off, its own cold salt
                out["on_speculation_off"] = asyncio.run(workload(
                    stack.addr, jobs, 4, 64, speculation=False, salt="no-speculation"))
    on, off = out["on"], out["off"]
    return {"ttft_p50_s": {"on": on["ttft_p50_s"], "off": off["ttft_p50_s"]},
            "ttft_ratio": off["ttft_p50_s"] / on["ttft_p50_s"],
            "tokens_per_s": {"on": on["tokens_per_s"], "off": off["tokens_per_s"]},
            "throughput_ratio": on["tokens_per_s"] / off["tokens_per_s"],
            "hit_rate": {"on": on["hit_rate"], "off": off["hit_rate"],
                         "speculation_off": out["on_speculation_off"]["hit_rate"]},
            "identical": [r["ids"] for r in on["requests"]]
            == [r["ids"] for r in off["requests"]]
            == [r["ids"] for r in out["on_speculation_off"]["requests"]],
            "system_prompt_tokens": len(load_tokenizer(DEFAULT_LLM).encode(system)),
            "users": users}


def routing(users: int, flags: list[str]) -> dict:
    """Four system prompts (~1,000 tokens of different notes each), users interleaved, short
    questions and answers (16 tokens): the prompt's cost dominates."""
    tok = load_tokenizer(DEFAULT_LLM)
    notes = mtbench_prompts(10)
    systems = []
    for k in range(4):
        text = f"You are assistant {k}. Notes:\n"
        for note in notes[k::4] + notes:
            if len(tok.encode(text)) >= 1000:
                break
            text += note + "\n"
        systems.append(text)
    questions = [f"Question {i}: which note is the most useful, in one word?"
                 for i in range(users)]
    jobs = [(systems[i % 4], questions[i]) for i in range(users)]
    out = {}
    for mode in ("prefix", "load"):
        with Stack(flags + ["--verifiers", "2", "--routing", mode]) as stack:
            run = asyncio.run(workload(stack.addr, jobs, 4, 16))
        later = run["requests"][4:]  # after each prefix's first request
        out[mode] = {"tokens_per_s": run["tokens_per_s"],
                     "hit_rate_after_first": sum(r["cached"] for r in later)
                     / sum(r["prompt"] for r in later),
                     "hit_rate": run["hit_rate"]}
    return out


def chunked_prefill(flags: list[str]) -> dict:
    tok = load_tokenizer(DEFAULT_LLM)
    long_system = system_prompt(2000)
    out = {"long_prompt_tokens": len(tok.encode(long_system))}
    for name, extra in (("chunked", []), ("blocking", ["--prefill-step-ratio", "0"])):
        with Stack(flags + ["--max-context", "4096", *extra]) as stack:
            out[name] = asyncio.run(_admission(stack.addr, long_system))
    return out


async def _admission(addr: str, long_system: str) -> dict:
    """4 streams of 160 tokens; after 2 s, the long prompt's request (its own salt: a
    cold prefill) starts; the streams' gaps before it and until its first token."""
    async with AsyncClient(addr, timeout=1800) as client:
        streams = [asyncio.create_task(ask(client, "You are brief.", q, 160, ignore_eos=True))
                   for q in mtbench_prompts(1)[:4]]
        await asyncio.sleep(2.0)
        sent = time.perf_counter()
        admitted = await ask(client, long_system, "Summarise the notes.", 4, salt="cold")
        first = sent + admitted["ttft_s"]
        runs = await asyncio.gather(*streams)
    before = [g for r in runs for _, end, g in r["gaps"] if end < sent]
    during = [g for r in runs for start, end, g in r["gaps"] if end > sent and start < first]
    return {"itl_p90_without_s": _p90(before), "itl_p90_during_s": _p90(during),
            "gaps_during": len(during), "ttft_long_s": admitted["ttft_s"]}


def copy_cost() -> dict:
    """In process: ``executor.copy`` of a 1,000- and a 2,000-token prefix between slots
    (median of 7), and computing 1,000 prompt tokens in 256-token chunks."""
    from services.verifier.engine import EngineConfig
    from services.verifier.factory import build_engine

    engine = build_engine(DEFAULT_LLM, EngineConfig(max_context=2048, slots=4))
    out = {}
    for n in (1000, 2000):
        times = []
        for _ in range(7):
            start = time.perf_counter()
            engine.executor.copy(0, 1, n)
            times.append(time.perf_counter() - start)
        out[f"copy_{n}_ms"] = statistics.median(times) * 1e3
    prompt = [(7 * i) % 30000 + 100 for i in range(1000)]
    start = time.perf_counter()
    for s in range(0, 1000, 256):
        engine._forward_chain(2, s, prompt[s:s + 256])
    out["compute_1000_ms"] = (time.perf_counter() - start) * 1e3
    return out


def _p90(values: list[float]) -> float | None:
    return statistics.quantiles(values, n=10)[-1] if len(values) >= 2 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--parts", default="1,2,3,4,copy", help="which parts to run")
    parser.add_argument("--flags", default="", help="more `specinfer up` flags")
    args = parser.parse_args()
    flags, parts = shlex.split(args.flags), set(args.parts.split(","))
    report: dict = {}
    if parts & {"1", "2"}:
        report["shared_prompt"] = shared_prompt(args.users, flags)
        s = report["shared_prompt"]
        print(f"shared prompt ({s['system_prompt_tokens']} tokens, {args.users} users, 4 "
              f"streams): TTFT p50 {s['ttft_p50_s']['off']:.3f} s off -> "
              f"{s['ttft_p50_s']['on']:.3f} s on ({s['ttft_ratio']:.1f}x); tokens/s "
              f"{s['tokens_per_s']['off']:.1f} -> {s['tokens_per_s']['on']:.1f} "
              f"({s['throughput_ratio']:.2f}x); hit rate on {s['hit_rate']['on']:.3f}, "
              f"speculation off {s['hit_rate']['speculation_off']:.3f}; identical "
              f"{s['identical']}")
    if "3" in parts:
        report["routing"] = routing(args.users, flags)
        for mode, row in report["routing"].items():
            print(f"routing {mode:<7} hit rate after each prefix's first "
                  f"{row['hit_rate_after_first']:.3f}, tokens/s {row['tokens_per_s']:.1f}")
    if "4" in parts:
        report["chunked_prefill"] = chunked_prefill(flags)
        for name in ("chunked", "blocking"):
            row = report["chunked_prefill"][name]
            print(f"prefill {name:<9} ITL p90 without {row['itl_p90_without_s']:.3f} s, "
                  f"during a {report['chunked_prefill']['long_prompt_tokens']}-token "
                  f"admission {row['itl_p90_during_s']:.3f} s; its TTFT "
                  f"{row['ttft_long_s']:.2f} s")
    if "copy" in parts:
        report["kv_copy"] = copy_cost()
        c = report["kv_copy"]
        print(f"prefix copy: {c['copy_1000_ms']:.1f} ms for 1,000 tokens, "
              f"{c['copy_2000_ms']:.1f} ms for 2,000; computing 1,000: "
              f"{c['compute_1000_ms']:.0f} ms")
    for part in report.values():  # the per-request records are large: not kept
        for row in part.values() if isinstance(part, dict) else ():
            if isinstance(row, dict):
                row.pop("requests", None)
    out = Path("bench/results") / f"prefix-cache-{date.today().isoformat()}" / "report.json"
    if out.exists():  # a run of some parts updates the day's report, keeping the others
        report = {**json.loads(out.read_text()), **report}
    write_report(out, report)


if __name__ == "__main__":
    main()
