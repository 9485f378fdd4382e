"""The router's CPU time per step on its emit path, for one long generation: a step's tokens
appended to the request (max_tokens, stop tokens, stop strings) and its stream's next text
delta (``Generation.deltas``), as the scheduler and the API servicers run them, now and at a
baseline revision whose ``services/router/request.py`` and ``frontend.py`` are read from git
(before the incremental detokenizer: ``0a1a295`` decoded the whole generation each step).

The tokens are MT-Bench first turns (real text), ``--tokens`` of them, ``--per-step`` per
step; with and without stop strings (that never match, so the generation runs to the end).
No model runs: only the router's side is timed (process CPU time).

    .venv/bin/python -m bench.router_cpu --tokens 4096
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
import types

from services.router import frontend, request
from specinfer.data import mtbench_first_turns
from specinfer.models import DEFAULT_LLM, load_tokenizer
from specinfer.sampling import SamplingParams

NEVER = ["\n\nUser:", "</answer>"]  # stop strings the text does not hold


def revision_module(rev: str, path: str) -> types.ModuleType:
    """The module at ``path`` as it was at git revision ``rev``."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True,
                            check=True).stdout
    name = f"baseline_{path.replace('/', '_').removesuffix('.py')}"
    module = types.ModuleType(name)
    module.__file__ = f"{rev}:{path}"
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def generation_tokens(tokenizer, count: int) -> list[int]:
    text = "\n\n".join(turn for _, turn in mtbench_first_turns())
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return (ids * (count // len(ids) + 1))[:count]


def step_times(request_module, new_generation, tokenizer, tokens: list[int], per_step: int,
               stop: list[str]) -> list[float]:
    """CPU seconds of each step: append its tokens, then take the stream's next delta."""
    def detokenize(ids: list[int]) -> str:  # the router's (services/router/main.py)
        return tokenizer.decode(ids, skip_special_tokens=True)

    eos = {tokenizer.eos_token_id}
    req = request_module.GenRequest([1], len(tokens), SamplingParams(), stop=stop)
    deltas = new_generation(req).deltas()
    text, times = [], []

    async def run() -> None:
        for at in range(0, len(tokens), per_step):
            start = time.process_time()
            new = req.append(tokens[at:at + per_step], eos, detokenize)
            req.events.put_nowait(("tokens", new))
            text.append((await deltas.__anext__())[1])
            times.append(time.process_time() - start)
        req.events.put_nowait(("done", req.finish_reason))
        text.append((await deltas.__anext__())[1])

    asyncio.run(run())
    assert req.generated == tokens and "".join(text) == detokenize(tokens)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens generated")
    parser.add_argument("--per-step", type=int, nargs="+", default=[1, 4],
                        help="tokens each step emits (1: plain decoding)")
    parser.add_argument("--baseline", default="0a1a295", help="git revision to compare with")
    args = parser.parse_args()
    tokenizer = load_tokenizer(DEFAULT_LLM)
    tokens = generation_tokens(tokenizer, args.tokens)
    old_request = revision_module(args.baseline, "services/router/request.py")
    old_frontend = revision_module(args.baseline, "services/router/frontend.py")
    old_fe = old_frontend.Frontend(tokenizer, "m", len(tokenizer))
    paths = {args.baseline: (old_request, lambda req: old_frontend.Generation(req, old_fe)),
             "now": (request, frontend.Generation)}
    last = max(1, args.tokens // 16)
    print(f"{args.tokens} tokens; CPU time per step, microseconds (first, last: the steps "
          f"of the first and the last {last} tokens)")
    print(f"{'code':>10} {'stop strings':>12} {'tokens/step':>11} {'mean':>9} {'first':>9} "
          f"{'last':>9} {'total ms':>9}")
    for per_step in args.per_step:
        for stop in ([], NEVER):
            for name, (module, generation) in paths.items():
                times = step_times(module, generation, tokenizer, tokens, per_step, stop)
                window = max(1, last // per_step)
                head, tail = times[:window], times[-window:]
                print(f"{name:>10} {len(stop):>12} {per_step:>11} "
                      f"{statistics.mean(times) * 1e6:>9.1f} {statistics.mean(head) * 1e6:>9.1f} "
                      f"{statistics.mean(tail) * 1e6:>9.1f} {sum(times) * 1e3:>9.1f}")


if __name__ == "__main__":
    main()
