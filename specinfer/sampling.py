"""Sampling parameters and logits processing, shared by speculative and plain decoding.

``target_probs`` turns raw logits into the distribution a request samples from
(temperature → top-k → top-p → min-p, the order transformers applies them). Speculative
verification and incremental decoding both call it, so with and without speculation the
next token has the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs


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

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise InvalidSamplingParams(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidSamplingParams(f"top_k must be >= 0, got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            raise InvalidSamplingParams(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise InvalidSamplingParams(f"seed must be in [0, 2**64), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidSamplingParams(f"logprobs must be in [0, {MAX_LOGPROBS}], "
                                        f"got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self) -> torch.Generator:
        """The request's own random stream (seeded if a seed was given)."""
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed % 2**63)
        return g


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
