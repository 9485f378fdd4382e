"""The Helm chart (deploy/helm/specinfer), checked without a cluster: linted and rendered
by the real Helm library (helm-python-sdk), every object validated against the Kubernetes
1.31 OpenAPI schemas (kubernetes-validate, strict: no unknown fields), the values schema
shown to refuse bad values, the values documented, and checkov run on the rendered
manifests. What the rendered workloads must hold (GPUs, probes, selectors, LWS, RBAC,
security, autoscaling, networking) is test_chart_workloads.py; the CRD kinds
(LeaderWorkerSet, ScaledObject, ServiceMonitor) are checked there by invariants.

`make chart` runs both files; `make test` runs them once, with the rest."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import yaml
from chart_render import (
    CASES,
    CHART,
    CHECKOV,
    CRD_KINDS,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    ROOT,
    TLS,
    chart,
    component,
    helm,
    merge,
    pod_templates,
    render,
)

kv = pytest.importorskip("kubernetes_validate")


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
        chart().render(values, name=RELEASE, namespace=NAMESPACE)
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
        chart().render(values, name=RELEASE, namespace=NAMESPACE)


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


def test_values_keys_others_rely_on():
    values = chart().values
    v = values["verifier"]
    assert v["device"] == "cpu" and v["tensorParallelSize"] == 1
    assert v["pipelineParallelSize"] == 1 and v["replicas"] >= 1
    assert isinstance(values["speculator"]["autoscaling"]["enabled"], bool)
    assert isinstance(v["autoscaling"]["enabled"], bool)
    assert values["tracing"]["otlpEndpoint"] == ""
    assert values["image"]["tag"] == "" and values["image"]["cudaSuffix"] == "-cuda"
    schema = chart().schema
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

    missing = [p for p in walk(chart().values) if not documented(p)]
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
    values = merge(TLS, {"tls": {"mountPath": str(mount)}, "speculator": {"port": port}})
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
