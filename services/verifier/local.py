"""Generation driven in-process against a verifier engine: the engine-only path used by
tests and benchmarks (the router drives the same steps over gRPC)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.verifier.engine import PrefillSpec, StepItem, VerifierEngine
from specinfer.constraints import Constraint
from specinfer.drafting import DraftPlan
from specinfer.sampling import SamplingParams, TokenLogprob
from specinfer.stops import SequenceStops, Stops
from specinfer.tree import TokenTree

# Maps the token histories of a batch (prompt + generated, the last one is each tree's
# root) to one tree per sequence. None = no speculation.
TreeSource = Callable[[list[list[int]]], list[TokenTree]]

_ids = itertools.count()


@dataclass
class LocalResult:
    token_ids: list[int]
    accepted_per_step: list[int] = field(default_factory=list)
    elapsed_s: float = 0.0
    ttft_s: float = 0.0
    draft_s: float = 0.0  # time in the tree source (the batch's, shared)
    verify_s: float = 0.0  # time in the engine's decode/verify steps
    logprobs: list[TokenLogprob] = field(default_factory=list)  # if params.logprobs is set
    reused_tokens: int = 0  # prompt tokens whose KV was cached (prefix caching)

    @property
    def steps(self) -> int:
        return len(self.accepted_per_step)


def generate_local(
    engine: VerifierEngine,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    trees: TreeSource | None = None,
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    draft: DraftPlan | None = None,
    constraint: Constraint | None = None,
    forced: bool = False,
) -> list[LocalResult]:
    """Decode a batch to ``max_new_tokens`` each (or a stop token, which is kept), one
    ``Step`` per iteration. ``draft`` has the verifier draft each step's trees itself with
    its own sources, merged with ``trees``' when given. ``constraint``: structured output
    (every sequence's), which ends at the end-of-sequence token it allows; ``forced``: its
    forced tokens drafted every step (as the router asks when a request speculates). ``params``: one
    for every sequence, or one each (e.g. a seed each: independent samples in one batch)."""
    params = params or SamplingParams()
    each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    draft = draft or DraftPlan()
    ends = Stops(max_new_tokens, frozenset(engine.eos_token_ids if stop_token_ids is None
                                           else stop_token_ids))
    start = time.perf_counter()
    ids = [f"local-{next(_ids)}" for _ in prompts]
    if constraint is not None:
        ends = Stops(max_new_tokens, ends.token_ids | frozenset(engine.eos_token_ids))
    first = engine.prefill([PrefillSpec(sid, list(p), q, constraint=constraint)
                            for sid, p, q in zip(ids, prompts, each, strict=True)])
    ttft = time.perf_counter() - start
    history = {sid: list(p) + [f.token] for sid, p, f in zip(ids, prompts, first, strict=True)}
    results = {sid: LocalResult([f.token], ttft_s=ttft, logprobs=f.logprobs,
                                reused_tokens=f.reused_tokens)
               for sid, f in zip(ids, first, strict=True)}
    stops = {sid: SequenceStops(ends) for sid in ids}
    for sid, f in zip(ids, first, strict=True):
        stops[sid].add([f.token])
    live = [sid for sid in ids if not stops[sid].finish_reason]
    try:
        while live:
            t0 = time.perf_counter()
            drafted = trees([history[sid] for sid in live]) if trees else [TokenTree()] * len(live)
            t1 = time.perf_counter()
            out = engine.step([StepItem(sid, history[sid][-1], tree, draft, forced=forced)
                               for sid, tree in zip(live, drafted, strict=True)])
            t2 = time.perf_counter()
            for r in out:
                res = results[r.sequence_id]
                res.draft_s += t1 - t0
                res.verify_s += t2 - t1
                new = r.tokens[:stops[r.sequence_id].add(r.tokens)]
                res.token_ids += new
                res.logprobs += r.logprobs[: len(new)]
                res.accepted_per_step.append(len(r.tokens))
                history[r.sequence_id] += r.tokens
            live = [sid for sid in live if not stops[sid].finish_reason]
    finally:
        engine.release(ids)
    elapsed = time.perf_counter() - start
    for res in results.values():
        res.elapsed_s = elapsed
    return [results[sid] for sid in ids]
