"""What the Helm chart's rendered workloads must hold, for every values case in
chart_render.CASES: GPUs and shared memory, probes and grace periods, selectors, the
verifier's Deployment or LeaderWorkerSet, discovery and RBAC, tracing, security contexts
and resources, the model mount, autoscaling (HPA, KEDA), network policies, TLS and auth
wiring, ServiceMonitors, the dashboard, the helm test hook and NOTES."""

from __future__ import annotations

import json

import pytest
from chart_render import (
    CASES,
    CHART,
    FULLNAME,
    LWS_INDEX,
    NAMESPACE,
    RELEASE,
    arg,
    args_of,
    chart,
    component,
    containers,
    find,
    is_hook,
    matches,
    merged_values,
    one,
    pod_templates,
    render,
    selected,
)


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
            assert c["image"].startswith("specinfer:" + chart().metadata["appVersion"])


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
    out = chart().render(CASES["tp2-pp2"], name=RELEASE, namespace=NAMESPACE)
    notes = next(v for k, v in out.items() if k.endswith("NOTES.txt"))
    assert f"helm test {RELEASE}" in notes and "LeaderWorkerSet" in notes
