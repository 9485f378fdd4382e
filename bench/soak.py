"""Soak: a whole stack (``specinfer up``) driven at its capacity for ``--minutes`` with a mix
of traffic — gRPC streams and unary calls (greedy and seeded sampling), streams cancelled
mid-way, calls with short client deadlines, bad requests (gRPC and HTTP), OpenAI HTTP
completions; the first ``--quiet`` of each minute only two requests are in flight, so the
router speculates (past ``--spec-max-batch`` it decodes plainly). Optionally one kind of
service is killed every ``--kill-every`` seconds (``up`` restarts it). Then it checks:

- every request is accounted for once: answered completely (token count = the usage's,
  within max_tokens; greedy ones equal to the reference taken before the load, speculation
  off) or refused with a clear status (RESOURCE_EXHAUSTED / HTTP 429, DEADLINE_EXCEEDED for
  short deadlines, UNAVAILABLE while a killed router restarts, INVALID_ARGUMENT / HTTP 400
  for bad requests, NOT_FOUND / HTTP 404 for a model not served); none unanswered within
  ``--request-timeout``;
- the verifiers' KV slots all free at the end (``Info.live_sequences`` == 0);
- no service died but those killed, and ``up`` stops cleanly (exit 0) on SIGTERM;
- the resident memory (VmRSS) of every process, sampled over the run: its slope after
  warm-up, in MiB per minute.

    python -m bench.soak [--minutes 10] [--kill verifier --kill-every 60]
    python -m bench.soak --minutes 1 --llm DIR --ssm DIR#layers=1 --datastore none \\
        --draft-head none --max-context 512     # tiny models

Writes bench/results/soak-<date>/ (or ``--out``): soak.json, memory.png and up.log; exits 1
if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import grpc

from bench.harness import Stack
from bench.soak_watch import (
    heap_sample,
    live_sequences,
    metrics_live,
    plot,
    restarts_logged,
    rss_mib,
    slope_mib_per_min,
)
from services.stack import wait_serving
from specinfer.client import build_request
from specinfer.models import DEFAULT_LLM
from specinfer.net import GRPC_OPTIONS
from specinfer.v1 import router_pb2_grpc

RESULTS = Path(__file__).parent / "results"
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Paris is the capital of",
           "1, 2, 3, 4,", "Once upon a time, in a small village,",
           "The three laws of thermodynamics are", "import numpy as np\n",
           "Dear hiring manager, I am writing to"]
# How often each kind of request is sent (relative weights).
MIX = {"stream": 25, "unary": 15, "sampled": 10, "cancel": 10, "deadline": 10, "bad": 5,
       "http": 15, "http_bad": 10}
BAD_GRPC = [dict(temperature=-1.0), dict(top_p=1.5), dict(max_tokens=0), dict(model="nope"),
            dict(prompt="")]
BAD_HTTP = [{"temperature": -1}, {"top_p": 1.5}, {"max_tokens": 0}, {"n": 99},
            {"logprobs": "yes"}, {"tools": [{"type": "function"}]}, {"model": "nope"}]
GOOD = {"complete", "resource_exhausted"}  # for every good request, whatever happens
REFUSED = {"invalid_argument", "not_found"}  # for every bad one


def expected_outcomes(kind: str, kill: str | None) -> set[str]:
    """The outcomes that are right for a request of ``kind`` (anything else fails)."""
    ok = set(REFUSED) if kind in ("bad", "http_bad") else set(GOOD)
    if kind == "cancel":
        ok.add("cancelled")
    if kind == "deadline":
        ok.add("deadline_exceeded")
    if kill == "router":  # in flight at the kill, or sent before it serves again
        ok.add("unavailable")
    return ok


@dataclass
class Record:
    id: str
    kind: str
    started_s: float  # since the load began
    seconds: float
    outcome: str  # complete, cancelled, deadline_exceeded, resource_exhausted, unavailable,
    # invalid_argument, not_found, wrong (answered, but not as it should be), lost, error
    tokens: int = 0
    speculative_steps: int = 0
    detail: str = ""  # a status message or what was wrong (never prompt text)


def _code_outcome(code: grpc.StatusCode) -> str:
    return {grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",
            grpc.StatusCode.UNAVAILABLE: "unavailable",
            grpc.StatusCode.DEADLINE_EXCEEDED: "deadline_exceeded",
            grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
            grpc.StatusCode.NOT_FOUND: "not_found",
            grpc.StatusCode.CANCELLED: "cancelled"}.get(code, "error")


def _http_outcome(status: int) -> str:
    return {400: "invalid_argument", 404: "not_found", 429: "resource_exhausted",
            503: "unavailable"}.get(status, "error")


class Load:
    """The traffic: ``concurrency`` workers, each sending one request after another."""

    def __init__(self, addr: str, http: str, model: str, reference: dict[str, list[int]],
                 max_tokens: int, request_timeout: float, metadata: list | None,
                 quiet: float = 0.0) -> None:
        self.channel = grpc.aio.insecure_channel(addr, options=GRPC_OPTIONS)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.http, self.model, self.reference = http, model, reference
        self.max_tokens, self.timeout, self.metadata = max_tokens, request_timeout, metadata
        self.headers = {k: v for k, v in metadata or []}
        self.records: list[Record] = []
        self.in_flight: dict[str, str] = {}  # id -> kind
        self.t0 = time.monotonic()
        self.quiet = quiet

    def quiet_now(self) -> bool:
        """In the quiet start of the current minute (the first one's is in the warm-up)."""
        return (time.monotonic() - self.t0) % 60 < 60 * self.quiet

    def _check(self, prompt: str | None, ids: list[int], usage_tokens: int, finish: str,
               max_tokens: int) -> str:
        """What is wrong with an answer ('' if nothing)."""
        if finish not in ("stop", "length"):
            return f"finish_reason {finish!r}"
        if len(ids) != usage_tokens:
            return f"{len(ids)} tokens streamed, usage says {usage_tokens}"
        if len(ids) > max_tokens or (finish == "length" and len(ids) != max_tokens):
            return f"{len(ids)} tokens for max_tokens {max_tokens} ({finish})"
        if prompt is not None and ids != self.reference[prompt][:max_tokens]:
            return "greedy tokens differ from the reference"
        return ""

    async def one(self, kind: str, rng: random.Random, rid: str,
                  session: aiohttp.ClientSession) -> Record:
        prompt = rng.choice(PROMPTS)
        max_tokens = rng.randint(4, self.max_tokens)
        started = time.monotonic()
        rec = Record(rid, kind, started - self.t0, 0.0, "lost")
        try:
            if kind in ("stream", "cancel"):
                await self._stream(rec, prompt, max_tokens, rng.randint(1, 3)
                                   if kind == "cancel" else None)
            elif kind in ("unary", "sampled", "deadline"):
                await self._unary(rec, prompt, max_tokens, kind, rng)
            elif kind == "bad":
                bad = {"max_tokens": 4, **rng.choice(BAD_GRPC)}
                req = build_request(bad.pop("prompt", prompt), **bad)
                out = await self.stub.Generate(req, timeout=self.timeout,
                                               metadata=self.metadata)
                rec.outcome, rec.detail = "wrong", "a bad request was answered"
                rec.tokens = len(out.token_ids)
            else:
                await self._http(rec, session, prompt, max_tokens, kind, rng)
        except grpc.aio.AioRpcError as exc:
            rec.outcome, rec.detail = _code_outcome(exc.code()), (exc.details() or "")[:200]
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and kind != "deadline":
                rec.outcome = "lost"  # not answered within --request-timeout
        except TimeoutError:
            rec.outcome, rec.detail = "lost", "no HTTP answer within --request-timeout"
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            rec.outcome, rec.detail = "unavailable", type(exc).__name__  # the router died
        rec.seconds = time.monotonic() - started
        return rec

    async def _stream(self, rec: Record, prompt: str, max_tokens: int,
                      cancel_after: int | None) -> None:
        call = self.stub.GenerateStream(build_request(prompt, max_tokens=max_tokens),
                                        timeout=self.timeout, metadata=self.metadata)
        ids, chunks, last = [], 0, None
        async for msg in call:
            ids += msg.token_ids
            chunks += 1
            last = msg
            if cancel_after is not None and chunks >= cancel_after and not msg.finish_reason:
                call.cancel()
                rec.outcome, rec.tokens = "cancelled", len(ids)
                return
        rec.tokens = len(ids)
        if last is not None:
            rec.speculative_steps = last.stats.speculative_steps
        if last is None:
            rec.outcome, rec.detail = "lost", "the stream ended without a message"
            return
        wrong = self._check(prompt, ids, last.usage.completion_tokens, last.finish_reason,
                            max_tokens)
        rec.outcome, rec.detail = ("wrong", wrong) if wrong else ("complete", "")

    async def _unary(self, rec: Record, prompt: str, max_tokens: int, kind: str,
                     rng: random.Random) -> None:
        sampled = kind == "sampled"
        req = build_request(prompt, max_tokens=max_tokens,
                            temperature=0.8 if sampled else 0.0,
                            seed=rng.randrange(1 << 31) if sampled else None)
        timeout = rng.uniform(0.05, 0.5) if kind == "deadline" else self.timeout
        out = await self.stub.Generate(req, timeout=timeout, metadata=self.metadata)
        rec.tokens, rec.speculative_steps = len(out.token_ids), out.stats.speculative_steps
        wrong = self._check(None if sampled else prompt, list(out.token_ids),
                            out.usage.completion_tokens, out.finish_reason, max_tokens)
        rec.outcome, rec.detail = ("wrong", wrong) if wrong else ("complete", "")

    async def _http(self, rec: Record, session: aiohttp.ClientSession, prompt: str,
                    max_tokens: int, kind: str, rng: random.Random) -> None:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0}
        if kind == "http_bad":
            body |= rng.choice(BAD_HTTP)
        async with session.post(f"{self.http}/v1/completions", json=body,
                                headers=self.headers) as resp:
            payload = await resp.json(content_type=None)
        if resp.status != 200:
            rec.outcome = _http_outcome(resp.status)
            rec.detail = str(payload.get("error", {}).get("message", ""))[:200]
            return
        if kind == "http_bad":
            rec.outcome, rec.detail = "wrong", "a bad request was answered"
            return
        choice, tokens = payload["choices"][0], payload["usage"]["completion_tokens"]
        rec.tokens = tokens
        wrong = "" if choice["finish_reason"] in ("stop", "length") and tokens <= max_tokens \
            else f"{tokens} tokens, finish_reason {choice['finish_reason']!r}"
        rec.outcome, rec.detail = ("wrong", wrong) if wrong else ("complete", "")

    async def worker(self, i: int, seed: int, until: float) -> None:
        rng = random.Random(seed * 1000 + i)
        kinds, weights = list(MIX), list(MIX.values())
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            n = 0
            while time.monotonic() < until:
                if i >= 2 and self.quiet_now():
                    await asyncio.sleep(0.2)
                    continue
                kind, rid = rng.choices(kinds, weights)[0], f"w{i}-{n}"
                n += 1
                self.in_flight[rid] = kind
                try:
                    rec = await self.one(kind, rng, rid, session)
                except Exception as exc:  # recorded, never silently dropped
                    rec = Record(rid, kind, 0.0, 0.0, "error", detail=repr(exc)[:200])
                self.records.append(rec)
                del self.in_flight[rid]
                if rec.outcome in ("unavailable", "resource_exhausted"):
                    await asyncio.sleep(0.5)  # as a client would, rather than spin


async def soak(args: argparse.Namespace, stack: Stack, out: Path) -> dict:
    metadata = None
    key = os.environ.get("SPECINFER_API_KEY", "").split(",")[0].strip()
    if key:  # the router enforces the keys it inherits through `up`
        metadata = [("authorization", f"Bearer {key}")]
    try:
        started_s = await asyncio.get_running_loop().run_in_executor(None, stack.wait)
    except RuntimeError:
        raise SystemExit(f"the stack did not start; see {out / 'up.log'}") from None
    print(f"soak: stack serving after {started_s:.0f} s", flush=True)
    async with aiohttp.ClientSession(headers=dict(metadata or [])) as session, \
            session.get(f"{stack.http}/v1/models") as resp:
        model = (await resp.json())["data"][0]["id"]
    reference: dict[str, list[int]] = {}
    async with grpc.aio.insecure_channel(stack.addr, options=GRPC_OPTIONS) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for p in PROMPTS:  # greedy, speculation off, before any load or fault
            reply = await stub.Generate(build_request(p, max_tokens=args.max_tokens,
                                                      speculation=False),
                                        timeout=300, metadata=metadata)
            reference[p] = list(reply.token_ids)
        for p in PROMPTS:  # and with speculation: the same tokens (it warms up drafting)
            reply = await stub.Generate(build_request(p, max_tokens=args.max_tokens),
                                        timeout=300, metadata=metadata)
            if list(reply.token_ids) != reference[p]:
                raise SystemExit("greedy output with speculation differs from without")
    first = {role: pid for role, pid, _ in stack.services()}
    load = Load(stack.addr, stack.http, model, reference, args.max_tokens,
                args.request_timeout, metadata, args.quiet)
    duration = args.minutes * 60
    until = load.t0 + duration
    memory: dict[str, list[tuple[float, float]]] = {}
    # Where each service's memory goes (its heap series), to tell a leak from the allocator
    # holding freed memory: from the router's /metrics and the services' --metrics-port.
    heap_urls = {"router": f"{stack.http}/metrics"}
    if args.metrics_port:
        roles = sorted((role for role, _, _ in stack.services() if role != "router"),
                       key=lambda role: role != "verifier")  # up's port order
        counts: dict[str, int] = {}
        for port, role in enumerate(roles, args.metrics_port):
            counts[role] = counts.get(role, 0) + 1
            heap_urls[f"{role}{counts[role]}"] = f"http://127.0.0.1:{port}/metrics"
    heap: dict[str, list[tuple[float, dict[str, float]]]] = {}
    kills: list[dict] = []

    async def sample() -> None:
        n = 0
        while time.monotonic() < until + 1:
            now = time.monotonic() - load.t0
            for role, pid, _ in [("up", stack.proc.pid, ""), *stack.services()]:
                mib = rss_mib(pid)
                if mib is not None:
                    memory.setdefault(f"{role}[{pid}]", []).append((round(now, 2), mib))
            if n % 5 == 0:
                for name, url in heap_urls.items():
                    got = await asyncio.get_running_loop().run_in_executor(
                        None, heap_sample, url)
                    if got:
                        heap.setdefault(name, []).append((round(now, 2), got))
            n += 1
            await asyncio.sleep(args.sample_every)

    async def kill() -> None:
        while time.monotonic() + args.kill_every < until:
            await asyncio.sleep(args.kill_every)
            found = [(pid, addr) for role, pid, addr in stack.services() if role == args.kill]
            if not found:
                continue  # still restarting from the last kill
            pid, addr = found[0]
            os.kill(pid, signal.SIGKILL)
            at = time.monotonic()
            back = await asyncio.get_running_loop().run_in_executor(
                None, wait_serving, addr, [], 300.0)
            kills.append({"role": args.kill, "pid": pid, "at_s": round(at - load.t0, 1),
                          "serving_again_after_s": round(time.monotonic() - at, 1)
                          if back else None})
            print(f"soak: killed the {args.kill} ({pid}); serving again after "
                  f"{kills[-1]['serving_again_after_s']} s", flush=True)

    tasks = [asyncio.create_task(sample())]
    if args.kill:
        tasks.append(asyncio.create_task(kill()))
    workers = [asyncio.create_task(load.worker(i, args.seed, until))
               for i in range(args.concurrency)]
    # Workers stop sending at ``until``; give the last requests time to be answered.
    done, pending = await asyncio.wait(workers, timeout=duration + args.request_timeout + 30)
    for task in pending:
        task.cancel()
    lost_in_flight = dict(load.in_flight)
    for task in tasks:
        task.cancel()
    await load.channel.close()
    load_s = time.monotonic() - load.t0

    verifiers = [addr for role, _, addr in stack.services() if role == "verifier"]
    # A killed router's sequences are freed by the verifier's lease (30 s by default).
    live = await live_sequences(verifiers, 45.0 if args.kill == "router" else 15.0)
    live_metric = metrics_live(args.metrics_port) if args.metrics_port else None
    last = {role: pid for role, pid, _ in stack.services()}
    restarts = restarts_logged(out / "up.log")
    killed = {args.kill: len(kills)} if args.kill else {}
    up_alive = stack.proc.poll() is None
    rc = stack.stop()

    outcomes: dict[str, dict[str, int]] = {}
    for r in load.records:
        outcomes.setdefault(r.kind, {}).setdefault(r.outcome, 0)
        outcomes[r.kind][r.outcome] += 1
    unexpected = [asdict(r) for r in load.records
                  if r.outcome not in expected_outcomes(r.kind, args.kill)]
    ids = [r.id for r in load.records]
    warmup = max(args.warmup, 0.0) if args.warmup >= 0 else duration * 0.25
    slopes = {name: slope_mib_per_min(points, warmup) for name, points in memory.items()}
    checks = {
        "every request answered once": not lost_in_flight and len(ids) == len(set(ids)),
        "every outcome as expected": not unexpected,
        "verifier slots free at the end": bool(live) and all(n == 0 for n in live.values())
        and live_metric in (None, 0.0),
        "no service died but those killed": restarts == {k: v for k, v in killed.items() if v}
        and set(first) == set(last) and up_alive,
        "up stopped cleanly": rc == 0,
    }
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "load_seconds": round(load_s, 1), "requests": len(load.records),
        "requests_per_minute": round(len(load.records) / (load_s / 60), 1),
        "tokens": sum(r.tokens for r in load.records if r.outcome == "complete"),
        "speculative_steps": sum(r.speculative_steps for r in load.records),
        "outcomes": outcomes, "unexpected": unexpected[:50],
        "unexpected_count": len(unexpected), "lost_in_flight": lost_in_flight,
        "live_sequences_at_end": live, "live_sequences_metric": live_metric,
        "kills": kills, "restarts_logged": restarts, "up_exit_code": rc,
        "memory_warmup_s": warmup,
        "memory_slope_mib_per_min": {k: None if v is None else round(v, 2)
                                     for k, v in slopes.items()},
        "memory_mib": {k: {"first": round(p[0][1], 1), "last": round(p[-1][1], 1),
                           "max": round(max(m for _, m in p), 1)} for k, p in memory.items()},
        "memory_samples": memory,
        "heap_slope_per_min": {name: {key: None if (v := slope_mib_per_min(
            [(t, got[key]) for t, got in points if key in got], warmup)) is None
            else round(v, 3) for key in points[-1][1]} for name, points in heap.items()},
        "heap_last": {name: {k: round(v, 1) for k, v in points[-1][1].items()}
                      for name, points in heap.items()},
        "heap_samples": heap,
        "checks": checks, "passed": all(checks.values()),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--llm", default=DEFAULT_LLM)
    p.add_argument("--ssm", action="append", default=None)
    p.add_argument("--datastore", default="auto")
    p.add_argument("--draft-head", default="auto")
    p.add_argument("--speculation", default="adaptive")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=48, help="the most tokens a request asks")
    p.add_argument("--concurrency", type=int, default=0,
                   help="requests in flight (default: --slots + 4: every slot busy, a queue)")
    p.add_argument("--quiet", type=float, default=0.25,
                   help="the fraction of each minute (its start) with two requests in "
                        "flight")
    p.add_argument("--kill", choices=("speculator", "verifier", "router"), default=None,
                   help="SIGKILL this service every --kill-every seconds (up restarts it)")
    p.add_argument("--kill-every", type=float, default=60.0)
    p.add_argument("--request-timeout", type=float, default=180.0,
                   help="a request not answered within this is lost (above the router's "
                        "--queue-timeout, 60 s)")
    p.add_argument("--sample-every", type=float, default=2.0, help="memory samples (s)")
    p.add_argument("--warmup", type=float, default=-1.0,
                   help="seconds of each process's life before its memory slope counts "
                        "(default: a quarter of the run)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="passed to up: the verifier's /metrics here (the speculator's on the "
                        "next port), read at the end and sampled for the heap series")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="default: bench/results/soak-<date>")
    args = p.parse_args(argv)
    args.concurrency = args.concurrency or args.slots + 4
    return args


def up_flags(args: argparse.Namespace) -> list[str]:
    """The flags of ``specinfer up`` this soak runs it with."""
    flags = ["--llm", args.llm, "--slots", str(args.slots), "--max-context",
             str(args.max_context), "--datastore", args.datastore, "--draft-head",
             args.draft_head, "--speculation", args.speculation]
    for ref in args.ssm or []:
        flags += ["--ssm", ref]
    if args.metrics_port:
        flags += ["--metrics-port", str(args.metrics_port)]
    return flags


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or RESULTS / f"soak-{datetime.datetime.now():%Y-%m-%d-%H%M}"
    out.mkdir(parents=True, exist_ok=True)
    stack = Stack(up_flags(args), out / "up.log").start()
    try:
        report = asyncio.run(soak(args, stack, out))
    finally:
        stack.stop()
    (out / "soak.json").write_text(json.dumps(report, indent=1, default=str))
    plot(report, out / "memory.png")
    print(json.dumps({k: report[k] for k in ("load_seconds", "requests", "outcomes",
                                             "unexpected_count", "live_sequences_at_end",
                                             "kills", "memory_slope_mib_per_min", "checks")},
                     indent=1))
    print(f"soak: {'passed' if report['passed'] else 'FAILED'}; report in {out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
