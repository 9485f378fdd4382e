"""`specinfer up` supervises its services (docs/architecture.md), and the fault matrix around it:
each kind of service is killed (SIGKILL) while streams run; every stream completes with the
greedy output taken before any fault (a killed router: the client retries, as the SDK does
on UNAVAILABLE), and `up` has the service serving again, on the same port. A speculator
that stops answering (SIGSTOP) holds no step past the router's --speculate-timeout; a
verifier that stalls past a step's timeout is failed over and taken back.

One stack of tiny models for the whole file; the tests run in order (each leaves the stack
serving)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from servers import free_port, start

from services.router.config import RouterConfig
from services.router.request import GenRequest
from services.router.scheduler import Scheduler
from services.stack import Supervised, Supervisor, service_processes
from specinfer.client import AsyncClient, Client, UnavailableError
from specinfer.sampling import SamplingParams

pytestmark = pytest.mark.processes

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Paris is the capital of",
           "1, 2, 3, 4,"]
TOKENS = 400  # long enough to be mid-stream at the kill (~1 s of tiny-model decoding)
SPECULATE_TIMEOUT_S = 0.5
BACK_WITHIN_S = 90.0  # a restart: its backoff (1 s) + loading (~5 s here) + a loaded box


@pytest.fixture(scope="module")
def up(tiny_chat_llm, tmp_path_factory):
    """`specinfer up` on the tiny models; its log (every service's) goes to a file."""
    log = tmp_path_factory.mktemp("up") / "up.log"
    with open(log, "w") as out:
        up = start("up", "--llm", tiny_chat_llm, "--ssm", f"{tiny_chat_llm}#layers=1",
                   "--datastore", "none", "--draft-head", "none", "--slots", "8",
                   "--max-context", "512", "--http-port", str(free_port()), "--speculation",
                   "always", "--speculate-timeout", str(SPECULATE_TIMEOUT_S), stdout=out,
                   stderr=subprocess.STDOUT, start_new_session=True)
    proc = up.proc
    try:
        up.wait()
        yield {"addr": up.addr, "proc": proc, "log": log}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0  # SIGTERM stops the stack cleanly
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its process group: no orphans
        assert not service_processes(proc.pid)


@pytest.fixture(scope="module")
def reference(up):
    """Greedy outputs with speculation off, before any fault."""
    with Client(up["addr"]) as c:
        return {p: c.generate(p, max_tokens=TOKENS, speculation=False).token_ids
                for p in PROMPTS}


def the(up, role: str) -> tuple[int, str]:
    """The pid and address of the stack's one ``role`` process."""
    found = [(pid, addr) for r, pid, addr in service_processes(up["proc"].pid) if r == role]
    assert len(found) == 1, found
    return found[0]


def serving(addr: str) -> bool:
    with grpc.insecure_channel(addr) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1).status == \
                health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


def back_serving(up, role: str, old_pid: int, old_addr: str) -> float:
    """Seconds until ``up`` runs a new ``role`` process, at the same address, serving."""
    started = time.monotonic()
    while time.monotonic() - started < BACK_WITHIN_S:
        found = [(pid, a) for r, pid, a in service_processes(up["proc"].pid) if r == role]
        if found and found[0][0] != old_pid and serving(old_addr):
            assert found == [(found[0][0], old_addr)]  # the same port: addresses stay valid
            return time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"{role} not serving again within {BACK_WITHIN_S} s")


def restart_logged(up, role: str) -> dict:
    """The structured line `up` logged for the ``role`` process that died."""
    for line in reversed(Path(up["log"]).read_text().splitlines()):
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("service") == "up" and entry.get("role") == role \
                    and entry["msg"] == "service exited; restarting it":
                return entry
    raise AssertionError(f"no restart logged for the {role}")


async def stream(client: AsyncClient, prompt: str, first: asyncio.Event | None = None,
                 retry: bool = False) -> tuple[list[int], float]:
    """A greedy stream's tokens and the longest wait between its chunks; with ``retry``,
    an UNAVAILABLE (the router died) starts it again from scratch, as a client would."""
    for _ in range(60 if retry else 1):
        ids, gap, last = [], 0.0, time.monotonic()
        try:
            async for chunk in client.stream(prompt, max_tokens=TOKENS):
                ids += chunk.token_ids
                gap, last = max(gap, time.monotonic() - last), time.monotonic()
                if first is not None:
                    first.set()
            return ids, gap
        except UnavailableError:
            if not retry:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("the router never came back")


async def streams_with_a_fault(addr: str, prompts: list[str], fault, retry: bool = False,
                               during=None):
    """Run ``prompts`` as streams; once each has tokens, ``fault()`` (which must find them
    all still running); ``during()``: another coroutine run after the fault."""
    async with AsyncClient(addr) as client:
        firsts = [asyncio.Event() for _ in prompts]
        tasks = [asyncio.create_task(stream(client, p, e, retry))
                 for p, e in zip(prompts, firsts, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
        assert not any(t.done() for t in tasks), "a stream ended before the fault"
        fault()
        extra = await during() if during is not None else None
        return await asyncio.gather(*tasks), extra


def test_a_stopped_speculator_holds_no_step_past_the_speculate_timeout(up, reference):
    """SIGSTOP: the speculator's connection stays open but nothing answers. The stream goes
    on decoding without trees (a stall of at most the budget now and then) and completes,
    with the same tokens, while the speculator is still stopped."""
    pid, addr = the(up, "speculator")
    try:
        [(ids, gap)], _ = asyncio.run(streams_with_a_fault(
            up["addr"], PROMPTS[:1], lambda: os.kill(pid, signal.SIGSTOP)))
        assert os.kill(pid, 0) is None and not serving(addr)  # still stopped, not restarted
    finally:
        os.kill(pid, signal.SIGCONT)
    assert ids == reference[PROMPTS[0]]
    assert gap < SPECULATE_TIMEOUT_S + 2.5, gap  # the old 10 s budget would stall 10 s
    assert the(up, "speculator") == (pid, addr)


def test_a_killed_speculator_is_restarted_and_streams_go_on(up, reference):
    pid, addr = the(up, "speculator")
    results, _ = asyncio.run(streams_with_a_fault(  # two: the router still speculates
        up["addr"], PROMPTS[:2], lambda: os.kill(pid, signal.SIGKILL)))
    assert [ids for ids, _ in results] == [reference[p] for p in PROMPTS[:2]]
    back_serving(up, "speculator", pid, addr)
    entry = restart_logged(up, "speculator")
    assert entry["exit_code"] == -signal.SIGKILL and entry["signal"] == "SIGKILL"
    assert entry["restart_in_s"] == 1.0 and entry["level"] == "warning"


def test_a_killed_single_verifier_is_restarted_and_its_streams_resume(up, reference):
    """The only verifier dies: its sequences wait (within the router's --queue-timeout) and
    are prefilled again from the router's history once `up` has it back; a request that
    arrives while it is down waits for it too."""
    pid, addr = the(up, "verifier")

    async def meanwhile():
        async with AsyncClient(up["addr"]) as client:
            return (await client.generate(PROMPTS[3], max_tokens=TOKENS,
                                          speculation=False)).token_ids

    results, late = asyncio.run(streams_with_a_fault(
        up["addr"], PROMPTS, lambda: os.kill(pid, signal.SIGKILL), during=meanwhile))
    assert [ids for ids, _ in results] == [reference[p] for p in PROMPTS]
    assert late == reference[PROMPTS[3]]
    assert the(up, "verifier")[1] == addr and serving(addr)
    assert restart_logged(up, "verifier")["exit_code"] == -signal.SIGKILL


def test_a_verifier_stalled_past_a_step_timeout_gets_its_sequences_back(up):
    """A verifier that stops answering (SIGSTOP) for longer than a step's timeout is failed
    over and probed; it comes back still holding the sequences whose calls timed out. The
    router releases them there before prefilling them again (else: "already live"), so the
    stream completes with the same tokens. The router runs in this process (its step
    timeout is not a flag), against the stack's verifier."""
    pid, addr = the(up, "verifier")

    async def tokens(req: GenRequest) -> list[int]:
        out = []
        while True:
            kind, payload = await req.events.get()
            if kind == "error":
                raise payload
            if kind == "done":
                return out
            out += payload

    async def main() -> tuple[list[int], list[int]]:
        scheduler = Scheduler(RouterConfig(), verifiers=[addr], eos_ids=[], step_timeout_s=1.0)
        await scheduler.start()
        try:
            want = GenRequest([1, 2, 3, 4], 100, SamplingParams())
            scheduler.submit(want)
            want = await tokens(want)
            req = GenRequest([1, 2, 3, 4], 100, SamplingParams())
            scheduler.submit(req)
            got = asyncio.create_task(tokens(req))
            while not req.generated:
                await asyncio.sleep(0.01)
            os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(2.5)
                assert not req.finish_reason
            finally:
                os.kill(pid, signal.SIGCONT)
            return want, await asyncio.wait_for(got, 60)
        finally:
            await scheduler.close()

    want, got = asyncio.run(main())
    assert got == want and len(got) == 100
    assert the(up, "verifier") == (pid, addr)  # stalled, not restarted


def test_a_killed_router_is_restarted_and_clients_reconnect(up, reference):
    pid, addr = the(up, "router")
    assert addr == up["addr"]

    async def meanwhile():  # the SDK's own retries on UNAVAILABLE ride out the restart
        async with AsyncClient(up["addr"]) as client:
            return (await client.generate(PROMPTS[1], max_tokens=TOKENS)).token_ids

    results, late = asyncio.run(streams_with_a_fault(
        up["addr"], PROMPTS, lambda: os.kill(pid, signal.SIGKILL), retry=True,
        during=meanwhile))
    assert [ids for ids, _ in results] == [reference[p] for p in PROMPTS]
    assert late == reference[PROMPTS[1]]
    back_serving(up, "router", pid, addr)
    assert restart_logged(up, "router")["exit_code"] == -signal.SIGKILL


def test_backoff_doubles_for_a_crash_loop_and_resets_after_serving(tmp_path, caplog):
    """Real processes under the real Supervisor (short delays): one that exits at once is
    restarted after 0.05, 0.1, 0.2, 0.2 s (the cap); one that served past ``stable_s``
    before each exit starts again after the first delay every time."""
    serve_then_exit = tmp_path / "serve.py"
    serve_then_exit.write_text(
        "import sys, time\nfrom concurrent import futures\nimport grpc\n"
        "from grpc_health.v1 import health, health_pb2_grpc\n"
        "server = grpc.server(futures.ThreadPoolExecutor(2))\n"
        "health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)\n"
        "server.add_insecure_port(sys.argv[1])\nserver.start()\ntime.sleep(1.0)\n"
        "sys.exit(1)\n")
    port = free_port()
    crashing = Supervised("speculator", "127.0.0.1:1", [sys.executable, "-c", "exit(3)"])
    stable = Supervised("verifier", f"127.0.0.1:{port}",
                        [sys.executable, str(serve_then_exit), f"127.0.0.1:{port}"])
    supervisor = Supervisor([crashing, stable], first_delay_s=0.05, max_delay_s=0.2,
                            stable_s=0.3)
    supervisor.start()
    delays: dict[str, list[float]] = {"speculator": [], "verifier": []}
    try:
        with caplog.at_level("INFO", logger="services.stack"):
            deadline = time.monotonic() + 30
            seen = {"speculator": 0.0, "verifier": 0.0}  # the last exit noted
            while len(delays["verifier"]) < 2 and time.monotonic() < deadline:
                supervisor.check()
                for s in (crashing, stable):
                    if s.restart_at is not None and s.exited_at != seen[s.role]:
                        seen[s.role] = s.exited_at
                        delays[s.role].append(s.delay_s)
                time.sleep(0.01)
    finally:
        supervisor.stop(grace_s=5)
    assert delays["speculator"][:5] == [0.05, 0.1, 0.2, 0.2, 0.2]
    assert delays["verifier"] == [0.05, 0.05]
    exits = [r for r in caplog.records if r.getMessage() == "service exited; restarting it"]
    assert {(r.role, r.exit_code) for r in exits} == {("speculator", 3), ("verifier", 1)}


def test_a_sigkilled_up_leaves_no_service_running(tiny_chat_llm):
    """`up` killed with SIGKILL (no chance to stop anything): every service it started
    ends too (the kernel tells them; they stop cleanly), none left as an orphan."""
    up = start("up", "--llm", tiny_chat_llm, "--speculators", "0", "--datastore", "none",
               "--draft-head", "none", "--http-port", "0", stdout=subprocess.DEVNULL,
               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        up.wait()
        pids = [pid for _, pid, _ in service_processes(up.proc.pid)]
        assert len(pids) == 2, pids  # the verifier and the router
        os.kill(up.proc.pid, signal.SIGKILL)
        up.proc.wait()
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.2)
        assert not [pid for pid in pids if _alive(pid)]
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by init, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
