"""Service discovery (services/router/discovery.py and kubernetes_discovery.py): static, DNS
(real resolution, plus a DNS double for answers that change), and Kubernetes EndpointSlices
through the real ``kubernetes`` client talking HTTP to kmock's Kubernetes API double
(``kmock`` fixture: a ``kmock.KubernetesEmulator`` served by a ``kmock.Server``; objects
changed over HTTP reach open watches as events, objects changed through ``kmock.objects`` do
not: a change the router's watch missed)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from pathlib import Path

import kmock as kmocklib
import pytest
import pytest_asyncio
from kube_api import LABEL, RES, Api, endpoint_slice, gone_once, is_watch, write_kubeconfig
from kubernetes.aio import client as kclient

from services.router import discovery, kubernetes_discovery
from services.router.discovery import DiscoveryError, DnsDiscovery, StaticDiscovery
from services.router.kubernetes_discovery import KubernetesDiscovery, ServiceTarget
from specinfer.config import parse


class Recorder:
    """on_change's calls, and a deadline-bound wait for a role's set."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, frozenset[str]]] = []

    def __call__(self, role: str, addresses: frozenset[str]) -> None:
        assert isinstance(addresses, frozenset)
        self.calls.append((role, addresses))

    def current(self, role: str) -> frozenset[str] | None:
        sets = [a for r, a in self.calls if r == role]
        return sets[-1] if sets else None

    def history(self, role: str) -> list[frozenset[str]]:
        return [a for r, a in self.calls if r == role]

    async def until(self, role: str, expected: set[str], within_s: float = 2.0) -> float:
        began = time.monotonic()
        while self.current(role) != frozenset(expected):
            if time.monotonic() - began > within_s:
                raise AssertionError(f"{role}: still {self.current(role)}, expected {expected} "
                                     f"after {within_s} s; calls: {self.calls}")
            await asyncio.sleep(0.02)
        return time.monotonic() - began

    def check_no_repeats(self) -> None:
        for role in discovery.ROLES:
            h = self.history(role)
            assert all(a != b for a, b in zip(h, h[1:], strict=False)), (role, h)


@pytest_asyncio.fixture
async def api(kmock):
    kmock.resources[RES] = {}  # known (empty) before any slice exists
    a = Api(kmock.url)
    yield a
    await a.session.close()


def _kube(url, targets: dict[str, list[ServiceTarget]], **kw) -> KubernetesDiscovery:
    cfg = kclient.Configuration(host=str(url).rstrip("/"))
    kw.setdefault("resync_s", 60.0)
    return KubernetesDiscovery(targets, configuration=cfg, **kw)


@contextlib.asynccontextmanager
async def running(d, rec: Recorder):
    await d.start(rec)
    try:
        yield d
    finally:
        began = time.monotonic()
        await d.close()
        assert time.monotonic() - began < 1.0, "close() must be prompt"
        rec.check_no_repeats()


def _lists(kmock) -> int:
    return len(kmock[kmocklib.action.LIST])


async def _until(predicate, within_s: float = 2.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


VER = ServiceTarget("ver", "default")


# --------------------------------------------------------------------- kubernetes


@pytest.mark.asyncio
async def test_initial_list_ready_endpoints_named_port_and_explicit_port(kmock, api):
    await api.create(endpoint_slice("ver-1", "ver", [
        ("10.0.0.1", True, None),      # ready
        ("10.0.0.2", None, None),      # ready null: counts
        ("10.0.0.3", True, False),     # not terminating
        ("10.0.0.4", False, None),     # not ready
        ("10.0.0.5", None, True),      # terminating
        ("10.0.0.6", False, True),
    ]))
    await api.create(endpoint_slice("ver-v6", "ver", [("fd00::7", True, None)],
                                    address_type="IPv6"))
    # another Service
    await api.create(endpoint_slice("other-1", "other", [("10.9.9.9", True, None)]))
    await api.create(endpoint_slice("ver-x", "ver", [("10.8.8.8", True, None)],
                                    namespace="elsewhere"))
    await api.create(endpoint_slice("spec-1", "spec", [("10.1.0.1", True, None)],
                                    ports=[("http", 80)]))
    rec = Recorder()
    spec = ServiceTarget("spec", "default", 7000)
    d = _kube(kmock.url, {"verifier": [VER], "speculator": [spec]})
    async with running(d, rec):
        assert rec.calls[:2] == [
            ("verifier", frozenset({"10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051",
                                    "[fd00::7]:50051"})),
            ("speculator", frozenset({"10.1.0.1:7000"})),  # the explicit port, as is
        ]
    # the label selectors went to the server (kmock ignores them; the client filters
    # again); the two roles list concurrently, so in either order
    selectors = {r.params["labelSelector"] for r in kmock[kmocklib.action.LIST]}
    assert {f"{LABEL}=ver", f"{LABEL}=spec"} <= selectors


@pytest.mark.asyncio
async def test_named_port_missing_and_other_port_name(kmock, api):
    await api.create(endpoint_slice("ver-1", "ver", [("10.0.0.1", True, None)],
                                    ports=[("http", 80)]))
    rec = Recorder()
    d = _kube(kmock.url, {"verifier": [VER, ServiceTarget("ver", "default", None, "http")]})
    async with running(d, rec):
        # no port named grpc: that target has nothing; ":http" picks the other name
        assert rec.current("verifier") == {"10.0.0.1:80"}
        assert rec.current("speculator") == frozenset()


@pytest.mark.asyncio
async def test_watch_added_modified_deleted_two_slices_union(kmock, api):
    await api.create(endpoint_slice("ver-1", "ver", [("10.0.0.1", True, None),
                                                     ("10.0.0.2", True, None)]))
    rec = Recorder()
    async with running(_kube(kmock.url, {"verifier": [VER]}), rec):
        assert rec.current("verifier") == {"10.0.0.1:50051", "10.0.0.2:50051"}
        await api.create(endpoint_slice("ver-2", "ver", [("10.0.1.1", None, None)]))  # a 2nd slice
        await rec.until("verifier", {"10.0.0.1:50051", "10.0.0.2:50051", "10.0.1.1:50051"})
        await api.patch("ver-1", {"endpoints": [  # 10.0.0.2 becomes not ready
            {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": False}}]})
        await rec.until("verifier", {"10.0.0.1:50051", "10.0.1.1:50051"})
        await api.patch("ver-1", {"endpoints": [  # 10.0.0.1 terminating
            {"addresses": ["10.0.0.1"], "conditions": {"ready": False, "serving": True,
                                                       "terminating": True}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": True}}]})
        await rec.until("verifier", {"10.0.0.2:50051", "10.0.1.1:50051"})
        await api.create(endpoint_slice("other-2", "other", [("10.9.9.9", True, None)]))  # not ours
        await api.delete("ver-2")
        await rec.until("verifier", {"10.0.0.2:50051"})
        await api.delete("ver-1")  # the Service really has no endpoints: empty is reported
        await rec.until("verifier", set())
        await api.create(endpoint_slice("ver-3", "ver", [("10.0.3.1", True, None)]))
        await rec.until("verifier", {"10.0.3.1:50051"})
    assert len(kmock[kmocklib.action.LIST]) == 1  # one list, then the watch did it all
    watch = kmock[kmocklib.action.WATCH][0].params
    assert watch["allowWatchBookmarks"] == "true" and int(watch["timeoutSeconds"]) > 0
    assert watch["resourceVersion"] and watch["labelSelector"] == f"{LABEL}=ver"


@pytest.mark.asyncio
@pytest.mark.parametrize("as_event", [False, True], ids=["http-410", "error-event-410"])
async def test_gone_relists_and_converges(kmock, api, as_event, caplog):
    await api.create(endpoint_slice("ver-1", "ver", [("10.0.0.1", True, None)]))
    await api.create(endpoint_slice("ver-2", "ver", [("10.0.0.2", True, None)]))
    armed = gone_once(kmock, as_event)
    rec = Recorder()
    # Watches end after ~1 s (kmock ignores timeoutSeconds; the client ends them too).
    d = _kube(kmock.url, {"verifier": [VER]}, watch_timeout_s=1, read_slack_s=0.2)
    caplog.set_level(logging.INFO, logger="services.router.discovery")
    async with running(d, rec):
        assert rec.current("verifier") == {"10.0.0.1:50051", "10.0.0.2:50051"}
        await _until(lambda: len(kmock[kmocklib.action.WATCH]) >= 1)  # a watch is open
        lists = _lists(kmock)
        # A change the watch never sees (as if made while it was down), then, when the
        # watch is re-opened (~1 s), 410 Gone.
        del kmock.objects[RES, "default", "ver-2"]
        armed.set()
        await rec.until("verifier", {"10.0.0.1:50051"}, within_s=4.0)
        assert not armed.is_set()
        assert _lists(kmock) > lists  # converged by re-listing, not by a resync (60 s)
        assert frozenset() not in rec.history("verifier")
    assert "410 Gone" in caplog.text  # an expected event: re-listed at once, no warning
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and r.name == "services.router.discovery"]


@pytest.mark.asyncio
async def test_silent_watch_converges_by_reopen_and_resync(kmock, api):
    """The server stops answering (headers sent, then nothing): the watch is given up after
    read_timeout_s, and the periodic re-list repairs what it missed."""
    await api.create(endpoint_slice("ver-1", "ver", [("10.0.0.1", True, None)]))
    await api.create(endpoint_slice("ver-2", "ver", [("10.0.0.2", True, None)]))
    silent = asyncio.Event()
    kmock[lambda req: silent.is_set() and is_watch(req)] << (b"", lambda: asyncio.sleep(3600))
    rec = Recorder()
    d = _kube(kmock.url, {"verifier": [VER]}, resync_s=1.5, read_timeout_s=0.5)
    silent.set()  # from the first watch on
    async with running(d, rec):
        assert rec.current("verifier") == {"10.0.0.1:50051", "10.0.0.2:50051"}
        await api.delete("ver-2")  # no watch hears this one
        await api.create(endpoint_slice("ver-3", "ver", [("10.0.0.3", True, None)]))
        # by the re-list every 1.5 s
        await rec.until("verifier", {"10.0.0.1:50051", "10.0.0.3:50051"}, within_s=2.5)
        lists = _lists(kmock)
        silent.clear()  # the server answers again: the watch works again
        await asyncio.sleep(0.6)  # the next watch opens (the silent one is given up)
        await api.delete("ver-1")
        await rec.until("verifier", {"10.0.0.3:50051"}, within_s=0.5)
        assert _lists(kmock) == lists  # the watch saw it, not a re-list
    assert len(kmock[kmocklib.action.WATCH]) >= 3  # re-opened after each silence


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.asyncio
async def test_api_unreachable_keeps_last_set_then_converges(kmock, api, caplog):
    """A second server for the same emulator, which the test stops and starts: while it is
    down the last set stays, nothing empty is reported; once back, it converges."""
    await api.create(endpoint_slice("ver-1", "ver", [("10.0.0.1", True, None)]))
    await api.create(endpoint_slice("ver-2", "ver", [("10.0.0.2", True, None)]))
    port = _free_port()
    server = kmocklib.Server(kmock, port=port)
    await server.__aenter__()
    rec = Recorder()
    d = _kube(server.url, {"verifier": [VER]}, backoff_max_s=0.3, request_timeout_s=2.0)
    try:
        with caplog.at_level(logging.WARNING, logger="services.router.discovery"):
            async with running(d, rec):
                assert rec.current("verifier") == {"10.0.0.1:50051", "10.0.0.2:50051"}
                await server.__aexit__(None, None, None)  # drops the watch connection
                await api.delete("ver-1")  # through the fixture's own server
                await api.delete("ver-2")
                await asyncio.sleep(1.5)  # several failed retries
                assert rec.current("verifier") == {"10.0.0.1:50051", "10.0.0.2:50051"}
                assert any("failed" in r.getMessage() for r in caplog.records)
                await api.create(endpoint_slice("ver-3", "ver", [("10.0.0.3", True, None)]))
                server = kmocklib.Server(kmock, port=port)
                await server.__aenter__()
                await rec.until("verifier", {"10.0.0.3:50051"}, within_s=3.0)
        assert frozenset() not in rec.history("verifier")
    finally:
        await server.__aexit__(None, None, None)


@pytest.mark.asyncio
async def test_api_down_at_start_reports_empty_then_converges(kmock, api):
    await api.create(endpoint_slice("ver-1", "ver", [("10.0.0.1", True, None)]))
    port = _free_port()
    rec = Recorder()
    cfg = kclient.Configuration(host=f"http://127.0.0.1:{port}")
    d = KubernetesDiscovery({"verifier": [VER]}, configuration=cfg, backoff_max_s=0.3)
    async with running(d, rec):
        assert rec.calls == [("verifier", frozenset()), ("speculator", frozenset())]
        async with kmocklib.Server(kmock, port=port):
            await rec.until("verifier", {"10.0.0.1:50051"}, within_s=3.0)
            await d.close()  # before the server goes


@pytest.mark.asyncio
async def test_from_flags_kubernetes_with_kubeconfig(kmock, api, tmp_path, monkeypatch):
    await api.create(endpoint_slice("ver-1", "ver", [("10.0.0.1", True, None)], namespace="prod"))
    await api.create(endpoint_slice("spec-1", "spec", [("10.1.0.1", True, None)], namespace="team"))
    kubeconfig = write_kubeconfig(tmp_path / "config", kmock.url, token="not-a-secret")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("POD_NAMESPACE", "prod")
    d = discovery.from_flags(_args("--discovery", "kubernetes"), ["ver"], ["spec.team:grpc"])
    assert isinstance(d, KubernetesDiscovery) and d.resync_s == 300.0
    rec = Recorder()
    async with running(d, rec):
        assert rec.current("verifier") == {"10.0.0.1:50051"}  # in $POD_NAMESPACE
        assert rec.current("speculator") == {"10.1.0.1:50051"}
    assert kmock[kmocklib.action.LIST][0].headers["Authorization"] == "Bearer not-a-secret"


# ---------------------------------------------------------------------------- dns


@pytest.mark.asyncio
async def test_dns_localhost_and_a_failing_name():
    expected = {discovery.format_address(info[4][0], 50051) for info in
                socket.getaddrinfo("localhost", 50051, type=socket.SOCK_STREAM)}
    assert "127.0.0.1:50051" in expected
    rec = Recorder()
    # The failing name fails in getaddrinfo itself (a 64-byte label), not at a DNS server:
    # CI may have no reachable resolver, and a lookup there waits on its timeouts.
    d = DnsDiscovery({"verifier": [("localhost", 50051), ("x" * 64 + ".invalid", 1)]},
                     interval_s=0.05)
    async with running(d, rec):
        # the failing name adds nothing (nothing known for it yet); the other one counts
        assert rec.calls == [("verifier", frozenset(expected)), ("speculator", frozenset())]
        await asyncio.sleep(0.3)  # a few rounds: nothing changes, nothing repeats
    assert len(rec.calls) == 2


class FakeDns:
    """A DNS double: answers from a table, or fails as getaddrinfo does."""

    def __init__(self) -> None:
        self.table: dict[str, list[str]] = {}
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list:
        self.calls += 1
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port)) for a in self.table[host]]


@pytest.mark.asyncio
async def test_dns_changes_failures_keep_the_last_set():
    dns = FakeDns()
    dns.table["ver.ns.svc"] = ["10.0.0.1", "fd00::1"]
    rec = Recorder()
    d = DnsDiscovery({"verifier": [("ver.ns.svc", 50051)], "speculator": [("spec", 7)]},
                     interval_s=0.05, resolve=dns)
    async with running(d, rec):
        assert rec.calls == [("verifier", frozenset({"10.0.0.1:50051", "[fd00::1]:50051"})),
                             ("speculator", frozenset())]  # spec fails: nothing known yet
        dns.table["ver.ns.svc"].append("10.0.0.2")
        await rec.until("verifier", {"10.0.0.1:50051", "[fd00::1]:50051", "10.0.0.2:50051"})
        dns.table["spec"] = ["10.1.0.1"]
        await rec.until("speculator", {"10.1.0.1:7"})
        del dns.table["ver.ns.svc"]  # NXDOMAIN: keep the last set
        calls, n = dns.calls, len(rec.calls)
        while dns.calls < calls + 6:
            await asyncio.sleep(0.02)
        assert len(rec.calls) == n
        dns.table["ver.ns.svc"] = ["10.0.0.3"]
        await rec.until("verifier", {"10.0.0.3:50051"})
    assert frozenset() not in rec.history("verifier")


# ------------------------------------------------------------------ static, flags


@pytest.mark.asyncio
async def test_static_reports_the_flags_once():
    flags = _args()
    assert (flags.mode, flags.interval, flags.kube_namespace) == ("static", None, None)
    d = discovery.from_flags(flags, ["a:1", "[::1]:2", "a:1"], [])
    assert isinstance(d, StaticDiscovery)
    rec = Recorder()
    async with running(d, rec):
        assert rec.calls == [("verifier", frozenset({"a:1", "[::1]:2"})),
                             ("speculator", frozenset())]


def _args(*argv: str) -> discovery.DiscoveryFlags:
    return parse(discovery.DiscoveryFlags, argv)


@pytest.mark.parametrize("argv,verifiers,speculators,flag", [
    (["--discovery-interval", "abc"], ["a:1"], [], "--discovery-interval"),
    (["--discovery-interval", "0"], ["a:1"], [], "--discovery-interval"),
    (["--discovery-interval", "-1"], ["a:1"], [], "--discovery-interval"),
    (["--discovery-interval", "nan"], ["a:1"], [], "--discovery-interval"),
    (["--discovery", "dns", "--discovery-interval", "inf"], ["a:1"], [], "--discovery-interval"),
    ([], [], [], "--verifier"),
    ([], [""], [], "--verifier"),
    ([], ["host"], [], "--verifier"),
    ([], ["host:0"], [], "--verifier"),
    ([], ["host:65536"], [], "--verifier"),
    ([], ["host:x"], [], "--verifier"),
    ([], ["::1:5"], [], "--verifier"),
    ([], ["a:1"], ["b:"], "--speculator"),
    (["--discovery", "dns"], [":50051"], [], "--verifier"),
    (["--discovery", "dns"], ["a:1"], ["b:99999"], "--speculator"),
    (["--discovery", "kubernetes"], [""], [], "--verifier"),
    (["--discovery", "kubernetes"], ["Bad_Name"], [], "--verifier"),
    (["--discovery", "kubernetes"], ["svc:0"], [], "--verifier"),
    (["--discovery", "kubernetes"], ["svc:70000"], [], "--verifier"),
    (["--discovery", "kubernetes"], ["svc:no_such!"], [], "--verifier"),
    (["--discovery", "kubernetes"], ["svc.ns.svc.cluster.local"], [], "--verifier"),
    (["--discovery", "kubernetes"], ["svc"], [".x"], "--speculator"),
    (["--discovery", "kubernetes", "--kube-namespace", "Not A NS"], ["svc"], [],
     "--kube-namespace"),
])
def test_from_flags_errors_name_the_flag(argv, verifiers, speculators, flag, tmp_path,
                                         monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "config"))
    (tmp_path / "config").write_text("{}")
    with pytest.raises(DiscoveryError, match=flag):
        discovery.from_flags(_args(*argv), verifiers, speculators)


def test_from_flags_kubernetes_without_config(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(DiscoveryError, match="--discovery"):
        discovery.from_flags(_args("--discovery", "kubernetes"), ["svc"], [])


def test_from_flags_kubernetes_targets_and_namespace(tmp_path, monkeypatch):
    (tmp_path / "config").write_text("{}")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "config"))
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    d = discovery.from_flags(_args("--discovery", "kubernetes", "--discovery-interval", "30"),
                             ["ver", "ver2.prod:8000"], ["spec:http"])
    assert d.resync_s == 30.0
    default_ns = "default"
    with contextlib.suppress(OSError):  # in a pod: the service account's namespace
        default_ns = Path(kubernetes_discovery.NAMESPACE_FILE).read_text().strip() or "default"
    assert d.targets["verifier"] == [ServiceTarget("ver", default_ns),
                                     ServiceTarget("ver2", "prod", 8000)]
    assert d.targets["speculator"] == [ServiceTarget("spec", default_ns, None, "http")]
    monkeypatch.setenv("POD_NAMESPACE", "team")
    d = discovery.from_flags(_args("--discovery", "kubernetes"), ["ver"], [])
    assert d.targets["verifier"] == [ServiceTarget("ver", "team")]
    d = discovery.from_flags(_args("--discovery", "kubernetes", "--kube-namespace", "x"),
                             ["ver"], [])
    assert d.targets["verifier"] == [ServiceTarget("ver", "x")]
    d = discovery.from_flags(_args("--discovery", "dns"), ["ver:1"], [])
    assert isinstance(d, DnsDiscovery) and d.interval_s == 5.0
