"""``specinfer generate``: one request through a running stack, with the gRPC SDK."""

from __future__ import annotations

import argparse
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="apply the chat template")
    p.add_argument("--no-speculation", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", default=None,
                       help="structured output: the answer is JSON valid against this "
                            "JSON Schema file")
    shape.add_argument("--json-object", action="store_true",
                       help="structured output: the answer is a JSON object")
    shape.add_argument("--regex", default=None,
                       help="structured output: the whole answer matches this regex")
    shape.add_argument("--choice", action="append", default=None, metavar="TEXT",
                       help="structured output: the answer is one of these (repeat it)")
    shape.add_argument("--grammar", metavar="FILE", default=None,
                       help="structured output: a Lark (or GBNF) grammar file")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--api-key", default=None,
                   help="the router's API key (default: SPECINFER_API_KEY)")
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="connect over TLS, trusting this CA (e.g. the one `up --tls` prints)")
    p.add_argument("--tls", action="store_true",
                   help="connect over TLS, trusting the system's CAs")


def run(args: argparse.Namespace) -> int:
    import json
    import time

    from specinfer.client import Client, SpecInferError

    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, speculation=not args.no_speculation)
    try:
        kwargs.update(_constraint(args))
    except OSError as exc:
        print(f"specinfer: {exc}", file=sys.stderr)
        return 2
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
        prompt = None
    else:
        prompt = args.prompt
    start = time.perf_counter()
    try:
        with Client(args.addr, timeout=args.timeout, api_key=args.api_key, tls=args.tls,
                    tls_ca=args.tls_ca) as client:
            if args.json:
                out = client.generate(prompt, **kwargs)
                elapsed = time.perf_counter() - start
                print(json.dumps({"text": out.text, "token_ids": out.token_ids,
                                  "finish_reason": out.finish_reason, "steps": out.steps,
                                  "accepted_per_step": out.accepted_per_step,
                                  "speculative_steps": out.stats.speculative_steps,
                                  "speculate_s": round(out.stats.speculate_s, 4),
                                  "verify_s": round(out.stats.verify_s, 4),
                                  "prompt_tokens": out.prompt_tokens,
                                  "elapsed_s": round(elapsed, 4),
                                  "tokens_per_s": round(len(out.token_ids) / elapsed, 2),
                                  "dtype": out.dtype}))
            else:
                for chunk in client.stream(prompt, **kwargs):
                    print(chunk.text, end="", flush=True)
                print()
    except SpecInferError as exc:
        print(f"specinfer: {exc}", file=sys.stderr)
        return 1
    return 0


def _constraint(args: argparse.Namespace) -> dict:
    """The SDK's structured-output argument the flags ask for (files read here)."""
    from pathlib import Path

    if args.json_schema:
        return {"json_schema": Path(args.json_schema).read_text()}
    if args.grammar:
        return {"grammar": Path(args.grammar).read_text()}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": args.choice}
    return {}
