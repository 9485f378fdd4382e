"""Structured output: what a request's generated text must be, and its grammar.

A ``Constraint`` is one of: a JSON Schema, any JSON object, a regular expression, a choice
among strings, or a context-free grammar (Lark, or GBNF/EBNF converted to Lark). Each
becomes one grammar for llguidance (docs/structured-output.md says why that library),
which the verifier compiles against the LLM's tokenizer (``specinfer.grammar``) and the
router checks before anything is scheduled, so a bad constraint is a 400 / INVALID_ARGUMENT
naming the field and never reaches a replica.

JSON grammars use fixed separators (``", "`` and ``": "``) and no free whitespace: a small
model can otherwise emit whitespace until ``max_tokens``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_BYTES = 64 * 1024  # a schema, regex or grammar larger than this is refused
MAX_CHOICES = 1024
# llguidance's JSON options: fixed separators, no free whitespace between tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Grammar complexity limits (llguidance's defaults are 500k symbols, 250k lexer states):
# lower, so one request cannot make the verifier build a huge grammar.
LIMITS = {"max_grammar_size": 200_000, "max_lexer_states": 100_000}


class InvalidConstraint(ValueError):
    """A constraint that cannot be compiled; the message names the field."""


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


@dataclass(frozen=True)
class Constraint:
    """``kind``: one of ``KINDS``. ``spec``: the JSON Schema (JSON text), the regex or the
    grammar; empty for ``json_object`` and ``choice``. ``choices``: the strings of a
    ``choice``."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """A stable hash of the constraint: compiled grammars are cached by it."""
        body = json.dumps([self.kind, self.spec, list(self.choices)], ensure_ascii=False)
        return hashlib.sha256(body.encode()).hexdigest()

    def grammar(self, field: str = "constraint") -> str:
        """The llguidance grammar (its JSON form); raises InvalidConstraint naming ``field``
        for anything malformed on its face (syntax is checked by ``check``)."""
        if self.kind not in KINDS:
            raise InvalidConstraint(f"{field}: unknown kind {self.kind!r} (one of {KINDS})")
        size = len(self.spec.encode()) + sum(len(c.encode()) for c in self.choices)
        if size > MAX_SPEC_BYTES:
            raise InvalidConstraint(f"{field}.{self.kind}: {size} bytes exceed the limit of "
                                    f"{MAX_SPEC_BYTES}")
        if self.kind == "json_object":
            return _json_grammar({"type": "object"})
        if self.kind == "json_schema":
            try:
                return _json_grammar(_schema(self.spec, f"{field}.json_schema"))
            except ValueError as exc:  # llguidance refuses the schema (InvalidConstraint
                if isinstance(exc, InvalidConstraint):  # is a ValueError too: as it is)
                    raise
                raise InvalidConstraint(f"{field}.json_schema: {_first_line(str(exc))}") \
                    from None
        if self.kind == "regex":
            if not self.spec:
                raise InvalidConstraint(f"{field}.regex: empty")
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(choice_lark(self.choices,
                                                                      f"{field}.choice"))
        return llguidance.LLMatcher.grammar_from_lark(lark(self.spec, f"{field}.grammar"))

    def check(self, field: str = "constraint") -> str:
        """The grammar, after llguidance has checked it compiles (without a tokenizer:
        the verifier compiles it against its own); raises InvalidConstraint naming
        ``field``."""
        grammar = self.grammar(field)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, None, limits=parser_limits())
        if is_error:
            raise InvalidConstraint(f"{field}.{self.kind}: {_first_line(messages[0])}")
        return grammar


def choice_lark(choices: tuple[str, ...], field: str) -> str:
    """A grammar whose language is exactly ``choices``."""
    if not choices:
        raise InvalidConstraint(f"{field}: the choice list is empty")
    if len(choices) > MAX_CHOICES:
        raise InvalidConstraint(f"{field}: {len(choices)} choices exceed {MAX_CHOICES}")
    if any(not isinstance(c, str) or not c for c in choices):
        raise InvalidConstraint(f"{field}: every choice must be a non-empty string")
    # Lark string literals take JSON's escapes.
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))


def lark(grammar: str, field: str) -> str:
    """Lark as given; GBNF/EBNF (``::=`` rules, as vLLM's guided_grammar takes) converted."""
    if not grammar.strip():
        raise InvalidConstraint(f"{field}: empty")
    if "::=" in grammar:
        try:
            return gbnf_to_lark(grammar)
        except (GbnfToLarkError, ValueError, KeyError, IndexError) as exc:
            raise InvalidConstraint(f"{field}: not a valid GBNF grammar: {exc}") from None
    return grammar


def _schema(text: str, field: str) -> dict | bool:
    try:
        schema = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise InvalidConstraint(f"{field}: not JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidConstraint(f"{field}: a JSON Schema is an object (or a boolean)")
    if isinstance(schema, dict):
        import jsonschema  # a dependency; imported here, where schemas are checked

        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            where = "/".join(str(p) for p in exc.absolute_path)
            raise InvalidConstraint(f"{field}: invalid JSON Schema"
                                    f"{' at ' + where if where else ''}: "
                                    f"{_first_line(exc.message)}") from None
    return schema


def _json_grammar(schema: dict | bool) -> str:
    if schema is False:
        raise ValueError("the schema false admits no output")
    if schema is True:  # llguidance's options apply to object schemas only
        schema = {}
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                         defaults=JSON_OPTIONS)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0][:300] if message.strip() else "invalid"
