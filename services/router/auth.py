"""API keys on the router's public APIs: ``--api-key KEY`` (repeatable) or
``SPECINFER_API_KEY`` (comma-separated). With keys, the OpenAI API requires
``Authorization: Bearer KEY`` and the gRPC Router API the same in its metadata; health
checks (and ``/metrics`` unless ``--metrics-auth``) stay open for probes.

A key is compared in constant time with every configured key and never logged: logs and
per-key limits see its ``key_id``, a short hash."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

from specinfer.errors import Unauthenticated

ENV = "SPECINFER_API_KEY"
ANONYMOUS = "-"  # the key id of every request while no key is configured


def key_id(key: str) -> str:
    """What logs and limits call a key: not the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in dict.fromkeys(keys) if k]

    @classmethod
    def from_flags(cls, flags: list[str], environ: Mapping[str, str] | None = None) -> ApiKeys:
        environ = os.environ if environ is None else environ
        from_env = [k.strip() for k in environ.get(ENV, "").split(",")]
        return cls([k.strip() for k in flags] + from_env)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def check(self, authorization: str | None) -> str:
        """The key id of an ``Authorization`` value (``Bearer KEY``); raises
        ``Unauthenticated`` if keys are required and it holds none of them."""
        if not self._keys:
            return ANONYMOUS
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("no API key: send the header Authorization: Bearer KEY "
                                  "(gRPC: metadata authorization: Bearer KEY)")
        given = token.strip().encode()
        match = False
        for key in self._keys:  # every key, so the time does not say which one is close
            match |= hmac.compare_digest(given, key)
        if not match:
            raise Unauthenticated("incorrect API key")
        return key_id(given.decode(errors="replace"))
