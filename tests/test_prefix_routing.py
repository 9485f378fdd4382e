"""Prefix- and load-aware routing (services/router/prefix_routing.py) on replicas as the
router keeps them: a prompt goes where its prefix is believed cached unless that replica
is loaded past the margin; without a prefix, to the least loaded; the index is bounded,
salted, and cleared when a replica comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.router.prefix_routing import ReplicaPrefixes, choose

SYSTEM = list(range(100, 164))  # four blocks of 16


@dataclass
class FakeReplica:
    address: str
    live: int = 0
    capacity: int = 8
    prefixes: ReplicaPrefixes = field(default_factory=lambda: ReplicaPrefixes(16, 1000))


def test_a_prompt_goes_where_its_prefix_is_unless_that_replica_is_overloaded():
    a, b = FakeReplica("a"), FakeReplica("b")
    a.prefixes.learn(SYSTEM + [1, 2], "")
    assert a.prefixes.matched(SYSTEM + [7], "") == 64
    assert a.prefixes.matched(SYSTEM[:40] + [7] * 30, "") == 32
    assert b.prefixes.matched(SYSTEM + [7], "") == 0
    replica, why, held = choose([a, b], SYSTEM + [7, 8], "", "r1", margin=0.25)
    assert (replica, why, held) == (a, "prefix", 64)
    a.live = 2  # 0.25 above b: still within the margin
    assert choose([a, b], SYSTEM + [7], "", "r2", margin=0.25)[:2] == (a, "prefix")
    a.live = 3  # past it: the least loaded
    assert choose([a, b], SYSTEM + [7], "", "r3", margin=0.25)[:2] == (b, "load")
    # Another tenant's salt shares nothing: load decides.
    a.live = 1
    assert choose([a, b], SYSTEM + [7], "tenant", "r4", margin=0.25)[:2] == (b, "load")


def test_without_a_prefix_equal_replicas_share_the_work():
    replicas = [FakeReplica(f"r{i}") for i in range(3)]
    chosen = {choose(replicas, [1, 2, 3], "", f"req-{k}", 0.25)[0].address for k in range(30)}
    assert chosen == {"r0", "r1", "r2"}


def test_the_index_is_bounded_and_cleared():
    prefixes = ReplicaPrefixes(16, capacity_blocks=4)
    prefixes.learn(SYSTEM, "")
    prefixes.learn(list(range(500, 532)), "")  # two more blocks: the oldest two go
    assert len(prefixes.blocks) == 4
    assert prefixes.matched(SYSTEM + [1], "") == 0  # its first block went first
    assert prefixes.matched(list(range(500, 532)) + [1], "") == 32
    prefixes.clear()
    assert prefixes.matched(list(range(500, 532)) + [1], "") == 0
    assert ReplicaPrefixes().matched(SYSTEM + [1], "") == 0  # caching off there


def test_the_router_picks_the_holder_and_forgets_a_replica_discovery_removed():
    """Through ReplicaSet.pick: a prompt goes to the replica its prefix was sent to (the
    router learns it at pick time); once discovery drops that replica, it and its index
    are gone and the next such prompt goes by load."""
    import asyncio

    from services.router.metrics import RouterMetrics
    from services.router.replicas import ReplicaSet
    from services.router.request import GenRequest
    from specinfer.sampling import SamplingParams

    async def run() -> list[str]:
        replicas = ReplicaSet([], RouterMetrics(), prefix_load_margin=0.25)
        replicas.update(frozenset({"10.0.0.1:1", "10.0.0.2:1"}))
        for r in replicas.replicas:  # as if their Info had answered
            r.joined, r.capacity, r.prefixes = True, 8, ReplicaPrefixes(16, 1000)
        chosen = []
        for k in range(3):
            req = GenRequest(SYSTEM + [k], 8, SamplingParams())
            replica = replicas.pick(req)
            chosen.append((replica.address, req.routing))
        first = chosen[0][0]
        replicas.update(frozenset({"10.0.0.1:1", "10.0.0.2:1"} - {first}))
        replicas.forget_removed(close_after_s=0)
        req = GenRequest(SYSTEM + [9], 8, SamplingParams())
        last = replicas.pick(req)
        await replicas.close()
        return [*chosen, (last.address, req.routing), first]

    *chosen, last, first = asyncio.run(run())
    assert chosen[0][1] == "load" and chosen[1:] == [(first, "prefix")] * 2
    assert last[0] != first and last[1] == "load"
