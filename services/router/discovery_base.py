"""What every discovery source shares (``discovery`` describes the sources and their
contract): the roles, the error a bad flag raises, address formatting, and ``Discovery``,
the base that reports each role's set, deduplicated and logged."""

from __future__ import annotations

import abc
import asyncio
import logging
import re
from collections.abc import Callable

# One logger for every discovery source, so operators filter on one name.
log = logging.getLogger("services.router.discovery")

ROLES = ("verifier", "speculator")
MODES = ("static", "dns", "kubernetes")
DEFAULT_INTERVAL_S = {"static": 0.0, "dns": 5.0, "kubernetes": 300.0}

OnChange = Callable[[str, frozenset[str]], None]


class DiscoveryError(ValueError):
    """A discovery flag that cannot work (the router exits 2 with this message)."""


def port_number(text: str, flag: str, target: str) -> int:
    if not re.fullmatch(r"[0-9]{1,5}", text) or not 0 < int(text) < 65536:
        raise DiscoveryError(f"{flag} {target!r}: the port must be 1-65535; got {text!r}")
    return int(text)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Discovery(abc.ABC):
    """The base: reports each role's set through ``on_change``, deduplicated."""

    source = "static"

    def __init__(self) -> None:
        self._on_change: OnChange | None = None
        self._last: dict[str, frozenset[str]] = {}
        self._tasks: list[asyncio.Task] = []

    @abc.abstractmethod
    async def start(self, on_change: OnChange) -> None:
        """Report each role's set once, then keep reporting changes (see ``discovery``)."""

    def _report(self, role: str, addresses: frozenset[str]) -> None:
        last = self._last.get(role)
        if last == addresses:
            return
        self._last[role] = addresses
        if last is not None:
            for a in sorted(addresses - last):
                log.info("discovery: address added",
                         extra={"role": role, "address": a, "source": self.source})
            for a in sorted(last - addresses):
                log.info("discovery: address removed",
                         extra={"role": role, "address": a, "source": self.source})
        else:
            log.info("discovery: initial addresses", extra={
                "role": role, "addresses": sorted(addresses), "source": self.source})
        if self._on_change is not None:
            try:
                self._on_change(role, addresses)
            except Exception:  # the router's bug must not stop discovery
                log.exception("discovery: on_change failed", extra={"role": role})

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        pending = set(tasks)
        while pending:
            for t in pending:
                t.cancel()
            # Cancelled again until done: on Python < 3.12 ``asyncio.wait_for`` loses a
            # cancellation that lands as its inner call completes (CPython gh-86296), and
            # a watch loop would run on, and an ``await`` of it never return.
            done, pending = await asyncio.wait(pending, timeout=0.5)
            for t in done:
                if not t.cancelled():
                    t.exception()  # retrieved: a task that failed is not logged at exit
