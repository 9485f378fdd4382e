"""Every sampling value that passes validation (as a service receives it: float32 on the
wire) gives a finite, normalised target distribution, a valid MSS outcome and finite
logprobs: property tests over extreme floats (denormals, huge, near 0 and 1) for every
field, greedy and sampled."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from specinfer.sampling import (
    InvalidSamplingParams,
    SamplingParams,
    process_logits,
    target_probs,
    token_logprobs,
)
from specinfer.tree import ROOT, Draft, TokenTree
from specinfer.verification import verify_batch, verify_stochastic
from specinfer.wire import sampling_on_the_wire

VOCAB = 48


def extreme(low: float | None = None, high: float | None = None) -> st.SearchStrategy:
    """Floats from the whole range, denormals included, and the edges near 0 and 1."""
    edges = [0.0, 5e-324, 1e-45, 1.4e-45, 1e-38, 1e-5, 1 - 1e-7, 1.0, 1 + 1e-7, 2.0, 1e30,
             3.4e38, 1e300]
    inside = [x for e in edges for x in (e, -e)
              if (low is None or x >= low) and (high is None or x <= high)]
    return st.one_of(st.sampled_from(inside),
                     st.floats(min_value=low, max_value=high, allow_nan=False,
                               allow_infinity=False))


@st.composite
def sampling_params(draw) -> SamplingParams:
    fields = dict(
        temperature=draw(extreme(0.0)),
        top_k=draw(st.one_of(st.just(0), st.integers(1, 2 * VOCAB))),
        top_p=draw(extreme(0.0, 1.0)),
        min_p=draw(extreme(0.0, 1.0)),
        seed=draw(st.integers(0, 2**64 - 1)),
        logprobs=draw(st.none() | st.integers(0, 20)),
        logit_bias=draw(st.dictionaries(st.integers(0, VOCAB - 1), extreme(), max_size=4)),
        presence_penalty=draw(extreme(-2.0, 2.0)),
        frequency_penalty=draw(extreme(-2.0, 2.0)),
        repetition_penalty=draw(extreme(0.0)),
    )
    try:
        return sampling_on_the_wire(SamplingParams(**fields))
    except InvalidSamplingParams:
        assume(False)  # refused with a 400 naming the field: not this test's concern


@st.composite
def logits_rows(draw, rows: int = 4) -> torch.Tensor:
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e4]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(rows, VOCAB, generator=gen) * scale
    if draw(st.booleans()):  # ties, as a saturated model gives them
        logits[:, : VOCAB // 2] = logits[0, 0]
    return logits


histories = st.lists(st.integers(0, VOCAB - 1), max_size=30)
SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.filter_too_much,
                                           HealthCheck.too_slow])


def _is_distribution(p: torch.Tensor) -> bool:
    return bool(torch.isfinite(p).all() and (p >= 0).all()
                and torch.allclose(p.double().sum(-1), torch.ones(p.shape[0],
                                                                  dtype=torch.float64),
                                   atol=1e-4))


@SETTINGS
@given(sampling_params(), logits_rows(), histories, st.lists(histories, min_size=4,
                                                             max_size=4))
def test_target_distributions_are_finite_and_normalised(params, logits, prompt, generated):
    processed = process_logits(logits, params, prompt, generated[0], generated)
    assert torch.isfinite(processed).all()
    probs = target_probs(processed, params)
    assert _is_distribution(probs)
    if params.greedy:
        assert (probs.max(-1).values == 1).all()


@SETTINGS
@given(sampling_params(), logits_rows(rows=4), st.integers(0, 2**31),
       st.sampled_from([0.0, 1e-30, 0.5, 1.0]))
def test_mss_gives_a_valid_token_for_any_valid_params(params, logits, seed, draft_mass):
    """A tree of 3 nodes whose drafts carry proposals of any shape (point masses, a
    proposal equal to the target): verification ends in tokens of the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    probs = target_probs(process_logits(logits, params, [], []), params)
    q = probs[0].clone()
    q[0] += draft_mass
    q = (q / q.sum()).tolist()
    ids = [t for t, v in enumerate(q) if v > 0]
    tree = TokenTree()
    a = tree.add(ROOT, ids[0], [Draft(0, 0, tuple(ids), tuple(q[t] for t in ids))])
    tree.add(a, 1, [Draft.one_hot(1, 0, 1)])
    tree.add(ROOT, VOCAB - 1, [Draft.one_hot(1, 0, VOCAB - 1)])
    if params.greedy:
        out = verify_batch(logits[None], [tree], [params], [None])[0]
    else:
        out = verify_stochastic(probs, tree, gen)
    assert out.tokens and all(0 <= t < VOCAB for t in out.tokens)


@SETTINGS
@given(logits_rows(), st.integers(0, 20))
def test_logprobs_are_finite(logits, top):
    tokens = logits.argmin(-1).tolist()  # the least likely: the hardest case
    for lp in token_logprobs(logits, tokens, top):
        assert math.isfinite(lp.logprob) and lp.logprob <= 0
        assert all(math.isfinite(v) for v in lp.top_logprobs) and len(lp.top_ids) == top
