"""The ``specinfer`` command (docs/architecture.md, "Commands"): parses, then dispatches to
the command's own module. Each service's flags and composition live beside it
(``services/<role>/main.py``): its flags are a frozen config class (``specinfer.config``)
and ``run`` builds the service from the parsed config. ``up`` is ``services.stack``
(declared the same way), ``generate`` ``services.generate``, and the training commands
``specinfer.training.commands``, which still add argparse flags themselves. Only the module
of the command being run is imported (so a serving process never loads training code);
``--help`` imports them all."""

from __future__ import annotations

import argparse
import importlib
import sys

from services.parent import follow_parent
from specinfer.config import add_arguments, from_namespace
from specinfer.models import ModelError

# (command, role) -> (help, module, its config class or flags function, its run function)
COMMANDS = {
    ("serve", "verifier"): ("the LLM and its KV cache", "services.verifier.main",
                            "VerifierConfig", "run"),
    ("serve", "speculator"): ("SSMs and drafters: token trees", "services.speculator.main",
                              "SpeculatorConfig", "run"),
    ("serve", "router"): ("the public API and the scheduler", "services.router.main",
                          "RouterConfig", "run"),
    ("boost-tune", None): ("train a boost-tuned SSM pool", "specinfer.training.commands",
                           "add_boost_args", "boost_tune"),
    ("train-head", None): ("train a draft head on the LLM's features from a boost-tune run's "
                           "data", "specinfer.training.commands", "add_head_args",
                           "train_head"),
    ("up", None): ("the whole stack on this machine", "services.stack", "UpConfig", "run"),
    ("generate", None): ("generate through a running stack", "services.generate", "add_args",
                         "run"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``only``, the flags of that command alone are filled in."""
    parser = argparse.ArgumentParser(prog="specinfer", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one service, as the Helm chart does")
    roles = serve.add_subparsers(dest="role", required=True)
    for (command, role), (text, module, flags, _) in COMMANDS.items():
        p = roles.add_parser(role, help=text) if role else sub.add_parser(command, help=text)
        if only in (None, command):
            declared = getattr(importlib.import_module(module), flags)
            if isinstance(declared, type):
                add_arguments(p, declared)
            else:
                declared(p)
    return parser


def _command(argv: list[str]) -> str | None:
    """The command named in ``argv`` (None for none, e.g. a bare ``--help``)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--log-level")
    pre.add_argument("command", nargs="?")
    known, _ = pre.parse_known_args(argv)
    return known.command if (known.command, None) in COMMANDS or known.command == "serve" \
        else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command(argv)).parse_args(argv)
    from specinfer.logs import setup_logging
    from specinfer.tls import TlsError
    from specinfer.tracing import TracingError

    role = getattr(args, "role", None)
    setup_logging(f"{args.command}-{role or ''}".strip("-"), args.log_level)
    follow_parent()  # a service `up` started ends with it
    _, name, flags, run = COMMANDS[(args.command, role)]
    module = importlib.import_module(name)
    declared = getattr(module, flags)
    try:
        config = from_namespace(declared, args) if isinstance(declared, type) else args
        return getattr(module, run)(config)
    except (ModelError, TracingError, TlsError) as exc:
        print(f"specinfer: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
