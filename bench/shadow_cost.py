"""What the adaptive policy's shadow drafts cost the verifier, in process.

The default LLM, its bundled draft head and corpus datastore, B sequences (MT-Bench first
turns) decoded plain: the median Step time with and without each sequence's shadow draft
(the model-free tree of up to 6 nodes the router asks for to measure the lookup modes),
in alternating rounds.

    python -m bench.shadow_cost [--batch 8] [--rounds 3] [--steps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.harness import mtbench_prompts
from services.flags import load_datastore
from services.verifier.engine import EngineConfig, PrefillSpec, StepItem
from services.verifier.factory import build_engine
from specinfer.chat import chat_ids
from specinfer.drafting import DraftPlan
from specinfer.drafting.model_free import ModelFreeDrafter
from specinfer.models import DEFAULT_LLM, load_tokenizer

SHADOW = DraftPlan(("model_free",), 6)  # the router's shadow plan (lookup-2 and lookup-6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    tok = load_tokenizer(DEFAULT_LLM)
    engine = build_engine(DEFAULT_LLM, EngineConfig(max_context=2048, slots=args.batch),
                          drafter=ModelFreeDrafter(load_datastore("auto", DEFAULT_LLM)))
    prompts = [chat_ids(tok, [{"role": "user", "content": p}])
               for p in mtbench_prompts(2)[: args.batch]]
    roots = {o.sequence_id: o.token for o in engine.prefill(
        [PrefillSpec(f"s{i}", p) for i, p in enumerate(prompts)])}

    def median_step(shadow: bool) -> float:
        times = []
        for _ in range(args.steps):
            items = [StepItem(sid, root, shadow=SHADOW if shadow else DraftPlan())
                     for sid, root in roots.items()]
            start = time.perf_counter()
            for out in engine.step(items):
                roots[out.sequence_id] = out.tokens[-1]
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    median_step(False)  # warm-up
    for _ in range(args.rounds):
        plain, shadowed = median_step(False), median_step(True)
        print(f"batch {args.batch}: plain step {plain * 1e3:.1f} ms, with shadow drafts "
              f"{shadowed * 1e3:.1f} ms (+{(shadowed / plain - 1) * 100:.1f}%)")


if __name__ == "__main__":
    main()
