"""The router's adaptive speculation policy: measured per batch size, self-correcting, and
choosing among plain decoding (mode 0) and several speculation modes."""

import pytest

from services.router.policy import SpeculationPolicy


def step(policy: SpeculationPolicy, batch: int, mode: int, rate: float,
         per_sequence: float = 2.0) -> None:
    """Record a step of ``mode`` delivering ``rate`` tokens per second; a speculating mode
    emits ``per_sequence`` tokens per sequence, plain decoding 1."""
    tokens = per_sequence if mode else 1
    policy.record(batch, True, mode, seconds=batch * tokens / rate,
                  per_sequence={f"s{i}": tokens for i in range(batch)} if mode else None)


def run(policy: SpeculationPolicy, batch: int, rates: list[float], steps: int) -> list[int]:
    """``rates[mode]``: the tokens per second each mode delivers."""
    modes = []
    for _ in range(steps):
        mode = policy.choose(batch, greedy=True)
        step(policy, batch, mode, rates[mode])
        modes.append(mode)
    return modes


def test_takes_the_faster_arm_and_explores_the_other():
    policy = SpeculationPolicy(2, explore_every=8, max_explore_every=8)
    modes = run(policy, 1, [10, 30], steps=66)
    assert modes[:2] == [1, 0]  # both measured first, speculation first
    assert modes[2:].count(0) == 8  # then one step in 8 explores
    modes = run(SpeculationPolicy(2, explore_every=8, max_explore_every=8), 1, [10, 8], 66)
    assert modes[2:].count(1) == 8


def test_chooses_among_several_modes_and_tries_each_in_turn():
    policy = SpeculationPolicy(4, explore_every=12, max_explore_every=12)
    modes = run(policy, 1, [10, 14, 12, 9], steps=4 + 38)
    assert modes[:4] == [1, 2, 3, 0]
    rest = modes[4:]
    assert rest.count(1) == 29  # the fastest mode, but each other mode every 12 steps
    assert [a for a in rest if a != 1] == [0, 2, 3] * 3


def test_exploration_backs_off_while_it_confirms_the_decision():
    policy = SpeculationPolicy(2, explore_every=8, max_explore_every=64, explore_cost=1.0)
    modes = run(policy, 1, [10, 8], steps=2 + 8 + 16 + 32 + 64 + 64)
    explored = [i for i, a in enumerate(modes[2:], 1) if a == 1]
    assert explored == [8, 24, 56, 120, 184]  # 8, 16, 32, 64, then capped at 64


def test_an_arm_that_loses_by_far_is_tried_rarely_from_the_start():
    policy = SpeculationPolicy(3, explore_every=8, max_explore_every=128, explore_cost=0.02)
    modes = run(policy, 1, [10, 9, 4], steps=3 + 200)
    rest = modes[3:]
    # Arm 2 runs at 0.4x: a try costs 1.5 steps, so tries come >= 75 steps apart.
    tries = [i for i, a in enumerate(rest) if a == 2]
    assert len(tries) == 2 and tries[1] - tries[0] >= 74  # 75, less float rounding
    assert rest.count(1) == 4  # the close mode: tried after 8, 16, 32, 64 steps


def test_an_exploration_that_wins_resets_the_backoff():
    policy = SpeculationPolicy(2, explore_every=4, max_explore_every=64, explore_cost=1.0)
    run(policy, 1, [10, 8], steps=2 + 4 + 8 + 16)  # backed off to 32
    assert policy.interval[(*policy._key(1, True), 1)] == 32
    for _ in range(3):
        step(policy, 1, 1, rate=40)  # speculation now beats plain
    assert policy.interval[(*policy._key(1, True), 1)] == 4


def test_noise_within_the_margin_does_not_flip_the_choice():
    policy = SpeculationPolicy(2, explore_every=1000, margin=0.05)
    run(policy, 1, [10, 11], steps=3)
    assert policy.choice[policy._key(1, True)] == 1
    for _ in range(30):
        step(policy, 1, 0, rate=11.3)  # plain now 3% ahead: within 5%
    assert policy.choose(1, greedy=True) == 1
    for _ in range(10):
        step(policy, 1, 0, rate=14)
    assert policy.choose(1, greedy=True) == 0


def test_an_arm_that_lost_by_far_at_a_smaller_batch_starts_as_a_loser():
    policy = SpeculationPolicy(3, explore_every=8, max_explore_every=64)
    run(policy, 1, [10, 12, 5], steps=20)  # mode 2 at 0.42x the best at batch 1
    modes = run(policy, 2, [10, 11, 5], steps=70)
    assert modes[:2] == [1, 0]  # mode 2 is not measured first at batch 2...
    assert 2 not in modes[:60] and 2 in modes[60:]  # ...but tried after max_explore_every
    assert policy.choose(8, greedy=True) == 1  # batch 8: the nearest measured size (2) says
    assert policy.choose(4, greedy=False) == 1  # other kinds of batch: measured as usual


def test_a_step_that_shared_the_verifier_with_a_prefill_does_not_skew_the_choice():
    """A disturbed step's time (a prefill chunk ran beside it) leaves a timed mode's
    estimate alone, so one slow plain step does not hand the batch to speculation; a mode
    not timed yet still takes it (else it would stay unmeasured under constant load)."""
    policy = SpeculationPolicy(2, explore_every=8, max_explore_every=8)
    run(policy, 4, [100, 90], steps=20)  # plain decoding wins by 10%
    assert policy.current(4, True) == 0
    for _ in range(5):  # plain steps each behind a prefill: 4x their time
        policy.record(4, True, 0, seconds=4 * 4 / 100, disturbed=True)
    assert policy.choose(4, greedy=True) == 0 and policy.rate((4, True), 0) == \
        pytest.approx(100)
    policy.record(2, True, 0, seconds=0.5, disturbed=True)  # untimed: counts
    assert policy.rate((2, True), 0) == pytest.approx(4.0)


def test_batch_sizes_and_kinds_are_measured_apart():
    policy = SpeculationPolicy(2, explore_every=1000)
    run(policy, 1, [10, 30], steps=10)
    run(policy, 16, [100, 50], steps=10)
    assert policy.choose(1, greedy=True) == 1
    assert policy.choose(12, greedy=True) == 0  # same bucket as 16
    assert policy.choose(16, greedy=False) == 1  # stochastic batches are unmeasured: try


def test_a_stale_estimate_is_corrected_by_exploration():
    policy = SpeculationPolicy(2, explore_every=4)
    run(policy, 2, [10, 30], steps=20)
    modes = run(policy, 2, [10, 5], steps=40)  # speculation stopped paying
    assert modes[-1] == 0 and sum(modes[-12:]) <= 3  # only exploring steps speculate


def test_an_arm_that_cannot_run_on_this_batch_is_never_chosen():
    """Micro-batch overlap needs two speculating sequences: with one, its mode is skipped,
    even where it is the usual choice of the bucket, and it is not counted down."""
    policy = SpeculationPolicy(3, explore_every=4, max_explore_every=4)
    run(policy, 2, [10, 12, 30], steps=20)  # mode 2 (overlap) wins at batch 2
    assert policy.choice[(2, True)] == 2
    countdown = policy.countdown[(2, True, 1)]
    modes = []
    for _ in range(12):
        mode = policy.choose(2, True, skip=frozenset({2}))
        step(policy, 2, mode, rate=10 + 2 * mode)
        modes.append(mode)
    assert 2 not in modes and modes.count(1) == 12  # the best of the rest, every step
    assert policy.countdown[(2, True, 1)] == countdown
    assert SpeculationPolicy(3).choose(2, True, skip=frozenset({2})) == 1


def test_cli_names_every_speculation_choice():
    from services.cli import build_parser
    from services.router.policy import PLAIN, SPECULATION_CHOICES

    parser = build_parser()
    for argv in (["serve", "router", "--verifier", "v"], ["up"]):
        for choice in SPECULATION_CHOICES:
            assert parser.parse_args([*argv, "--speculation", choice]).speculation == choice
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--speculation", "sometimes"])
    # Mode 0 is plain decoding in every choice, so a policy's index is a mode index.
    assert all(modes[0] is PLAIN for modes in SPECULATION_CHOICES.values())


def test_each_sequence_speculates_where_its_own_drafts_fit():
    """Tokens per step are pooled over sequences but conditioned on each one's own: after
    a sequence whose drafts fit (2 tokens per step), one whose drafts all miss decodes
    plainly once its own steps outweigh the pooled prior; a step with drafts costs 10%
    more here."""
    policy = SpeculationPolicy(2, explore_every=8, max_explore_every=8)

    def generate(sequence: str, fit: int, steps: int) -> list[int]:
        modes = []
        for _ in range(steps):
            mode = policy.choose(1, True, sequences=(sequence,))
            policy.record(1, True, mode, seconds=1.1 if mode else 1.0,
                          per_sequence={sequence: fit} if mode else None)
            modes.append(mode)
        policy.forget(sequence)
        return modes

    fits = generate("fits", 2, 60)
    assert fits[2:].count(1) >= 50
    misses = generate("misses", 1, 80)
    assert misses[:10].count(1) >= 8  # the pooled yield says speculate...
    assert misses[-30:].count(1) <= 4  # ...its own says not: only exploring steps do
    assert not any(seq.startswith("fits") or seq == "misses" for seq, _ in policy.sequences)
    assert generate("fits-too", 2, 10)[2:].count(1) >= 7  # a new one starts from the pool


def test_shadow_yields_measure_an_arm_without_running_it():
    """Yields recorded for a mode that did not run (the verifier's shadow drafts) move its
    rate: here they show speculation would pay, and the policy switches to it."""
    policy = SpeculationPolicy(2, explore_every=1000)
    policy.record(1, True, 1, seconds=1.1, per_sequence={"a": 1})
    policy.record(1, True, 0, seconds=1.0)
    assert policy.choose(1, True, sequences=("a",)) == 0
    for _ in range(30):
        policy.record(1, True, 0, seconds=1.0)
        policy.record_yield(True, 1, "a", 2)
    assert policy.choose(1, True, sequences=("a",)) == 1


def test_a_partial_step_speculates_for_the_sequences_whose_drafts_fit_best():
    """Past the speculating limit, a mode's rate counts only its ``at_most`` best sequences'
    own yields; every other sequence decodes plain (one token). So a mode whose drafts fit
    two sequences of eight wins a partial step although its pooled yield would not pay for
    the whole batch, and the policy picks those two."""
    policy = SpeculationPolicy(2, explore_every=1000, prior_steps=1.0)
    seqs = tuple(f"s{i}" for i in range(8))
    for _ in range(40):  # drafts fit s2 and s5 (4 tokens a step), no other sequence
        for seq in seqs:
            policy.record_yield(True, 1, seq, 4 if seq in ("s2", "s5") else 1)
    assert policy.best(True, 1, seqs, 2) == ("s2", "s5")
    policy.record(8, True, 0, seconds=0.100)  # plain: 8 tokens in 100 ms
    policy.record(8, True, 1, seconds=0.110)  # partial: 2 trees cost 10% more
    key = policy._key(8, True)
    partial = policy.rate(key, 1, 8, seqs, at_most=2)
    assert partial == pytest.approx((6 + 2 * policy.tokens_per_step(True, 1, "s2")) / 0.110)
    assert partial > policy.rate(key, 0, 8, seqs, at_most=2) == pytest.approx(80)
    assert policy.choose(8, True, sequences=seqs, at_most=2) == 1
    # Drafts that fit no sequence: plain wins the same step.
    flat = SpeculationPolicy(2, explore_every=1000)
    for seq in seqs:
        flat.record_yield(True, 1, seq, 1)
    flat.record(8, True, 0, seconds=0.100)
    flat.record(8, True, 1, seconds=0.110)
    assert flat.choose(8, True, sequences=seqs, at_most=2) == 0
