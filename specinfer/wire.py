"""Conversions between core types and the wire messages of ``proto/specinfer/v1``."""

from __future__ import annotations

from specinfer.constraints import Constraint
from specinfer.drafting import DraftPlan
from specinfer.errors import InvalidArgument
from specinfer.sampling import SamplingParams, TokenLogprob
from specinfer.tree import Draft, TokenTree
from specinfer.v1 import common_pb2, verifier_pb2


def sampling_from_proto(msg: common_pb2.SamplingParams, field: str) -> SamplingParams:
    """Validated sampling parameters; the error names ``field`` (e.g. ``items[2].sampling``)
    and, in its message, the bad field in it."""
    try:
        return _sampling(msg)
    except ValueError as exc:
        raise InvalidArgument(field, str(exc)) from exc


def sampling_on_the_wire(p: SamplingParams) -> SamplingParams:
    """``p`` as a service receiving it will see it (its floats rounded to the proto's
    float32), validated again: a value valid in float64 may not be once rounded (a
    top_p of 1e-50 becomes 0). Raises ``InvalidSamplingParams`` naming the field."""
    return _sampling(sampling_to_proto(p))


def _sampling(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        logit_bias=dict(msg.logit_bias),
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty
        if msg.HasField("repetition_penalty") else 1.0,
        min_tokens=msg.min_tokens, min_tokens_stop_ids=tuple(msg.min_tokens_stop_ids),
    )


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=p.temperature, top_k=p.top_k, min_p=p.min_p)
    if p.top_p != 1.0:
        msg.top_p = p.top_p
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    msg.logit_bias.update(dict(p.logit_bias))
    msg.presence_penalty, msg.frequency_penalty = p.presence_penalty, p.frequency_penalty
    if p.repetition_penalty != 1.0:
        msg.repetition_penalty = p.repetition_penalty
    msg.min_tokens = p.min_tokens
    msg.min_tokens_stop_ids.extend(p.min_tokens_stop_ids)
    return msg


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(logprob=lp.logprob, top_token_ids=lp.top_ids,
                                   top_logprobs=lp.top_logprobs)


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.logprob, tuple(msg.top_token_ids), tuple(msg.top_logprobs))


def tree_to_proto(tree: TokenTree) -> common_pb2.TokenTree:
    msg = common_pb2.TokenTree(tokens=tree.tokens, parents=tree.parents)
    for drafts in tree.drafts:
        node = msg.drafts.add()
        for d in drafts:
            node.drafts.add(
                source=d.source,
                rank=d.rank,
                proposal=common_pb2.SparseDistribution(token_ids=d.q_ids, probs=d.q_probs),
            )
    return msg


def tree_shape_to_proto(tree: TokenTree | None) -> common_pb2.TokenTree | None:
    """A tree's tokens and parents only (a shadow draft: measured, never verified)."""
    return None if tree is None else common_pb2.TokenTree(tokens=tree.tokens,
                                                          parents=tree.parents)


def tree_from_proto(msg: common_pb2.TokenTree) -> TokenTree:
    """Validates the structure (raises ``ValueError`` naming the bad field)."""
    drafts = []
    for i, node in enumerate(msg.drafts):
        node_drafts = []
        for j, d in enumerate(node.drafts):
            ids, probs = tuple(d.proposal.token_ids), tuple(d.proposal.probs)
            if len(ids) != len(probs):
                raise ValueError(
                    f"tree.drafts[{i}].drafts[{j}].proposal: {len(ids)} token_ids, "
                    f"{len(probs)} probs"
                )
            if any(not (0 <= p <= 1) for p in probs) or abs(sum(probs) - 1) > 1e-3:
                raise ValueError(
                    f"tree.drafts[{i}].drafts[{j}].proposal.probs must be a distribution"
                )
            node_drafts.append(Draft(d.source, d.rank, ids, probs))
        drafts.append(node_drafts)
    return TokenTree.from_arrays(list(msg.tokens), list(msg.parents), drafts)


# The verifier's step protocol (InfoResponse.step_protocol): 2 = one Step call per batch.
STEP_PROTOCOL = 2


def draft_plan_to_proto(plan: DraftPlan) -> verifier_pb2.DraftPlan | None:
    """A Step item's draft or shadow plan on the wire; None (unset) for no own drafts."""
    return verifier_pb2.DraftPlan(sources=plan.sources, max_nodes=plan.max_nodes) \
        if plan else None


def draft_plan_from_proto(msg, field: str) -> DraftPlan:
    """A Step item's draft or shadow plan (``field`` names it in errors)."""
    names = tuple(msg.sources)
    if len(set(names)) != len(names):
        raise InvalidArgument(f"{field}.sources", "a source is named twice")
    return DraftPlan(names, msg.max_nodes)



def constraint_to_proto(c: Constraint | None) -> common_pb2.Constraint | None:
    if c is None:
        return None
    if c.kind == "json_object":
        return common_pb2.Constraint(json_object=True)
    if c.kind == "choice":
        return common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=list(c.choices)))
    return common_pb2.Constraint(**{c.kind: c.spec})


def constraint_from_proto(msg: common_pb2.Constraint, field: str) -> Constraint | None:
    """The request's constraint, or None when unset; malformed on its face (an empty
    regex, an empty choice list, ``json_object: false``) raises InvalidArgument naming
    ``field``. Whether it compiles is the grammar compiler's to say."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        if not msg.json_object:
            raise InvalidArgument(f"{field}.json_object", "must be true when set")
        return Constraint("json_object")
    if kind == "choice":
        return Constraint("choice", choices=tuple(msg.choice.choices))
    return Constraint(kind, getattr(msg, kind))
