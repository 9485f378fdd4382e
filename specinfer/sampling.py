"""Sampling parameters and logits processing, shared by speculative and plain decoding.

``process_logits`` applies the request's logits processors, which depend on the text so
far: repetition penalty (prompt and generated tokens), frequency and presence penalties
(generated tokens), logit bias, min_tokens. ``target_probs`` then turns logits into the distribution
a request samples from (temperature → top-k → top-p → min-p, the order transformers
applies them). Speculative verification and incremental decoding both call them, a tree
node's row with the node's ancestors counted as generated, so with and without
speculation the next token has the same distribution.

Every value that passes validation gives a finite, normalised distribution: temperatures
below ``GREEDY_BELOW`` act as greedy (as vLLM does), processed logits are clamped to a
finite range, and a truncation always keeps the most likely token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
GREEDY_BELOW = 1e-5  # temperatures under this act as greedy
MAX_LOGIT_BIAS = 100.0  # OpenAI's clamp
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's range [-2, 2]
LOGIT_LIMIT = 1e30  # processed logits are clamped to +-this: finite after any temperature


class InvalidSamplingParams(ValueError):
    """A sampling field is out of range; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None
    logprobs: int | None = None  # report log-probabilities with this many alternatives
    # (token id, bias) pairs, sorted, biases clamped to +-MAX_LOGIT_BIAS; a mapping is
    # accepted too.
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    # vLLM's min_tokens: these ids (EOS and stop token ids) are suppressed until this many
    # tokens have been generated.
    min_tokens: int = 0
    min_tokens_stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise InvalidSamplingParams(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.top_k < 2**31:
            raise InvalidSamplingParams(f"top_k must be in [0, 2**31), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            raise InvalidSamplingParams(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise InvalidSamplingParams(f"seed must be in [0, 2**64), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidSamplingParams(f"logprobs must be in [0, {MAX_LOGPROBS}], "
                                        f"got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidSamplingParams(f"{name} must be in [-{MAX_PENALTY:g}, "
                                            f"{MAX_PENALTY:g}], got {value}")
        if not (0 < self.repetition_penalty < float("inf")):
            raise InvalidSamplingParams(f"repetition_penalty must be > 0, got "
                                        f"{self.repetition_penalty}")
        if not 0 <= self.min_tokens < 2**31:
            raise InvalidSamplingParams(f"min_tokens must be in [0, 2**31), got "
                                        f"{self.min_tokens}")
        stop_ids = tuple(sorted(set(self.min_tokens_stop_ids)))
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**31
               for t in stop_ids):
            raise InvalidSamplingParams("min_tokens_stop_ids must be token ids")
        object.__setattr__(self, "min_tokens_stop_ids", stop_ids)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) \
            else self.logit_bias
        pairs = {}
        for token, value in bias:
            if isinstance(token, bool) or not isinstance(token, int) \
                    or not 0 <= token < 2**31:
                raise InvalidSamplingParams(f"logit_bias keys must be token ids, got {token!r}")
            if not math.isfinite(value):
                raise InvalidSamplingParams(f"logit_bias values must be finite, got {value}")
            pairs[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(value)))
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs.items())))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def processes_logits(self) -> bool:
        """Whether the next token depends on the text so far beyond the model's logits."""
        return bool(self.logit_bias) or self.presence_penalty != 0 \
            or self.frequency_penalty != 0 or self.repetition_penalty != 1 \
            or self.suppresses_stops

    @property
    def suppresses_stops(self) -> bool:
        return self.min_tokens > 0 and bool(self.min_tokens_stop_ids)

    def make_generator(self) -> torch.Generator:
        """The request's own random stream (seeded if a seed was given)."""
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed % 2**63)
        return g


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int],
                   generated: Sequence[int],
                   extra: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """``logits [R, V]``, row r the LLM's logits after ``prompt + generated + extra[r]``
    (``extra``: a tree node's path, counted as generated; default none), with the
    request's processors applied: repetition penalty over the prompt and generated tokens,
    then frequency and presence penalties over the generated ones, then logit bias, then
    min_tokens (a row whose next token would be generated token number < min_tokens, from
    0, gets its stop ids at -LOGIT_LIMIT: no probability at any temperature); clamped to
    +-LOGIT_LIMIT. Returned as float32 (the input when there is nothing to do).
    The shared text is counted once; each row adds only its own few tokens."""
    if not params.processes_logits:
        return logits
    out = logits.float().clone()
    vocab = out.shape[-1]

    def counts(tokens: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        return torch.bincount(ids, minlength=vocab)[:vocab].float()

    base = counts(generated)
    in_prompt = counts(prompt) > 0 if params.repetition_penalty != 1 else None
    for r, tokens in enumerate(extra or [()] * out.shape[0]):
        row = out[r]
        seen = base + counts(tokens) if tokens else base
        if in_prompt is not None:
            scaled = torch.where(row > 0, row / params.repetition_penalty,
                                 row * params.repetition_penalty)
            row.copy_(torch.where(in_prompt | (seen > 0), scaled, row)
                      .clamp(-LOGIT_LIMIT, LOGIT_LIMIT))
        row -= params.frequency_penalty * seen + params.presence_penalty * (seen > 0)
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.long)
        bias = torch.tensor([b for t, b in params.logit_bias if t < vocab])
        out[:, ids] += bias
    out.clamp_(-LOGIT_LIMIT, LOGIT_LIMIT)
    if params.suppresses_stops:
        stops = torch.tensor([t for t in params.min_tokens_stop_ids if t < vocab],
                             dtype=torch.long)
        for r, tokens in enumerate(extra or [()] * out.shape[0]):
            if len(generated) + len(tokens) < params.min_tokens:
                out[r, stops] = -LOGIT_LIMIT
    return out


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Distribution to sample from, ``[..., V]`` float32. Greedy requests get a one-hot on
    the argmax (the limit of temperature → 0), so one code path serves both."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token once the mass of the tokens before it already reaches top_p;
        # the most likely token is always kept.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    if params.min_p > 0:
        floor = params.min_p * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely tokens at its position."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Log-probabilities of ``tokens[i]`` under ``logits[i]`` (``[n, V]``), the LLM's raw
    distribution (before temperature and truncation, as vLLM and OpenAI report them), with
    the ``top`` most likely tokens of each row."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1).tolist()
    if top:
        values, ids = logp.topk(top, dim=-1)
        values, ids = values.tolist(), ids.tolist()
    else:
        values = ids = [[] for _ in tokens]
    return [TokenLogprob(lp, tuple(i), tuple(v)) for lp, i, v in zip(chosen, ids, values,
                                                                     strict=True)]


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token from a 1-D distribution."""
    return int(torch.multinomial(probs.to(torch.float64), 1, generator=generator))


def uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))
