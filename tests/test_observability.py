"""Traces and metrics from the three services as separate processes (tiny random Llama over
SmolLM2's tokenizer): spans exported over OTLP/gRPC to a real receiver (the TraceService of
``opentelemetry-proto``), ``/metrics`` parsed with ``prometheus_client``'s own parser, the
Grafana dashboard checked against what the services export."""

from __future__ import annotations

import json
import math
import re
import secrets
import shutil
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import free_port, prometheus

from bench.otlp_receiver import OtlpReceiver, poll
from specinfer.client import Client

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "helm" / "specinfer" / "dashboards" / "specinfer.json"


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def stack(receiver, processes, tiny_chat_llm):
    """Verifier, speculator and router, each exporting traces to ``receiver`` and serving
    metrics (the router's on its HTTP port)."""
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
    tracing = ("--otlp-traces-endpoint", receiver.endpoint)
    ports = {k: free_port() for k in ("verifier_metrics", "speculator_metrics", "http")}
    verifier = processes.start("verifier", "--llm", tiny_chat_llm, "--metrics-port",
                               str(ports["verifier_metrics"]), "--slots", "8", "--max-context",
                               "512", "--threads", "1", "--datastore", "none", *tracing,
                               env=env)
    speculator = processes.start("speculator", "--llm", tiny_chat_llm, "--ssm",
                                 f"{tiny_chat_llm}#layers=1", "--metrics-port",
                                 str(ports["speculator_metrics"]), "--max-context", "512",
                                 "--threads", "1", "--datastore", "none", *tracing, env=env)
    router = processes.router(tiny_chat_llm, [verifier], "--http-port", str(ports["http"]),
                              "--speculation", "always", "--spec-max-batch", "64", *tracing,
                              speculators=(speculator,), env=env)
    return {"addr": router.addr, "http": f"http://127.0.0.1:{ports['http']}",
            "verifier_metrics": f"http://127.0.0.1:{ports['verifier_metrics']}/metrics",
            "speculator_metrics": f"http://127.0.0.1:{ports['speculator_metrics']}/metrics",
            "model": tiny_chat_llm}


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _post(url: str, body: dict, headers: dict | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _scrape(url: str) -> dict:
    """{(sample name, sorted labels): value} of every sample at ``url``."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _total(samples: dict, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))


def _complete_trace(receiver: OtlpReceiver, trace_id: str, services: set[str],
                    names: set[str]):
    """The trace once it holds spans of every service and every name in ``names`` (the
    request span ends last, after its final step)."""
    def ready():
        spans = receiver.trace(trace_id)
        have = {s.service for s in spans}, {s.name for s in spans}
        return spans if services <= have[0] and names <= have[1] else None

    spans = poll(ready)
    assert spans, sorted({(s.service, s.name) for s in receiver.trace(trace_id)})
    return spans


SERVICES = {"specinfer-router", "specinfer-speculator", "specinfer-verifier"}


def test_one_http_request_is_one_trace_across_the_three_services(stack, receiver):
    trace_id, caller_span, traceparent = _traceparent()
    out = _post(f"{stack['http']}/v1/chat/completions",
                {"model": stack["model"], "max_tokens": 16, "temperature": 0,
                 "messages": [{"role": "user", "content": "Name three colours."}]},
                {"traceparent": traceparent})
    request_span = f"chat {stack['model']}"
    spans = _complete_trace(receiver, trace_id, SERVICES,
                            {request_span, "POST /v1/chat/completions", "Prefill", "Speculate",
                             "specinfer.v1.Verifier/Prefill",
                             "specinfer.v1.Speculator/SpeculateStream",
                             "specinfer.v1.Verifier/Release"})
    ids = {s.span_id for s in spans}
    for s in spans:  # every parent is in the trace, or is the caller's span
        assert s.parent_id in ids | {caller_span}, (s.service, s.name)
    by_name = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    (http,) = by_name["POST /v1/chat/completions"]
    assert http.parent_id == caller_span and http.service == "specinfer-router"
    assert http.attributes["http.response.status_code"] == 200
    (req,) = by_name[request_span]
    assert req.parent_id == http.span_id
    a, usage = req.attributes, out["usage"]
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == stack["model"]
    assert a["gen_ai.request.max_tokens"] == 16
    assert a["gen_ai.request.temperature"] == 0.0 and a["gen_ai.request.top_p"] == 1.0
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a["gen_ai.response.finish_reasons"] == [out["choices"][0]["finish_reason"]]
    steps = usage["speculation"]["accepted_per_step"]
    assert a["specinfer.steps"] == len(steps)
    assert a["specinfer.mean_accepted_tokens_per_step"] == pytest.approx(
        sum(steps) / len(steps))
    assert a["specinfer.verify_seconds"] > 0 and a["specinfer.speculate_seconds"] > 0
    # Each router call is a child of the request, and the service's span of the call
    # the child of the router's (for the speculator's stream: of each message).
    for client, server, service in [("Prefill", "specinfer.v1.Verifier/Prefill", "verifier"),
                                    ("Speculate", "specinfer.v1.Speculator/SpeculateStream",
                                     "speculator")]:
        calls = {s.span_id: s for s in by_name[client]}
        assert all(c.parent_id == req.span_id for c in calls.values())
        for s in by_name[server]:
            assert s.service == f"specinfer-{service}" and s.parent_id in calls
            assert s.attributes["specinfer.batch_size"] >= 1
    (release,) = by_name["specinfer.v1.Verifier/Release"]  # the slot freed in the trace too
    assert release.parent_id == req.span_id
    verifies = by_name.get("Step", [])
    assert len(verifies) == len(steps)
    for v in verifies:
        assert {"specinfer.batch_size", "specinfer.tree_nodes",
                "specinfer.accepted_tokens"} <= set(v.attributes)
        assert v.attributes["specinfer.speculation_mode"] == "tree"  # --speculation always
    accepted = sum(v.attributes.get("specinfer.accepted_tokens", 0) for v in verifies)
    assert accepted == sum(steps) - len(steps)  # one request alone in its steps


def test_the_grpc_sdk_carries_the_callers_current_span(stack, receiver):
    """The SDK injects the caller's current OpenTelemetry span (here a remote span context
    made current with the API alone), and the router's server span is its child."""
    from opentelemetry import context, trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    trace_id, caller_span, _ = _traceparent()
    span = NonRecordingSpan(SpanContext(int(trace_id, 16), int(caller_span, 16),
                                        is_remote=True, trace_flags=TraceFlags(1)))
    token = context.attach(trace.set_span_in_context(span))
    try:
        with Client(stack["addr"]) as c:
            out = c.generate("Once upon a time", max_tokens=12)
    finally:
        context.detach(token)
    spans = _complete_trace(receiver, trace_id, SERVICES,
                            {"specinfer.v1.Router/Generate", f"text_completion {stack['model']}"})
    (server,) = [s for s in spans if s.name == "specinfer.v1.Router/Generate"]
    assert server.parent_id == caller_span
    assert server.attributes["rpc.system"] == "grpc"
    (req,) = [s for s in spans if s.name == f"text_completion {stack['model']}"]
    assert req.attributes["gen_ai.usage.output_tokens"] == len(out.token_ids)
    assert req.attributes["specinfer.steps"] == out.steps


def test_a_batched_call_is_in_one_trace_and_links_the_others(stack, receiver):
    """Requests decoded together: each shared call belongs to one request's trace and links
    the other requests' spans."""
    callers = [_traceparent() for _ in range(3)]

    def ask(traceparent: str) -> None:
        _post(f"{stack['http']}/v1/completions",
              {"model": stack["model"], "prompt": "The quick brown fox", "max_tokens": 32,
               "temperature": 0}, {"traceparent": traceparent})

    threads = [threading.Thread(target=ask, args=(tp,)) for _, _, tp in callers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    name = f"text_completion {stack['model']}"
    # A shared call is in one trace only: the others may hold the router's spans alone.
    traces = [_complete_trace(receiver, trace_id, {"specinfer-router"}, {name})
              for trace_id, _, _ in callers]
    requests = {(t[0].trace_id, s.span_id) for t in traces for s in t if s.name == name}
    linked = [(s, link) for t in traces for s in t for link in s.links]
    assert linked, "no call was shared by the concurrent requests"
    for s, (trace_id, span_id) in linked:
        assert s.name in ("Prefill", "Speculate", "Step")
        assert (trace_id, span_id) in requests and trace_id != s.trace_id


def test_router_metrics_match_the_responses(stack):
    """Counts, tokens and speculation counters on the router's /metrics move exactly by
    what the responses themselves report."""
    before = _scrape(f"{stack['http']}/metrics")
    verifier_before = _scrape(stack["verifier_metrics"])
    with Client(stack["addr"]) as c:
        outs = [c.generate("The quick brown fox", max_tokens=20),
                c.generate("def fibonacci(n):", max_tokens=12, temperature=0.8, seed=3),
                c.generate("1, 2, 3, 4,", max_tokens=8, speculation=False),
                c.generate("Paris is", max_tokens=16)]
        streamed = list(c.stream("Hello there", max_tokens=10))
    after = _scrape(f"{stack['http']}/metrics")

    def delta(name: str, **labels) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    stats = [o.stats for o in outs] + [streamed[-1].stats]
    generated = [len(o.token_ids) for o in outs] + [sum(len(c.token_ids) for c in streamed)]
    steps = [a for s in stats for a in s.accepted_per_step]
    p = "specinfer:"
    reasons = [o.finish_reason for o in outs] + [streamed[-1].finish_reason]
    for reason in set(reasons):
        assert delta(p + "request_success_total", finished_reason=reason) == reasons.count(reason)
    assert delta(p + "generation_tokens_total") == sum(generated)
    assert delta(p + "prompt_tokens_total") == sum(o.prompt_tokens for o in outs) + \
        _prompt_tokens(stack, "Hello there")
    assert delta(p + "spec_decode_num_drafts_total") == sum(s.speculative_steps for s in stats)
    assert delta(p + "spec_decode_num_draft_tokens_total") == sum(s.drafted_tokens for s in stats)
    accepted = sum(a - 1 for a in steps)
    assert accepted > 0  # the tiny SSM is the LLM's first layer: some drafts are accepted
    assert delta(p + "spec_decode_num_accepted_tokens_total") == accepted
    assert delta(p + "spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert delta(p + "spec_decode_num_accepted_tokens_per_pos_total", position="0") == \
        sum(a >= 2 for a in steps)
    assert delta(p + "steps_total") == len(steps)  # one request at a time: a step each
    # One Step call, one forward pass, per router step (mixed rows or not).
    verifier_after = _scrape(stack["verifier_metrics"])
    assert _total(verifier_after, p + "verifier_forward_passes_total") - \
        _total(verifier_before, p + "verifier_forward_passes_total") == len(steps)
    assert delta(p + "time_to_first_token_seconds_count") == len(stats)
    assert delta(p + "e2e_request_latency_seconds_count") == len(stats)
    assert delta(p + "inter_token_latency_seconds_count") == sum(generated) - len(stats)
    assert delta(p + "request_generation_tokens_sum") == sum(generated)
    assert delta(p + "verify_latency_seconds_count", rpc="Prefill") == len(stats)
    assert delta(p + "verify_latency_seconds_count") == len(stats) + len(steps)
    assert _total(after, p + "num_requests_running") == 0
    assert _total(after, p + "num_requests_waiting") == 0
    assert _total(after, p + "replica_healthy", role="verifier") == 1
    assert _total(after, p + "replica_healthy", role="speculator") == 1
    assert _total(after, "process_cpu_seconds_total") > 0


def test_a_mixed_batch_is_one_forward_pass_a_step(stack):
    """Requests with and without speculation stepped together: each router step is one
    Step call, one forward pass of the verifier, whatever rows it mixes."""
    router_before = _scrape(f"{stack['http']}/metrics")
    verifier_before = _scrape(stack["verifier_metrics"])
    prompts = [("Tell me a story about a cat", True), ("Count to twenty:", False),
               ("Write a poem", True), ("List the planets", False)]
    outs: dict[str, object] = {}

    def run(prompt: str, speculation: bool) -> None:
        with Client(stack["addr"]) as c:
            outs[prompt] = c.generate(prompt, max_tokens=40, speculation=speculation)

    threads = [threading.Thread(target=run, args=p) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outs) == len(prompts)
    router_after = _scrape(f"{stack['http']}/metrics")
    verifier_after = _scrape(stack["verifier_metrics"])
    steps = _total(router_after, "specinfer:steps_total") - \
        _total(router_before, "specinfer:steps_total")
    passes = _total(verifier_after, "specinfer:verifier_forward_passes_total") - \
        _total(verifier_before, "specinfer:verifier_forward_passes_total")
    assert steps > 0 and passes == steps
    # Fewer passes than the requests' own steps added up: rows shared steps.
    assert passes < sum(o.stats.steps for o in outs.values())
    # Only the speculating requests drafted; the others decoded one token a step.
    for (prompt, speculation) in prompts:
        stats = outs[prompt].stats
        assert (stats.drafted_tokens > 0) == speculation
        assert speculation or all(a == 1 for a in stats.accepted_per_step)


def _prompt_tokens(stack, prompt: str) -> int:
    with Client(stack["addr"]) as c:  # speculation off: one more request, same prompt
        return c.generate(prompt, max_tokens=1, speculation=False).prompt_tokens


def test_verifier_metrics_show_the_kv_cache_in_use(stack):
    with Client(stack["addr"]) as c:
        chunks = c.stream("Tell me a story", max_tokens=200)
        next(chunks)  # prefilled: its sequence holds the cache now
        during = _scrape(stack["verifier_metrics"])
        for _ in chunks:
            pass
    assert 0 < _total(during, "specinfer:kv_cache_usage_perc") <= 1
    assert _total(during, "specinfer:verifier_sequences", state="live") == 1
    assert _total(during, "specinfer:kv_cache_capacity_tokens") == 8 * 512

    def released():
        after = _scrape(stack["verifier_metrics"])
        return after if _total(after, "specinfer:verifier_sequences", state="live") == 0 \
            else None

    after = poll(released, timeout=10)
    assert after and _total(after, "specinfer:kv_cache_usage_perc") == 0
    assert _total(after, "specinfer:verifier_step_seconds_count", rpc="Prefill") >= 1
    assert _total(after, "specinfer:verifier_step_seconds_count", rpc="Step") >= 1
    spec = _scrape(stack["speculator_metrics"])
    assert _total(spec, "specinfer:speculate_seconds_count") >= 1
    assert _total(spec, "specinfer:speculator_tree_nodes_total") >= 1


def test_the_dashboard_plots_only_metrics_the_services_export(stack):
    """Every ``specinfer:`` series the Grafana dashboard queries is one the router,
    verifier or speculator serves, and it has the panels an operator looks for."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
                "gauge": ("",)}
    exported = set()  # every series name a family declares, observed yet or not
    for url in (f"{stack['http']}/metrics", stack["verifier_metrics"],
                stack["speculator_metrics"]):
        with urllib.request.urlopen(url, timeout=10) as resp:
            for family in text_string_to_metric_families(resp.read().decode()):
                exported |= {family.name + s for s in suffixes.get(family.type, ("",))}
    board = json.loads(DASHBOARD.read_text())
    panels = [p for p in board["panels"] if p.get("type") != "row"]
    queried = {m for p in panels for t in p.get("targets", [])
               for m in re.findall(r"specinfer:[a-z0-9_:]+", t["expr"])}
    assert queried and queried <= exported, sorted(queried - exported)
    titles = " | ".join(p["title"].lower() for p in panels)
    for wanted in ("throughput", "time to first token", "inter-token", "queue", "kv cache",
                   "acceptance", "mode"):
        assert wanted in titles, wanted


PROMETHEUS = shutil.which("prometheus")  # Debian's package: `make test` installs it


def _prom_query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (make test "
                    "installs it)")
def test_a_real_prometheus_stores_every_series_the_dashboard_queries(stack, tmp_path):
    """Debian's Prometheus scrapes router, verifier and speculator (it negotiates
    OpenMetrics) under a load that touches every panel; every query of the Grafana
    dashboard and the chart's KEDA trigger query returns a finite sample through its HTTP
    API, so the names it stored are the names the docs and the dashboard use."""
    targets = {"router": f"{stack['http']}/metrics", "verifier": stack["verifier_metrics"],
               "speculator": stack["speculator_metrics"]}
    with prometheus(targets, tmp_path, {"namespace": "specinfer-test"}) as base:
        with Client(stack["addr"]) as c:  # load over several scrapes
            end = time.monotonic() + 8
            while time.monotonic() < end:
                c.generate("Count: 1, 2, 3,", max_tokens=24)
                c.generate("Reply in JSON.", max_tokens=16, json_object=True)
        time.sleep(2)  # the last scrape after the load
        board = json.loads(DASHBOARD.read_text())
        queries = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
        queries.append('sum(specinfer:num_requests_waiting{namespace="specinfer-test"})')
        empty = []
        for expr in queries:
            expr = expr.replace("$__rate_interval", "30s").replace("$model_name", ".*")
            result = _prom_query(base, expr)
            values = [float(r["value"][1]) for r in result]
            # A label set with no events in the window is NaN (a gap in the panel, as in
            # Grafana); each query must have data.
            if not any(math.isfinite(v) for v in values):
                empty.append((expr, values))
        assert len(queries) >= 28 and not empty, empty
        # The verifier's and speculator's series kept their colons.
        stored = {r["metric"]["__name__"] for job in ("verifier", "speculator")
                  for r in _prom_query(base, f'{{__name__=~"specinfer.*", job="{job}"}}')}
        assert "specinfer:kv_cache_usage_perc" in stored, sorted(stored)
        assert not any(n.startswith("specinfer_") for n in stored), sorted(stored)
