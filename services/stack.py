"""``specinfer up``: the whole stack on this machine — verifier(s), speculator(s) and the
router as separate ``specinfer serve <role>`` processes on loopback — until SIGINT/SIGTERM,
then stops every one of them. It supervises them: a service that dies once the stack serves
is started again with the same command line (so the same port: the router's addresses stay
valid) after an exponential backoff, while the others keep serving."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.parent import child_env
from services.router import auth
from services.router.config import RouterConfig
from services.speculator.config import SpeculatorConfig
from services.verifier.config import VerifierConfig
from specinfer import tls, tracing
from specinfer.config import Flags, flag, forward, forwarded, to_argv
from specinfer.net import GRPC_OPTIONS, free_port
from specinfer.placement import PlacementFlags
from specinfer.tls import TlsFlags

log = logging.getLogger(__name__)

SERVICES = {"verifier": VerifierConfig, "speculator": SpeculatorConfig, "router": RouterConfig}
MODEL_SERVICES = (VerifierConfig, SpeculatorConfig)
EVERY_SERVICE = tuple(SERVICES.values())


@dataclass(frozen=True)
class UpConfig(Flags):
    """``up``'s flags: most are a service's own, forwarded to it (``to``); the rest say how
    many services to run and how ``up`` wires them."""

    llm: str = forward(VerifierConfig, "llm", to=EVERY_SERVICE, help="the LLM: a model "
                       "directory, .gguf file or alias (default %(default)s)")
    ssm: tuple[str, ...] | None = forward(
        SpeculatorConfig, "ssm", help="an SSM for the speculators (repeatable; see serve "
        "speculator); default: the bundled pool if present")
    host: str = forward(RouterConfig, "host", help="address of the router's gRPC and HTTP "
                        "APIs (default %(default)s)")
    port: int = forward(RouterConfig, "port", help="the router's gRPC port")
    http_port: int = forward(RouterConfig, "http_port", help="the OpenAI-compatible HTTP API, "
                             "/metrics and /health")
    verifiers: int = flag(1, "verifier replicas", minimum=1)
    speculators: int = flag(1, "speculator replicas (0: the verifiers' own drafts only)",
                            minimum=0)
    tp: int = forward(VerifierConfig, "tp", help="tensor-parallel ranks per verifier "
                      "(DeepSpeed AutoTP)")
    pp: int = forward(VerifierConfig, "pp", help="pipeline stages per verifier")
    slots: int = forward(VerifierConfig, "slots", help="sequences each verifier holds in its "
                         "KV cache at once")
    max_context: int = forward(VerifierConfig, "max_context", to=MODEL_SERVICES,
                               help="tokens per sequence: prompt + generated")
    expansion: str | None = forward(SpeculatorConfig, "expansion",
                                    help="the speculator's static tree")
    draft_head: str = forward(VerifierConfig, "draft_head", help="the verifiers' draft head: "
                              "auto, none or a directory (see serve verifier)")
    no_prefix_caching: bool = forward(VerifierConfig, "no_prefix_caching",
                                      help="turn off the verifiers' automatic prefix caching")
    prefill_chunk: int = forward(VerifierConfig, "prefill_chunk")
    prefill_step_ratio: float = forward(VerifierConfig, "prefill_step_ratio")
    datastore: str = forward(VerifierConfig, "datastore", to=MODEL_SERVICES,
                             help="the speculators' and verifiers' corpus drafts: auto, none "
                             "or a saved .npz")
    speculation: str = forward(RouterConfig, "speculation")
    chat_template: str = forward(RouterConfig, "chat_template")
    spec_max_batch: int = forward(RouterConfig, "spec_max_batch")
    routing: str = forward(RouterConfig, "routing")
    speculate_timeout: float | None = forward(
        RouterConfig, "speculate_timeout", default=None,
        help="the router's budget for one Speculate call (see serve router)")
    speculate_rpc: str = forward(RouterConfig, "speculate_rpc", help="the router's calls to "
                                 "the speculators (see serve router)")
    # Validated here (PlacementFlags.resolve in run), before any service starts.
    placement: PlacementFlags = forward(VerifierConfig, "placement", to=MODEL_SERVICES)
    # Every service's; the OTEL_* environment is inherited too.
    otlp_traces_endpoint: str | None = forward(VerifierConfig, "otlp_traces_endpoint",
                                               to=EVERY_SERVICE)
    # The router's, but keys reach it in its environment, not in `ps`: forwarded by run.
    api_key: tuple[str, ...] = forward(RouterConfig, "api_key", to=())
    metrics_auth: bool = forward(RouterConfig, "metrics_auth")
    tls: TlsFlags = forward(RouterConfig, "tls", to=EVERY_SERVICE)
    throwaway_tls: bool = flag(False, "a throw-away CA and certificate for a local trial: TLS "
                               "on both public APIs, mutual TLS between the services (the "
                               "CA's path is printed, for clients)", name="--tls")
    metrics_port: int = flag(0, "the router serves /metrics on --http-port; with this, the "
                             "verifiers serve theirs on this port and the next ones, then the "
                             "speculators (0 = only the router's)")

    def check(self) -> None:
        if self.throwaway_tls and (self.tls.tls_cert or self.tls.tls_key or self.tls.tls_ca):
            raise tls.TlsError("--tls makes its own certificates: drop --tls-cert/--tls-key/"
                               "--tls-ca, or --tls")
        for service in EVERY_SERVICE:  # a value a service would refuse fails here
            service(**forwarded(self, service))


def service_command(config: UpConfig, role: str, **values: Any) -> list[str]:
    """``specinfer serve role`` with ``config``'s values declared for that service and
    ``values`` (what ``up`` decides per process: ports, threads, addresses)."""
    service = SERVICES[role]
    return [sys.executable, "-m", "services", "serve", role,
            *to_argv(service, {**forwarded(config, service), **values})]


def wait_serving(address: str, procs: list[subprocess.Popen], timeout: float,
                 stop: Callable[[], bool] | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> bool:
    """Until ``address`` reports SERVING (True); False as soon as one of ``procs`` exits,
    ``stop()`` turns true, or ``timeout`` seconds pass."""
    channel = grpc.secure_channel(address, credentials, options=GRPC_OPTIONS) if credentials \
        else grpc.insecure_channel(address, options=GRPC_OPTIONS)  # reconnect waits capped
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not (stop and stop()):
            if any(p.poll() is not None for p in procs):
                return False
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.3)
        return False
    finally:
        channel.close()


@dataclass
class Supervised:
    """One service of the stack: its command line (the same on every start, port included)
    and its current process."""

    role: str  # verifier, speculator or router
    address: str  # where it listens (gRPC, with the health service)
    cmd: list[str]
    env: dict[str, str] | None = None  # None: this process's environment
    proc: subprocess.Popen | None = None
    serving_since: float | None = None  # monotonic; None until SERVING after each start
    exited_at: float = 0.0
    restart_at: float | None = None  # set while it waits out its backoff
    delay_s: float = 0.0  # the last backoff (0: none yet)
    restarts: int = 0

    def start(self) -> None:
        # It ends with `up`, even a SIGKILLed one (parent.follow_parent).
        self.proc = subprocess.Popen(self.cmd, env=child_env(self.env))
        self.serving_since, self.restart_at = None, None


class Supervisor:
    """Restarts services that exit, with exponential backoff: ``first_delay_s`` doubling up
    to ``max_delay_s``, back to ``first_delay_s`` for a service that had served
    ``stable_s`` before it died (a crash now and then is not a crash loop)."""

    def __init__(self, services: list[Supervised], *, first_delay_s: float = 1.0,
                 max_delay_s: float = 30.0, stable_s: float = 60.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.services = services
        self.first_delay_s, self.max_delay_s, self.stable_s = (first_delay_s, max_delay_s,
                                                               stable_s)
        self.credentials = credentials

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [s.proc for s in self.services if s.proc is not None]

    def start(self) -> None:
        for s in self.services:
            s.start()

    def check(self, now: float | None = None) -> None:
        """One pass: schedule a restart for each service that exited, start those whose
        backoff is over, and note those serving again."""
        now = time.monotonic() if now is None else now
        for s in self.services:
            if s.restart_at is not None:
                if now >= s.restart_at:
                    s.start()
                    s.restarts += 1
                    log.info("service restarted", extra={
                        "role": s.role, "address": s.address, "pid": s.proc.pid,
                        "restarts": s.restarts})
                continue
            code = s.proc.poll()
            if code is None:
                if s.serving_since is None and self._serving(s):
                    s.serving_since = now
                    if s.restarts:
                        log.info("service serving again", extra={
                            "role": s.role, "address": s.address,
                            "down_s": round(now - s.exited_at, 1)})
                continue
            served = now - s.serving_since if s.serving_since is not None else 0.0
            s.delay_s = self.first_delay_s if not s.delay_s or served >= self.stable_s \
                else min(self.max_delay_s, 2 * s.delay_s)
            s.exited_at, s.restart_at = now, now + s.delay_s
            log.warning("service exited; restarting it", extra={
                "role": s.role, "address": s.address, "exit_code": code,
                "signal": _signal_name(code),
                "served_s": round(served, 1), "restart_in_s": s.delay_s})

    def _serving(self, s: Supervised) -> bool:
        # A fresh channel each time: a kept one would wait out its reconnect backoff.
        channel = grpc.secure_channel(s.address, self.credentials) if self.credentials \
            else grpc.insecure_channel(s.address)
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=0.5).status == \
                health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False
        finally:
            channel.close()

    def stop(self, grace_s: float = 30.0) -> None:
        stop_processes(self.procs, grace_s)


def run(config: UpConfig) -> int:
    config.placement.resolve()  # a bad --device/--dtype fails here, not in every service
    tracing.exporter_for(config.otlp_traces_endpoint, os.environ)  # ... and a bad endpoint
    config, credentials = _tls(config)
    keys = auth.ApiKeys.from_flags(list(config.api_key))  # validated here; passed as the env's
    router_env = {**os.environ, auth.ENV: ",".join(
        [*config.api_key, os.environ.get(auth.ENV, "")]).strip(",")} if keys.required else None
    metrics_ports = iter(range(config.metrics_port, config.metrics_port + 1000)
                         if config.metrics_port else [])
    metrics_urls = []

    def metrics_port() -> dict[str, int]:
        port = next(metrics_ports, 0)
        if not port:
            return {}
        metrics_urls.append(f"http://127.0.0.1:{port}/metrics")
        return {"metrics_port": port}
    services: list[Supervised] = []
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # Share the cores among the model processes.
    threads = max(1, (os.cpu_count() or 1) // max(1, config.verifiers * config.tp * config.pp))
    addresses: dict[str, list[str]] = {"verifier": [], "speculator": []}
    for role, count in (("verifier", config.verifiers), ("speculator", config.speculators)):
        for _ in range(count):
            port = free_port()
            addresses[role].append(f"127.0.0.1:{port}")
            services.append(Supervised(role, addresses[role][-1], service_command(
                config, role, port=port, threads=threads, **metrics_port())))
    verifiers, speculators = addresses["verifier"], addresses["speculator"]
    router = f"{config.host}:{config.port}"
    services.append(Supervised("router", router, service_command(
        config, "router", verifier=tuple(verifiers), speculator=tuple(speculators)),
        env=router_env))
    supervisor = Supervisor(services, credentials=credentials)
    supervisor.start()
    rc = 0
    try:
        # A service that exits before the stack first serves is a setup error (a bad
        # model, a port in use): stop, rather than restart it forever.
        if not wait_serving(router, supervisor.procs, timeout=900, stop=lambda: stopping,
                            credentials=credentials):
            if not stopping:
                print("specinfer up: a service failed to start", file=sys.stderr)
                rc = 1
        else:
            web = f"{'https' if credentials else 'http'}://{config.host}:{config.http_port}"
            print(f"specinfer is serving: gRPC {router}  OpenAI HTTP {web}/v1  metrics "
                  f"{' '.join([f'{web}/metrics', *metrics_urls])}"
                  + (f"  TLS CA {config.tls.tls_ca}" if credentials else "")
                  + (f"  API keys {len(keys)}" if keys.required else "")
                  + "  (Ctrl-C stops)", flush=True)
        while not stopping and rc == 0:
            supervisor.check()
            time.sleep(0.5)
    finally:
        supervisor.stop()
    return rc


def _tls(config: UpConfig) -> tuple[UpConfig, grpc.ChannelCredentials | None]:
    """``config`` with the TLS files every service gets (``--tls``: a throw-away CA made
    now), and the credentials ``up``'s own health checks use (a client certificate for
    mutual TLS)."""
    if config.throwaway_tls:
        import tempfile

        pki = tls.throwaway_pki(Path(tempfile.mkdtemp(prefix="specinfer-tls-")))
        config = dataclasses.replace(config, throwaway_tls=False, tls=TlsFlags(
            tls_cert=str(pki["cert"]), tls_key=str(pki["key"]), tls_ca=str(pki["ca"]),
            tls_server_name=config.tls.tls_server_name))
    files = tls.from_flags(config.tls)  # a bad file stops `up` here (exit 2)
    if files is None:
        return config, None
    # Our health checks: trust the CA (or, without one, the system's roots) and present
    # the stack's certificate, which a mutual-TLS verifier asks for.
    return config, grpc.ssl_channel_credentials(files.ca, files.key, files.cert)


def service_processes(up_pid: int) -> list[tuple[str, int, str]]:
    """The ``serve <role>`` processes a running ``specinfer up`` (``up_pid``) runs now, as
    (role, pid, gRPC address), read from /proc (Linux): what a soak or a fault test kills
    and watches."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after the (command name)
        if ppid != up_pid or "serve" not in argv or argv.index("serve") + 1 >= len(argv):
            continue
        flags = dict(zip(argv, argv[1:], strict=False))
        found.append((argv[argv.index("serve") + 1], int(entry.name),
                      f"{flags.get('--host', '127.0.0.1')}:{flags.get('--port', '')}"))
    return sorted(found)


def _signal_name(code: int) -> str | None:
    """The signal that ended a process (a negative return code), if one did."""
    try:
        return signal.Signals(-code).name if code < 0 else None
    except ValueError:
        return None


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 30.0) -> None:
    """SIGTERM every process that still runs, wait, and SIGKILL what did not stop."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
