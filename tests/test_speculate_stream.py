"""``SpeculateStream``: the same trees as the unary ``Speculate`` for the same contexts, step
after step with accepted paths of every length, greedy and sampled, and after the stream is
dropped and opened again; its refusals; a router that drafts over it keeping greedy output
identical while its speculator is killed and restarted; and the router's streams following
the speculator pool as service discovery changes it."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from servers import Stack, service, stream_sessions

from specinfer.client import Client
from specinfer.v1 import common_pb2, speculator_pb2, speculator_pb2_grpc

pytestmark = pytest.mark.processes

GREEDY = common_pb2.SamplingParams()
SAMPLED = common_pb2.SamplingParams(temperature=0.8, seed=11)
TREE = speculator_pb2.TreeConfig(expansion=[1, 2, 1], max_nodes=32)


def same_tree(a: common_pb2.TokenTree, b: common_pb2.TokenTree) -> None:
    assert list(a.tokens) == list(b.tokens) and list(a.parents) == list(b.parents)
    for x, y in zip(a.drafts, b.drafts, strict=True):
        for dx, dy in zip(x.drafts, y.drafts, strict=True):
            assert (dx.source, dx.rank) == (dy.source, dy.rank)
            assert list(dx.proposal.token_ids) == list(dy.proposal.token_ids)
            assert list(dx.proposal.probs) == pytest.approx(list(dy.proposal.probs), abs=1e-4)


class Stream:
    """A SpeculateStream and what it holds, as the router keeps it."""

    def __init__(self, stub) -> None:
        self.call = stub.SpeculateStream()
        self.sent: dict[str, int] = {}
        self.step = 0

    async def speculate(self, contexts: dict[str, list[int]], sampling,
                        release=()) -> speculator_pb2.SpeculateStreamResponse:
        self.step += 1
        items = [speculator_pb2.StreamItem(
            sequence_id=sid, offset=self.sent.get(sid, 0), delta=ctx[self.sent.get(sid, 0):],
            sampling=sampling, tree=TREE) for sid, ctx in contexts.items()]
        await self.call.write(speculator_pb2.SpeculateStreamRequest(
            step=self.step, items=items, release=list(release)))
        reply = await self.call.read()
        assert reply.step == self.step
        self.sent |= {sid: len(ctx) for sid, ctx in contexts.items()}
        return reply


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_stream_and_unary_give_the_same_trees(tiny_speculator, sampling):
    rng = random.Random(3)

    async def run() -> int:
        async with grpc.aio.insecure_channel(tiny_speculator) as channel:
            stub = speculator_pb2_grpc.SpeculatorStub(channel)
            contexts = {"a": [rng.randrange(128) for _ in range(40)],
                        "b": [rng.randrange(128) for _ in range(7)]}
            stream, streams, deltas = Stream(stub), 1, set()
            for step in range(30):
                if step == 15:  # dropped and opened again: full contexts, same trees
                    stream.call.cancel()
                    stream, streams = Stream(stub), streams + 1
                got = await stream.speculate(contexts, sampling)
                # The unary call, under other ids (its own SSM caches).
                want = await stub.Speculate(speculator_pb2.SpeculateRequest(items=[
                    speculator_pb2.SpeculateItem(sequence_id="unary-" + sid, context=ctx,
                                                 sampling=sampling, tree=TREE)
                    for sid, ctx in contexts.items()]), timeout=30)
                for g, w in zip(got.results, want.results, strict=True):
                    assert len(g.tree.tokens) > 0
                    same_tree(g.tree, w.tree)
                # The verifier accepts 0-4 tokens of the tree, plus its own next token.
                for ctx in contexts.values():
                    accepted = rng.randrange(5)
                    ctx += [rng.randrange(128) for _ in range(accepted + 1)]
                    deltas.add(accepted + 1)
            stream.call.cancel()
            assert deltas == {1, 2, 3, 4, 5}
            return streams

    assert asyncio.run(run()) == 2


def test_stream_refusals_name_the_field(tiny_speculator):
    async def refused(messages: list[speculator_pb2.SpeculateStreamRequest]):
        async with grpc.aio.insecure_channel(tiny_speculator) as channel:
            call = speculator_pb2_grpc.SpeculatorStub(channel).SpeculateStream()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                for m in messages:
                    await call.write(m)
                    reply = await call.read()
                    assert reply.step == m.step
            return err.value

    def item(sid: str, offset: int, delta: list[int]) -> speculator_pb2.StreamItem:
        return speculator_pb2.StreamItem(sequence_id=sid, offset=offset, delta=delta,
                                         sampling=GREEDY, tree=TREE)

    first = speculator_pb2.SpeculateStreamRequest(step=1, items=[item("s", 0, [1, 2, 3])])
    # An offset the stream does not hold: resend from the start.
    err = asyncio.run(refused([first, speculator_pb2.SpeculateStreamRequest(
        step=2, items=[item("s", 5, [4])])]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "items[0].offset" in err.details() and "holds 3 tokens" in err.details()
    # A released sequence is gone.
    err = asyncio.run(refused([first, speculator_pb2.SpeculateStreamRequest(
        step=2, items=[item("s", 3, [4])], release=["s"])]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    # A token outside the vocabulary, an empty context, a sequence twice.
    for bad, field in [(item("s", 0, [1, 999]), "items[0].context"),
                       (item("s", 0, []), "items[0].context")]:
        err = asyncio.run(refused([speculator_pb2.SpeculateStreamRequest(step=1, items=[bad])]))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details()
    err = asyncio.run(refused([speculator_pb2.SpeculateStreamRequest(
        step=1, items=[item("s", 0, [1]), item("s", 0, [2])])]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "items[1].sequence_id" in \
        err.details()


def test_the_ssm_feeds_only_the_accepted_delta(tiny_llama):
    """Each step an SSM drafts from its cached KV plus the tokens accepted since (its tree
    nodes' KV is overwritten by them), and its trees equal a cold SSM's."""
    from specinfer.drafting import DraftRequest
    from specinfer.drafting.ssm import SSMDrafter
    from specinfer.models import load_ssm

    def drafter() -> SSMDrafter:
        return SSMDrafter(load_ssm(tiny_llama)[0], 0, slots=2, max_context=256)

    warm, fed = drafter(), []
    catch_up = warm._catch_up

    def counting(slots, feeds, starts, features=None):
        fed.append([len(f) for f in feeds])
        return catch_up(slots, feeds, starts, features)

    warm._catch_up = counting
    rng = random.Random(5)
    context = [rng.randrange(128) for _ in range(50)]
    new = len(context)  # tokens the SSM has not seen: all of them at first
    for step in range(8):
        tree = warm.propose([DraftRequest("s", list(context), [2, 1, 1])])[0]
        assert fed[-1] == [new], fed
        cold = drafter().propose([DraftRequest("s", list(context), [2, 1, 1])])[0]
        assert tree.tokens == cold.tokens and tree.parents == cold.parents
        new = step % 4 + 1  # an accepted path of 0-3 tokens and the bonus token
        context += [rng.randrange(128) for _ in range(new)]


PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Paris is the capital of", "1, 2, 3,"]


def test_router_over_the_stream_survives_a_speculator_restart(tiny_chat_llm):
    """Greedy output is identical with the stream, while its speculator is killed
    mid-traffic (steps decode without it), and after a new one takes its address (a new
    stream, from full contexts)."""
    with Stack() as stack:
        verifier = stack.start("verifier", "--llm", tiny_chat_llm, "--threads", "1",
                               "--datastore", "none")
        speculator_args = ("--llm", tiny_chat_llm, "--ssm", tiny_chat_llm, "--datastore",
                           "none", "--threads", "1")
        speculator = stack.start("speculator", *speculator_args).wait()
        addr = stack.router(tiny_chat_llm, [verifier], "--http-port", "0", "--speculation",
                            "always", speculators=(speculator,)).addr
        with Client(addr) as c:
            reference = {p: c.generate(p, max_tokens=48, speculation=False).token_ids
                         for p in PROMPTS}
            for p in PROMPTS:  # over the stream
                assert c.generate(p, max_tokens=48).token_ids == reference[p]

        async def kill_mid_traffic():
            started = asyncio.Event()
            task = asyncio.create_task(stream_sessions(addr, PROMPTS, PROMPTS, 48, started,
                                                       len(PROMPTS)))
            await asyncio.wait_for(started.wait(), 60)
            speculator.proc.kill()
            return await task

        for prompt, ids in asyncio.run(kill_mid_traffic()):
            assert ids == reference[prompt]
        speculator.proc.wait()
        stack.start("speculator", *speculator_args, port=speculator.port).wait()
        with Client(addr) as c:
            for p in PROMPTS:
                assert c.generate(p, max_tokens=48).token_ids == reference[p]


def test_streams_open_and_close_as_discovery_changes_the_pool(tiny_llama, tiny_speculator):
    """The router's pool as service discovery changes it: a replica that leaves has its
    stream cancelled; the sequences' next step goes to another replica over a new stream
    from full contexts, with the trees its unary Speculate gives; a replica that comes back
    starts with an empty stream."""
    with service("speculator", "--llm", tiny_llama, "--ssm", tiny_llama, "--max-nodes", "32",
                 "--max-context", "512", "--threads", "1") as (other, _):
        asyncio.run(_follow_the_pool(tiny_speculator, other))


async def _follow_the_pool(a: str, b: str) -> None:
    from services.router.drafting import SpeculatorPool
    from services.router.metrics import RouterMetrics
    from services.router.policy import SpeculatorPlan
    from services.router.request import GenRequest, Replica
    from specinfer.sampling import SamplingParams

    pool = SpeculatorPool([a], RouterMetrics("m"), stream=True)
    await pool.await_serving(60)
    plan = SpeculatorPlan(TREE.max_nodes, tuple(TREE.expansion))
    reqs = [GenRequest(list(range(3, 3 + n)), 64, SamplingParams()) for n in (5, 9)]
    for r in reqs:
        r.replica = Replica("verifier", None, None, max_tree_nodes=32, max_context=512)
    channels = {addr: grpc.aio.insecure_channel(addr) for addr in (a, b)}

    async def step_on(addr: str) -> dict[str, int]:
        """One step's trees from the pool, checked against ``addr``'s unary call; returns
        the histories' lengths it drafted for."""
        drafted_for = {r.id: len(r.history) for r in reqs}
        trees = await pool.speculate(reqs, [plan] * len(reqs), "tree")
        unary = await speculator_pb2_grpc.SpeculatorStub(channels[addr]).Speculate(
            speculator_pb2.SpeculateRequest(items=[speculator_pb2.SpeculateItem(
                sequence_id=r.id, context=r.history, sampling=GREEDY, tree=TREE)
                for r in reqs]), timeout=30)
        assert set(trees) == {r.id for r in reqs}
        for res in unary.results:
            same_tree(trees[res.sequence_id], res.tree)
        for k, r in enumerate(reqs):  # accepted paths of different lengths
            r.generated += [7 + k] * (k + 1)
        return drafted_for

    try:
        for _ in range(3):
            await step_on(a)
        stream_a = pool.members[a].stream
        call_a = stream_a.call
        assert stream_a.step == 3 and call_a is not None
        pool.update(frozenset({b}))  # a leaves, b joins
        assert a not in pool.members and stream_a.call is None
        await asyncio.sleep(0.1)
        assert call_a.done() and call_a.cancelled()
        await pool.await_serving(60)
        drafted_for = await step_on(b)
        stream_b = pool.members[b].stream
        assert stream_b.step == 1  # a new stream, full contexts: the trees matched above
        assert stream_b.sent == drafted_for
        await step_on(b)  # and deltas from then on
        assert stream_b.step == 2
        pool.update(frozenset({a, b}))  # a is back: a fresh member, nothing held for it
        assert pool.members[a].stream is not stream_a and not pool.members[a].stream.sent
        assert pool.members[a].stream.call is None
    finally:
        await pool.close()
        for channel in channels.values():
            await channel.close()
