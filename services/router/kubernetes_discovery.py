"""Kubernetes discovery (``--discovery kubernetes``): ``SERVICE[.NAMESPACE][:PORT]``
targets and the EndpointSlice list + watch that follows them. What the mode reports, and
when, is described in ``discovery`` (the module every source shares)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.router.discovery_base import (
    DEFAULT_INTERVAL_S,
    ROLES,
    Discovery,
    DiscoveryError,
    OnChange,
    format_address,
    port_number,
)

# One logger for every discovery source, so operators filter on one name.
log = logging.getLogger("services.router.discovery")

NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
SERVICE_LABEL = "kubernetes.io/service-name"
DEFAULT_PORT_NAME = "grpc"
BACKOFF_START_S, BACKOFF_MAX_S = 1.0, 30.0

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


@dataclass(frozen=True)
class ServiceTarget:
    """One ``SERVICE[.NAMESPACE][:PORT]``: ``port`` a number, or else ``port_name``."""
    service: str
    namespace: str
    port: int | None = None
    port_name: str = DEFAULT_PORT_NAME

    def __str__(self) -> str:
        return f"{self.service}.{self.namespace}:{self.port or self.port_name}"


def parse_service(target: str, namespace: str, flag: str = "--verifier") -> ServiceTarget:
    text = target.strip()
    if not text:
        raise DiscoveryError(f"{flag}: an empty Service name")
    name, sep, port_text = text.partition(":")
    port, port_name = None, DEFAULT_PORT_NAME
    if sep:
        if re.fullmatch(r"[0-9]+", port_text):
            port = port_number(port_text, flag, target)
        elif _DNS_LABEL.fullmatch(port_text) and len(port_text) <= 15:
            port_name = port_text
        else:
            raise DiscoveryError(f"{flag} {target!r}: the port must be 1-65535 or a port name; "
                                 f"got {port_text!r}")
    service, dot, ns = name.partition(".")
    ns = ns if dot else namespace
    for what, value in (("Service", service), ("namespace", ns)):
        if not (_DNS_LABEL.fullmatch(value) and len(value) <= 63):
            raise DiscoveryError(f"{flag} {target!r}: expected SERVICE[.NAMESPACE][:PORT] "
                                 f"(DNS labels); bad {what} {value!r}")
    return ServiceTarget(service, ns, port, port_name)


def namespace(flag_value: str | None) -> str:
    if flag_value is not None:
        ns = flag_value.strip()
        if not (_DNS_LABEL.fullmatch(ns) and len(ns) <= 63):
            raise DiscoveryError(f"--kube-namespace: not a namespace name: {flag_value!r}")
        return ns
    if os.environ.get("POD_NAMESPACE", "").strip():
        return os.environ["POD_NAMESPACE"].strip()
    with contextlib.suppress(OSError):
        ns = Path(NAMESPACE_FILE).read_text().strip()
        if ns:
            return ns
    return "default"


def check_kube_config() -> None:
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return  # in-cluster; the token is read (and its absence reported) at start
    paths = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    if not any(Path(p).is_file() for p in paths.split(os.pathsep) if p):
        raise DiscoveryError("--discovery kubernetes: not in a cluster "
                             "(KUBERNETES_SERVICE_HOST unset) and no kubeconfig at "
                             f"{paths} ($KUBECONFIG)")


class _Gone(Exception):
    """410: the resourceVersion is too old; re-list."""


class _ApiError(Exception):
    pass


@dataclass
class _TargetState:
    target: ServiceTarget
    role: str
    slices: dict[str, frozenset[str]] = field(default_factory=dict)
    warned_port: set[str] = field(default_factory=set)


class KubernetesDiscovery(Discovery):
    """EndpointSlice list + watch per target, on ``kubernetes.aio`` (asyncio, aiohttp).

    ``configuration``: a ``kubernetes.aio.client.Configuration`` (tests: ``host`` set to an
    API double); without it, in-cluster or kubeconfig config is loaded at ``start``.
    ``watch_timeout_s``: the server-side ``timeoutSeconds`` of each watch (the client gives
    up ``read_slack_s`` later in any case); ``read_timeout_s``: a watch silent that long is
    re-opened from the last resourceVersion (a dead connection shows as silence);
    ``request_timeout_s``: a list (or a watch's headers) at most this long.
    """

    source = "kubernetes"

    def __init__(self, targets: dict[str, list[ServiceTarget]], *,
                 resync_s: float = DEFAULT_INTERVAL_S["kubernetes"],
                 configuration: Any = None, watch_timeout_s: float = 240.0,
                 read_timeout_s: float = 90.0, request_timeout_s: float = 30.0,
                 read_slack_s: float = 10.0, backoff_max_s: float = BACKOFF_MAX_S) -> None:
        super().__init__()
        self.targets = {role: list(targets.get(role, [])) for role in ROLES}
        self.resync_s = resync_s
        self.configuration = configuration
        self.watch_timeout_s = watch_timeout_s
        self.read_timeout_s = read_timeout_s
        self.request_timeout_s = request_timeout_s
        self.read_slack_s = read_slack_s
        self.backoff_max_s = backoff_max_s
        self._states = [_TargetState(t, role) for role in ROLES for t in self.targets[role]]
        self._api_client: Any = None
        self._api: Any = None

    async def _connect(self) -> None:
        from kubernetes.aio import client, config

        configuration = self.configuration
        if configuration is None:
            configuration = client.Configuration()
            try:
                if os.environ.get("KUBERNETES_SERVICE_HOST"):
                    config.load_incluster_config(client_configuration=configuration)
                else:
                    await config.load_kube_config(
                        config_file=os.environ.get("KUBECONFIG") or "~/.kube/config",
                        client_configuration=configuration, persist_config=False)
            except Exception as exc:
                raise DiscoveryError(f"--discovery kubernetes: cannot load the cluster "
                                     f"config: {exc}") from exc
        self._api_client = client.ApiClient(configuration)
        self._api = client.DiscoveryV1Api(self._api_client)

    async def start(self, on_change: OnChange) -> None:
        self._on_change = on_change
        await self._connect()
        rvs = await asyncio.gather(*(self._first_list(s) for s in self._states))
        for role in ROLES:
            self._report(role, self._union(role))
        for state, rv in zip(self._states, rvs, strict=True):
            self._tasks.append(asyncio.ensure_future(self._run(state, rv)))

    async def _first_list(self, state: _TargetState) -> str | None:
        try:
            return await self._list(state, report=False)
        except Exception as exc:
            log.warning("discovery: cannot list EndpointSlices; retrying", extra={
                "target": str(state.target), "error": _describe(exc)})
            return None

    def _union(self, role: str) -> frozenset[str]:
        return frozenset().union(*(a for s in self._states if s.role == role
                                   for a in s.slices.values()))

    async def close(self) -> None:
        await super().close()
        if self._api_client is not None:
            client, self._api_client = self._api_client, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 1.0)

    # -- list and watch ---------------------------------------------------------------

    async def _run(self, state: _TargetState, rv: str | None) -> None:
        """List (unless ``rv`` is from a list just made), watch, re-list on 410 and every
        ``resync_s``; retries with backoff; never raises (but CancelledError)."""
        loop = asyncio.get_running_loop()
        start = min(BACKOFF_START_S, self.backoff_max_s)
        backoff = start
        failing = rv is None
        gone_in_a_row = 0

        async def pause() -> None:
            nonlocal backoff
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, self.backoff_max_s)

        while True:
            try:
                if rv is None:
                    rv = await self._list(state)
                    if failing:
                        failing = False
                        log.info("discovery: EndpointSlices listed again",
                                 extra={"target": str(state.target)})
                resync_at = loop.time() + self.resync_s
                while (remaining := resync_at - loop.time()) > 0:
                    began = loop.time()
                    rv, events, ended = await self._watch(state, rv, remaining)
                    if events:
                        backoff, gone_in_a_row = start, 0
                    elif ended and loop.time() - began < 1.0:
                        await pause()  # ended at once, empty: don't spin on such a server
                rv = None  # resync
            except asyncio.CancelledError:
                raise
            except _Gone:
                gone_in_a_row += 1
                log.info("discovery: watch expired (410 Gone); re-listing",
                         extra={"target": str(state.target)})
                rv = None
                if gone_in_a_row > 1:  # 410 right after a fresh list: don't spin either
                    await pause()
            except Exception as exc:
                rv = None
                failing = True
                log.warning("discovery: EndpointSlice list/watch failed; keeping the last "
                            "addresses, retrying", extra={
                                "target": str(state.target), "error": _describe(exc),
                                "retry_in_s": backoff})
                await pause()

    def _selector(self, state: _TargetState) -> str:
        return f"{SERVICE_LABEL}={state.target.service}"

    async def _list(self, state: _TargetState, report: bool = True) -> str:
        resp = await asyncio.wait_for(
            self._api.list_namespaced_endpoint_slice_without_preload_content(
                state.target.namespace, label_selector=self._selector(state),
                _request_timeout=self.request_timeout_s),
            self.request_timeout_s)
        try:
            body = await asyncio.wait_for(resp.read(), self.request_timeout_s)
        finally:
            resp.release()
        if resp.status != 200:
            raise _ApiError(f"list: HTTP {resp.status}: {body[:300]!r}")
        data = json.loads(body)
        slices = {}
        for item in data.get("items") or []:
            name, addresses = self._slice_addresses(state, item)
            if name is not None:
                slices[name] = addresses
        state.slices = slices
        if report:
            self._report(state.role, self._union(state.role))
        return str((data.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, state: _TargetState, rv: str,
                     remaining_s: float) -> tuple[str, int, bool]:
        """One watch request until the server ends it, ``remaining_s`` passes, or it is
        silent for ``read_timeout_s``; returns (the last resourceVersion, events seen,
        whether the server ended it).
        Raises _Gone on 410, other errors on failures."""
        timeout_s = max(1, math.ceil(min(remaining_s, self.watch_timeout_s)))
        kwargs: dict[str, Any] = {"label_selector": self._selector(state), "watch": True,
                                  "allow_watch_bookmarks": True, "timeout_seconds": timeout_s}
        if rv:
            kwargs["resource_version"] = rv
        resp = await asyncio.wait_for(
            self._api.list_namespaced_endpoint_slice_without_preload_content(
                state.target.namespace, _request_timeout=float(timeout_s + self.read_slack_s),
                **kwargs),
            self.request_timeout_s)
        try:
            if resp.status == 410:
                raise _Gone()
            if resp.status != 200:
                body = await asyncio.wait_for(resp.read(), self.request_timeout_s)
                raise _ApiError(f"watch: HTTP {resp.status}: {body[:300]!r}")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + min(remaining_s, timeout_s + self.read_slack_s)
            events, buf = 0, b""
            while True:
                wait = min(self.read_timeout_s, deadline - loop.time())
                if wait <= 0:
                    log.debug("discovery: watch closed (its time is up)", extra={
                        "target": str(state.target), "events": events})
                    return rv, events, False
                try:  # not readline(): aiohttp caps a line at 128 KiB, a big slice is more
                    chunk = await asyncio.wait_for(resp.content.readany(), wait)
                except TimeoutError:
                    log.debug("discovery: watch silent; re-opening",
                              extra={"target": str(state.target), "events": events})
                    return rv, events, False
                if not chunk:
                    log.debug("discovery: watch ended", extra={
                        "target": str(state.target), "events": events})
                    return rv, events, True  # the server ended it (timeoutSeconds)
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        rv = self._apply(state, json.loads(line), rv)
                        events += 1
        finally:
            resp.release()

    def _apply(self, state: _TargetState, event: dict, rv: str) -> str:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone()
            raise _ApiError(f"watch ERROR event: {obj.get('code')} {obj.get('reason')}: "
                            f"{str(obj.get('message'))[:200]}")
        new_rv = str((obj.get("metadata") or {}).get("resourceVersion") or "") or rv
        if kind == "BOOKMARK":
            return new_rv
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            log.debug("discovery: unknown watch event", extra={"type": kind})
            return new_rv
        name, addresses = self._slice_addresses(state, obj)
        if name is None:
            return new_rv
        if kind == "DELETED":
            state.slices.pop(name, None)
        else:
            state.slices[name] = addresses
        self._report(state.role, self._union(state.role))
        return new_rv

    def _slice_addresses(self, state: _TargetState,
                         obj: dict) -> tuple[str | None, frozenset[str]]:
        """(slice name, its ready addresses), or (None, _) for a slice of another Service
        (the label selector is applied here too)."""
        meta = obj.get("metadata") or {}
        name = meta.get("name")
        if not name or (meta.get("labels") or {}).get(SERVICE_LABEL) != state.target.service:
            return None, frozenset()
        if meta.get("namespace") not in (None, state.target.namespace):
            return None, frozenset()
        if obj.get("addressType") not in (None, "IPv4", "IPv6"):
            return name, frozenset()  # FQDN slices: not ours to resolve
        port = state.target.port
        if port is None:
            port = next((p.get("port") for p in obj.get("ports") or []
                         if p.get("name") == state.target.port_name and p.get("port")), None)
            if port is None:
                if obj.get("endpoints") and name not in state.warned_port:
                    state.warned_port.add(name)
                    log.warning("discovery: EndpointSlice has no port with that name", extra={
                        "target": str(state.target), "slice": name,
                        "port_name": state.target.port_name,
                        "ports": [p.get("name") for p in obj.get("ports") or []]})
                return name, frozenset()
        addresses = set()
        for ep in obj.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False or cond.get("terminating") is True:
                continue
            for ip in ep.get("addresses") or []:
                addresses.add(format_address(ip, int(port)))
        return name, frozenset(addresses)


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:300]}"
