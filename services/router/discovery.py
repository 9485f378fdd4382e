"""Service discovery for the router: which verifier and speculator replicas exist, now and
as they come and go.

``--discovery`` picks the source; ``--verifier``/``--speculator`` (repeatable, in main.py)
name the targets, read per mode:

- ``static`` (default): ``HOST:PORT`` addresses, reported once at start, never changed.
- ``dns``: ``HOST:PORT`` names (a headless Service), resolved with ``getaddrinfo`` at start
  and every ``--discovery-interval`` seconds (default 5); a role's set is every A/AAAA
  address of every one of its names, each with the name's port.
- ``kubernetes``: ``SERVICE[.NAMESPACE][:PORT]``: the ready endpoints of the Service's
  EndpointSlices (``discovery.k8s.io/v1``, label ``kubernetes.io/service-name=SERVICE``) in
  NAMESPACE (default ``--kube-namespace``: ``$POD_NAMESPACE``, else the service account's
  namespace file, else ``default``). ``:PORT`` is the number used for every address (the
  pod's port); without it, the slice's port named ``grpc`` (``:NAME`` picks another name).
  List, then watch from the list's resourceVersion (bookmarks on, a server-side
  ``timeoutSeconds``, a client-side read timeout); ADDED/MODIFIED/DELETED are applied per
  slice name (the set is the union of a Service's slices); ``410 Gone`` (an HTTP 410 or an
  ERROR event with code 410) re-lists; every ``--discovery-interval`` seconds (default 300)
  it re-lists anyway, so a watch that died silently cannot leave stale replicas for longer
  than that. An endpoint counts when ``conditions.ready`` is true or null (the API: null is
  ready) and ``conditions.terminating`` is not true. Config: in-cluster when
  ``KUBERNETES_SERVICE_HOST`` is set, else the kubeconfig (``$KUBECONFIG``, ~/.kube/config);
  tests pass ``configuration=`` to :class:`KubernetesDiscovery`.

Addresses are reported as ``ip:port``, IPv6 as ``[ip]:port``; static addresses as given.

``Discovery.start(on_change)`` calls ``on_change(role, addresses)`` once for each role
(``"verifier"``, then ``"speculator"``) before it returns, then again from background tasks
whenever a role's set changes, always with the role's complete set and never with a set
equal to the last one reported. A role without targets (no ``--speculator``) is reported
once, as the empty set, and never again. A failed first resolution or list reports the
empty set at start (nothing is known yet; the router stays NOT_SERVING until a verifier
joins) and is retried in the background.

Failures after that keep the last known set: a broken or refused API connection, a DNS
failure, a watch that stops answering. They are logged as warnings and retried with
backoff (1 s doubling to 30 s; DNS simply retries every interval); a background task never
raises. An empty set is reported only when the source says so (every slice of a Service
gone or not ready) -- never because of an error. In DNS mode this includes "no such name"
(EAI_NONAME): a headless Service without ready pods answers NXDOMAIN, but so do a typo, a
not-yet-created Service and a DNS hiccup, and dropping every replica on a hiccup would
abort every sequence in flight, while keeping a dead replica costs little (calls to it fail
over; a draining one says NOT_SERVING first). So DNS mode does not see a scale to zero; the
kubernetes mode does.

Every address added or removed is logged (``extra={"role", "address", "source"}``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.router.discovery_base import (
    DEFAULT_INTERVAL_S,
    MODES,
    ROLES,
    Discovery,
    DiscoveryError,
    OnChange,
    format_address,
    port_number,
)
from services.router.kubernetes_discovery import (
    KubernetesDiscovery,
    check_kube_config,
    namespace,
    parse_service,
)
from specinfer.config import Flags, flag

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiscoveryFlags(Flags):
    mode: str = flag("static", "how --verifier/--speculator are read: static host:port "
                     "addresses; dns: HOST:PORT names re-resolved to every address (a headless "
                     "Service); kubernetes: SERVICE[.NAMESPACE][:PORT] whose EndpointSlices "
                     "are watched (default port: the one named grpc)", name="--discovery",
                     choices=MODES)
    # Checked by from_flags: its default depends on the mode.
    interval: str | None = flag(None, "dns: seconds between resolutions (default 5); "
                                "kubernetes: seconds between full re-lists that repair a "
                                "silently broken watch (default 300)",
                                name="--discovery-interval", metavar="SECONDS")
    kube_namespace: str | None = flag(None, "namespace of Services named without one "
                                      "(default: $POD_NAMESPACE, else the pod's service "
                                      "account namespace, else default)", metavar="NS")


def from_flags(flags: DiscoveryFlags, verifiers: Sequence[str],
               speculators: Sequence[str]) -> Discovery:
    """The discovery source the flags describe; raises DiscoveryError naming the flag."""
    mode = flags.mode
    interval = _interval(flags.interval, mode)
    targets = {"verifier": list(verifiers or []), "speculator": list(speculators or [])}
    if not targets["verifier"]:
        raise DiscoveryError("--verifier: at least one is needed")
    if mode == "static":
        return StaticDiscovery(_static_targets(targets))
    if mode == "dns":
        return DnsDiscovery(_dns_targets(targets), interval)
    ns = namespace(flags.kube_namespace)
    parsed = {role: [parse_service(t, ns, _flag(role)) for t in ts]
              for role, ts in targets.items()}
    check_kube_config()
    return KubernetesDiscovery(parsed, resync_s=interval)


def _flag(role: str) -> str:
    return f"--{role}"


def _interval(value: Any, mode: str) -> float:
    if value is None or value == "":
        return DEFAULT_INTERVAL_S[mode]
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise DiscoveryError(f"--discovery-interval must be a number of seconds; "
                             f"got {value!r}") from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise DiscoveryError(f"--discovery-interval must be > 0 seconds; got {value!r}")
    return seconds


def split_host_port(target: str, flag: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); raises DiscoveryError naming flag."""
    text = target.strip()
    m = re.fullmatch(r"\[([^\]]+)\]:([^:]*)", text) or re.fullmatch(r"([^:\[\]]+):([^:]*)", text)
    if not text:
        raise DiscoveryError(f"{flag}: an empty address")
    if m is None or not m.group(1).strip():
        raise DiscoveryError(f"{flag} {target!r}: expected HOST:PORT ([ADDR]:PORT for IPv6)")
    return m.group(1), port_number(m.group(2), flag, target)


def _static_targets(targets: dict[str, list[str]]) -> dict[str, list[str]]:
    for role, ts in targets.items():
        for t in ts:
            split_host_port(t, _flag(role))
    return {role: [t.strip() for t in ts] for role, ts in targets.items()}


def _dns_targets(targets: dict[str, list[str]]) -> dict[str, list[tuple[str, int]]]:
    return {role: [split_host_port(t, _flag(role)) for t in ts]
            for role, ts in targets.items()}


class StaticDiscovery(Discovery):
    source = "static"

    def __init__(self, targets: dict[str, list[str]]) -> None:
        super().__init__()
        self.targets = {role: list(targets.get(role, [])) for role in ROLES}

    async def start(self, on_change: OnChange) -> None:
        self._on_change = on_change
        for role in ROLES:
            self._report(role, frozenset(self.targets[role]))


class DnsDiscovery(Discovery):
    source = "dns"

    def __init__(self, targets: dict[str, list[tuple[str, int]]],
                 interval_s: float = DEFAULT_INTERVAL_S["dns"], *,
                 resolve: Callable[[str, int], Awaitable[list]] | None = None) -> None:
        """``resolve(host, port)``: getaddrinfo's answer (default: the event loop's
        ``getaddrinfo(host, port, type=SOCK_STREAM)``; tests pass a DNS double)."""
        super().__init__()
        self.resolve = resolve or _getaddrinfo
        self.targets = {role: list(targets.get(role, [])) for role in ROLES}
        self.interval_s = interval_s
        self._known: dict[tuple[str, int], frozenset[str]] = {}  # the last good answer
        self._failing: set[tuple[str, int]] = set()

    async def start(self, on_change: OnChange) -> None:
        self._on_change = on_change
        await self._resolve_all()
        if any(self.targets.values()):
            self._tasks.append(asyncio.ensure_future(self._loop()))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._resolve_all()
            except Exception:  # never: _resolve_all handles its errors; but stay alive
                log.exception("discovery: dns round failed")

    async def _resolve_all(self) -> None:
        names = sorted({t for ts in self.targets.values() for t in ts})
        answers = await asyncio.gather(
            *(self.resolve(h, p) for h, p in names),
            return_exceptions=True)
        for (host, port), answer in zip(names, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, (OSError, UnicodeError)):
                    log.error("discovery: dns resolution error", exc_info=answer)
                if (host, port) not in self._failing:
                    self._failing.add((host, port))
                    log.warning("discovery: dns resolution failed; keeping the last addresses",
                                extra={"host": host, "port": port, "error": str(answer),
                                       "kept": sorted(self._known.get((host, port), ()))})
                continue
            if (host, port) in self._failing:
                self._failing.discard((host, port))
                log.info("discovery: dns resolution works again",
                         extra={"host": host, "port": port})
            self._known[(host, port)] = frozenset(
                format_address(info[4][0], port) for info in answer
                if info[0] in (socket.AF_INET, socket.AF_INET6))
        for role in ROLES:
            self._report(role, frozenset().union(
                *(self._known.get(t, frozenset()) for t in self.targets[role])))


async def _getaddrinfo(host: str, port: int) -> list:
    return await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
