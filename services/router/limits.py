"""The router's request limits, each with a flag and a default, and each answered with a
message naming it: HTTP 400 (413 for the body, 429 for streams per key) or gRPC
INVALID_ARGUMENT (RESOURCE_EXHAUSTED for streams per key and oversized messages)."""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from specinfer.errors import InvalidArgument, ResourceExhausted
from specinfer.models import ModelError
from specinfer.sampling import MAX_LOGPROBS


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 16 * 1024 * 1024
    max_prompt_tokens: int = 0  # 0: the verifiers' context, less one token to generate
    max_tokens: int = 0  # 0: what fits in the context after the prompt
    max_n: int = 8
    max_stop_strings: int = 16
    max_stop_chars: int = 1024
    max_logprobs: int = MAX_LOGPROBS
    max_streams_per_key: int = 256
    max_prompts: int = 32  # prompts in one completions request (a batch)

    def check_stop(self, field: str, stop: list[str]) -> None:
        if len(stop) > self.max_stop_strings:
            raise InvalidArgument(field, f"{len(stop)} stop strings; at most "
                                  f"{self.max_stop_strings} (--max-stop-strings)")
        for i, s in enumerate(stop):
            if len(s) > self.max_stop_chars:
                raise InvalidArgument(f"{field}[{i}]", f"{len(s)} characters; at most "
                                      f"{self.max_stop_chars} (--max-stop-chars)")

    def check_prompt(self, field: str, tokens: int) -> None:
        if self.max_prompt_tokens and tokens > self.max_prompt_tokens:
            raise InvalidArgument(field, f"{tokens} tokens; at most {self.max_prompt_tokens} "
                                  "(--max-prompt-tokens)")

    def check_max_tokens(self, field: str, value: int) -> None:
        if self.max_tokens and value > self.max_tokens:
            raise InvalidArgument(field, f"{value}; at most {self.max_tokens} (--max-tokens)")

    def check_logprobs(self, field: str, value: int | None) -> None:
        if value is not None and value > self.max_logprobs:
            raise InvalidArgument(field, f"{value}; at most {self.max_logprobs} "
                                  "(--max-logprobs)")


def add_flags(p: argparse.ArgumentParser) -> None:
    d = Limits()
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="largest HTTP request body and gRPC request message (HTTP 413)")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                   help="longest prompt in tokens (0: the model's context less one)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="largest max_tokens a request may ask for (0: no limit but the "
                        "context; longer requests are cut at the context)")
    p.add_argument("--max-n", type=int, default=d.max_n, help="most choices (n) per request")
    p.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                   help="most stop strings per request")
    p.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars,
                   help="longest stop string, in characters")
    p.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help=f"most alternatives per token with logprobs (<= {MAX_LOGPROBS})")
    p.add_argument("--max-streams-per-key", type=int, default=d.max_streams_per_key,
                   help="requests (choices) one API key may have in flight at once (HTTP "
                        "429 / RESOURCE_EXHAUSTED past it); without keys, all requests share "
                        "one count")
    p.add_argument("--max-prompts", type=int, default=d.max_prompts,
                   help="most prompts in one /v1/completions request (a list of prompts: "
                        "one choice each, times n)")


def from_flags(args: argparse.Namespace) -> Limits:
    limits = Limits(args.max_body_bytes, args.max_prompt_tokens, args.max_tokens, args.max_n,
                    args.max_stop_strings, args.max_stop_chars, args.max_logprobs,
                    args.max_streams_per_key, args.max_prompts)
    for name, value in vars(limits).items():
        least = 1 if name in ("max_body_bytes", "max_n", "max_streams_per_key",
                              "max_prompts") else 0
        if value < least:
            raise ModelError(f"--{name.replace('_', '-')} must be >= {least}; got {value}")
    if limits.max_logprobs > MAX_LOGPROBS:
        raise ModelError(f"--max-logprobs must be <= {MAX_LOGPROBS}; got {limits.max_logprobs}")
    return limits


class KeyStreams:
    """Requests in flight per API key."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.live: Counter[str] = Counter()

    @contextmanager
    def hold(self, key: str, n: int = 1) -> Iterator[None]:
        if self.live[key] + n > self.limit:
            raise ResourceExhausted(f"{self.live[key]} requests of this API key in flight; "
                                    f"at most {self.limit} (--max-streams-per-key)",
                                    retry_after_s=1)
        self.live[key] += n
        try:
            yield
        finally:
            self.live[key] -= n
            if not self.live[key]:
                del self.live[key]
