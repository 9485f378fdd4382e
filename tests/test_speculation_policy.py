"""The router's adaptive speculation policy: measured, per batch size, self-correcting."""

from services.router.scheduler import SpeculationPolicy


def run(policy: SpeculationPolicy, batch: int, on_rate: float, off_rate: float,
        steps: int) -> list[bool]:
    modes = []
    for _ in range(steps):
        spec = policy.speculate(batch, greedy=True)
        policy.record(batch, True, spec, tokens=int(on_rate if spec else off_rate), seconds=1.0)
        modes.append(spec)
    return modes


def test_takes_the_faster_mode_and_explores_the_other():
    policy = SpeculationPolicy(explore_every=8, max_explore_every=8)
    modes = run(policy, 1, on_rate=30, off_rate=10, steps=66)
    assert modes[:2] == [True, False]  # both measured first
    assert sum(not m for m in modes[2:]) == 8  # then one step in 8 explores
    modes = run(SpeculationPolicy(explore_every=8, max_explore_every=8), 1, on_rate=8,
                off_rate=10, steps=66)
    assert sum(modes[2:]) == 8


def test_exploration_backs_off_while_it_confirms_the_decision():
    policy = SpeculationPolicy(explore_every=8, max_explore_every=64)
    modes = run(policy, 1, on_rate=8, off_rate=10, steps=2 + 8 + 16 + 32 + 64 + 64)
    explored = [i for i, m in enumerate(modes[2:], 1) if m]
    assert explored == [8, 24, 56, 120, 184]  # 8, 16, 32, 64, then capped at 64


def test_an_exploration_that_wins_resets_the_backoff():
    policy = SpeculationPolicy(explore_every=4, max_explore_every=64)
    run(policy, 1, on_rate=8, off_rate=10, steps=2 + 4 + 8 + 16)  # backed off to 32
    assert policy.interval[policy._key(1, True)] == 32
    policy.record(1, True, True, tokens=20, seconds=1.0)  # speculation now beats plain
    assert policy.interval[policy._key(1, True)] == 4


def test_batch_sizes_and_kinds_are_measured_apart():
    policy = SpeculationPolicy(explore_every=1000)
    run(policy, 1, on_rate=30, off_rate=10, steps=10)
    run(policy, 16, on_rate=50, off_rate=100, steps=10)
    assert policy.speculate(1, greedy=True)
    assert not policy.speculate(12, greedy=True)  # same bucket as 16
    assert policy.speculate(16, greedy=False)  # stochastic batches are unmeasured: try


def test_a_stale_estimate_is_corrected_by_exploration():
    policy = SpeculationPolicy(explore_every=4)
    run(policy, 2, on_rate=30, off_rate=10, steps=20)
    modes = run(policy, 2, on_rate=5, off_rate=10, steps=40)  # speculation stopped paying
    assert not modes[-1] and 1 <= sum(modes[-12:]) <= 3  # only exploring steps speculate
