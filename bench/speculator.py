"""Speculation quality and cost on MT-Bench first turns, engine-only (no RPC).

Mean accepted tokens per LLM step (bonus token included) for: each SSM alone, the merged
pool, n-gram alone, the corpus datastore alone, the model-free pair (n-gram + datastore,
the router's lookup modes), pool + n-gram (+ datastore); greedy and stochastic (T=0.7);
and tree shapes (a sequence vs trees of width 2-5). Then the verifier's draft head on the
LLM's features (``specinfer.drafting.head``), alone and with the model-free drafts (the router's
"head" mode), and the "merged" mode (the pool's trees sent to the verifier, merged there with
the head's and the model-free drafts). Also each drafter's draft-step cost relative to an
LLM step, and a length profile: accepted tokens per step over the first N tokens of answers up to
``max(--lengths)`` long, beside how much of those answers repeats itself (a small LLM's
greedy answers loop, and model-free drafts accept whole loops).
Prints tables, writes JSON and PNG plots.

    python -m bench.speculator [--pool DIR ...] [--head DIR|none] [--prompts 8]
                               [--new-tokens 64] [--lengths 64,128,256,512] [--quick]
                               [--lengths-only] [--merged-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from services.router.policy import MERGED
from services.speculator.engine import SpeculateSpec, SpeculatorEngine
from services.verifier.engine import EngineConfig
from services.verifier.factory import build_engine
from services.verifier.local import generate_local
from specinfer.chat import chat_prompt_ids
from specinfer.data import mtbench_first_turns
from specinfer.drafting import DraftPlan, DraftRequest
from specinfer.drafting.datastore import sharegpt_datastore
from specinfer.drafting.head import FeatureDrafter, bundled_head
from specinfer.drafting.model_free import ModelFreeDrafter
from specinfer.drafting.ssm import SSMDrafter
from specinfer.models import DEFAULT_LLM, default_pool, load_tokenizer
from specinfer.sampling import SamplingParams

MERGED_SHAPE = ",".join(str(w) for w in MERGED.expansion) or "old"  # what the router sends
SHAPES = {
    "chain-3": [1, 1, 1],
    "chain-4": [1, 1, 1, 1],
    "chain-6": [1, 1, 1, 1, 1, 1],
    "w2-d4": [2, 1, 1, 1],
    "w3-d4": [3, 2, 1, 1],
    "w4-d3": [4, 2, 1],
    "w2": [2, 1, 1, 1, 1, 1],
    "w3": [3, 1, 1, 1, 1],
    "paper-1,1,3,1,1,1,1,1": [1, 1, 3, 1, 1, 1, 1, 1],
    "w4": [4, 2, 1, 1, 1],
    "w5": [5, 1, 1, 1, 1],
}


def summarize(runs) -> dict:
    """Accepted tokens per step (bonus included) and tokens per second over ``runs``."""
    steps = sum(r.steps for r in runs)
    return {"accepted_per_step": sum(sum(r.accepted_per_step) for r in runs) / max(1, steps),
            "tokens_per_s": sum(len(r.token_ids) for r in runs) / sum(r.elapsed_s for r in runs),
            "steps": steps}


def run(engine, spec_engine, prompts, new_tokens, params, expansion, dynamic=False,
        max_nodes=0):
    runs = []
    for k, p in enumerate(prompts):
        def trees(histories, k=k):  # a stable id per sequence: the SSM KV cache hits
            return spec_engine.speculate([SpeculateSpec(f"p{k}-{i}", h, params, expansion,
                                                        max_nodes, dynamic)
                                          for i, h in enumerate(histories)])

        runs.append(generate_local(engine, [p], new_tokens, trees=trees, params=params)[0])
    return summarize(runs)


def draft_cost(drafter: SSMDrafter, engine, context: list[int], reps: int = 10) -> dict:
    """One draft level (a single-node forward) vs one LLM incremental step, same context."""
    features = None
    if isinstance(drafter, FeatureDrafter):  # the LLM's, as the verifier would hand them
        with torch.inference_mode():
            body = engine.executor.runtime.model.model
            features = body(input_ids=torch.tensor([context[:-1]])).last_hidden_state[0]
    drafter.propose([DraftRequest("cost", context, [1], features=features)])  # warm the cache
    xs = []
    for _ in range(reps):
        t = time.perf_counter()
        # re-feeds root + 1 level
        drafter.propose([DraftRequest("cost", context, [1, 1], features=features)])
        xs.append(time.perf_counter() - t)
    ssm_ms = statistics.median(xs) * 1e3 / 2
    from services.verifier.engine import PrefillSpec
    engine.prefill([PrefillSpec("cost", context)])
    root = engine.sequences["cost"].root
    ys = []
    for _ in range(reps):
        t = time.perf_counter()
        root = engine.decode([("cost", root)])[0].tokens[0]
        ys.append(time.perf_counter() - t)
    engine.release(["cost"])
    llm_ms = statistics.median(ys) * 1e3
    return {"ssm_level_ms": ssm_ms, "llm_step_ms": llm_ms, "ratio": ssm_ms / llm_ms}


def prefix_acceptance(runs, cuts: list[int]) -> dict[int, float]:
    """Accepted tokens per step over each answer's first ``cut`` tokens (the steps that
    began before token ``cut``), pooled over ``runs``."""
    out = {}
    for cut in cuts:
        tokens = steps = 0
        for r in runs:
            done = 0
            for a in r.accepted_per_step:
                if done >= cut:
                    break
                tokens, steps, done = tokens + a, steps + 1, done + a
        out[cut] = tokens / max(1, steps)
    return out


def repeated_ngrams(prompt: list[int], answer: list[int], n: int = 4) -> tuple[int, int]:
    """(answer n-grams seen earlier in prompt + answer, answer n-grams)."""
    ids, seen, repeated = prompt + answer, set(), 0
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i : i + n])
        if i + n > len(prompt):
            repeated += gram in seen
        seen.add(gram)
    return repeated, max(0, len(ids) - n + 1 - max(0, len(prompt) - n + 1))


def length_profile(engine, prompts, cuts: list[int], configs) -> list[dict]:
    """Per config (name, node budget, sampling, whether the engine's draft head drafts,
    with its default tree): accepted/step by answer prefix, answer lengths, repeated 4-gram
    share."""
    rows = []
    default = EngineConfig()
    set_head_tree(engine, default.head_expansion, default.head_dynamic)
    for name, budget, params, head in configs:
        plan = DraftPlan(("head", "model_free") if head else ("model_free",), budget)
        runs = [generate_local(engine, [p], max(cuts), params=params, draft=plan)[0]
                for p in prompts]
        rep = [repeated_ngrams(p, r.token_ids) for p, r in zip(prompts, runs, strict=True)]
        rows.append({"config": name, "by_prefix": prefix_acceptance(runs, cuts),
                     "answer_tokens": [len(r.token_ids) for r in runs],
                     "repeated_4grams": sum(a for a, _ in rep) / max(1, sum(b for _, b in rep))})
    return rows


def set_head_tree(engine, expansion, dynamic: bool) -> None:
    """The shape of the engine's draft head trees from now on (if it has a head)."""
    head = engine.drafts.by_name.get("head")
    if head is not None:
        head.expansion, head.dynamic = list(expansion), dynamic


def run_head(engine, prompts, new_tokens, params, expansion, max_nodes, dynamic) -> dict:
    """The verifier drafting its own trees: the head's tree (``dynamic``, else the static
    ``expansion``; at most the engine's ``head_nodes``), then model-free drafts, within
    ``max_nodes``."""
    set_head_tree(engine, expansion, dynamic)
    return summarize([generate_local(engine, [p], new_tokens, params=params,
                                     draft=DraftPlan(("head", "model_free"), max_nodes))[0]
                      for p in prompts])


def run_merged(engine, spec_engine, prompts, new_tokens, params, ssm_nodes: int,
               max_nodes: int, expansion: list[int] | None = None,
               ssm_only: bool = True) -> dict:
    """The router's "merged" mode: the SSM pool's trees (at most ``ssm_nodes``, of
    ``expansion``; with ``ssm_only``, no model-free drafts from the speculator) sent with
    each Step item, merged in the verifier with its head's tree (dynamic for greedy, in
    the room left) and model-free drafts, within ``max_nodes``."""
    set_head_tree(engine, EngineConfig().head_expansion, True)
    runs = []
    for k, p in enumerate(prompts):
        def trees(histories, k=k):
            return spec_engine.speculate([SpeculateSpec(f"m{k}-{i}", h, params,
                                                        list(expansion or []), ssm_nodes,
                                                        ssm_only=ssm_only)
                                          for i, h in enumerate(histories)])

        runs.append(generate_local(engine, [p], new_tokens, trees=trees, params=params,
                                   draft=DraftPlan(("head", "model_free"), max_nodes))[0])
    return summarize(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llm", default=DEFAULT_LLM)
    ap.add_argument("--pool", nargs="*", default=None,
                    help="SSM refs (default: bundled pool; none given: no SSM configs)")
    ap.add_argument("--prompts", type=int, default=8, help="MT-Bench first turns (<= 80)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--lengths", default="64,128,256,512",
                    help="answer prefixes for the length profile ('' for none)")
    ap.add_argument("--lengths-only", action="store_true",
                    help="only the length profile (e.g. with --prompts 80)")
    ap.add_argument("--head", default=None, help="draft head dir (default: bundled), or none")
    ap.add_argument("--quick", action="store_true", help="4 prompts x 32 tokens, fewer configs")
    ap.add_argument("--merged-only", action="store_true",
                    help="only plain decoding, the head mode and the merged mode")
    ap.add_argument("--merged-shapes", default=MERGED_SHAPE,
                    help="SSM tree shapes of the merged mode, ';'-separated expansions "
                         "(SSM-only trees; 'old' = the speculator's default tree with its "
                         "model-free drafts)")
    ap.add_argument("--out", default="bench/results/speculator")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.lengths = 4, 32, ""
    refs = args.pool if args.pool is not None else default_pool(args.llm)
    tokenizer = load_tokenizer(args.llm)
    turns = mtbench_first_turns()
    step = max(1, len(turns) // args.prompts)
    prompts = [chat_prompt_ids(tokenizer, p) for _, p in turns[::step][: args.prompts]]
    store = sharegpt_datastore(tokenizer)
    head = bundled_head(args.llm) if args.head is None else \
        (None if args.head == "none" else args.head)
    engine = build_engine(args.llm, EngineConfig(max_context=2048, slots=4),
                          drafter=ModelFreeDrafter(store), head=str(head) if head else None)
    vocab = engine.vocab_size
    drafters = [SSMDrafter.load(ref, i, slots=4, llm_vocab_size=vocab)
                for i, ref in enumerate(refs)]
    greedy, stoch = SamplingParams(), SamplingParams(temperature=0.7, seed=0)
    default = SHAPES["paper-1,1,3,1,1,1,1,1"]
    # (name, SSMs, prompt lookup, datastore, sampling, expansion, node budget)
    configs = []
    for i, d in enumerate(drafters):
        configs.append((f"ssm-{i + 1}", [d], False, None, greedy, default, 64))
    if len(drafters) > 1:
        configs.append(("pool", drafters, False, None, greedy, default, 64))
    configs.append(("ngram", [], True, None, greedy, [0], 64))
    configs.append(("datastore", [], False, store, greedy, [0], 64))
    for budget in (2, 6):
        configs.append((f"ngram+datastore, {budget} nodes", [], True, store, greedy, [0],
                        budget))
    configs.append(("ngram+datastore, 2 nodes T=0.7", [], True, store, stoch, [0], 2))
    if len(drafters) > 1:
        configs.append(("ssm-1+ngram", drafters[:1], True, None, greedy, default, 64))
    if drafters:  # `--pool` with no refs: model-free and head configs only
        configs.append(("pool+ngram", drafters, True, None, greedy, default, 64))
        configs.append(("pool+ngram+datastore", drafters, True, store, greedy, default, 64))
        configs.append(("pool+ngram T=0.7", drafters, True, None, stoch, default, 64))
    if drafters and not args.quick:
        for name, shape in SHAPES.items():
            if shape != default:
                configs.append((f"pool+ngram {name}", drafters, True, None, greedy, shape, 64))
        configs.append(("pool+ngram dynamic-32", drafters, True, None, greedy, default, 64))

    # (name, static expansion, node budget, sampling, dynamic): the verifier's own trees,
    # the head drafting at most EngineConfig.head_nodes of them
    head_configs = []
    if engine.drafts.head is not None:
        static = list(EngineConfig().head_expansion)
        head_configs = [("head chain-4", [1, 1, 1, 1], 4, greedy, False),
                        ("head dynamic + ngram+datastore, 16 nodes (default)", static, 16,
                         greedy, True),
                        (f"head {static} + ngram+datastore, 16 nodes T=0.7 (default)", static,
                         16, stoch, False)]
        if not args.quick:
            head_configs += [(f"head static {static} + ngram+datastore, 16 nodes", static, 16,
                              greedy, False),
                             ("head chain-4 + ngram+datastore, 16 nodes", [1, 1, 1, 1], 16,
                              greedy, False),
                             ("head dynamic + ngram+datastore, 8 nodes", static, 8, greedy,
                              True)]

    if args.merged_only:  # the head mode's defaults beside the merged mode
        configs, head_configs = [], [c for c in head_configs if c[0].endswith("(default)")]
        args.lengths = ""
    results = {"llm": args.llm, "pool": refs, "head": str(head) if head else None,
               "prompts": len(prompts), "new_tokens": args.new_tokens, "configs": []}
    if not args.lengths_only:  # the main table
        costed = [(f"ssm-{i + 1}", d) for i, d in enumerate(drafters)]
        if engine.drafts.head is not None:
            costed.append(("head", engine.drafts.head))
        results["draft_cost"] = []
        for name, d in costed:
            c = draft_cost(d, engine, prompts[0]) | {"drafter": name}
            results["draft_cost"].append(c)
            print(f"{name}: one draft level {c['ssm_level_ms']:.1f} ms vs LLM step "
                  f"{c['llm_step_ms']:.1f} ms = {c['ratio']:.3f}")
        plain = run(engine, SpeculatorEngine([], vocab, prompt_lookup=False), prompts,
                    args.new_tokens, greedy, [0])
        plain_tps = plain["tokens_per_s"]
        print(f"\n{'config':<62} {'acc/step':>9} {'tok/s':>7} {'vs plain':>9}")
        print(f"{'no speculation':<62} {1.0:>9.2f} {plain_tps:>7.1f} {1.0:>9.2f}")
        for name, pool, ngram, datastore, params, shape, budget in configs:
            spec = SpeculatorEngine(pool, vocab, prompt_lookup=ngram, expansion=shape, max_nodes=64,
                                    datastore=datastore)
            for d in pool:
                d.entries.clear()
            r = run(engine, spec, prompts, args.new_tokens, params, shape,
                    dynamic=name.endswith("dynamic-32"), max_nodes=budget)
            r.update(config=name, expansion=shape)
            results["configs"].append(r)
            print(f"{name:<62} {r['accepted_per_step']:>9.2f} {r['tokens_per_s']:>7.1f} "
                  f"{r['tokens_per_s'] / plain_tps:>9.2f}")
        for name, shape, budget, params, dynamic in head_configs:
            r = run_head(engine, prompts, args.new_tokens, params, shape, budget, dynamic)
            r.update(config=name, expansion=shape)
            results["configs"].append(r)
            print(f"{name:<62} {r['accepted_per_step']:>9.2f} {r['tokens_per_s']:>7.1f} "
                  f"{r['tokens_per_s'] / plain_tps:>9.2f}")
        if engine.drafts.head is not None and drafters:
            # The router's "merged" mode: SSM trees (12 nodes) + head + model-free, 24 nodes.
            spec = SpeculatorEngine(drafters, vocab, prompt_lookup=True, datastore=store,
                                    max_nodes=64)
            for shape in args.merged_shapes.split(";"):
                old = shape.strip() == "old"
                expansion = None if old else [int(w) for w in shape.split(",")]
                label = "speculator default + its ngram+datastore" if old else \
                    f"SSM-only {expansion}"
                for name, params in ((f"merged: pool 12 ({label}) + head, 24 nodes", greedy),
                                     (f"merged ({label}), T=0.7", stoch)):
                    for d in drafters:
                        d.entries.clear()
                    r = run_merged(engine, spec, prompts, args.new_tokens, params, 12, 24,
                                   expansion, ssm_only=not old)
                    r.update(config=name, expansion=expansion or list(spec.expansion))
                    results["configs"].append(r)
                    print(f"{name:<62} {r['accepted_per_step']:>9.2f} "
                          f"{r['tokens_per_s']:>7.1f} {r['tokens_per_s'] / plain_tps:>9.2f}")
        results["plain_tokens_per_s"] = plain_tps
    cuts = sorted(int(x) for x in args.lengths.split(",") if x.strip())
    if cuts:
        profile = [("ngram+datastore, 6 nodes", 6, greedy, False)]
        if engine.drafts.head is not None:
            profile += [("head (default tree) + ngram+datastore, 16 nodes", 16, greedy, True),
                        ("same, T=0.7", 16, stoch, True)]
        results["length_profile"] = length_profile(engine, prompts, cuts, profile)
        print(f"\naccepted/step over the answers' first N tokens (answers up to {cuts[-1]})")
        print(f"{'config':<62} " + " ".join(f"{c:>6}" for c in cuts) + "  repeated 4-grams")
        for row in results["length_profile"]:
            print(f"{row['config']:<62} " + " ".join(f"{row['by_prefix'][c]:>6.2f}" for c in cuts)
                  + f"  {row['repeated_4grams']:>16.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculator.json").write_text(json.dumps(results, indent=2))
    if results["configs"]:
        plot(results, out / "speculator.png")
    if results.get("length_profile"):
        plot_lengths(results, out / "speculator-lengths.png")
    print(f"wrote {out}/speculator.json and its plots")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c["config"] for c in results["configs"]]
    acc = [c["accepted_per_step"] for c in results["configs"]]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(names) + 1.5))
    ax.barh(names[::-1], acc[::-1], color="#4c72b0")
    ax.axvline(1.0, color="grey", linestyle="--", label="plain decoding")
    ax.set_xlabel("mean accepted tokens per LLM step (bonus included)")
    ax.set_title(f"MT-Bench first turns ({results['prompts']} prompts, "
                 f"{results['new_tokens']} new tokens)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_lengths(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in results["length_profile"]:
        cuts = sorted(int(c) for c in row["by_prefix"])
        ax.plot(cuts, [row["by_prefix"][c] for c in cuts], marker="o",
                label=f"{row['config']} (repeated 4-grams {row['repeated_4grams']:.0%})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("answer prefix (tokens)")
    ax.set_ylabel("mean accepted tokens per LLM step")
    ax.set_title(f"MT-Bench first turns ({results['prompts']} prompts): by answer length")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
