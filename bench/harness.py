"""The one way a benchmark drives a whole stack: start ``specinfer up`` on free ports
(:class:`Stack`), wait until it serves (the router's gRPC health SERVING, then its HTTP
``/health`` 200), time prompts through it (:func:`time_prompts`: N concurrent streams, each
taking the next prompt when its last one ends; tokens/s, TTFT, TPOT and the outputs), compare
speculation off and on per request (:func:`speculation_on_off`, the request's
``speculation`` field), and stop it (SIGTERM; SIGKILL to its process group if it hangs).

    with Stack(["--speculation", "adaptive"]) as stack:
        rows = speculation_on_off(stack.addr, mtbench_prompts(1), [1, 2, 4, 8], new_tokens=128)
        print(format_on_off(rows))
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.stack import service_processes, wait_serving
from specinfer.client import AsyncClient, Stats
from specinfer.data import mtbench_first_turns
from specinfer.net import free_port

# The number formats the benchmarks compare, as (--dtype, --quantize).
FORMATS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"),
           "int8": ("bfloat16", "int8")}


def mtbench_prompts(per_category: int = 1) -> list[str]:
    """MT-Bench first turns, ``per_category`` from each of its 8 categories (10 = all 80)."""
    return [turn for _, turn in mtbench_first_turns(per_category)]


class Stack:
    """``specinfer up`` with ``flags`` (any of its flags but ``--port`` and ``--http-port``,
    which it picks free), in its own process group. Its output goes to ``log``; by default
    a temporary file, removed after a clean stop and named in the error if it fails."""

    def __init__(self, flags: Sequence[str] = (), log: Path | None = None,
                 code: Path | None = None) -> None:
        self.flags = list(flags)
        # Another checkout's code for the stack (e.g. a git worktree of an older commit):
        # the same harness times both sides of a change.
        self.code = code
        self.port, self.http_port = free_port(), free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.http = f"http://127.0.0.1:{self.http_port}"
        self.log, self._temporary_log = log, log is None
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def start(self) -> Stack:
        if self.log is None:
            fd, path = tempfile.mkstemp(prefix="specinfer-up-", suffix=".log")
            os.close(fd)
            self.log = Path(path)
        self.started = time.monotonic()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services", "up", "--port", str(self.port),
                 "--http-port", str(self.http_port), *self.flags],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                cwd=self.code, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                    **({"PYTHONPATH": str(self.code)} if self.code else {})})
        return self

    def wait(self, timeout: float = 900.0) -> float:
        """Until the stack serves on both APIs; the seconds since :meth:`start`. Raises
        RuntimeError, with the end of its log, if ``up`` exits or ``timeout`` passes."""
        deadline = self.started + timeout
        if wait_serving(self.addr, [self.proc], timeout) and self._http_healthy(deadline):
            return time.monotonic() - self.started
        tail = self.log.read_text(errors="replace")[-3000:] if self.log else ""
        raise RuntimeError(f"specinfer up {' '.join(self.flags)} did not come up "
                           f"(log {self.log}):\n{tail}")

    def _http_healthy(self, deadline: float) -> bool:
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.http}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return True
            except (urllib.error.URLError, OSError):  # 503 (no verifier yet) or not up
                pass
            time.sleep(0.3)
        return False

    def services(self) -> list[tuple[str, int, str]]:
        """The (role, pid, gRPC address) of each service ``up`` runs now."""
        return service_processes(self.proc.pid)

    def stop(self, grace_s: float = 90.0) -> int | None:
        """SIGTERM and wait; ``up``'s exit code, or None if it had to be killed (with its
        process group)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return None
        if code == 0 and self._temporary_log and self.log is not None:
            self.log.unlink(missing_ok=True)
        return code

    def __enter__(self) -> Stack:
        self.start()
        try:
            self.wait()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class Timed:
    """One request through the stack, timed at the client."""

    prompt: str
    token_ids: list[int]
    text: str
    seconds: float  # sent -> stream ended
    ttft_s: float | None  # sent -> first token
    last_token_s: float | None  # sent -> last token
    stats: Stats | None  # the router's speculation statistics (on the last chunk)

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if self.ttft_s is None or self.tokens < 2:
            return None
        return (self.last_token_s - self.ttft_s) / (self.tokens - 1)


@dataclass
class Pass:
    """A list of prompts sent by ``streams`` concurrent clients, each taking the next prompt
    when its last request ends (so ``streams`` requests are in flight until the list runs
    out)."""

    streams: int
    speculation: bool
    requests: list[Timed]  # in prompt order
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        """Aggregate output tokens per second."""
        return sum(r.tokens for r in self.requests) / self.wall_s

    @property
    def accepted_per_step(self) -> float | None:
        """Tokens per LLM step, pooled over the requests."""
        steps = sum(r.stats.steps for r in self.requests if r.stats)
        return sum(r.tokens for r in self.requests) / steps if steps else None

    def median(self, of: Callable[[Timed], float | None]) -> float | None:
        values = [v for v in map(of, self.requests) if v is not None]
        return statistics.median(values) if values else None


async def run_pass(client: AsyncClient, prompts: Sequence[str], *, streams: int,
                   new_tokens: int, speculation: bool = True, temperature: float = 0.0,
                   seed: int | None = None) -> Pass:
    """Each prompt as one chat user turn, streamed; request ``k`` is seeded ``seed + k``
    (when sampling)."""
    results: list[Timed | None] = [None] * len(prompts)
    queue = iter(enumerate(prompts))  # shared: each client takes the next prompt

    async def one(k: int, prompt: str) -> Timed:
        sent = time.perf_counter()
        ids: list[int] = []
        text, first, last, stats = [], None, None, None
        async for chunk in client.stream(messages=[{"role": "user", "content": prompt}],
                                         max_tokens=new_tokens, temperature=temperature,
                                         seed=None if seed is None else seed + k,
                                         speculation=speculation):
            if chunk.token_ids:
                last = time.perf_counter() - sent
                first = last if first is None else first
            ids += chunk.token_ids
            text.append(chunk.text)
            stats = chunk.stats or stats
        return Timed(prompt, ids, "".join(text), time.perf_counter() - sent, first, last,
                     stats)

    async def worker() -> None:
        for k, prompt in queue:
            results[k] = await one(k, prompt)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(streams, len(prompts)))))
    return Pass(streams, speculation, results, time.perf_counter() - start)


def time_prompts(addr: str, prompts: Sequence[str], *, streams: int = 1, new_tokens: int,
                 speculation: bool = True, temperature: float = 0.0, seed: int | None = None,
                 timeout: float = 1800.0) -> Pass:
    """:func:`run_pass` against the router at ``addr``, from synchronous code."""
    async def go() -> Pass:
        async with AsyncClient(addr, timeout=timeout) as client:
            return await run_pass(client, prompts, streams=streams, new_tokens=new_tokens,
                                  speculation=speculation, temperature=temperature, seed=seed)
    return asyncio.run(go())


def _summary(passes: list[Pass]) -> dict:
    rates = [p.tokens_per_s for p in passes]
    accepted = [a for a in (p.accepted_per_step for p in passes) if a is not None]
    ttft = [t for t in (p.median(lambda r: r.ttft_s) for p in passes) if t is not None]
    tpot = [t for t in (p.median(lambda r: r.tpot_s) for p in passes) if t is not None]
    return {"tokens_per_s": statistics.median(rates), "spread": [min(rates), max(rates)],
            "runs": rates,
            "accepted_per_step": statistics.mean(accepted) if accepted else None,
            "ttft_p50_s": statistics.median(ttft) if ttft else None,
            "tpot_p50_ms": statistics.median(tpot) * 1e3 if tpot else None}


def _by_mode(series: dict[str, float]) -> dict[str, float]:
    """``scrape``'s series keyed by their ``mode`` label's value alone."""
    return {labels.split('mode="', 1)[1].split('"', 1)[0]: value
            for labels, value in series.items() if 'mode="' in labels}


def speculation_on_off(addr: str, prompts: Sequence[str], levels: Sequence[int], *,
                       new_tokens: int, reps: int = 1, temperature: float = 0.0,
                       seed: int | None = None, warmup: bool = True,
                       progress: Callable[[str], None] = print,
                       metrics_url: str | None = None) -> list[dict]:
    """Aggregate tokens/s of every prompt at each number of concurrent streams, speculation
    off and on per request, ``reps`` times each, interleaved (off, on; then on, off; ...)
    so drift falls on both. ``warmup``: one pass with speculation on first (one-time costs,
    and what an adaptive router learns). Greedy rows also count the prompts whose outputs
    are identical with and without speculation (they must all be). With the router's
    ``metrics_url``, each setting also reports its router iterations by speculation mode
    (``specinfer:steps_total``), summed over its passes."""
    steps_name = "specinfer:steps_total"
    if warmup:
        p = time_prompts(addr, prompts, streams=max(levels), new_tokens=new_tokens,
                         temperature=temperature, seed=seed)
        progress(f"warm-up: {p.tokens_per_s:.1f} tok/s at {p.streams} streams")
    rows = []
    for n in levels:
        passes: dict[bool, list[Pass]] = {False: [], True: []}
        steps: dict[bool, dict[str, float]] = {False: {}, True: {}}
        identical = 0
        for rep in range(reps):
            for spec in (False, True) if rep % 2 == 0 else (True, False):
                before = _by_mode(scrape(metrics_url, steps_name)) if metrics_url else {}
                p = time_prompts(addr, prompts, streams=n, new_tokens=new_tokens,
                                 speculation=spec, temperature=temperature, seed=seed)
                passes[spec].append(p)
                if metrics_url:
                    for mode, count in _by_mode(scrape(metrics_url, steps_name)).items():
                        done = count - before.get(mode, 0.0)
                        steps[spec][mode] = steps[spec].get(mode, 0.0) + done
                progress(f"{n} streams, speculation {'on ' if spec else 'off'}: "
                         f"{p.tokens_per_s:.1f} tok/s")
            identical += sum(a.token_ids == b.token_ids for a, b in
                             zip(passes[False][-1].requests, passes[True][-1].requests,
                                 strict=True))
        off, on = _summary(passes[False]), _summary(passes[True])
        if metrics_url:
            off["steps_by_mode"], on["steps_by_mode"] = steps[False], steps[True]
        rows.append({"streams": n, "off": off, "on": on,
                     "speedup": on["tokens_per_s"] / off["tokens_per_s"],
                     "identical": f"{identical}/{reps * len(prompts)}"
                     if temperature == 0 else None})
    return rows


def format_on_off(rows: list[dict]) -> str:
    """The rows of :func:`speculation_on_off` as a Markdown table."""
    def num(x: float | None, fmt: str) -> str:
        return "–" if x is None else format(x, fmt)

    lines = ["| streams | off tok/s | on tok/s | on/off | on: accepted/step | "
             "TTFT p50 s off / on | TPOT p50 ms off / on | greedy identical |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        off, on = r["off"], r["on"]
        lines.append(
            f"| {r['streams']} | {off['tokens_per_s']:.1f} | {on['tokens_per_s']:.1f} | "
            f"{r['speedup']:.2f}x | {num(on['accepted_per_step'], '.2f')} | "
            f"{num(off['ttft_p50_s'], '.2f')} / {num(on['ttft_p50_s'], '.2f')} | "
            f"{num(off['tpot_p50_ms'], '.0f')} / {num(on['tpot_p50_ms'], '.0f')} | "
            f"{r['identical'] or '–'} |")
    return "\n".join(lines)


def write_report(path: Path, report: dict) -> None:
    """A benchmark's JSON report, its folder made if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


def scrape(url: str, name: str) -> dict[str, float]:
    """Counter ``name``'s series on a Prometheus text page, by their labels."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0].removeprefix(name): float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(name + "{")}
