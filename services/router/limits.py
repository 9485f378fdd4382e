"""The router's request limits, each with a flag and a default, and each answered with a
message naming it: HTTP 400 (413 for the body, 429 for streams per key) or gRPC
INVALID_ARGUMENT (RESOURCE_EXHAUSTED for streams per key and oversized messages)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from specinfer.config import Flags, flag
from specinfer.errors import InvalidArgument, ResourceExhausted
from specinfer.sampling import MAX_LOGPROBS


@dataclass(frozen=True)
class Limits(Flags):
    max_body_bytes: int = flag(16 * 1024 * 1024, "largest HTTP request body and gRPC request "
                               "message (HTTP 413)", minimum=1)
    max_prompt_tokens: int = flag(0, "longest prompt in tokens (0: the model's context less "
                                  "one)", minimum=0)
    max_tokens: int = flag(0, "largest max_tokens a request may ask for (0: no limit but the "
                           "context; longer requests are cut at the context)", minimum=0)
    max_n: int = flag(8, "most choices (n) per request", minimum=1)
    max_stop_strings: int = flag(16, "most stop strings per request", minimum=0)
    max_stop_chars: int = flag(1024, "longest stop string, in characters", minimum=0)
    max_logprobs: int = flag(MAX_LOGPROBS, "most alternatives per token with logprobs "
                             f"(<= {MAX_LOGPROBS})", minimum=0, maximum=MAX_LOGPROBS)
    max_streams_per_key: int = flag(256, "requests (choices) one API key may have in flight "
                                    "at once (HTTP 429 / RESOURCE_EXHAUSTED past it); without "
                                    "keys, all requests share one count", minimum=1)
    max_prompts: int = flag(32, "most prompts in one /v1/completions request (a list of "
                            "prompts: one choice each, times n)", minimum=1)

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
