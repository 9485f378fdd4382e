"""How often speculative greedy output equals the same engine's plain greedy decoding, per
number format (issue: exactness per dtype). In float32 both also equal transformers'
``generate``; in bfloat16 and int8 different batch shapes (1 query vs a tree's rows) may
round differently, so a near-tie can flip a token and the texts part from there.

For each format: the 80 MT-Bench first turns (chat template), ``--new-tokens`` each, one
sequence at a time; plain decoding, then speculation with the verifier's own drafts
(draft head + model-free, ``--draft-nodes`` per step). Prints the share of prompts whose
tokens are identical and where the first difference falls; writes JSON. Where float32 runs
too, each other format's quality beside it: how many tokens its plain text keeps to
float32's (transformers') before the two part, on average.

    python -m bench.exactness [--formats float32,bfloat16,int8] [--prompts 80]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.harness import write_report
from services.verifier.engine import EngineConfig
from services.verifier.factory import build_engine
from services.verifier.local import generate_local
from specinfer.chat import chat_prompt_ids
from specinfer.data import mtbench_first_turns
from specinfer.drafting import DraftPlan
from specinfer.drafting.head import bundled_head
from specinfer.drafting.model_free import ModelFreeDrafter
from specinfer.models import DEFAULT_LLM, load_tokenizer
from specinfer.placement import resolve

FORMATS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"),
           "int8": ("bfloat16", "int8")}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llm", default=DEFAULT_LLM)
    ap.add_argument("--formats", default="float32,bfloat16,int8")
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--draft-nodes", type=int, default=16)
    ap.add_argument("--out", default="bench/results/exactness.json")
    args = ap.parse_args()
    tok = load_tokenizer(args.llm)
    prompts = [chat_prompt_ids(tok, p) for _, p in mtbench_first_turns()][: args.prompts]
    head = bundled_head(args.llm)
    report = {"llm": args.llm, "prompts": len(prompts), "new_tokens": args.new_tokens,
              "draft_nodes": args.draft_nodes, "formats": {}}
    plains: dict[str, list[list[int]]] = {}
    for name in args.formats.split(","):
        dtype, quantize = FORMATS[name]
        engine = build_engine(args.llm, EngineConfig(max_context=2048, slots=2),
                              drafter=ModelFreeDrafter(), head=str(head) if head else None,
                              placement=resolve("cpu", dtype, quantize, "off"))
        same, diffs, accepted, start = 0, [], [], time.perf_counter()
        plains[name] = []
        for ids in prompts:
            plain = generate_local(engine, [ids], args.new_tokens)[0]
            plains[name].append(plain.token_ids)
            sources = ("head", "model_free") if head else ("model_free",)
            spec = generate_local(engine, [ids], args.new_tokens,
                                  draft=DraftPlan(sources, args.draft_nodes))[0]
            d = first_difference(plain.token_ids, spec.token_ids)
            same += d is None
            if d is not None:
                diffs.append(d)
            accepted.append(len(spec.token_ids) / max(1, spec.steps))
        share = same / len(prompts)
        report["formats"][name] = {"identical": same, "share": share,
                                   "first_difference_at": sorted(diffs),
                                   "tokens_per_step": sum(accepted) / len(accepted),
                                   "seconds": time.perf_counter() - start}
        print(f"{name:<9} identical {same}/{len(prompts)} ({share:.1%}); differing prompts "
              f"part at tokens {sorted(diffs)}; {sum(accepted) / len(accepted):.2f} "
              f"tokens/step", flush=True)
    for name, texts in plains.items():
        if name == "float32" or "float32" not in plains:
            continue
        kept = [len(ref) if d is None else d for ref, text in zip(plains["float32"], texts,
                                                                   strict=True)
                for d in [first_difference(ref, text)]]
        report["formats"][name]["tokens_kept_to_float32"] = sum(kept) / len(kept)
        print(f"{name:<9} plain text keeps to float32's for {sum(kept) / len(kept):.1f} "
              f"tokens on average (of {args.new_tokens})", flush=True)
    write_report(Path(args.out), report)


if __name__ == "__main__":
    main()
