"""The verifier as a real gRPC service in its own process: RPCs, health, reflection,
status codes for bad requests (and it keeps serving), graceful SIGTERM."""

from __future__ import annotations

import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from servers import cli, free_port, scrape, service, start

from specinfer.tree import ROOT, TokenTree
from specinfer.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specinfer.wire import tree_to_proto

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def verifier(tiny_llama):
    metrics_port = free_port()
    with service("verifier", "--llm", tiny_llama, "--max-context", "64", "--slots", "3",
                 "--max-tree-nodes", "8", "--metrics-port", str(metrics_port)) as (addr, _):
        channel = grpc.insecure_channel(addr)
        yield verifier_pb2_grpc.VerifierStub(channel), channel, metrics_port
        channel.close()


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def prefill(stub, sid, tokens, **sampling):
    req = verifier_pb2.PrefillRequest(items=[verifier_pb2.PrefillItem(
        sequence_id=sid, token_ids=tokens, sampling=common_pb2.SamplingParams(**sampling))])
    return stub.Prefill(req, timeout=30).results[0]


def step(stub, *items: verifier_pb2.StepItem) -> list[verifier_pb2.StepResult]:
    return list(stub.Step(verifier_pb2.StepRequest(items=items), timeout=30).results)


def test_prefill_step_release(verifier):
    stub, _, _ = verifier
    info = stub.Info(verifier_pb2.InfoRequest(), timeout=10)
    assert info.vocab_size == 128 and info.dtype == "float32" and info.max_tree_nodes == 8
    assert info.step_protocol == 2
    assert [(s.name, s.sampled) for s in info.draft_sources] == [("model_free", False)]
    first = prefill(stub, "a", [1, 2, 3, 4]).token
    tree = TokenTree()
    x = tree.add(ROOT, 5)
    tree.add(x, 6)
    tree.add(ROOT, 7)
    res = step(stub, verifier_pb2.StepItem(sequence_id="a", root_token=first,
                                           tree=tree_to_proto(tree)))[0]
    assert 1 <= len(res.tokens) <= 3 and res.cached_tokens == 4 + len(res.tokens)
    assert res.drafted_nodes == 3
    dec = step(stub, verifier_pb2.StepItem(sequence_id="a", root_token=res.tokens[-1]))[0]
    assert len(dec.tokens) == 1 and dec.drafted_nodes == 0
    assert dec.cached_tokens == res.cached_tokens + 1
    assert stub.Release(verifier_pb2.ReleaseRequest(sequence_ids=["a"]), timeout=10).released == 1


def test_one_step_call_is_one_forward_pass_for_a_mixed_batch(verifier):
    """Plain rows, a row with a sent tree and a row the verifier drafts for, in one Step
    call: one forward pass (the verifier's forward-pass counter rises by one), and each
    row's tokens are what it would get stepped alone."""
    stub, _, metrics_port = verifier
    prompts = {"p": [1, 2, 3, 4], "t": [5, 6, 7, 8, 9], "d": [9, 8, 9, 8, 9, 8, 9, 8]}
    roots = {sid: prefill(stub, sid, p).token for sid, p in prompts.items()}
    items = [verifier_pb2.StepItem(sequence_id="p", root_token=roots["p"]),
             verifier_pb2.StepItem(sequence_id="t", root_token=roots["t"],
                                   tree=tree_to_proto(TokenTree.chain([3, 4]))),
             verifier_pb2.StepItem(sequence_id="d", root_token=roots["d"],
                                   draft=verifier_pb2.DraftPlan(sources=["model_free"],
                                                                max_nodes=4))]
    before = forward_passes(metrics_port)
    together = step(stub, *items)
    assert forward_passes(metrics_port) == before + 1
    assert [len(r.tokens) >= 1 for r in together] == [True] * 3
    assert together[0].drafted_nodes == 0 and together[1].drafted_nodes == 2
    assert together[2].drafted_nodes <= 4
    stub.Release(verifier_pb2.ReleaseRequest(sequence_ids=list(prompts)), timeout=10)
    for item, want in zip(items, together, strict=True):  # alone, from a fresh prefill
        sid = item.sequence_id
        assert prefill(stub, sid, prompts[sid]).token == roots[sid]
        assert step(stub, item)[0].tokens == want.tokens
        stub.Release(verifier_pb2.ReleaseRequest(sequence_ids=[sid]), timeout=10)


def forward_passes(port: int) -> float:
    """The verifier's forward-pass counter, from its /metrics."""
    return sum(v for k, v in scrape(f"http://127.0.0.1:{port}/metrics").items()
               if k.startswith("specinfer:verifier_forward_passes_total"))


def test_a_long_prefill_does_not_stall_the_steps_of_live_sequences(tiny_llama):
    """A 1,500-token prompt computed 32 tokens at a time: Step calls of a live sequence,
    sent after the Prefill, are answered while it is under way, its chunks riding in
    their forward passes."""
    port = free_port()
    with service("verifier", "--llm", tiny_llama, "--max-context", "2048", "--slots", "2",
                 "--prefill-chunk", "32", "--metrics-port", str(port)) as (addr, _), \
            grpc.insecure_channel(addr) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        root = prefill(stub, "live", [1, 2, 3]).token
        long = verifier_pb2.PrefillRequest(items=[verifier_pb2.PrefillItem(
            sequence_id="long", token_ids=[(7 * i) % 120 + 1 for i in range(1500)])])
        pending = stub.Prefill.future(long, timeout=60)
        during = 0
        while not pending.done():
            root = step(stub, verifier_pb2.StepItem(sequence_id="live",
                                                    root_token=root))[0].tokens[-1]
            during += not pending.done()
        assert pending.result().results[0].sequence_id == "long"
        assert during >= 3, during
        metrics = scrape(f"http://127.0.0.1:{port}/metrics")
        riding = sum(v for k, v in metrics.items()
                     if k.startswith("specinfer:verifier_prefill_riding_tokens_total"))
        assert riding > 0


def test_health_and_reflection(verifier):
    _, channel, _ = verifier
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="specinfer.v1.Verifier"),
                        timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]), timeout=5))
    names = {s.name for s in reply.list_services_response.service}
    assert "specinfer.v1.Verifier" in names


def test_bad_requests_get_precise_codes_and_the_service_keeps_serving(verifier):
    stub, _, _ = verifier
    root = prefill(stub, "b", [3, 4, 5]).token

    def verify(sid, root_token, tree_msg, **plans):
        return lambda: step(stub, verifier_pb2.StepItem(sequence_id=sid, root_token=root_token,
                                                        tree=tree_msg, **plans))

    code, details = code_of(verify("ghost", root, common_pb2.TokenTree()))
    assert code == grpc.StatusCode.NOT_FOUND and "sequence_id" in details  # never prefilled
    cases = [
        (verify("b", root, common_pb2.TokenTree(tokens=[999], parents=[-1])), "tokens[0]"),
        (verify("b", root, common_pb2.TokenTree(tokens=[1, 2], parents=[1, -1])), "parents"),
        (verify("b", root, tree_to_proto(TokenTree.chain(list(range(9))))), "tree"),
        (verify("b", root, common_pb2.TokenTree(), draft=verifier_pb2.DraftPlan(
            sources=["head"], max_nodes=4)), "items[0].draft.sources"),
        (verify("b", root, common_pb2.TokenTree(), shadow=verifier_pb2.DraftPlan(
            sources=["model_free", "model_free"], max_nodes=4)), "items[0].shadow.sources"),
        (verify("b", root, common_pb2.TokenTree(), draft=verifier_pb2.DraftPlan(
            sources=["model_free"], max_nodes=9)), "items[0].draft.max_nodes"),
        (lambda: prefill(stub, "c", []), "token_ids"),
        (lambda: prefill(stub, "c", [1], temperature=-1.0), "temperature"),
        (lambda: prefill(stub, "c", [1], temperature=1.0, top_p=1.5), "top_p"),
    ]
    for call, field in cases:
        code, details = code_of(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert field in details
    # Capacity: 3 slots, "b" holds one.
    prefill(stub, "c1", [1])
    prefill(stub, "c2", [1])
    code, details = code_of(lambda: prefill(stub, "c3", [1]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    stub.Release(verifier_pb2.ReleaseRequest(sequence_ids=["c1", "c2"]), timeout=10)
    # A deadline shorter than the work: DEADLINE_EXCEEDED, and the sequence is not admitted
    # on a later retry's behalf (release it if it was).
    code, _ = code_of(lambda: stub.Prefill(verifier_pb2.PrefillRequest(items=[
        verifier_pb2.PrefillItem(sequence_id="late", token_ids=[1] * 60)]), timeout=0.002))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    stub.Release(verifier_pb2.ReleaseRequest(sequence_ids=["late"]), timeout=10)
    # "b" is untouched and still decodes.
    out = step(stub, verifier_pb2.StepItem(sequence_id="b", root_token=root))[0]
    assert out.cached_tokens == 4
    stub.Release(verifier_pb2.ReleaseRequest(sequence_ids=["b"]), timeout=10)


def test_sigterm_stops_cleanly(tiny_llama):
    """Also with a live sequence that no router steps any more (its router is gone): the
    drain ends once nothing has stepped it for 3 s, not at --drain-timeout."""
    import time

    with service("verifier", "--llm", tiny_llama, "--drain-timeout", "120",
                 "--sequence-lease", "0") as (addr, proc):
        with grpc.insecure_channel(addr) as channel:
            prefill(verifier_pb2_grpc.VerifierStub(channel), "orphan", [1, 2, 3])
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - start < 30


def test_missing_model_is_a_clear_error(tmp_path):
    out = cli("serve", "verifier", "--llm", str(tmp_path / "nope"), "--port", "0")
    assert out.returncode == 2
    assert "not found" in out.stderr


def test_every_rpc_is_unavailable_until_the_model_is_loaded(tiny_llama):
    """From the moment it listens until its engine is built, every RPC answers UNAVAILABLE
    with a message (not an internal error); then the same calls succeed."""
    import time

    verifier = start("verifier", "--llm", tiny_llama, "--max-context", "64", "--slots", "2")
    channel = grpc.insecure_channel(verifier.addr)
    stub = verifier_pb2_grpc.VerifierStub(channel)
    calls = {
        "Info": lambda: stub.Info(verifier_pb2.InfoRequest(), timeout=5),
        "Release": lambda: stub.Release(verifier_pb2.ReleaseRequest(sequence_ids=["x"]),
                                        timeout=5),
        "Step": lambda: stub.Step(verifier_pb2.StepRequest(items=[
            verifier_pb2.StepItem(sequence_id="x", root_token=1)]), timeout=5),
    }
    seen: dict[str, set] = {name: set() for name in calls}
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                calls["Info"]()
                break
            except grpc.RpcError as exc:
                seen["Info"].add(exc.code())
                answers = {}
                for name in ("Release", "Step"):
                    try:
                        calls[name]()
                    except grpc.RpcError as other:
                        answers[name] = other.code()
                        if other.code() == grpc.StatusCode.UNAVAILABLE:
                            assert other.details()
                try:  # the engine may have come up between these calls: not counted
                    calls["Info"]()
                    break
                except grpc.RpcError:
                    for name, code in answers.items():
                        seen[name].add(code)
            time.sleep(0.05)
        assert stub.Release(verifier_pb2.ReleaseRequest(sequence_ids=["x"]),
                            timeout=5).released == 0
        assert code_of(calls["Step"])[0] == grpc.StatusCode.NOT_FOUND  # unknown
        for name, codes in seen.items():
            assert codes <= {grpc.StatusCode.UNAVAILABLE}, (name, codes)
    finally:
        channel.close()
        verifier.stop()
