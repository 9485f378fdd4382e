"""Fuzzing every RPC of the three gRPC services (Router Generate/GenerateStream,
Speculator Speculate/SpeculateStream, Verifier Prefill/Step/Release/Info) as real
processes (tiny random Llama over SmolLM2's tokenizer), with hypothesis. Each call sends one
of: random bytes; a valid request; a message with random field values, built from the
message's descriptor (integers at their extremes, floats incl. NaN and infinities, huge
repeated fields and strings, nested messages); or a valid request's serialization, mutated
(bit flips, truncation, inserted, deleted or duplicated bytes); a request stream sends 1-3
of them. No call may answer INTERNAL or UNKNOWN (a server failure) or time out, every
process must stay up, and afterwards good requests still answer correctly and no fuzzed
sequence holds a verifier slot.
``SPECINFER_FUZZ_EXAMPLES`` raises the examples per RPC (``make fuzz``).

The verifier trusts its router for sequence ids, so the fuzzed verifier is a process of its
own (not the router's), and every sequence a fuzzed Prefill may have created is released
right after the call."""

from __future__ import annotations

import math
import os

import grpc
import pytest
from google.protobuf import descriptor, message_factory
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from specinfer.client import Client
from specinfer.v1 import (
    common_pb2,
    router_pb2,
    speculator_pb2,
    verifier_pb2,
    verifier_pb2_grpc,
)

pytestmark = pytest.mark.processes

EXAMPLES = int(os.environ.get("SPECINFER_FUZZ_EXAMPLES", "100"))
MAX_CONTEXT = 96  # keeps every generation short, whatever max_tokens says
TIMEOUT_S = 30.0  # any call past this is a hang
LIVE = ("live-0", "live-1")  # the fuzzed verifier's sequences the test keeps alive
# What each call sends; valid requests too, so that calls also succeed and move state.
KINDS = ["bytes", "message", "message", "mutated", "mutated", "valid"]
FAILURES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
            grpc.StatusCode.DEADLINE_EXCEEDED}

SERVICES = {"router": router_pb2.DESCRIPTOR.services_by_name["Router"],
            "speculator": speculator_pb2.DESCRIPTOR.services_by_name["Speculator"],
            "verifier": verifier_pb2.DESCRIPTOR.services_by_name["Verifier"]}
METHODS = [(role, m) for role, service in SERVICES.items() for m in service.methods]


@pytest.fixture(scope="module")
def stack(processes, tiny_chat_llm):
    """Router (with its own verifier and the speculator) and a second verifier to fuzz."""
    verifier = ("--llm", tiny_chat_llm, "--max-context", str(MAX_CONTEXT), "--threads", "1",
                "--datastore", "none", "--draft-head", "none")
    services = {
        "verifier": processes.start("verifier", *verifier, "--slots", "8"),
        "fuzzed": processes.start("verifier", *verifier, "--slots", "4"),
        "speculator": processes.start("speculator", "--llm", tiny_chat_llm, "--ssm",
                                      f"{tiny_chat_llm}#layers=1", "--max-context",
                                      str(MAX_CONTEXT), "--threads", "1", "--datastore",
                                      "none"),
    }
    services["router"] = processes.router(
        tiny_chat_llm, [services["verifier"]], "--http-port", "0", "--speculation", "always",
        "--spec-max-batch", "64", speculators=(services["speculator"],))
    for name in ("fuzzed", "speculator"):
        services[name].wait()
    return {"addrs": {k: s.addr for k, s in services.items()},
            "procs": {k: s.proc for k, s in services.items()}}


# --- random messages from descriptors -------------------------------------------------

F = descriptor.FieldDescriptor
INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1), F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}
SPECIAL_FLOATS = [0.0, -0.0, 1.0, 0.5, -1.0, 2.0, 1e-45, 3.4e38, -3.4e38, math.inf,
                  -math.inf, math.nan]


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({lo, hi, 0, 1, max(lo, -1), hi // 2 + 1, min(hi, 2**31), max(lo, -(2**31))})
    # Small values (token ids, node counts, indices) reach past the first checks.
    return st.one_of(st.sampled_from(edges), st.integers(0, 300), st.integers(lo, hi))


def _texts() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(["", *LIVE, "fz-0", "user", "assistant", "system"]),
                     st.text(max_size=24),
                     st.builds(lambda s, n: s * n, st.text(min_size=1, max_size=3),
                               st.integers(1000, 100_000)))


def _scalar(field: descriptor.FieldDescriptor) -> st.SearchStrategy:
    if field.type in INT_RANGES:
        return _integers(*INT_RANGES[field.type])
    if field.type == F.TYPE_FLOAT:
        return st.one_of(st.sampled_from(SPECIAL_FLOATS), st.floats(width=32))
    if field.type == F.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(SPECIAL_FLOATS), st.floats())
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_STRING:
        return _texts()
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == F.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]),
                         _integers(-(2**31), 2**31 - 1))
    raise NotImplementedError(field.type)


LIST_BYTES = 8 << 20  # a huge repeated field: up to ~8 MiB (past gRPC's 4 MiB limit)


def _size(value) -> int:
    if isinstance(value, str):
        return len(value.encode()) + 2
    return value.ByteSize() + 2 if hasattr(value, "ByteSize") else 10


@st.composite
def _many(draw, element: st.SearchStrategy, big: int) -> list:
    """A few elements, or sometimes the first one repeated up to ``big`` times (and
    ``LIST_BYTES`` in all: the copies of nested huge fields would multiply)."""
    values = draw(st.lists(element, max_size=6))
    repeat = draw(st.integers(100, big)) if draw(st.integers(0, 3)) == 0 else 0
    if values and repeat:
        values = [values[0]] * max(1, min(repeat, LIST_BYTES // _size(values[0])))
    return values


def _is_map(field: descriptor.FieldDescriptor) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


@st.composite
def messages(draw, desc: descriptor.Descriptor, depth: int = 0):
    """A message of type ``desc`` with random fields set (one member of each oneof)."""
    msg = message_factory.GetMessageClass(desc)()
    chosen = set()
    for oneof in desc.oneofs:
        if len(oneof.fields) == 1 and oneof.name == "_" + oneof.fields[0].name:
            chosen.add(oneof.fields[0].name)  # proto3 optional: set or not, below
        else:
            chosen.add(draw(st.sampled_from([f.name for f in oneof.fields] + [""])))
    for field in desc.fields:
        if field.containing_oneof is not None and field.name not in chosen:
            continue
        if (field.type == F.TYPE_MESSAGE and depth >= 4) or not draw(st.booleans()):
            continue
        if _is_map(field):
            key, value = (field.message_type.fields_by_name[n] for n in ("key", "value"))
            entries = draw(st.one_of(
                st.dictionaries(_scalar(key), _scalar(value), max_size=6),
                st.builds(lambda n, v, text=key.type == F.TYPE_STRING:
                          {(f"k{i}" if text else i): v for i in range(n)},
                          st.integers(100, 5000), _scalar(value))))
            getattr(msg, field.name).update(entries)
        elif field.type == F.TYPE_MESSAGE:
            element = messages(field.message_type, depth + 1)
            if field.is_repeated:
                getattr(msg, field.name).extend(draw(_many(element, 300)))
            else:
                getattr(msg, field.name).CopyFrom(draw(element))
        elif field.is_repeated:
            getattr(msg, field.name).extend(draw(_many(_scalar(field), 20_000)))
        else:
            setattr(msg, field.name, draw(_scalar(field)))
    return msg


# --- valid requests, and mutations of their bytes -------------------------------------


class Live:
    """The fuzzed verifier's sequences the test keeps alive: each one's last token (the
    root the next Step must name) and cached tokens."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = verifier_pb2_grpc.VerifierStub(channel)
        self.roots: dict[str, int] = {}
        self.cached: dict[str, int] = {}

    def ensure(self) -> None:
        """Every LIVE sequence prefilled, with room left to verify a tree."""
        for sid in LIVE:
            if sid in self.roots and self.cached[sid] < MAX_CONTEXT - 40:
                continue
            self.stub.Release(verifier_pb2.ReleaseRequest(sequence_ids=[sid]), timeout=10)
            out = self.stub.Prefill(verifier_pb2.PrefillRequest(items=[verifier_pb2.PrefillItem(
                sequence_id=sid, token_ids=[1, 42, 7, 42, 7])]), timeout=10)
            self.roots[sid], self.cached[sid] = out.results[0].token, 5

    def update(self, method: str, request: bytes, response: bytes) -> None:
        """Follow a successful call's effect on the LIVE sequences."""
        if method == "Release":
            for sid in verifier_pb2.ReleaseRequest.FromString(request).sequence_ids:
                self.roots.pop(sid, None)
        elif method == "Prefill":  # a fuzzed prompt: start it again (ensure)
            for r in verifier_pb2.PrefillResponse.FromString(response).results:
                if r.sequence_id in LIVE:
                    self.roots[r.sequence_id], self.cached[r.sequence_id] = r.token, MAX_CONTEXT
        elif method == "Step":
            for r in verifier_pb2.StepResponse.FromString(response).results:
                if r.sequence_id in LIVE:
                    self.roots[r.sequence_id] = r.tokens[-1]
                    self.cached[r.sequence_id] = r.cached_tokens

    def release_others(self, request: bytes) -> None:
        """Free what a Prefill request may have created, but the LIVE sequences."""
        try:
            items = verifier_pb2.PrefillRequest.FromString(request).items
        except Exception:  # not a PrefillRequest: the verifier created nothing either
            return
        ids = list({i.sequence_id for i in items} - set(LIVE))
        for start in range(0, len(ids), 1000):
            self.stub.Release(verifier_pb2.ReleaseRequest(sequence_ids=ids[start:start + 1000]),
                              timeout=10)


def _sampling(draw) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(temperature=draw(st.sampled_from([0.0, 0.7])),
                                       top_k=draw(st.sampled_from([0, 5])))
    if draw(st.booleans()):
        params.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        params.logprobs = draw(st.integers(0, 3))
    return params


# Constraints a valid request may carry (their mutations reach the compilers too).
CONSTRAINTS = [common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=["yes", "no"])),
               common_pb2.Constraint(regex="[a-c]{1,5}"),
               common_pb2.Constraint(json_object=True),
               common_pb2.Constraint(json_schema='{"type": "object", "properties": '
                                     '{"x": {"type": "integer"}}, "required": ["x"]}')]


@st.composite
def valid_requests(draw, method: str, live: Live):
    """A request the service accepts (for the LIVE sequences as they are now)."""
    tokens = draw(st.lists(st.integers(0, 300), min_size=1, max_size=12))
    if method in ("Generate", "GenerateStream"):
        req = router_pb2.GenerateRequest(max_tokens=draw(st.integers(1, 8)),
                                         sampling=_sampling(draw))
        kind = draw(st.sampled_from(["prompt", "ids", "chat"]))
        if kind == "prompt":
            req.prompt = draw(st.text(min_size=1, max_size=20))
        elif kind == "ids":
            req.prompt_token_ids.ids.extend(tokens)
        else:
            req.chat.messages.add(role="user", content=draw(st.text(max_size=20)))
        if draw(st.booleans()):
            req.constraint.CopyFrom(draw(st.sampled_from(CONSTRAINTS)))
        elif kind == "chat" and draw(st.booleans()):
            req.tools.add(name="f", parameters='{"type": "object", "properties": '
                          '{"x": {"type": "integer"}}}')
            req.tool_choice.mode = draw(st.sampled_from(["auto", "required", "none"]))
        return req
    if method == "Speculate":
        return speculator_pb2.SpeculateRequest(items=[speculator_pb2.SpeculateItem(
            sequence_id="s", context=tokens, sampling=_sampling(draw),
            tree=speculator_pb2.TreeConfig(expansion=[2, 1], max_nodes=8,
                                           dynamic=draw(st.booleans())))])
    if method == "SpeculateStream":  # a first message (offset 0) is valid in any position
        return speculator_pb2.SpeculateStreamRequest(
            step=draw(st.integers(0, 9)), release=draw(st.lists(st.sampled_from("st"))),
            items=[speculator_pb2.StreamItem(
                sequence_id="s", offset=0, delta=tokens, sampling=_sampling(draw),
                tree=speculator_pb2.TreeConfig(expansion=[2, 1], max_nodes=8,
                                               dynamic=draw(st.booleans())))])
    if method == "Prefill":
        item = verifier_pb2.PrefillItem(sequence_id="fz-0", token_ids=tokens,
                                        sampling=_sampling(draw))
        if draw(st.booleans()):
            item.constraint.CopyFrom(draw(st.sampled_from(CONSTRAINTS)))
        return verifier_pb2.PrefillRequest(items=[item])
    sid = draw(st.sampled_from(LIVE))
    root = live.roots.get(sid, 0)
    if method == "Step":  # a plain row, a sent tree, own drafts, or a tree and own drafts
        item = verifier_pb2.StepItem(sequence_id=sid, root_token=root)
        if draw(st.booleans()):
            item.tree.tokens.extend([tokens[0], tokens[0] + 1, 5][:3])
            item.tree.parents.extend([-1, -1, 0])
        if draw(st.booleans()):
            item.draft.sources.append("model_free")
            item.draft.max_nodes = draw(st.integers(3, 8))
        if draw(st.booleans()):
            item.shadow.sources.append("model_free")
            item.shadow.max_nodes = draw(st.integers(0, 4))
        return verifier_pb2.StepRequest(items=[item])
    if method == "Release":
        return verifier_pb2.ReleaseRequest(sequence_ids=["fz-0", "nobody"])
    return verifier_pb2.InfoRequest()


@st.composite
def mutated(draw, base: bytes) -> bytes:
    """``base`` with 1-4 random edits: bit flips, truncation, inserted, deleted or
    duplicated bytes, a byte overwritten. Every edit draws the same values whatever the
    bytes (whose length follows the LIVE state), so hypothesis can replay it."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        edit = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "repeat",
                                     "byte"]))
        at, extra = draw(st.integers(0, 2**16)), draw(st.binary(min_size=1, max_size=8))
        at %= max(1, len(data))
        if edit == "insert" or not data:
            data[at:at] = extra
        elif edit == "flip":
            data[at] ^= 1 << (extra[0] % 8)
        elif edit == "truncate":
            del data[at:]
        elif edit == "delete":
            del data[at:at + len(extra)]
        elif edit == "repeat":
            data += data[at:]
        else:
            data[at] = extra[0]
    return bytes(data)


# --- the fuzzing ----------------------------------------------------------------------


def _invoke(channel: grpc.Channel, path: str, method: descriptor.MethodDescriptor,
            payloads: list[bytes]) -> tuple[grpc.StatusCode, bytes, str]:
    """Send raw bytes (one message, or each of ``payloads`` on a request stream); returns
    the status, the (last) response's bytes and the details."""
    payload = payloads[0]
    try:
        if method.client_streaming:
            responses = list(channel.stream_stream(path)(iter(payloads), timeout=TIMEOUT_S))
            return grpc.StatusCode.OK, responses[-1] if responses else b"", ""
        if method.server_streaming:
            responses = list(channel.unary_stream(path)(payload, timeout=TIMEOUT_S))
            return grpc.StatusCode.OK, responses[-1] if responses else b"", ""
        return grpc.StatusCode.OK, channel.unary_unary(path)(payload, timeout=TIMEOUT_S), ""
    except grpc.RpcError as exc:
        return exc.code(), b"", exc.details() or ""


@pytest.mark.parametrize("role,method", METHODS, ids=lambda x: getattr(x, "name", x))
def test_fuzz_rpc(stack, role, method):
    addr = stack["addrs"]["fuzzed" if role == "verifier" else role]
    path = f"/{method.containing_service.full_name}/{method.name}"
    codes: dict[str, int] = {}
    with grpc.insecure_channel(addr) as channel:
        live = Live(channel) if role == "verifier" else None

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.filter_too_much])
        @given(data=st.data())
        def fuzz(data):
            if live is not None:
                live.ensure()
            payloads = []
            for _ in range(data.draw(st.integers(1, 3)) if method.client_streaming else 1):
                kind = data.draw(st.sampled_from(KINDS), label="kind")
                if kind == "bytes":
                    payload = data.draw(st.binary(max_size=512), label="payload")
                elif kind == "message":
                    payload = data.draw(messages(method.input_type)).SerializeToString()
                else:
                    payload = data.draw(valid_requests(method.name, live)).SerializeToString()
                    if kind == "mutated":
                        payload = data.draw(mutated(payload), label="payload")
                payloads.append(payload)
            payload = payloads[0]
            code, response, details = _invoke(channel, path, method, payloads)
            codes[code.name] = codes.get(code.name, 0) + 1
            note(f"{code.name}: {details[:300]}")
            if live is not None:
                if method.name == "Prefill":
                    live.release_others(payload)
                if code == grpc.StatusCode.OK:
                    live.update(method.name, payload, response)
            assert code not in FAILURES, f"{method.name} answered {code.name}: {details[:500]}"
            # An error says what was wrong; one too long for gRPC's metadata loses its code.
            assert code == grpc.StatusCode.OK or details, f"{code.name} without a message"
            assert "metadata size" not in details, f"the status was lost: {details[:500]}"
            for name, proc in stack["procs"].items():
                assert proc.poll() is None, f"the {name} exited with {proc.returncode}"

        fuzz()
        if live is not None:
            live.stub.Release(verifier_pb2.ReleaseRequest(sequence_ids=list(LIVE)), timeout=10)
    print(f"{method.name}: {codes}")


def test_good_requests_still_answer_correctly_after_fuzzing(stack):
    addrs = stack["addrs"]
    with Client(addrs["router"]) as client:
        for prompt in ("The quick brown fox", "def fibonacci(n):"):
            fast = client.generate(prompt, max_tokens=24)
            plain = client.generate(prompt, max_tokens=24, speculation=False)
            assert fast.token_ids == plain.token_ids and len(fast.token_ids) == 24
    with grpc.insecure_channel(addrs["fuzzed"]) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        # Every sequence a fuzzed call created has been freed: all four slots admit again.
        assert stub.Info(verifier_pb2.InfoRequest(), timeout=10).live_sequences == 0
        items = [verifier_pb2.PrefillItem(sequence_id=f"after-{i}", token_ids=[1, 2, 3])
                 for i in range(4)]
        assert len(stub.Prefill(verifier_pb2.PrefillRequest(items=items), timeout=10)
                   .results) == 4
        stub.Release(verifier_pb2.ReleaseRequest(sequence_ids=[i.sequence_id for i in items]),
                     timeout=10)
    with grpc.insecure_channel(addrs["speculator"]) as channel:
        out = channel.unary_unary(
            "/specinfer.v1.Speculator/Speculate",
            request_serializer=speculator_pb2.SpeculateRequest.SerializeToString,
            response_deserializer=speculator_pb2.SpeculateResponse.FromString)(
            speculator_pb2.SpeculateRequest(items=[speculator_pb2.SpeculateItem(
                sequence_id="after", context=[1, 42, 7])]), timeout=10)
        assert len(out.results[0].tree.tokens) > 0
    for name, proc in stack["procs"].items():
        assert proc.poll() is None, name
