"""Structured output on the verifier engine (a tiny random Llama over SmolLM2's real
tokenizer): constrained greedy decoding is the same with and without speculation (trees
the verifier drafts, decoy trees sent to it, forced tokens), every output follows its
constraint, forced tokens make steps accept more than one token, bad constraints are
refused by name, and constrained sampling keeps its distribution under speculation
(chi-square, the test of ``test_speculative_sampling``)."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest
import torch
from test_speculative_sampling import homogeneity_pvalue

from bench.trees import decoy_tree
from services.verifier.engine import EngineConfig, PrefillSpec, StepItem
from services.verifier.factory import build_engine
from services.verifier.local import generate_local
from specinfer.constraints import Constraint, InvalidConstraint
from specinfer.drafting import DraftPlan, DraftRequest
from specinfer.drafting.ssm import SSMDrafter
from specinfer.errors import InvalidArgument
from specinfer.grammar import allowed
from specinfer.models import load_model, load_tokenizer
from specinfer.placement import resolve
from specinfer.sampling import SamplingParams
from specinfer.tree import ROOT, Draft, TokenTree

N = 500  # samples per arm of the chi-square test

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
     "required": ["ok", "tags"], "additionalProperties": False},
    {"enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
        "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
]
CONSTRAINTS = (
    [Constraint("json_schema", json.dumps(s)) for s in SCHEMAS]
    + [Constraint("json_schema", json.dumps(s)) for s in (
        {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                 "maximum": 999},
                                          "score": {"type": "number"}},
         "required": ["id"], "additionalProperties": False},
        {"type": "array", "items": {"type": "object", "properties": {
            "k": {"type": "string", "maxLength": 4}}, "required": ["k"],
            "additionalProperties": False}, "maxItems": 2},
        {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
        {"type": "object", "properties": {"status": {"const": "ok"},
                                          "items": {"type": "array", "maxItems": 3,
                                                    "items": {"type": "integer"}}},
         "required": ["status", "items"], "additionalProperties": False},
        {"type": "string", "pattern": "^[A-Z][a-z]{2,6}$"},
    )]
    + [Constraint("json_object"),
       Constraint("regex", r"[0-9]{3}-[0-9]{4}"),
       Constraint("regex", r"(yes|no), because [a-z ]{1,20}\."),
       Constraint("regex", r"[A-Z]{2}[0-9]{2} ?[a-z]+"),
       Constraint("regex", r"(ab|abc|abcd)+!"),
       Constraint("choice", choices=("positive", "negative", "neutral")),
       Constraint("choice", choices=("New York", "New Delhi", "Newcastle", "Paris")),
       Constraint("choice", choices=("a", "ab", "abc")),
       Constraint("grammar", 'start: "(" num " " op " " num ")"\nnum: /[0-9]{1,3}/\n'
                             'op: "+" | "-" | "*"'),
       Constraint("grammar", 'root ::= "The answer is " [0-9]+ "."')]
)
# ``make test`` runs every constraint in float32 and a cross-section in bfloat16;
# SPECINFER_STRUCTURED_MATRIX=1 (``make test-structured``) every one in every format.
FULL = os.environ.get("SPECINFER_STRUCTURED_MATRIX") == "1"
CASES = [(c, "float32") for c in CONSTRAINTS] + [
    (c, fmt) for fmt in (("bfloat16", "int8") if FULL else ("bfloat16",))
    for i, c in enumerate(CONSTRAINTS) if FULL or i % 4 == 0]


def follows(constraint: Constraint, text: str) -> bool:
    """Whether ``text`` (a finished output) is in the constraint's language."""
    if constraint.kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), json.loads(constraint.spec))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if constraint.kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if constraint.kind == "regex":
        return re.fullmatch(constraint.spec, text, re.ASCII) is not None
    if constraint.kind == "choice":
        return text in constraint.choices
    return (re.fullmatch(r"\(\d{1,3} [-+*] \d{1,3}\)", text) is not None
            or re.fullmatch(r"The answer is \d+\.", text) is not None)


ENGINE = EngineConfig(max_context=256, slots=4, max_tree_nodes=24)


@pytest.fixture(scope="module")
def chat_engine(tiny_chat_llm):
    return build_engine(tiny_chat_llm, ENGINE)


@pytest.fixture(scope="module")
def engines(tiny_chat_llm, chat_engine):
    """An engine per number format, built on first use."""
    built = {"float32": chat_engine}

    def get(fmt: str):
        if fmt not in built:
            placement = resolve("cpu", quantize="int8") if fmt == "int8" else \
                resolve("cpu", fmt)
            built[fmt] = build_engine(tiny_chat_llm, ENGINE, placement=placement)
        return built[fmt]
    return get


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_llm):
    return load_tokenizer(tiny_chat_llm)


def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t) for t in ("Give me the data:", "Answer in JSON please.")]


def decoys(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return lambda histories: [decoy_tree(list(torch.randint(0, 49152, (4,), generator=gen)),
                                         49152, gen) for _ in histories]


# The unit tier (make test-fast) keeps one constraint of each kind; the rest are `slow`.
FAST = {next(c for c in CONSTRAINTS if c.kind == kind).key for kind in
        ("json_schema", "json_object", "regex", "choice", "grammar")}


@pytest.mark.parametrize("constraint,fmt", [
    pytest.param(c, f, id=f"{c.kind}-{c.key[:6]}-{f}",
                 marks=() if f == "float32" and c.key in FAST else pytest.mark.slow)
    for c, f in CASES])
def test_constrained_greedy_is_the_same_with_every_kind_of_draft(engines, tokenizer,
                                                                 constraint, fmt):
    """In each format against its own plain constrained decoding (float32's plain decoding
    is transformers' argmax: tests/test_verifier_engine.py)."""
    chat_engine = engines(fmt)
    plain = generate_local(chat_engine, prompts(tokenizer), 48, constraint=constraint)
    eos = chat_engine.eos_token_ids[0]
    for r in plain:  # a finished output follows the constraint
        if r.token_ids[-1] == eos:
            text = tokenizer.decode(r.token_ids[:-1])
            assert follows(constraint, text), text
    for trees, draft in [(decoys(1), None), (None, DraftPlan(("model_free",), 12)),
                         (decoys(2), DraftPlan(("model_free",), 16))]:
        spec = generate_local(chat_engine, prompts(tokenizer), 48, trees=trees, draft=draft,
                              constraint=constraint)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


@pytest.fixture(scope="module")
def head_engine(tiny_chat_llm, tiny_chat_head):
    return build_engine(tiny_chat_llm, ENGINE, head=tiny_chat_head)


def test_drafts_are_masked_at_the_source(tiny_chat_llm, chat_engine, tokenizer):
    """A drafter given the grammar drafts only what it allows after each node's path, and
    a sampled draft's ``q`` is its distribution masked and renormalised (support inside
    the mask, summing to 1); without the grammar the same drafter drafts forbidden tokens
    (so the mask is what keeps them out)."""
    c = Constraint("regex", r"(yes|no), because [a-z ]{1,20}\.")
    ssm = SSMDrafter(load_model(tiny_chat_llm), slots=1, max_context=128)
    prompt = prompts(tokenizer)[1]
    grammar = chat_engine.grammars.start(c, [])
    for params in (SamplingParams(), SamplingParams(1.0, seed=3)):
        def draft(allowed, params=params):
            gen = None if params.greedy else torch.Generator().manual_seed(5)
            return ssm.propose([DraftRequest("s", prompt, [3, 2, 1], params, gen,
                                             allowed=allowed)])[0]
        tree = draft(grammar.allowed_words)
        assert len(tree) >= 3
        for node in range(len(tree)):
            path = tree.path_tokens(node)
            mask = grammar.allowed_words(path[:-1])
            assert allowed(mask, path[-1]), (node, path)
            for d in tree.drafts[node]:
                assert all(allowed(mask, t) for t in d.q_ids)
                assert abs(sum(d.q_probs) - 1) < 1e-6
        free = draft(None)
        assert any(not allowed(grammar.allowed_words(free.path_tokens(n)[:-1]), free.tokens[n])
                   for n in range(len(free)))


def test_forced_tokens_make_steps_accept_several_tokens(chat_engine, tokenizer):
    """A schema's keys and punctuation are forced: drafted by the grammar, accepted."""
    schema = {"type": "object", "properties": {k: {"type": "boolean"} for k in
                                               ("first_flag", "second_flag", "third_flag")},
              "required": ["first_flag", "second_flag", "third_flag"],
              "additionalProperties": False}
    c = Constraint("json_schema", json.dumps(schema))
    forced = chat_engine.forced_tokens
    plan = DraftPlan(("model_free",), 16)
    [spec] = generate_local(chat_engine, prompts(tokenizer)[:1], 64, draft=plan, constraint=c)
    [plain] = generate_local(chat_engine, prompts(tokenizer)[:1], 64, constraint=c)
    assert spec.token_ids == plain.token_ids
    assert json.loads(tokenizer.decode(spec.token_ids[:-1])).keys() == schema["properties"].keys()
    assert chat_engine.forced_tokens > forced
    assert len(spec.token_ids) / spec.steps > 2.0, spec.accepted_per_step
    assert plain.steps == len(plain.token_ids) - 1  # one token a step without a plan
    # Forced tokens alone (no tree, no plan: what a request that speculates gets in a
    # step the policy decodes plain): the same output in fewer steps.
    [alone] = generate_local(chat_engine, prompts(tokenizer)[:1], 64, constraint=c,
                             forced=True)
    assert alone.token_ids == plain.token_ids
    assert len(alone.token_ids) / alone.steps > 1.5, alone.accepted_per_step


def test_min_tokens_gives_way_to_a_finished_grammar(chat_engine, tokenizer):
    """min_tokens forbids the end of sequence where the grammar allows nothing else: the
    constraint wins (the output ends where it must)."""
    c = Constraint("choice", choices=("A", "B"))
    params = SamplingParams(min_tokens=5, min_tokens_stop_ids=tuple(chat_engine.eos_token_ids))
    for draft in (None, DraftPlan(("model_free",), 8)):
        out = generate_local(chat_engine, prompts(tokenizer), 16, params=params, draft=draft,
                             constraint=c)
        for r in out:
            assert tokenizer.decode(r.token_ids[:-1]) in ("A", "B")
            assert r.token_ids[-1] in chat_engine.eos_token_ids


@pytest.mark.parametrize("constraint,field,message", [
    (Constraint("json_schema", "{nope"), "items[0].constraint", "not JSON"),
    (Constraint("json_schema", '{"type": "strange"}'), "items[0].constraint", "Schema"),
    (Constraint("regex", "(unclosed"), "items[0].constraint", "regex"),
    (Constraint("regex", ""), "items[0].constraint", "empty"),
    (Constraint("choice", choices=()), "items[0].constraint", "empty"),
    (Constraint("choice", choices=("a", "")), "items[0].constraint", "non-empty"),
    (Constraint("grammar", "start: undefined_rule"), "items[0].constraint", "undefined"),
    (Constraint("grammar", "x" * 70_000), "items[0].constraint", "limit"),
])
def test_bad_constraints_are_refused_by_name(chat_engine, tokenizer, constraint, field,
                                             message):
    with pytest.raises(InvalidArgument) as err:
        chat_engine.prefill([PrefillSpec("bad", prompts(tokenizer)[0], SamplingParams(),
                                         constraint=constraint)])
    assert str(err.value).startswith(field)
    assert message.lower() in str(err.value).lower(), str(err.value)
    assert "bad" not in chat_engine.sequences
    with pytest.raises(InvalidConstraint):  # the router's check, without a tokenizer
        constraint.check()


def test_a_reprefill_continues_the_grammar(chat_engine, tokenizer):
    """After a failover the router prefills prompt + generated: the grammar resumes."""
    c = Constraint("json_schema", json.dumps(SCHEMAS[0]))
    [full] = generate_local(chat_engine, prompts(tokenizer)[:1], 40, constraint=c)
    prompt = prompts(tokenizer)[0]
    cut = len(full.token_ids) // 2
    chat_engine.prefill([PrefillSpec("again", prompt + full.token_ids[:cut], SamplingParams(),
                                     prompt_length=len(prompt), constraint=c)])
    out = []
    try:
        history = prompt + full.token_ids[: cut + 1]
        out = full.token_ids[: cut + 1]
        while out[-1] not in chat_engine.eos_token_ids and len(out) < 40:
            [r] = chat_engine.step([StepItem("again", history[-1])])
            history += r.tokens
            out += r.tokens
    finally:
        chat_engine.release(["again"])
    assert out == full.token_ids
    with pytest.raises(InvalidArgument, match="do not follow"):
        chat_engine.prefill([PrefillSpec("wrong", prompt + tokenizer.encode("plain words"),
                                         SamplingParams(), prompt_length=len(prompt),
                                         constraint=c)])


# ------------------------------------------------------------------ sampling


def sampled_trees(q: dict[int, float], chain_ids: list[int], seed: int):
    """Trees whose two root children are drawn from ``q`` (token -> probability: tokens the
    grammar allows and tokens it forbids), each with a random chain of ``chain_ids`` below:
    sampled drafts, which MSS verifies against the masked target."""
    gen = torch.Generator().manual_seed(seed)
    ids, probs = tuple(q), tuple(q.values())
    weights = torch.tensor(probs)

    def trees(histories):
        out = []
        for _ in histories:
            tree = TokenTree()
            for rank in range(2):
                tok = ids[int(torch.multinomial(weights, 1, generator=gen))]
                node = tree.add(ROOT, tok, [Draft(0, rank, ids, probs)])
                for _ in range(2):
                    tok = chain_ids[int(torch.randint(0, len(chain_ids), (1,),
                                                      generator=gen))]
                    node = tree.add(node, tok, [Draft.one_hot(1, 0, tok)])
            out.append(tree)
        return out
    return trees


@pytest.mark.slow  # 2 x N constrained samples
def test_constrained_sampling_keeps_its_distribution_under_speculation(chat_engine,
                                                                       head_engine,
                                                                       tokenizer):
    """A choice whose mask changes token by token (after "The" the four directions, after
    "The north" "-east" or the end), sampled at T=1 with sampled trees (drafts the grammar
    forbids among them): the output strings' distribution with speculation equals plain
    sampling's (p > 1e-3)."""
    c = Constraint("choice", choices=("The north", "The south", "The east", "The west",
                                      "The north-east"))
    vocab_ids = sorted({t for s in c.choices for t in tokenizer.encode(s)}
                       | {t for s in (" x", " the", "-") for t in tokenizer.encode(s)})
    # The first token ("The") comes from the prefill; the trees decide from the second
    # on. At their root q is half a token the grammar forbids (" x") and half an allowed
    # one the LLM makes less likely than that (" west", p ~ 0.17 here), so the forbidden
    # draft's rejection changes the residual the other draft is verified against.
    q = {tokenizer.encode(" x")[0]: 0.5, tokenizer.encode(" west")[0]: 0.5}
    prompt = prompts(tokenizer)[0]

    plain_texts = _sample(chat_engine, prompt, c, None, 0, tokenizer)
    spec_texts = _sample(chat_engine, prompt, c, sampled_trees(q, vocab_ids, 7), 10_000,
                         tokenizer)
    # The draft head's trees, sampled from its distribution masked to the grammar at the
    # source (a random head: its q spreads over many allowed spellings of the choices).
    head_texts = _sample(head_engine, prompt, c, None, 20_000, tokenizer,
                         DraftPlan(("head",), 8))
    assert set(plain_texts) <= set(c.choices) and set(spec_texts) <= set(c.choices)
    assert set(head_texts) <= set(c.choices)
    assert len(set(plain_texts)) >= 3
    index = {s: i for i, s in enumerate(c.choices)}
    for texts in (spec_texts, head_texts):
        p = homogeneity_pvalue([index[t] for t in plain_texts], [index[t] for t in texts])
        assert p > 1e-3, (p, sorted(plain_texts)[:5])


def _sample(engine, prompt, constraint, trees, seed0: int, tokenizer,
            draft: DraftPlan | None = None) -> list[str]:
    texts, batch = [], ENGINE.slots  # a seed each, a batch at a time
    for start in range(0, N, batch):
        params = [SamplingParams(1.0, seed=seed0 + i) for i in range(start, start + batch)]
        texts += [tokenizer.decode(r.token_ids[:-1]) for r in generate_local(
            engine, [prompt] * batch, 8, trees=trees, params=params, constraint=constraint,
            draft=draft)]
    return texts


def test_odd_multibyte_choices_never_fail_the_batch(chat_engine, tokenizer):
    """Found by the HTTP fuzzer: choices of astral and control characters at a huge
    temperature made llguidance refuse a token its own mask allowed, which failed the
    whole Step call (INTERNAL). Now such a sequence ends (EOS) and nothing else fails."""
    choices = ("\x9d*\U0007a983", "\xc3\U000abf15\xf6\xcf", "\x05", "\x15/", "lS\xee\U00041760",
               "\U000e7f36\xa3\U0002749e\xe0\xc0")
    c = Constraint("choice", choices=choices)
    for seed in range(12):
        for draft in (None, DraftPlan(("model_free",), 8)):
            [r] = generate_local(chat_engine, [prompts(tokenizer)[0]], 40, constraint=c,
                                 params=SamplingParams(3e16, seed=seed), draft=draft)
            assert r.token_ids[-1] in chat_engine.eos_token_ids
