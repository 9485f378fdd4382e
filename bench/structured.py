"""Structured output: what constraints cost and what speculation gains under them.

1. In process, on the LLM's tokenizer: compile time of every schema (a cache miss), the
   cache hit's time, and the mask's cost per token while decoding each schema's answer.
2. Through the default stack (``specinfer up``): N chat requests each asking for JSON valid
   against one of the schemas (``response_format`` json_schema), greedy, speculation on and
   off per request, one stream: tokens/s, accepted tokens per step, outputs identical and
   valid; and the same prompts without a constraint (the anchor: what a request pays for
   its constraint).

    python -m bench.structured [--requests 40] [--max-tokens 96] [--flags "..."]

Writes bench/results/structured-<date>/report.json (and prints the table)."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import time
import urllib.request
from collections.abc import Sequence
from datetime import date
from pathlib import Path

from bench.harness import Stack, scrape, write_report
from specinfer.client import AsyncClient
from specinfer.net import free_port

# Schemas of the kind applications send: records with enums, numbers, nested objects and
# arrays; bounded so a greedy answer ends within max_tokens.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                      "email": {"type": "string", "maxLength": 40}},
     "required": ["name", "age", "email"], "additionalProperties": False},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative",
                                                             "neutral"]},
                                      "confidence": {"type": "number", "minimum": 0,
                                                     "maximum": 1}},
     "required": ["sentiment", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                      "tags": {"type": "array", "maxItems": 4,
                                               "items": {"type": "string", "maxLength": 12}},
                                      "published": {"type": "boolean"}},
     "required": ["title", "tags", "published"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "country": {"type": "string", "maxLength": 20},
                                      "location": {"type": "object", "properties": {
                                          "lat": {"type": "number"}, "lon": {"type": "number"}},
                                          "required": ["lat", "lon"],
                                          "additionalProperties": False}},
     "required": ["city", "country", "location"], "additionalProperties": False},
    {"type": "object", "properties": {"steps": {"type": "array", "minItems": 1, "maxItems": 3,
                                                "items": {"type": "string", "maxLength": 40}},
                                      "difficulty": {"enum": ["easy", "medium", "hard"]}},
     "required": ["steps", "difficulty"], "additionalProperties": False},
]
TASKS = [
    "Describe a fictional person.", "Classify the sentiment of: 'I loved the film.'",
    "Summarise an article about renewable energy.", "Tell me about the capital of France.",
    "Explain how to boil an egg.", "Describe a software engineer from Berlin.",
    "Classify the sentiment of: 'The service was slow.'", "Write a blog post header on AI.",
    "Tell me about Tokyo.", "Explain how to plant a tree.",
]


def requests(n: int) -> list[tuple[str, dict]]:
    """``n`` (prompt, schema) pairs: every task with every schema, in turn."""
    out = []
    for i in range(n):
        schema = SCHEMAS[i % len(SCHEMAS)]
        task = TASKS[(i // len(SCHEMAS) + i) % len(TASKS)]
        out.append((f"{task} Answer in JSON with the fields {', '.join(schema['properties'])}.",
                    schema))
    return out


def in_process(llm: str) -> dict:
    """Compile and mask costs on the LLM's tokenizer, without a model."""
    from specinfer.constraints import Constraint
    from specinfer.grammar import GrammarCompiler
    from specinfer.models import load_tokenizer

    tokenizer = load_tokenizer(llm)
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    _ = compiler.tokenizer
    tokenizer_s = time.perf_counter() - start
    compiles, hits, masks = [], [], []
    for schema in SCHEMAS:
        c = Constraint("json_schema", json.dumps(schema))
        start = time.perf_counter()
        compiler.compile(c)
        compiles.append(time.perf_counter() - start)
        start = time.perf_counter()
        grammar = compiler.start(c, [])
        hits.append(time.perf_counter() - start)
        # Walk a valid answer token by token, timing each mask.
        answer = tokenizer.encode(json.dumps(_example(schema)))
        buf = grammar.masks(1)
        for token in answer:
            start = time.perf_counter()
            grammar.fill(buf, 0)
            masks.append(time.perf_counter() - start)
            if not grammar.matcher.consume_token(token):
                break
    return {"tokenizer_build_s": tokenizer_s,
            "compile_ms": {"median": statistics.median(compiles) * 1e3,
                           "max": max(compiles) * 1e3},
            "cache_hit_ms": statistics.median(hits) * 1e3,
            "mask_us_per_token": {"median": statistics.median(masks) * 1e6,
                                  "p90": sorted(masks)[int(len(masks) * 0.9)] * 1e6}}


def _example(schema: dict):
    """A small valid instance of one of SCHEMAS (for timing masks along a real path)."""
    kind = schema.get("type")
    if "enum" in schema:
        return schema["enum"][0]
    if kind == "object":
        return {k: _example(v) for k, v in schema["properties"].items()}
    if kind == "array":
        return [_example(schema["items"])] * max(1, schema.get("minItems", 1))
    return {"string": "text", "integer": 42, "number": 0.5, "boolean": True}[kind]


# Where a step's time goes, from the services' /metrics (sums over every series): the
# router's iterations, its Speculate and Step calls, the verifier engine's steps and the
# share of them spent on constraints, the speculator's drafting.
PHASES = {
    "iterations": "specinfer:steps_total",
    "draft_calls": "specinfer:draft_latency_seconds_count",
    "draft_s": "specinfer:draft_latency_seconds_sum",
    "step_calls": "specinfer:verify_latency_seconds_count",  # Prefill calls too
    "step_call_s": "specinfer:verify_latency_seconds_sum",
    "engine_steps": "specinfer:verifier_step_seconds_count",
    "engine_step_s": "specinfer:verifier_step_seconds_sum",
    "grammar_s": "specinfer:grammar_mask_seconds_total",
    "speculate_s": "specinfer:speculate_seconds_sum",
}


def metrics_urls(http: str, metrics_base: int, ports: int = 8) -> list[str]:
    """The router's /metrics (on the OpenAI port) and the services' (``up --metrics-port``
    gives them ports from ``metrics_base`` on)."""
    return [f"{http}/metrics",
            *(f"http://127.0.0.1:{p}/metrics" for p in range(metrics_base, metrics_base + ports))]


def phase_totals(urls: Sequence[str]) -> dict[str, float]:
    totals = dict.fromkeys(PHASES, 0.0)
    for url in urls:
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:  # no service on that port
            continue
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            for phase, metric in PHASES.items():
                if name == metric:
                    totals[phase] += float(line.rsplit(" ", 1)[1])
    return totals


def per_iteration(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Milliseconds per router iteration of each phase between two snapshots."""
    delta = {k: after[k] - before[k] for k in PHASES}
    n = max(delta["iterations"], 1.0)
    return {"iterations": delta["iterations"],
            **{f"{k[:-2]}_ms": 1e3 * delta[k] / n for k in PHASES if k.endswith("_s")}}


async def through_stack(addr: str, pairs: list[tuple[str, dict]], max_tokens: int,
                        metrics: Sequence[str] = ()) -> dict:
    import jsonschema

    async def run(speculation: bool, constrained: bool) -> dict:
        tokens, steps, speculative, elapsed, texts, valid = 0, 0, 0, 0.0, [], 0
        before = phase_totals(metrics)
        async with AsyncClient(addr, timeout=600) as client:
            for prompt, schema in pairs:
                start = time.perf_counter()
                out = await client.generate(
                    messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                    speculation=speculation, **({"json_schema": schema} if constrained else {}))
                elapsed += time.perf_counter() - start
                tokens += len(out.token_ids)
                steps += max(out.steps, 1)
                speculative += out.stats.speculative_steps
                texts.append(out.text)
                if constrained and out.finish_reason == "stop":
                    try:
                        jsonschema.validate(json.loads(out.text), schema)
                        valid += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
        return {"tokens_per_s": tokens / elapsed, "tokens": tokens,
                "tokens_per_step": tokens / steps, "speculative_share": speculative / steps,
                "valid": valid, "texts": texts,
                "phases": per_iteration(before, phase_totals(metrics))}

    await run(True, True)  # warm-up: compiles every schema once, as a server would have
    rows = {}
    for name, constrained in (("json_schema", True), ("unconstrained", False)):
        off = await run(False, constrained)
        on = await run(True, constrained)
        rows[name] = {"off": {k: v for k, v in off.items() if k != "texts"},
                      "on": {k: v for k, v in on.items() if k != "texts"},
                      "speedup": on["tokens_per_s"] / off["tokens_per_s"],
                      "identical": on["texts"] == off["texts"]}
    return rows


def cache_lookups(urls: Sequence[str]) -> dict:
    """The verifiers' grammar cache lookups, summed over the pages at ``urls``."""
    counts = {"hit": 0.0, "miss": 0.0}
    for url in urls:
        try:
            series = scrape(url, "specinfer:grammar_cache_lookups_total")
        except OSError:  # no service on that port (URLError is an OSError)
            continue
        for labels, value in series.items():
            counts["hit" if 'result="hit"' in labels else "miss"] += value
    total = counts["hit"] + counts["miss"]
    return {**counts, "hit_rate": counts["hit"] / total if total else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--flags", default="", help="more `specinfer up` flags")
    parser.add_argument("--llm", default=None, help="the LLM (default: up's)")
    args = parser.parse_args()
    from specinfer.models import DEFAULT_LLM

    report = {"in_process": in_process(args.llm or DEFAULT_LLM)}
    print(json.dumps(report["in_process"], indent=1))
    metrics_base = free_port()  # up gives its services /metrics ports from here on
    flags = shlex.split(args.flags) + (["--llm", args.llm] if args.llm else []) + \
        ["--metrics-port", str(metrics_base)]
    with Stack(flags) as stack:
        pages = metrics_urls(stack.http, metrics_base)
        report["stack"] = asyncio.run(through_stack(stack.addr, requests(args.requests),
                                                    args.max_tokens, pages))
        report["grammar_cache"] = cache_lookups(pages)
    cache = report["grammar_cache"]
    print(f"grammar cache (the verifiers' metrics): {cache['hit']} hits, {cache['miss']} "
          f"misses, hit rate {cache['hit_rate']:.3f}")
    report["requests"], report["max_tokens"] = args.requests, args.max_tokens
    print(f"{'workload':<14} {'off tok/s':>9} {'on tok/s':>9} {'speedup':>8} "
          f"{'tok/step on':>11} {'valid':>6} {'identical':>9}")
    for name, row in report["stack"].items():
        valid = f"{row['on']['valid']}/{args.requests}" if name == "json_schema" else "-"
        print(f"{name:<14} {row['off']['tokens_per_s']:>9.1f} {row['on']['tokens_per_s']:>9.1f} "
              f"{row['speedup']:>7.2f}x {row['on']['tokens_per_step']:>11.2f} {valid:>6} "
              f"{row['identical']!s:>9}")
    print("milliseconds per router iteration (from the services' metrics):")
    for name, row in report["stack"].items():
        for arm in ("off", "on"):
            phases = row[arm]["phases"]
            print(f"  {name:<14} {arm:<3} " + " ".join(
                f"{k}={v:.1f}" if k.endswith("_ms") else f"{k}={v:.0f}"
                for k, v in phases.items()))
    out = Path("bench/results") / f"structured-{date.today().isoformat()}" / "report.json"
    write_report(out, report)


if __name__ == "__main__":
    main()
