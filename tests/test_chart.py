"""The Helm chart (deploy/helm/specinfer), checked without a cluster: linted and rendered
by the real Helm library (helm-python-sdk), every object validated against the Kubernetes
1.31 OpenAPI schemas (kubernetes-validate, strict: no unknown fields), the CRD kinds
(LeaderWorkerSet, ScaledObject, ServiceMonitor) checked by invariants, the values schema
shown to refuse bad values, and checkov run on the rendered manifests.

`make chart` runs just this file; `make test` runs it once, with the rest."""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
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


def _example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()) or {}


def _merge(*layers: dict) -> dict:
    out: dict = {}
    for layer in layers:
        _merge_into(out, copy.deepcopy(layer))
    return out


def _merge_into(dst: dict, src: dict) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge_into(dst[key], value)
        else:
            dst[key] = value


# Every case is rendered once (in-process, cached) and checked by every test below.
CASES: dict[str, dict] = {
    "default": {},
    "cpu": _example("cpu"),
    "gpu": _example("gpu"),
    "tp2": _example("tp2"),
    "tp2-pp2": _example("tp2-pp2"),
    "tls": TLS,
    "auth-secret": {"auth": {"existingSecret": "my-keys", "secretKey": "keys"}},
    "auth-keys": {"auth": {"apiKeys": ["k1", "k2"]}},
    "keda": KEDA,
    "keda-lws": _merge(_example("tp2-pp2"), KEDA),
    "servicemonitor": MONITOR,
    "tracing": TRACING,
    "image-volume": {"model": {"source": "image", "image": {"reference": "reg/llm:1"},
                               "path": "model.gguf"},
                     "speculator": {"device": "cuda"}},
    "everything": _merge(_example("tp2-pp2"), TLS, TRACING, MONITOR,
                         {"auth": {"apiKeys": ["k1"]},
                          "image": {"digest": "sha256:" + "a" * 64,
                                    "cudaDigest": "sha256:" + "b" * 64},
                          "networkPolicy": {"router": {"from": [
                              {"namespaceSelector": {"matchLabels": {"team": "apps"}}}]}},
                          "cache": {"existingClaim": "shared-cache"}}),
}


@functools.cache
def _chart():
    return helm.Chart.load(CHART)


@functools.cache
def _render_json(values_json: str) -> tuple[dict, ...]:
    out = _chart().render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE,
                          is_install=True)
    docs: list[dict] = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return tuple(docs)


def render(values: dict) -> list[dict]:
    return copy.deepcopy(list(_render_json(json.dumps(values, sort_keys=True))))


def merged_values(values: dict) -> dict:
    return _chart().merge_values(values)


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


# --- lint, schema validation, checkov -------------------------------------------------------


@pytest.mark.parametrize("case", ["default", "cpu", "gpu", "tp2", "tp2-pp2", "everything"])
def test_lint(case):
    report = helm.lint(CHART, CASES[case], strict=True, namespace=NAMESPACE,
                       kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("case", CASES)
def test_objects_validate_against_kubernetes_schemas(case):
    docs = render(CASES[case])
    assert docs
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        assert doc["metadata"].get("namespace") == NAMESPACE, where
        if doc["kind"] in CRD_KINDS:
            continue  # no schema there: checked by the invariants below
        try:
            kv.validate(doc, KUBE_VERSION, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{case}: {where}: {exc}")


def test_validator_is_strict():
    """kubernetes-validate (strict) really refuses an unknown field: the check above bites."""
    doc = next(d for d in render({}) if d["kind"] == "Deployment")
    doc["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, KUBE_VERSION, strict=True)


def test_schema_offers_exactly_the_routers_speculation_modes():
    from services.router.policy import SPECULATION_CHOICES

    schema = json.loads((CHART / "values.schema.json").read_text())
    enum = schema["properties"]["router"]["properties"]["speculation"]["enum"]
    assert set(enum) == set(SPECULATION_CHOICES)


@pytest.mark.parametrize("values, field", [
    ({"verifier": {"tensorParallelSize": "two"}}, "/verifier/tensorParallelSize"),
    ({"verifier": {"tensorParallelSize": 0}}, "/verifier/tensorParallelSize"),
    ({"verifier": {"pipelineParallelSize": 0}}, "/verifier/pipelineParallelSize"),
    ({"verifier": {"device": "tpu"}}, "/verifier/device"),
    ({"verifier": {"replicas": -1}}, "/verifier/replicas"),
    ({"gpus": 8}, "'gpus'"),
    ({"verifier": {"gpus": 8}}, "'gpus'"),
    ({"tracing": {"otlpEndpoint": 4317}}, "/tracing/otlpEndpoint"),
    ({"router": {"autoscaling": {"minReplicas": 0}}}, "/router/autoscaling/minReplicas"),
])
def test_schema_refuses_bad_values(values, field):
    with pytest.raises(helm.HelmError) as render_error:
        _chart().render(values, name=RELEASE, namespace=NAMESPACE)
    assert field in str(render_error.value), str(render_error.value)
    report = helm.lint(CHART, values, namespace=NAMESPACE)
    assert any(field in e for e in report["errors"]) or any(
        field in m["error"] for m in report["messages"] if m["severity"] == 3), report


@pytest.mark.parametrize("values, message", [
    ({"verifier": {"autoscaling": {"enabled": True, "minReplicas": 0}}},
     "verifier.autoscaling.minReplicas 0 needs autoscaling.keda"),
    ({"model": {"source": "pvc"}}, "model.pvc.claimName is required"),
    ({"tls": {"enabled": True}}, "tls.secretName is required"),
])
def test_render_refuses_inconsistent_values(values, message):
    with pytest.raises(helm.HelmError, match=message):
        _chart().render(values, name=RELEASE, namespace=NAMESPACE)


def test_checkov(tmp_path):
    """checkov (framework kubernetes) on every case's manifests: no failed check. The
    skipped ones are in deploy/helm/specinfer/.checkov.yaml and in `checkov.io/skip`
    annotations, each with its reason."""
    if not CHECKOV.exists():
        pytest.skip(f"{CHECKOV} is absent: `make checkov-venv` (make test and make chart "
                    "create it) installs checkov in its own venv")
    for case, values in CASES.items():
        text = "\n---\n".join(yaml.safe_dump(d, sort_keys=False) for d in render(values))
        (tmp_path / f"{case}.yaml").write_text(text)
    proc = subprocess.run(
        [str(CHECKOV), "-d", str(tmp_path), "--framework", "kubernetes", "--skip-download",
         "--config-file", str(CHART / ".checkov.yaml"), "--output", "json", "--quiet",
         "--compact"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    assert proc.stdout.strip(), proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [(c["check_id"], c["resource"], c["file_path"])
              for r in reports for c in r.get("results", {}).get("failed_checks", [])]
    assert not failed, failed
    summary = [r.get("summary", {}) for r in reports]
    assert sum(s.get("passed", 0) for s in summary) > 500, summary
    skipped = {c["check_id"] for r in reports
               for c in r.get("results", {}).get("skipped_checks", [])}
    assert skipped <= {"CKV_K8S_43", "CKV_K8S_15", "CKV_K8S_38", "CKV_K8S_35", "CKV_K8S_8",
                       "CKV_K8S_9"}, skipped


# --- invariants --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_gpus_and_shm(case):
    docs, values = render(CASES[case]), merged_values(CASES[case])
    v = values["verifier"]
    for where, pod in pod_templates(docs):
        device = {"verifier": v["device"],
                  "speculator": values["speculator"]["device"]}.get(component(pod), "cpu")
        gpus_expected = {"verifier": v["tensorParallelSize"], "speculator": 1}.get(component(pod))
        for c in containers(pod):
            limits = c["resources"].get("limits", {})
            requests = c["resources"].get("requests", {})
            tag = c["image"].rsplit(":", 1)[-1] if "@" not in c["image"] else ""
            if device == "cuda":
                assert limits.get("nvidia.com/gpu") == gpus_expected, (where, limits)
                assert tag.endswith("-cuda") or "@sha256:" + "b" * 64 in c["image"], c["image"]
            else:
                assert "nvidia.com/gpu" not in limits and "nvidia.com/gpu" not in requests, where
                assert not tag.endswith("-cuda"), c["image"]
        volumes = {vol["name"]: vol for vol in pod["spec"].get("volumes", [])}
        shm = [m for c in containers(pod) for m in c.get("volumeMounts", [])
               if m["mountPath"] == "/dev/shm"]
        if component(pod) == "verifier" and v["device"] == "cuda":
            assert len(shm) == 1, where
            vol = volumes[shm[0]["name"]]
            assert vol["emptyDir"]["medium"] == "Memory"
            assert vol["emptyDir"]["sizeLimit"] == v["shm"]["sizeLimit"]
            if v["runtimeClassName"]:
                assert pod["spec"]["runtimeClassName"] == v["runtimeClassName"]
            assert pod["spec"].get("nodeSelector", {}) == v["nodeSelector"]
            assert pod["spec"].get("tolerations", []) == v["tolerations"]
        elif component(pod) == "verifier":
            assert not shm and "runtimeClassName" not in pod["spec"], where


@pytest.mark.parametrize("case", CASES)
def test_probes_and_grace(case):
    docs, values = render(CASES[case]), merged_values(CASES[case])
    tls = values["tls"]["enabled"]
    ports = {"router": values["router"]["grpcPort"], "speculator": values["speculator"]["port"],
             "verifier": values["verifier"]["port"]}
    for where, pod in pod_templates(docs):
        if is_hook(pod):
            continue
        (c,) = pod["spec"]["containers"]
        if where.endswith("/worker"):  # a pipeline stage > 0: no gRPC, it follows stage 0
            assert "readinessProbe" not in c and "ports" not in c
            continue
        port = ports[component(pod)]
        for probe in ("startupProbe", "readinessProbe"):
            if tls:  # the kubelet's grpc probe cannot speak TLS: the same check, over TLS
                assert "grpc_health" in c[probe]["exec"]["command"][-1], where
            else:
                assert c[probe]["grpc"]["port"] == port, (where, probe)
        assert c["livenessProbe"]["tcpSocket"]["port"] == port, where
        assert set(c["livenessProbe"]) & {"grpc", "exec", "httpGet"} == set()
        startup = c["startupProbe"]
        if component(pod) == "verifier":
            assert startup["failureThreshold"] * startup["periodSeconds"] >= 20 * 60
            drain = float(arg(c, "--drain-timeout"))
            assert pod["spec"]["terminationGracePeriodSeconds"] > drain
            assert drain == values["verifier"]["drainTimeoutSeconds"]


@pytest.mark.parametrize("case", CASES)
def test_selectors_pick_the_right_pods(case):
    docs, values = render(CASES[case]), merged_values(CASES[case])
    lws = values["verifier"]["pipelineParallelSize"] > 1
    pods = {where: component(pod) for where, pod in pod_templates(docs)}
    of = lambda comp: {w for w, c in pods.items() if c == comp}  # noqa: E731
    for d in find(docs, "Deployment"):
        assert matches(d["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
    for comp in ("router", "speculator", "verifier"):
        svc = one(docs, "Service", f"{FULLNAME}-{comp}")
        want = of(comp)
        if comp == "verifier" and lws:  # only stage 0 serves gRPC: only the leader
            want = {w for w in want if w.endswith("/leader")}
            assert svc["spec"]["selector"][LWS_INDEX] == "0"
        assert selected(docs, svc["spec"]["selector"]) == want, comp
        assert "grpc" in {p["name"] for p in svc["spec"]["ports"]}
        if comp != "router":
            assert svc["spec"]["clusterIP"] == "None"  # headless: one A record per pod
        pdb = one(docs, "PodDisruptionBudget", f"{FULLNAME}-{comp}")
        assert selected(docs, pdb["spec"]["selector"]) == of(comp), comp
        assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
        policy = one(docs, "NetworkPolicy", f"{FULLNAME}-{comp}")
        assert selected(docs, policy["spec"]["podSelector"]) == of(comp), comp
    for d in find(docs, "Service"):  # the helm test pod is nobody's endpoint
        assert not any(pods[w] == "test" for w in selected(docs, d["spec"]["selector"]))


@pytest.mark.parametrize("case", CASES)
def test_verifier_workload(case):
    docs, values = render(CASES[case]), merged_values(CASES[case])
    v = values["verifier"]
    pp, tp = v["pipelineParallelSize"], v["tensorParallelSize"]
    lwss = find(docs, "LeaderWorkerSet")
    deployments = find(docs, "Deployment", f"{FULLNAME}-verifier")
    if pp > 1:
        assert not deployments and len(lwss) == 1
        (lws,) = lwss
        assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        lwt = lws["spec"]["leaderWorkerTemplate"]
        assert lwt["size"] == pp
        assert lwt["restartPolicy"] == "RecreateGroupAfterStart"
        assert ("replicas" in lws["spec"]) != v["autoscaling"]["enabled"]
        if "replicas" in lws["spec"]:
            assert lws["spec"]["replicas"] == v["replicas"]
        templates = [lwt["leaderTemplate"], lwt["workerTemplate"]]
        for t in templates:
            (c,) = t["spec"]["containers"]
            assert arg(c, "--master-port") == str(v["rendezvousPort"])
        (leader,) = lwt["leaderTemplate"]["spec"]["containers"]
        assert "rendezvous" in {p["name"] for p in leader["ports"]}
    else:
        assert not lwss and len(deployments) == 1
        templates = [deployments[0]["spec"]["template"]]
        spec = deployments[0]["spec"]
        assert ("replicas" in spec) != v["autoscaling"]["enabled"]
        if "replicas" in spec:
            assert spec["replicas"] == v["replicas"]
    for t in templates:
        (c,) = t["spec"]["containers"]
        assert args_of(c)[:2] == ["serve", "verifier"]
        assert arg(c, "--tp") == str(tp) and arg(c, "--pp") == str(pp)
        assert arg(c, "--device") == v["device"]
        assert arg(c, "--host") == "0.0.0.0"


@pytest.mark.parametrize("case", CASES)
def test_router_discovery_and_rbac(case):
    docs, values = render(CASES[case]), merged_values(CASES[case])
    dep = one(docs, "Deployment", f"{FULLNAME}-router")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert args_of(c)[:2] == ["serve", "router"]
    assert arg(c, "--discovery") == "kubernetes"
    assert arg(c, "--verifier") == f"{FULLNAME}-verifier:{values['verifier']['port']}"
    assert arg(c, "--speculator") == f"{FULLNAME}-speculator:{values['speculator']['port']}"
    assert arg(c, "--port") == "50051" and arg(c, "--http-port") == "8000"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "http": 8000}
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    sa = pod["serviceAccountName"]
    one(docs, "ServiceAccount", sa)
    (binding,) = [b for b in find(docs, "RoleBinding")
                  if any(s["kind"] == "ServiceAccount" and s["name"] == sa for s in b["subjects"])]
    role = one(docs, "Role", binding["roleRef"]["name"])
    verbs = {verb for rule in role["rules"] if "discovery.k8s.io" in rule["apiGroups"]
             and "endpointslices" in rule["resources"] for verb in rule["verbs"]}
    assert {"list", "watch"} <= verbs
    assert not any("*" in rule["verbs"] or "*" in rule["resources"] for rule in role["rules"])
    for comp in ("speculator", "verifier"):  # no API access for the pools
        for where, p in pod_templates(docs):
            if component(p) == comp:
                assert p["spec"]["automountServiceAccountToken"] is False, where
                assert p["spec"]["serviceAccountName"] != sa


@pytest.mark.parametrize("case", CASES)
def test_tracing_env(case):
    docs, values = render(CASES[case]), merged_values(CASES[case])
    endpoint = values["tracing"]["otlpEndpoint"]
    for where, pod in pod_templates(docs):
        for c in pod["spec"]["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            if endpoint and not is_hook(pod):
                assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == {
                    "name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": endpoint}, where
            elif not endpoint:
                assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env, where


@pytest.mark.parametrize("case", CASES)
def test_security_context_and_resources(case):
    docs = render(CASES[case])
    for where, pod in pod_templates(docs):
        psc = pod["spec"]["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] == 10001
        assert psc["seccompProfile"]["type"] == "RuntimeDefault"
        mounts_by_pod = set()
        for c in containers(pod):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc.get("privileged")
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), where
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), where
            mounts_by_pod |= {m["mountPath"] for m in c.get("volumeMounts", [])
                              if not m.get("readOnly")}
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert env.get("HOME") == "/tmp"
            if not is_hook(pod):
                assert env["SPECINFER_CACHE"] == "/var/cache/specinfer"
        assert "/tmp" in mounts_by_pod, where  # read-only root: writable /tmp and cache
        if not is_hook(pod):
            assert "/var/cache/specinfer" in mounts_by_pod, where


@pytest.mark.parametrize("case", CASES)
def test_model_mounted_read_only(case):
    docs, values = render(CASES[case]), merged_values(CASES[case])
    m = values["model"]
    for _, pod in pod_templates(docs):
        if is_hook(pod):
            continue
        (c,) = pod["spec"]["containers"]
        mounts = {x["name"]: x for x in c["volumeMounts"]}
        volumes = {x["name"]: x for x in pod["spec"]["volumes"]}
        if m["source"] == "builtin":
            assert "model" not in mounts and arg(c, "--llm") == m["ref"]
        else:
            assert mounts["model"]["readOnly"] is True
            assert mounts["model"]["mountPath"] == m["mountPath"]
            assert arg(c, "--llm") == f"{m['mountPath']}/{m['path']}".rstrip("/")
            if m["source"] == "pvc":
                assert volumes["model"]["persistentVolumeClaim"] == {
                    "claimName": m["pvc"]["claimName"], "readOnly": True}
            else:
                assert volumes["model"]["image"]["reference"] == m["image"]["reference"]


@pytest.mark.parametrize("case", CASES)
def test_autoscaling(case):
    docs, values = render(CASES[case]), merged_values(CASES[case])
    keda = values["autoscaling"]["keda"]
    lws = values["verifier"]["pipelineParallelSize"] > 1
    hpas = {d["metadata"]["name"]: d for d in find(docs, "HorizontalPodAutoscaler")}
    scaled = {d["metadata"]["name"]: d for d in find(docs, "ScaledObject")}
    assert f"{FULLNAME}-router" in hpas  # the router: always an HPA (on by default)
    for comp in ("speculator", "verifier"):
        a = values[comp]["autoscaling"]
        name = f"{FULLNAME}-{comp}"
        target_kind = "LeaderWorkerSet" if comp == "verifier" and lws else "Deployment"
        target_name = f"{FULLNAME}-verifier-lws" if target_kind == "LeaderWorkerSet" else name
        one(docs, target_kind, target_name)  # what the autoscaler targets exists
        if not a["enabled"]:
            assert name not in hpas and name not in scaled
            continue
        if keda:
            assert name not in hpas
            so = scaled[name]
            assert so["apiVersion"] == "keda.sh/v1alpha1"
            assert so["spec"]["scaleTargetRef"]["kind"] == target_kind
            assert so["spec"]["scaleTargetRef"]["name"] == target_name
            assert so["spec"]["minReplicaCount"] == a["minReplicas"]
            assert so["spec"]["maxReplicaCount"] == a["maxReplicas"]
            (trigger,) = so["spec"]["triggers"]
            assert trigger["type"] == "prometheus"
            assert "specinfer:num_requests_waiting" in trigger["metadata"]["query"]
            assert f'namespace="{NAMESPACE}"' in trigger["metadata"]["query"]
            assert trigger["metadata"]["serverAddress"] == \
                values["autoscaling"]["prometheus"]["serverAddress"]
            assert isinstance(trigger["metadata"]["threshold"], str)
        else:
            assert name not in scaled
            hpa = hpas[name]
            assert hpa["apiVersion"] == "autoscaling/v2"
            assert hpa["spec"]["scaleTargetRef"]["kind"] == target_kind
            assert hpa["spec"]["scaleTargetRef"]["name"] == target_name
            assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    if keda:  # scale to zero allowed
        assert any(so["spec"]["minReplicaCount"] == 0 for so in scaled.values())


@pytest.mark.parametrize("case", CASES)
def test_network_policies(case):
    docs, values = render(CASES[case]), merged_values(CASES[case])
    router_labels = one(docs, "Deployment", f"{FULLNAME}-router")["spec"]["template"][
        "metadata"]["labels"]
    prom = values["networkPolicy"]["prometheus"]
    for comp, port in (("speculator", "grpc"), ("verifier", "grpc")):
        rules = one(docs, "NetworkPolicy", f"{FULLNAME}-{comp}")["spec"]["ingress"]
        grpc_rules = [r for r in rules if any(p.get("port") == port for p in r.get("ports", []))]
        assert grpc_rules and all(len(r["from"]) == 1 for r in grpc_rules)
        for r in grpc_rules:  # from the router only
            assert matches(r["from"][0]["podSelector"], router_labels)
            assert "namespaceSelector" not in r["from"][0]
            assert r["from"][0]["podSelector"]["matchLabels"][
                "app.kubernetes.io/component"] == "router"
        metrics = [r for r in rules if any(p.get("port") == "metrics" for p in r.get("ports", []))]
        assert metrics[0]["from"] == [{"namespaceSelector": prom["namespaceSelector"],
                                       "podSelector": prom["podSelector"]}]
        all_ports = [r for r in rules if "ports" not in r]
        if comp == "verifier":  # pipeline stages reach each other on every port
            (r,) = all_ports
            assert r["from"][0]["podSelector"]["matchLabels"][
                "app.kubernetes.io/component"] == "verifier"
        else:
            assert not all_ports
    router_rules = one(docs, "NetworkPolicy", f"{FULLNAME}-router")["spec"]["ingress"]
    public = router_rules[0]
    assert {p["port"] for p in public["ports"]} == {"grpc", "http"}
    assert public.get("from", []) == values["networkPolicy"]["router"]["from"]


def test_tls_and_auth_wiring():
    docs = render(CASES["everything"])
    mount = "/etc/specinfer/tls"
    for where, pod in pod_templates(docs):
        (c,) = pod["spec"]["containers"]
        vols = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert vols["tls"]["secret"]["secretName"] == "specinfer-tls"
        assert {m["name"]: m for m in c["volumeMounts"]}["tls"]["readOnly"] is True
        if is_hook(pod):
            assert arg(c, "--tls-ca") == f"{mount}/ca.crt"
            continue
        assert arg(c, "--tls-cert") == f"{mount}/tls.crt", where
        assert arg(c, "--tls-key") == f"{mount}/tls.key", where
        assert arg(c, "--tls-ca") == f"{mount}/ca.crt", where
        if component(pod) == "router":
            assert arg(c, "--tls-server-name") == "specinfer.internal"
        else:
            assert arg(c, "--tls-server-name") is None
    secret = one(docs, "Secret", f"{FULLNAME}-api-keys")
    assert secret["stringData"] == {"api-keys": "k1"}
    for where, pod in pod_templates(docs):
        env = {e["name"]: e for e in pod["spec"]["containers"][0].get("env", [])}
        if component(pod) in ("router", "test"):
            assert env["SPECINFER_API_KEY"]["valueFrom"]["secretKeyRef"] == {
                "name": f"{FULLNAME}-api-keys", "key": "api-keys"}, where
        else:
            assert "SPECINFER_API_KEY" not in env
    images = {c["image"] for _, pod in pod_templates(docs) for c in pod["spec"]["containers"]}
    assert images == {"specinfer@sha256:" + "a" * 64, "specinfer@sha256:" + "b" * 64}


def test_auth_existing_secret_and_defaults():
    docs = render(CASES["auth-secret"])
    assert not find(docs, "Secret")
    router = one(docs, "Deployment", f"{FULLNAME}-router")["spec"]["template"]["spec"]
    env = {e["name"]: e for e in router["containers"][0]["env"]}
    assert env["SPECINFER_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "my-keys",
                                                                     "key": "keys"}
    default = render({})
    assert not find(default, "Secret")
    for _, pod in pod_templates(default):
        for c in pod["spec"]["containers"]:
            assert "SPECINFER_API_KEY" not in {e["name"] for e in c.get("env", [])}
            assert not [a for a in args_of(c) if a.startswith("--tls")]
            assert c["image"].startswith("specinfer:" + _chart().metadata["appVersion"])


def test_service_monitors():
    docs = render(CASES["servicemonitor"])
    assert not find(render({}), "ServiceMonitor")
    monitors = find(docs, "ServiceMonitor")
    assert len(monitors) == 3
    services = find(docs, "Service")
    for sm in monitors:
        assert sm["apiVersion"] == "monitoring.coreos.com/v1"
        assert sm["metadata"]["labels"]["release"] == "prom"
        (svc,) = [s for s in services
                  if matches(sm["spec"]["selector"], s["metadata"]["labels"])]
        (endpoint,) = sm["spec"]["endpoints"]
        port = {p["name"]: p["port"] for p in svc["spec"]["ports"]}[endpoint["port"]]
        assert endpoint["path"] == "/metrics"
        assert port == (8000 if svc["metadata"]["name"].endswith("-router") else 9090)


def test_dashboard_configmap():
    (cm,) = [d for d in render({}) if d["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(cm["data"]["specinfer.json"])
    assert board == json.loads((CHART / "dashboards" / "specinfer.json").read_text())
    off = render({"metrics": {"dashboard": {"enabled": False}}})
    assert not find(off, "ConfigMap")


def test_helm_test_hook():
    docs = render({})
    (pod,) = find(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    assert args_of(c)[0] == "generate"
    assert arg(c, "--addr") == f"{FULLNAME}-router:50051"
    assert arg(c, "--max-tokens") == "8" and "--json" in args_of(c)
    assert pod["spec"]["restartPolicy"] == "Never"


def test_notes_render():
    out = _chart().render(CASES["tp2-pp2"], name=RELEASE, namespace=NAMESPACE)
    notes = next(v for k, v in out.items() if k.endswith("NOTES.txt"))
    assert f"helm test {RELEASE}" in notes and "LeaderWorkerSet" in notes


def test_values_keys_others_rely_on():
    values = _chart().values
    v = values["verifier"]
    assert v["device"] == "cpu" and v["tensorParallelSize"] == 1
    assert v["pipelineParallelSize"] == 1 and v["replicas"] >= 1
    assert isinstance(values["speculator"]["autoscaling"]["enabled"], bool)
    assert isinstance(v["autoscaling"]["enabled"], bool)
    assert values["tracing"]["otlpEndpoint"] == ""
    assert values["image"]["tag"] == "" and values["image"]["cudaSuffix"] == "-cuda"
    schema = _chart().schema
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) >= set(values)


def test_no_stale_dashboard_path():
    """The dashboard moved into the chart (Helm reads no file outside it)."""
    assert not (ROOT / "deploy" / "grafana").exists()
    git = shutil.which("git")
    if git is None:
        pytest.skip("no git")
    hits = subprocess.run([git, "grep", "-n", "deploy/grafana", "--", ":!tests/test_chart.py"],
                          cwd=ROOT, capture_output=True, text=True).stdout
    assert not hits, hits


def test_every_value_is_documented():
    """deploy/README.md's table names every value (`<c>.x` for the three components'
    shared keys, `a.b.*` for a group, `a.b.x`, `.y` for siblings)."""
    text = (ROOT / "deploy" / "README.md").read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("| `")]
    leaves_of = ("requests", "limits", "startup", "readiness", "liveness")

    def walk(d, prefix=""):
        for key, value in d.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and value and key not in leaves_of \
                    and key not in ("labels", "matchLabels") and "Selector" not in key \
                    and "ecurityContext" not in key and key != "resources":
                yield from walk(value, path + ".")
            else:
                yield path

    def documented(path: str) -> bool:
        parts = path.split(".")
        candidates = [path]
        if parts[0] in ("router", "speculator", "verifier"):
            candidates.append("<c>." + ".".join(parts[1:]))
        for n in range(1, len(parts)):
            candidates.append(".".join(parts[:n]) + ".*")
            candidates.append("<c>." + ".".join(parts[1:n]) + ".*")
        if any(f"`{c}`" in text for c in candidates):
            return True
        parent, leaf = ".".join(parts[:-1]), parts[-1]
        probe_group = "/".join(leaves_of[2:])
        return any((f"`{parent}." in ln or f"`<c>.{'.'.join(parts[1:-1])}." in ln)
                   and (f".{leaf}`" in ln or f"`.{leaf}`" in ln or f"{probe_group}`" in ln)
                   for ln in lines)

    missing = [p for p in walk(_chart().values) if not documented(p)]
    assert not missing, missing


@pytest.mark.parametrize("serving", [True, False])
def test_tls_health_probe_command_works(tmp_path, serving):
    """With TLS the startup/readiness probe is an exec of a Python health check over mutual
    TLS: run that exact command (with this interpreter) against a real gRPC server with
    the health service, behind mutual TLS with certificates naming tls.serverName."""
    import socket
    import sys
    from concurrent import futures

    import grpc
    import trustme
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    ca = trustme.CA()
    cert = ca.issue_cert("specinfer.internal")
    mount = tmp_path / "tls"
    mount.mkdir()
    (mount / "ca.crt").write_bytes(ca.cert_pem.bytes())
    (mount / "tls.key").write_bytes(cert.private_key_pem.bytes())
    (mount / "tls.crt").write_bytes(cert.cert_chain_pems[0].bytes())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    values = _merge(TLS, {"tls": {"mountPath": str(mount)}, "speculator": {"port": port}})
    (pod,) = [p for _, p in pod_templates(render(values)) if component(p) == "speculator"]
    command = pod["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    assert command[0] == "python3"

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING if serving
                 else health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_secure_port(f"127.0.0.1:{port}", grpc.ssl_server_credentials(
        [(cert.private_key_pem.bytes(), cert.cert_chain_pems[0].bytes())],
        root_certificates=ca.cert_pem.bytes(), require_client_auth=True))
    server.start()
    try:
        proc = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True,
                              timeout=30)
    finally:
        server.stop(0)
    assert proc.returncode == (0 if serving else 1), proc.stderr[-2000:]
