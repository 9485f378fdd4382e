"""API keys, TLS and mutual TLS between the services, and the router's limits, on real
processes: certificates made here with ``trustme``; a verifier and a speculator that
accept only the cluster CA's certificates, a router serving TLS on both public APIs with
keys, and tight limits to probe just under and just over each one."""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from servers import free_port, start

from services.router.auth import ApiKeys
from services.router.limits import KeyStreams
from specinfer.client import AuthenticationError, Client, InvalidRequestError, OverloadedError
from specinfer.errors import ResourceExhausted, Unauthenticated
from specinfer.v1 import speculator_pb2, speculator_pb2_grpc, verifier_pb2, verifier_pb2_grpc

pytestmark = pytest.mark.processes

KEYS = ("sk-first-0123456789", "sk-second-abcdef")
ENV_KEY = "sk-from-env-777"
WRONG = "sk-wrong-key-555"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    leaf, stranger = ca.issue_cert("localhost", "127.0.0.1"), other.issue_cert("127.0.0.1")
    paths = {"ca": d / "ca.pem", "cert": d / "cert.pem", "key": d / "key.pem",
             "other_cert": d / "other.pem", "other_key": d / "other-key.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    leaf.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    leaf.private_key_pem.write_to_path(str(paths["key"]))
    stranger.cert_chain_pems[0].write_to_path(str(paths["other_cert"]))
    stranger.private_key_pem.write_to_path(str(paths["other_key"]))
    return {k: str(v) for k, v in paths.items()}


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def stack(processes, tiny_chat_llm, pki, tmp_path_factory):
    mtls = ("--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"])
    http = free_port()
    log = tmp_path_factory.mktemp("logs") / "router.log"
    verifier = processes.start("verifier", "--llm", tiny_chat_llm, "--slots", "8",
                               "--max-context", "512", "--threads", "1", "--datastore", "none",
                               *mtls)
    speculator = processes.start("speculator", "--llm", tiny_chat_llm, "--ssm",
                                 f"{tiny_chat_llm}#layers=1", "--max-context", "512",
                                 "--threads", "1", "--datastore", "none", *mtls)
    with open(log, "w") as log_file:
        router = processes.start(
            "router", "--llm", tiny_chat_llm, "--http-port", str(http), "--verifier",
            verifier.addr, "--speculator", speculator.addr, "--speculation", "always",
            "--spec-max-batch", "64", *mtls, "--api-key", KEYS[0], "--api-key", KEYS[1],
            "--max-n", "3", "--max-streams-per-key", "2", "--max-stop-strings", "2",
            "--max-stop-chars", "8", "--max-prompt-tokens", "64", "--max-tokens", "32",
            "--max-logprobs", "3", "--max-body-bytes", "4096",
            env={"SPECINFER_API_KEY": ENV_KEY}, stderr=log_file)
    router.wait(credentials=grpc.ssl_channel_credentials(_read(pki["ca"])))
    return {"addr": router.addr, "https": f"https://127.0.0.1:{http}",
            "verifier": verifier.addr, "speculator": speculator.addr, "log": log, **pki}


def _client(stack, key: str | None = KEYS[0]) -> Client:
    return Client(stack["addr"], api_key=key or "", tls_ca=stack["ca"], retry_seconds=0)


def _https(stack, path: str, body: dict | None = None, key: str | None = KEYS[0],
           raw: bytes | None = None) -> tuple[int, dict | str]:
    context = ssl.create_default_context(cafile=stack["ca"])
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None
                                        else None)
    req = urllib.request.Request(stack["https"] + path, data=data, headers=headers,
                                 method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, context=context, timeout=60) as resp:
            text = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as exc:
        text, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def test_the_stack_generates_through_mutual_tls_with_a_key(stack):
    with _client(stack) as c:
        spec = c.generate("The quick brown fox", max_tokens=16)
        plain = c.generate("The quick brown fox", max_tokens=16, speculation=False)
    assert spec.token_ids == plain.token_ids and len(spec.token_ids) > 0
    assert spec.stats.speculative_steps > 0  # the speculator answered through mTLS


@pytest.mark.parametrize("key", [None, WRONG, KEYS[0][:-1]])
def test_grpc_without_a_right_key_is_unauthenticated(stack, key):
    with _client(stack, key) as c, pytest.raises(AuthenticationError) as err:
        c.generate("Hello", max_tokens=4)
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_every_configured_key_works_on_both_apis(stack):
    for key in (*KEYS, ENV_KEY):
        with _client(stack, key) as c:
            assert len(c.generate("Hello", max_tokens=4).token_ids) > 0
        status, body = _https(stack, "/v1/completions",
                              {"prompt": "Hello", "max_tokens": 4}, key=key)
        assert status == 200, body


@pytest.mark.parametrize("key", [None, WRONG])
def test_http_without_a_right_key_is_401_in_openais_shape(stack, key):
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "Hi"}]}),
                       ("/v1/models", None)):
        status, out = _https(stack, path, body, key=key)
        assert status == 401, (path, out)
        assert out["error"]["type"] == "invalid_request_error" and out["error"]["message"]


def test_probes_stay_open_without_a_key(stack):
    status, text = _https(stack, "/metrics", key=None)
    assert status == 200 and "specinfer:num_requests_running" in text
    channel = grpc.secure_channel(stack["addr"],
                                  grpc.ssl_channel_credentials(_read(stack["ca"])))
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                      timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_no_key_reaches_the_logs(stack):
    with _client(stack, WRONG) as c, pytest.raises(AuthenticationError):
        c.generate("Hello", max_tokens=2)
    _https(stack, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, key=WRONG)
    with _client(stack) as c:
        c.generate("Hello", max_tokens=2)
    time.sleep(0.5)
    logs = stack["log"].read_text()
    assert "router ready" in logs  # the capture works
    for key in (*KEYS, ENV_KEY, WRONG):
        assert key not in logs


def _verifier_info(stack, credentials) -> grpc.StatusCode:
    channel = grpc.secure_channel(stack["verifier"], credentials) if credentials \
        else grpc.insecure_channel(stack["verifier"])
    try:
        verifier_pb2_grpc.VerifierStub(channel).Info(verifier_pb2.InfoRequest(), timeout=10)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        channel.close()


def _speculator_stream(stack, credentials) -> grpc.StatusCode:
    """One SpeculateStream message and its answer."""
    channel = grpc.secure_channel(stack["speculator"], credentials) if credentials \
        else grpc.insecure_channel(stack["speculator"])
    message = speculator_pb2.SpeculateStreamRequest(step=1, items=[
        speculator_pb2.StreamItem(sequence_id="s", delta=[1, 42, 7])])
    try:
        replies = speculator_pb2_grpc.SpeculatorStub(channel).SpeculateStream(
            iter([message]), timeout=10)
        assert [r.step for r in replies] == [1]
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        channel.close()


@pytest.mark.parametrize("call", [_verifier_info, _speculator_stream],
                         ids=["verifier Info", "speculator SpeculateStream"])
def test_internal_services_accept_only_certificates_of_their_ca(stack, call):
    def read(name: str) -> bytes:
        return _read(stack[name])

    ca = read("ca")
    assert call(stack, grpc.ssl_channel_credentials(
        ca, read("key"), read("cert"))) == grpc.StatusCode.OK
    assert call(stack, None) == grpc.StatusCode.UNAVAILABLE  # plaintext
    assert call(stack, grpc.ssl_channel_credentials(ca)) == \
        grpc.StatusCode.UNAVAILABLE  # no client certificate
    assert call(stack, grpc.ssl_channel_credentials(
        ca, read("other_key"), read("other_cert"))) == grpc.StatusCode.UNAVAILABLE


# --- limits: just under passes, just over is refused naming the limit ---------------------

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("under,over,field", [
    ({"n": 2}, {"n": 4}, "n"),
    ({"stop": ["a", "b"]}, {"stop": ["a", "b", "c"]}, "stop"),
    ({"stop": ["12345678"]}, {"stop": ["123456789"]}, "stop[0]"),
    ({"max_tokens": 32}, {"max_tokens": 33}, "max_tokens"),
    ({"logprobs": 3}, {"logprobs": 4}, "logprobs"),
    ({"prompt": list(range(10, 74))}, {"prompt": list(range(10, 75))}, "prompt"),
])
def test_http_limits(stack, under, over, field):
    base = {"prompt": "Hello", "max_tokens": 2}
    status, out = _https(stack, "/v1/completions", {**base, **under})
    assert status == 200, out
    status, out = _https(stack, "/v1/completions", {**base, **over})
    assert status == 400 and out["error"]["param"] == field, out
    assert "--max-" in out["error"]["message"] or field == "n"


def test_chat_top_logprobs_limit(stack):
    base = {"messages": CHAT, "max_tokens": 2, "logprobs": True}
    assert _https(stack, "/v1/chat/completions", {**base, "top_logprobs": 3})[0] == 200
    status, out = _https(stack, "/v1/chat/completions", {**base, "top_logprobs": 4})
    assert status == 400 and out["error"]["param"] == "top_logprobs"


def test_body_size_limit_is_413(stack):
    padding = "x" * 3000
    assert _https(stack, "/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                             "user": padding})[0] == 200
    status, out = _https(stack, "/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                                    "user": padding * 2})
    assert status == 413 and out["error"]["param"] == "body", out


def test_streams_per_key_limit_is_429(stack):
    """n choices count as n streams of the key: 3 > --max-streams-per-key 2."""
    status, out = _https(stack, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "n": 3})
    assert status == 429 and "--max-streams-per-key" in out["error"]["message"], out


def test_grpc_limits(stack):
    with _client(stack) as c:
        assert len(c.generate(token_ids=list(range(10, 74)), max_tokens=32,
                              stop=["a", "12345678"], logprobs=3).token_ids) > 0
        for kwargs, field in (({"token_ids": list(range(10, 75))}, "prompt_token_ids"),
                              ({"max_tokens": 33}, "max_tokens"),
                              ({"stop": ["a", "b", "c"]}, "stop"),
                              ({"stop": ["123456789"]}, "stop[0]"),
                              ({"logprobs": 4}, "sampling.logprobs")):
            kwargs = {"prompt": "Hi", "max_tokens": 2, **kwargs}
            with pytest.raises(InvalidRequestError, match=field.replace("[", r"\[")):
                c.generate(**kwargs)
        with pytest.raises(OverloadedError):  # a request message past --max-body-bytes
            c.generate("x " * 3000, max_tokens=2)


# --- the pieces alone -------------------------------------------------------------------


def test_api_keys_from_flags_and_environment():
    keys = ApiKeys.from_flags(["a1", " a2 "], {"SPECINFER_API_KEY": "b1, ,b2"})
    assert len(keys) == 4 and keys.required
    for good in ("Bearer a1", "bearer a2", "Bearer  b2 "):
        assert keys.check(good).startswith("key-")
    assert keys.check("Bearer a1") != keys.check("Bearer b1")
    for bad in (None, "", "a1", "Basic a1", "Bearer", "Bearer a", "Bearer a1x"):
        with pytest.raises(Unauthenticated):
            keys.check(bad)
    assert not ApiKeys.from_flags([], {}).required
    assert ApiKeys.from_flags([], {}).check(None) == "-"


def test_key_streams_count_and_free():
    streams = KeyStreams(3)
    with streams.hold("k", 2):
        with streams.hold("k"), pytest.raises(ResourceExhausted, match="3"), \
                streams.hold("k"):
            pass
        with streams.hold("other", 3):
            pass
    assert not streams.live


def test_up_with_tls_and_a_key(tiny_chat_llm, tmp_path):
    """`specinfer up --tls --api-key K`: a throw-away CA, TLS on the public API, mutual TLS
    inside; the key reaches the router in its environment, not on any command line."""
    from services.stack import service_processes

    http = free_port()
    key = "sk-up-test-4242"
    out = tmp_path / "up.out"
    with open(out, "w") as stdout:
        up = start("up", "--llm", tiny_chat_llm, "--ssm", f"{tiny_chat_llm}#layers=1",
                   "--datastore", "none", "--draft-head", "none", "--slots", "4",
                   "--max-context", "512", "--http-port", str(http), "--tls", "--api-key", key,
                   "--speculation", "always", stdout=stdout)
    try:
        deadline = time.monotonic() + 240
        while "specinfer is serving" not in out.read_text():
            assert up.proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.5)
        line = out.read_text()
        assert "https://" in line
        ca = line.split("TLS CA ")[1].split()[0]
        with Client(up.addr, tls_ca=ca, api_key=key, retry_seconds=0) as c:
            spec = c.generate("The quick brown fox", max_tokens=12)
            plain = c.generate("The quick brown fox", max_tokens=12, speculation=False)
        assert spec.token_ids == plain.token_ids and spec.stats.speculative_steps > 0
        with Client(up.addr, tls_ca=ca, api_key="", retry_seconds=0) as c, \
                pytest.raises(AuthenticationError):
            c.generate("Hi", max_tokens=2)
        with Client(up.addr, retry_seconds=0, timeout=5) as c, \
                pytest.raises(Exception, match="UNAVAILABLE"):  # plaintext is refused
            c.generate("Hi", max_tokens=2)
        roles = service_processes(up.proc.pid)
        assert {r for r, _, _ in roles} == {"router", "speculator", "verifier"}
        for _, pid, _ in roles:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert key.encode() not in f.read()
    finally:
        assert up.stop(grace_s=60) == 0
