"""Tensor parallel (DeepSpeed AutoTP), pipeline parallel, and both together give the same
greedy tokens as a single process (tiny random Llama, rank processes on gloo), also with
the pipeline stages started as separate commands; a lost stage fails fast."""

import os
import signal
import time

import grpc
import pytest
import servers
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from servers import free_port, service

from services.verifier.engine import EngineConfig
from services.verifier.executor import Executor, ForwardArgs
from services.verifier.factory import build_engine
from services.verifier.local import generate_local
from services.verifier.parallel import layer_range, rendezvous_from
from specinfer.models import ModelError
from specinfer.tree import TokenTree
from specinfer.v1 import verifier_pb2, verifier_pb2_grpc

pytestmark = pytest.mark.processes


def run(model_dir: str, tp: int, pp: int):
    engine = build_engine(model_dir, EngineConfig(max_context=128, slots=4), tp=tp, pp=pp,
                          micro_batches=2)
    executor = engine.executor
    assert isinstance(executor, Executor) and executor.healthy
    assert (executor.tp, executor.pp) == (tp, pp)
    try:
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (5, 11, 8)]

        def trees(histories):  # fixed-shape trees, so verification runs the tree path
            return [TokenTree.chain([h[-1], h[-2]]) for h in histories]

        spec = generate_local(engine, prompts, 12, trees=trees)
        plain = generate_local(engine, prompts, 12)
        if tp * pp > 1:  # features stay on their ranks: refused before any rank is asked
            with pytest.raises(ValueError, match="tp = pp = 1"):
                executor.forward(ForwardArgs(torch.tensor([[1]]), torch.tensor([[0]]),
                                             torch.tensor([0]), torch.tensor([0]), None,
                                             features=True))
            assert executor.features is None
        tokens = [r.token_ids for r in spec], [r.token_ids for r in plain]
    finally:
        executor.close()
    # A closed parallel executor serves no more calls; the local one loses nothing.
    assert executor.healthy == (tp * pp == 1)
    return tokens


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return run(tiny_llama, 1, 1)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_parallel_matches_single_process(tiny_llama, reference, tp, pp):
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    before = {k: os.environ.get(k) for k in keys}
    assert run(tiny_llama, tp, pp) == reference
    # The rendezvous environment is not left behind for services this process starts.
    assert {k: os.environ.get(k) for k in keys} == before


def test_layer_ranges_cover_every_layer_once():
    for layers in (1, 4, 30, 31):
        for pp in range(1, min(layers, 5) + 1):
            ranges = [layer_range(layers, pp, s) for s in range(pp)]
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
            assert all(hi > lo for lo, hi in ranges)


def test_stages_started_as_separate_commands(tiny_llama, reference):
    """TP 2 x PP 2 with stage 1 started by its own command, both stages meeting through
    the environment (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, RANK counting nodes): the
    same greedy tokens as one process; killing stage 1 makes the verifier answer
    UNAVAILABLE and report NOT_SERVING within seconds, and its stage-0 peer rank exit."""
    port = free_port()
    meet = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    layout = ["--llm", tiny_llama, "--tp", "2", "--pp", "2", "--rank-timeout", "10",
              "--datastore", "none", "--draft-head", "none"]
    stage1 = servers.start("verifier", *layout, env={**meet, "RANK": "1"},
                           start_new_session=True).proc
    try:
        with service("verifier", *layout, "--slots", "4", "--max-context", "128",
                     env={**meet, "RANK": "0"}) as (addr, _):
            channel = grpc.insecure_channel(addr)
            stub = verifier_pb2_grpc.VerifierStub(channel)
            gen = torch.Generator().manual_seed(3)
            prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (5, 11, 8)]
            ids = [f"s{i}" for i in range(3)]
            first = stub.Prefill(verifier_pb2.PrefillRequest(items=[
                verifier_pb2.PrefillItem(sequence_id=s, token_ids=p)
                for s, p in zip(ids, prompts, strict=True)]), timeout=60)
            tokens = [[r.token] for r in first.results]
            for _ in range(11):
                out = stub.Step(verifier_pb2.StepRequest(items=[
                    verifier_pb2.StepItem(sequence_id=s, root_token=t[-1])
                    for s, t in zip(ids, tokens, strict=True)]), timeout=60)
                for t, r in zip(tokens, out.results, strict=True):
                    t.extend(r.tokens)
            assert tokens == reference[1]  # plain decoding in one process

            os.killpg(stage1.pid, signal.SIGKILL)
            stage1.wait()
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                stub.Step(verifier_pb2.StepRequest(items=[
                    verifier_pb2.StepItem(sequence_id=s, root_token=t[-1])
                    for s, t in zip(ids, tokens, strict=True)]), timeout=60)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "lost a rank" in err.value.details()
            assert time.monotonic() - start < 15
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 5
            while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                    health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "still SERVING after losing a stage"
                time.sleep(0.2)
    finally:
        if stage1.poll() is None:
            os.killpg(stage1.pid, signal.SIGKILL)


def test_rendezvous_from_flags_and_environment():
    assert rendezvous_from(None, None, None, 2, environ={}) is None
    assert rendezvous_from(None, None, None, 2, environ={"MASTER_ADDR": "h"}) is None
    lws = {"LWS_LEADER_ADDRESS": "verifier-0.verifier", "LWS_WORKER_INDEX": "1",
           "LWS_GROUP_SIZE": "2", "RANK": "7"}
    meet = rendezvous_from(None, None, None, 2, environ=lws)
    assert (meet.master_addr, meet.master_port, meet.node_rank) == ("verifier-0.verifier",
                                                                    29500, 1)
    env = {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "4000", "RANK": "0", "WORLD_SIZE": "3"}
    meet = rendezvous_from(None, None, None, 3, environ=env)
    assert (meet.master_addr, meet.master_port, meet.node_rank) == ("10.0.0.5", 4000, 0)
    meet = rendezvous_from(2, "other", 5000, 3, environ=env)  # flags win
    assert (meet.master_addr, meet.master_port, meet.node_rank) == ("other", 5000, 2)
    for args, env, message in [
        ((1, None, None, 2), {}, "--master-addr"),
        ((None, "h", None, 2), {}, "--node-rank"),
        ((None, None, None, 2), {**lws, "LWS_GROUP_SIZE": "3"}, "LWS_GROUP_SIZE=3"),
        ((2, "h", None, 2), {}, "--node-rank must be in 0..1"),
    ]:
        with pytest.raises(ModelError, match=message):
            rendezvous_from(*args, environ=env)
