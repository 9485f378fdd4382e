"""Driving kmock's Kubernetes API double (the ``kmock`` fixture) as a cluster would: the
EndpointSlices of a Service, changed over HTTP so open watches see them, a one-shot
``410 Gone`` for the next watch, and a kubeconfig that points a client at the double."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import kmock as kmocklib

RES = "discovery.k8s.io/v1/endpointslices"
LABEL = "kubernetes.io/service-name"


def endpoint_slice(name: str, service: str,
                   endpoints: list[tuple[str, bool | None, bool | None]],
                   ports=(("metrics", 9090), ("grpc", 50051)), namespace: str = "default",
                   address_type: str = "IPv4") -> dict:
    """endpoints: (address, ready, terminating); None leaves the condition out (null)."""
    eps = []
    for address, ready, terminating in endpoints:
        cond = {}
        if ready is not None:
            cond["ready"] = ready
        if terminating is not None:
            cond["terminating"] = terminating
        eps.append({"addresses": [address], "conditions": cond})
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "addressType": address_type,
            "metadata": {"name": name, "namespace": namespace, "labels": {LABEL: service}},
            "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports],
            "endpoints": eps}


class Api:
    """Changes EndpointSlices over HTTP (so open watches see them), as the cluster would."""

    def __init__(self, url) -> None:
        self.url = str(url).rstrip("/")
        self.session = aiohttp.ClientSession()

    def _path(self, ns: str, name: str = "") -> str:
        path = f"{self.url}/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
        return f"{path}/{name}" if name else path

    async def create(self, obj: dict) -> None:
        ns = obj["metadata"]["namespace"]
        async with self.session.post(self._path(ns), json=obj) as r:
            assert r.status == 200, await r.text()

    async def patch(self, name: str, patch: dict, ns: str = "default") -> None:
        async with self.session.patch(self._path(ns, name), json=patch) as r:
            assert r.status == 200, await r.text()

    async def delete(self, name: str, ns: str = "default") -> None:
        async with self.session.delete(self._path(ns, name)) as r:
            assert r.status == 200, await r.text()


def is_watch(req) -> bool:
    return req.action == kmocklib.action.WATCH


def gone_once(kmock, as_event: bool) -> asyncio.Event:
    """Arms a one-shot 410 for the next watch request once the returned event is set: an
    HTTP 410, or (as_event) a 200 stream with an ERROR event of code 410."""
    armed = asyncio.Event()
    status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
              "code": 410, "reason": "Expired", "message": "too old resource version: 1 (9)"}

    def serve():
        armed.clear()
        if as_event:
            return ({"type": "ERROR", "object": status},)
        raise kmocklib.KubernetesError(status=410, reason="Expired", message=status["message"])

    kmock[lambda req: armed.is_set() and is_watch(req)] << serve
    return armed


def write_kubeconfig(path: Path, url, token: str = "not-a-secret") -> Path:
    """A kubeconfig whose current context is the API double at ``url``."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "kmock", "cluster": {"server": str(url).rstrip("/")}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "kmock", "user": "u"}}]}))
    return path
