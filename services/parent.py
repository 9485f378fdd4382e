"""Children that end with the process that started them, even when it is SIGKILLed:
``specinfer up``'s services and a verifier's rank processes would otherwise run on as
orphans, holding their ports, memory and KV slots."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

ENV = "SPECINFER_PARENT_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) naming this process as the child's parent, for
    ``follow_parent`` in the child."""
    return {**(os.environ if env is None else env), ENV: str(os.getpid())}


def follow_parent(grace_s: float = 60.0, kernel: bool = True) -> None:
    """In a process started with ``child_env``: once its parent is gone, SIGTERM itself (a
    clean stop: a verifier drains, a router frees its slots), and exit after ``grace_s``
    if that has not ended it. With ``kernel`` (Linux) the kernel sends the SIGTERM the
    moment the parent dies (``PR_SET_PDEATHSIG``: it fires when the parent's *thread*
    that started the child ends, so only for children started from a thread that lives as
    long as the process, as `up`'s main loop); a watch thread checks every second in any
    case (a parent gone before this ran, other systems)."""
    parent = os.environ.pop(ENV, None)  # popped: this process's own children get its pid
    if parent is None:
        return
    parent_pid = int(parent)
    if kernel and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
