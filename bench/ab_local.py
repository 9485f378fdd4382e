"""Two code trees, one workload, in alternating rounds: in-process generation (the
verifier engine's ``generate_local``, the code the service runs, minus RPC) on the default
LLM, so that a change's cost on requests it does not target is measured against the code
before it on the same machine in the same minutes (single runs drift 20-50% on this VM;
alternating A, B, B, A ... rounds cancel the drift).

    git worktree add /tmp/before 3865be9
    python -m bench.ab_local --code /tmp/before [--rounds 6] [--prompts 4]
                             [--new-tokens 64] [--draft none|lookup]
                             [--format float32|bfloat16|int8]

Each round runs each tree in a fresh process: build the engine, warm up on one prompt,
then time MT-Bench first turns one at a time, greedy (``--draft lookup``: the verifier's
prompt-lookup drafts, 16 nodes; ``none``: plain decoding). Prints tokens/s per round and
tree and the median ratio, checks both trees generated the same tokens, and writes
bench/results/ab-local-<date>/report.json."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from datetime import date
from pathlib import Path

from bench.harness import FORMATS, write_report

# Runs inside each tree (its own imports): what both the old and the new code expose.
WORKER = textwrap.dedent("""
    import json, sys, time
    from services.verifier.engine import EngineConfig
    from services.verifier.factory import build_engine
    from services.verifier.local import generate_local
    from specinfer.chat import chat_prompt_ids
    from specinfer.data import mtbench_first_turns
    from specinfer.models import DEFAULT_LLM, load_tokenizer
    from specinfer.placement import resolve
    from specinfer.plans import DraftPlan

    prompts_n, new_tokens, draft = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    placement = resolve("cpu", sys.argv[4], sys.argv[5])
    tokenizer = load_tokenizer(DEFAULT_LLM)
    prompts = [chat_prompt_ids(tokenizer, t) for _, t in mtbench_first_turns(1)][:prompts_n]
    engine = build_engine(DEFAULT_LLM, EngineConfig(max_context=1024, slots=2),
                          placement=placement)
    plan = DraftPlan(("model_free",), 16) if draft == "lookup" else None
    generate_local(engine, prompts[:1], 16, draft=plan)  # warm-up
    tokens, elapsed, outputs = 0, 0.0, []
    for p in prompts:
        start = time.perf_counter()
        [r] = generate_local(engine, [p], new_tokens, draft=plan)
        elapsed += time.perf_counter() - start
        tokens += len(r.token_ids)
        outputs.append(r.token_ids)
    import services, specinfer
    print(json.dumps({"tokens_per_s": tokens / elapsed, "tokens": tokens,
                      "outputs": outputs, "code": [specinfer.__file__, services.__file__]}))
""")


def run_tree(code: Path, prompts: int, new_tokens: int, draft: str, fmt: str = "float32"
             ) -> dict:
    out = subprocess.run([sys.executable, "-c", WORKER, str(prompts), str(new_tokens), draft,
                          *FORMATS[fmt]],
                         cwd=code, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(code), "HF_HUB_OFFLINE": "1"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(path.startswith(str(code)) for path in result["code"]), result["code"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", type=Path, required=True, help="the other tree (A)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draft", choices=["none", "lookup"], default="lookup")
    parser.add_argument("--format", choices=list(FORMATS), default="float32")
    args = parser.parse_args()
    trees = {"before": args.code.resolve(), "after": Path.cwd().resolve()}
    rows, same = [], True
    for k in range(args.rounds):
        order = ["before", "after"] if k % 2 == 0 else ["after", "before"]
        row = {}
        for name in order:
            row[name] = run_tree(trees[name], args.prompts, args.new_tokens, args.draft,
                                 args.format)
        same &= row["before"]["outputs"] == row["after"]["outputs"]
        rows.append({name: r["tokens_per_s"] for name, r in row.items()})
        print(f"round {k + 1}: before {rows[-1]['before']:.2f} tok/s, after "
              f"{rows[-1]['after']:.2f} tok/s, after/before "
              f"{rows[-1]['after'] / rows[-1]['before']:.3f}", flush=True)
    ratios = [r["after"] / r["before"] for r in rows]
    report = {"trees": {k: str(v) for k, v in trees.items()}, "rounds": rows,
              "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
              "ratio_max": max(ratios), "identical_outputs": same,
              "prompts": args.prompts, "new_tokens": args.new_tokens, "draft": args.draft,
              "format": args.format}
    print(f"after/before: median {report['ratio_median']:.3f} (min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}) over {args.rounds} rounds; outputs identical: {same}")
    name = f"ab-local-{date.today().isoformat()}-{args.format}-{args.draft}"
    out = Path("bench/results") / name / "report.json"
    write_report(out, report)


if __name__ == "__main__":
    main()
