"""Rendering the Helm chart (deploy/helm/specinfer) with the real Helm library
(helm-python-sdk), in-process and cached, and the queries the chart tests share: the
values cases every test checks, the rendered objects, pod templates, containers, flags,
selectors. Imported by test_chart.py (lint, schemas, values, checkov) and
test_chart_workloads.py (invariants of what runs)."""

from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python")
kv = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "specinfer"
EXAMPLES = CHART / "examples"
CHECKOV = Path(os.environ.get("SPECINFER_CHECKOV", ROOT / ".venv-checkov" / "bin" / "checkov"))
KUBE_VERSION = "1.31.0"
RELEASE, NAMESPACE = "demo", "serving"
FULLNAME = "demo-specinfer"
CRD_KINDS = {"LeaderWorkerSet", "ScaledObject", "ServiceMonitor"}
LWS_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"

TLS = {"tls": {"enabled": True, "secretName": "specinfer-tls", "serverName": "specinfer.internal"}}
KEDA = {"autoscaling": {"keda": True, "prometheus": {"serverAddress": "http://prom:9090"}},
        "speculator": {"autoscaling": {"enabled": True, "minReplicas": 0}},
        "verifier": {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 3}}}
TRACING = {"tracing": {"otlpEndpoint": "http://otel-collector.observability:4317"}}
MONITOR = {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}}


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()) or {}


def merge(*layers: dict) -> dict:
    out: dict = {}
    for layer in layers:
        merge_into(out, copy.deepcopy(layer))
    return out


def merge_into(dst: dict, src: dict) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            merge_into(dst[key], value)
        else:
            dst[key] = value


# Every case is rendered once (in-process, cached) and checked by every test below.
CASES: dict[str, dict] = {
    "default": {},
    "cpu": example("cpu"),
    "gpu": example("gpu"),
    "tp2": example("tp2"),
    "tp2-pp2": example("tp2-pp2"),
    "tls": TLS,
    "auth-secret": {"auth": {"existingSecret": "my-keys", "secretKey": "keys"}},
    "auth-keys": {"auth": {"apiKeys": ["k1", "k2"]}},
    "keda": KEDA,
    "keda-lws": merge(example("tp2-pp2"), KEDA),
    "servicemonitor": MONITOR,
    "tracing": TRACING,
    "image-volume": {"model": {"source": "image", "image": {"reference": "reg/llm:1"},
                               "path": "model.gguf"},
                     "speculator": {"device": "cuda"}},
    "everything": merge(example("tp2-pp2"), TLS, TRACING, MONITOR,
                         {"auth": {"apiKeys": ["k1"]},
                          "image": {"digest": "sha256:" + "a" * 64,
                                    "cudaDigest": "sha256:" + "b" * 64},
                          "networkPolicy": {"router": {"from": [
                              {"namespaceSelector": {"matchLabels": {"team": "apps"}}}]}},
                          "cache": {"existingClaim": "shared-cache"}}),
}


@functools.cache
def chart():
    return helm.Chart.load(CHART)


@functools.cache
def render_json(values_json: str) -> tuple[dict, ...]:
    out = chart().render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE,
                          is_install=True)
    docs: list[dict] = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return tuple(docs)


def render(values: dict) -> list[dict]:
    return copy.deepcopy(list(render_json(json.dumps(values, sort_keys=True))))


def merged_values(values: dict) -> dict:
    return chart().merge_values(values)


def find(docs, kind, name=None):
    return [d for d in docs
            if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs, kind, name):
    found = find(docs, kind, name)
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def pod_templates(docs) -> list[tuple[str, dict]]:
    """(where, pod template) for every pod the release runs; LWS workers are 'worker'."""
    pods = []
    for d in docs:
        kind, name = d["kind"], d["metadata"]["name"]
        if kind in ("Deployment", "StatefulSet"):
            pods.append((f"{kind}/{name}", d["spec"]["template"]))
        elif kind == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            leader = dict(lwt.get("leaderTemplate") or lwt["workerTemplate"])
            leader = copy.deepcopy(leader)
            leader.setdefault("metadata", {}).setdefault("labels", {})[LWS_INDEX] = "0"
            worker = copy.deepcopy(lwt["workerTemplate"])
            worker.setdefault("metadata", {}).setdefault("labels", {})[LWS_INDEX] = "1"
            pods += [(f"{kind}/{name}/leader", leader), (f"{kind}/{name}/worker", worker)]
        elif kind == "Pod":
            pods.append((f"Pod/{name}", d))
    return pods


def component(pod: dict) -> str:
    return pod["metadata"]["labels"]["app.kubernetes.io/component"]


def is_hook(pod: dict) -> bool:
    return "helm.sh/hook" in (pod["metadata"].get("annotations") or {})


def containers(pod: dict) -> list[dict]:
    return pod["spec"]["containers"] + pod["spec"].get("initContainers", [])


def args_of(container: dict) -> list[str]:
    return container.get("args", [])


def arg(container: dict, flag: str) -> str | None:
    for a in args_of(container):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def matches(selector: dict, labels: dict) -> bool:
    """Label-selector semantics (matchLabels and a Service's plain selector)."""
    match = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    assert "matchExpressions" not in selector, "the chart uses matchLabels only"
    return all(labels.get(k) == v for k, v in match.items())


def selected(docs, selector: dict) -> set[str]:
    return {where for where, pod in pod_templates(docs)
            if matches(selector, pod["metadata"]["labels"])}
