"""`make bench`: specinfer against the anchors, side by side, in one run.

Writes bench/results/<date>/{results.json, report.md, *.png} and prints a summary.

1. Latency at batch 1 on MT-Bench first turns (one per category with --quick, else
   --per-category each), greedy and T=0.7:
   transformers generate (plain), transformers assisted generation (our best SSM as
   assistant_model) and prompt lookup, llama.cpp on the same GGUF (greedy; where
   ``make bench-anchors`` installed it); specinfer engine-only with speculation off / on
   (model-free drafts only, 2 nodes; the default SSM tree; without --quick also a chain,
   the paper's tree and a dynamic tree),
   and the full gRPC stack off / on (adaptive). Runs are interleaved (A B A B ...) per
   prompt so drift cancels; figures are medians over prompts with their spread, plus mean
   accepted tokens per step, TTFT, time per output token, and where the time goes
   (speculation / verification / the rest).
2. Throughput under load through the stack: N concurrent streams, speculation on vs off
   (``bench.harness.speculation_on_off``, as ``python -m bench.onoff``).
3. Tree-shape sweep (engine-only): accepted tokens and tokens/s per shape.

    python -m bench.run [--quick] [--new-tokens 128] [--per-category 2] [--shape-prompts 8]
                        [--concurrency 1,2,4,8,16,32] [--pool DIR ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from bench.formats import anchors_python, llama_cpp
from bench.harness import Stack, format_on_off, speculation_on_off, time_prompts
from services.router.policy import HEAD
from services.speculator.engine import DEFAULT_EXPANSION, SpeculateSpec, SpeculatorEngine
from services.verifier.engine import EngineConfig
from services.verifier.factory import build_engine
from services.verifier.local import generate_local
from specinfer.chat import chat_prompt_ids
from specinfer.data import mtbench_first_turns
from specinfer.drafting import DraftPlan
from specinfer.drafting.datastore import sharegpt_datastore
from specinfer.drafting.head import bundled_head
from specinfer.drafting.model_free import ModelFreeDrafter
from specinfer.drafting.ssm import SSMDrafter
from specinfer.models import DEFAULT_LLM, default_pool, load_ssm, load_tokenizer
from specinfer.sampling import SamplingParams

GREEDY, STOCH = SamplingParams(), SamplingParams(temperature=0.7, seed=0)
PAPER = [1, 1, 3, 1, 1, 1, 1, 1]
HEAD_NODES = HEAD.max_nodes  # the stack's "head" mode: the same tree budget
SHAPES = {"chain-3": [1] * 3, "chain-4": [1] * 4, "chain-6": [1] * 6, "paper": PAPER,
          "w2-d4": [2, 1, 1, 1], "w3-d4": [3, 2, 1, 1], "w2-d6": [2, 1, 1, 1, 1, 1],
          "w3-d5": [3, 1, 1, 1, 1], "w4-d4": [4, 2, 1, 1], "w5-d3": [5, 1, 1]}
DYNAMIC_BUDGETS = (4, 8, 16, 32)  # node budgets of the dynamic tree in the sweep


class Prompt(NamedTuple):
    category: str
    text: str  # the user turn, as the stack gets it (it applies the chat template)
    ids: list[int]  # the same through the chat template, as the engine gets it


def hf_assistant(llm, ssm, vocab_ids):
    """Our SSM as a transformers assistant model: its reduced head spread over the full
    vocabulary (tokens outside it get logit 0)."""
    import copy

    assistant = copy.deepcopy(ssm)
    if vocab_ids is not None:
        head = torch.nn.Linear(llm.config.hidden_size, llm.config.vocab_size, bias=False)
        with torch.no_grad():
            head.weight.zero_()
            head.weight[vocab_ids] = ssm.lm_head.weight
        assistant.lm_head = head
    assistant.generation_config = copy.deepcopy(llm.generation_config)
    return assistant


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.tok = load_tokenizer(args.llm)
        self.datastore = sharegpt_datastore(self.tok)
        # The verifier's own drafts (draft head, then prompt lookup and datastore), as the
        # stack's "head" mode makes them; the speculator's sources are given per run.
        self.head = bundled_head(args.llm)
        self.engine = build_engine(args.llm, EngineConfig(max_context=2048, slots=4),
                                   drafter=ModelFreeDrafter(self.datastore),
                                   head=str(self.head) if self.head else None)
        self.llm = self.engine.executor.runtime.model
        self.refs = args.pool if args.pool is not None else default_pool(args.llm)
        self.drafters = [SSMDrafter.load(r, i, slots=4, llm_vocab_size=self.engine.vocab_size)
                         for i, r in enumerate(self.refs)]
        # transformers' assisted generation gets our best SSM in float32.
        self.assistant = hf_assistant(self.llm, *load_ssm(self.refs[0])) if self.refs else None
        self.counter = iter(range(10**9))

    # --- single runs, each returning {tokens, elapsed, ttft, accepted} -----------------

    def hf(self, ids, params, **kw):
        sample = dict(do_sample=True, temperature=params.temperature) if not params.greedy \
            else dict(do_sample=False)
        x = torch.tensor([ids])
        t = time.perf_counter()
        with torch.no_grad():
            out = self.llm.generate(x, attention_mask=torch.ones_like(x),
                                    max_new_tokens=self.args.new_tokens, **sample, **kw)
        n = out.shape[1] - len(ids)
        return {"tokens": n, "elapsed": time.perf_counter() - t, "accepted": None}

    def ours(self, ids, params, shape=None, dynamic=False, spec=True, max_nodes=0):
        """The engine in-process with the speculator's sources (SSM pool, prompt lookup,
        corpus datastore); ``shape`` [0] drafts without the SSMs."""
        trees = None
        if spec:
            engine = SpeculatorEngine(self.drafters, self.engine.vocab_size, expansion=shape,
                                      max_nodes=64, datastore=self.datastore)

            sid = f"s{next(self.counter)}"  # stable per sequence: the SSM KV cache hits

            def trees(histories):
                return engine.speculate([SpeculateSpec(f"{sid}-{i}", h, params,
                                                       shape or DEFAULT_EXPANSION, max_nodes,
                                                       dynamic)
                                         for i, h in enumerate(histories)])
        res = generate_local(self.engine, [ids], self.args.new_tokens, trees=trees,
                             params=params)[0]
        return {"tokens": len(res.token_ids), "elapsed": res.elapsed_s, "ttft": res.ttft_s,
                "accepted": sum(res.accepted_per_step) / max(1, res.steps),
                "draft_s": res.draft_s, "verify_s": res.verify_s}

    def ours_head(self, ids, params, max_nodes=HEAD_NODES):
        """The engine drafting its own trees: the draft head's chain and model-free drafts."""
        res = generate_local(self.engine, [ids], self.args.new_tokens, params=params,
                             draft=DraftPlan(("head", "model_free"), max_nodes))[0]
        return {"tokens": len(res.token_ids), "elapsed": res.elapsed_s, "ttft": res.ttft_s,
                "accepted": sum(res.accepted_per_step) / max(1, res.steps),
                "draft_s": 0.0, "verify_s": res.verify_s}

    def stack(self, addr: str, prompt: str, params: SamplingParams, spec: bool) -> dict:
        [r] = time_prompts(addr, [prompt], new_tokens=self.args.new_tokens,
                           speculation=spec, temperature=params.temperature,
                           seed=params.seed).requests
        out = {"tokens": r.tokens, "elapsed": r.seconds, "ttft": r.ttft_s}
        if r.stats is not None:
            out.update(accepted=sum(r.stats.accepted_per_step) / max(1, r.stats.steps),
                       draft_s=r.stats.speculate_s, verify_s=r.stats.verify_s)
        return out


def summarize(runs: list[dict]) -> dict:
    tps = [r["tokens"] / r["elapsed"] for r in runs]
    out = {"tokens_per_s": statistics.median(tps), "spread": [min(tps), max(tps)],
           "n": len(runs)}
    acc = [r["accepted"] for r in runs if r.get("accepted") is not None]
    if acc:
        out["accepted_per_step"] = statistics.mean(acc)
    if all("draft_s" in r for r in runs):
        # Where a request's time goes: drafting (for the stack: waiting on the speculator,
        # RPC included), verification (likewise), and the rest (prefill, scheduling,
        # streaming, RPC).
        total = sum(r["elapsed"] for r in runs)
        draft = sum(r["draft_s"] for r in runs) / total
        verify = sum(r["verify_s"] for r in runs) / total
        out["time_share"] = {"speculation": draft, "verification": verify,
                             "other": max(0.0, 1 - draft - verify)}
    ttft = [r["ttft"] for r in runs if r.get("ttft") is not None]
    if ttft:
        out["ttft_s"] = statistics.median(ttft)
        out["tpot_ms"] = statistics.median(
            (r["elapsed"] - r["ttft"]) / max(1, r["tokens"] - 1) * 1e3 for r in runs
            if r.get("ttft") is not None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llm", default=DEFAULT_LLM)
    ap.add_argument("--pool", nargs="*", default=None)
    ap.add_argument("--quick", action="store_true", help="8 prompts x 64 tokens, fewer systems")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--shape-prompts", type=int, default=8, help="prompts per tree shape")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.per_category, args.new_tokens, args.concurrency = 1, 64, "1,4"
    out = Path(args.out or f"bench/results/{datetime.date.today().isoformat()}")
    out.mkdir(parents=True, exist_ok=True)
    b = Bench(args)
    prompts = [Prompt(c, p, chat_prompt_ids(b.tok, p))
               for c, p in mtbench_first_turns(args.per_category)]
    print(f"{len(prompts)} MT-Bench prompts, {args.new_tokens} new tokens, pool {b.refs}")

    with Stack(["--max-context", "2048", *sum((["--ssm", r] for r in b.refs), [])]) as stack:
        systems = {
            "hf-generate": lambda q, p: b.hf(q.ids, p),
            "hf-prompt-lookup": lambda q, p: b.hf(q.ids, p, prompt_lookup_num_tokens=10),
            "ours-engine-off": lambda q, p: b.ours(q.ids, p, spec=False),
            "ours-engine-lookup": lambda q, p: b.ours(q.ids, p, [0], max_nodes=2),
            "ours-engine-tree": lambda q, p: b.ours(q.ids, p, DEFAULT_EXPANSION),
            **({"ours-engine-head": lambda q, p: b.ours_head(q.ids, p)} if b.head else {}),
            "ours-stack-off": lambda q, p: b.stack(stack.addr, q.text, p, False),
            "ours-stack-on": lambda q, p: b.stack(stack.addr, q.text, p, True),
        }
        if b.assistant is not None:
            systems["hf-assisted-ssm"] = lambda q, p: b.hf(q.ids, p,
                                                          assistant_model=b.assistant)
        if not args.quick:
            systems["ours-engine-chain"] = lambda q, p: b.ours(q.ids, p, [1] * 4)
            systems["ours-engine-paper"] = lambda q, p: b.ours(q.ids, p, PAPER)
            systems["ours-engine-dynamic"] = lambda q, p: b.ours(q.ids, p, PAPER, True)
        results = {"machine": {"platform": platform.platform(), "cpu": platform.processor(),
                               "cores": os.cpu_count(), "torch": torch.__version__,
                               "threads": torch.get_num_threads()},
                   "llm": args.llm, "dtype": str(b.engine.executor.dtype), "pool": b.refs,
                   "new_tokens": args.new_tokens, "prompts": len(prompts), "latency": {}}

        def save() -> None:  # after each phase, so a late failure keeps what was measured
            (out / "results.json").write_text(json.dumps(results, indent=2))
        for mode, params in (("greedy", GREEDY), ("T=0.7", STOCH)):
            runs: dict[str, list[dict]] = {k: [] for k in systems}
            by_cat: dict[str, dict[str, list[float]]] = {}
            for prompt in prompts:  # interleaved: every system on this prompt, in turn
                for name, fn in systems.items():
                    r = fn(prompt, params)
                    runs[name].append(r)
                    by_cat.setdefault(prompt.category, {}).setdefault(name, []).append(
                        r["tokens"] / r["elapsed"])
            summary = {k: summarize(v) for k, v in runs.items()}
            if mode == "greedy":  # llama.cpp on the same GGUF (make bench-anchors), greedy
                cpp = llama_cpp([q.ids for q in prompts], args.new_tokens, anchors_python())
                if cpp is not None:
                    summary["llama.cpp"] = {"tokens_per_s": statistics.median(cpp),
                                            "spread": [min(cpp), max(cpp)]}
                else:
                    print("llama.cpp: not installed (make bench-anchors)")
            base = summary["hf-generate"]["tokens_per_s"]
            for s in summary.values():
                s["speedup"] = s["tokens_per_s"] / base
            results["latency"][mode] = {"systems": summary, "by_category": {
                c: {k: statistics.median(v) for k, v in d.items()} for c, d in by_cat.items()}}
            print(f"\n[{mode}] batch 1")
            print(f"{'system':<22} {'tok/s':>7} {'speedup':>8} {'acc/step':>9} {'TTFT s':>7}")
            for k, s in summary.items():
                print(f"{k:<22} {s['tokens_per_s']:>7.1f} {s['speedup']:>8.2f} "
                      f"{s.get('accepted_per_step', float('nan')):>9.2f} "
                      f"{s.get('ttft_s', float('nan')):>7.2f}")
            save()
        # Throughput: every prompt at each number of streams, one pass off, one on (each
        # pass times all the prompts; the latency phase above was the warm-up).
        results["load"] = speculation_on_off(stack.addr, [q.text for q in prompts],
                                             [int(x) for x in args.concurrency.split(",")],
                                             new_tokens=args.new_tokens, warmup=False)
        print("\nunder load\n" + format_on_off(results["load"]))
        save()
        if not args.quick:
            results["shapes"] = shape_sweep(b, [q.ids for q in prompts[:args.shape_prompts]])
    (out / "results.json").write_text(json.dumps(results, indent=2))
    write_report(results, out)
    print(f"\nwrote {out}/results.json, report.md and plots")


def shape_sweep(b: Bench, prompts) -> list[dict]:
    """Static trees (width x depth) and the dynamic tree under several node budgets."""
    rows = []
    print(f"\n{'shape':<12} {'acc/step':>9} {'tok/s':>7}")
    configs = [(name, shape, False, 0) for name, shape in SHAPES.items()]
    configs += [(f"dynamic-{n}", PAPER, True, n) for n in DYNAMIC_BUDGETS]
    for name, shape, dynamic, budget in configs:
        runs = [b.ours(ids, GREEDY, shape, dynamic, max_nodes=budget) for ids in prompts]
        s = summarize(runs)
        rows.append({"shape": name, "expansion": shape, "dynamic": dynamic,
                     "max_nodes": budget, **s})
        print(f"{name:<12} {s['accepted_per_step']:>9.2f} {s['tokens_per_s']:>7.1f}")
    return rows


def write_report(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [f"# specinfer benchmark — {datetime.date.today().isoformat()}", "",
             f"LLM `{results['llm']}` ({results['dtype']}), SSM pool {results['pool']}, "
             f"{results['prompts']} MT-Bench first turns, {results['new_tokens']} new tokens.",
             f"Machine: {results['machine']}", ""]
    for mode, data in results["latency"].items():
        lines += [f"## Batch 1, {mode}", "", "| system | tok/s (median) | spread | speedup | "
                  "accepted/step | TTFT s | TPOT ms | time: speculation / verification / "
                  "other |", "|---|---|---|---|---|---|---|---|"]
        for k, s in data["systems"].items():
            share = s.get("time_share")
            share = " / ".join(f"{share[x]:.0%}" for x in ("speculation", "verification",
                                                          "other")) if share else "–"
            lines.append(f"| {k} | {s['tokens_per_s']:.1f} | {s['spread'][0]:.1f}–"
                         f"{s['spread'][1]:.1f} | {s['speedup']:.2f}× | "
                         f"{s.get('accepted_per_step', float('nan')):.2f} | "
                         f"{s.get('ttft_s', float('nan')):.2f} | "
                         f"{s.get('tpot_ms', float('nan')):.0f} | {share} |")
        lines.append("")
        fig, ax = plt.subplots(figsize=(8, 4))
        names = list(data["systems"])
        ax.barh(names, [data["systems"][k]["speedup"] for k in names], color="#4c72b0")
        ax.axvline(1.0, color="grey", linestyle="--")
        ax.set_xlabel("speedup vs transformers generate (batch 1)")
        ax.set_title(mode)
        fig.tight_layout()
        fname = f"latency-{mode.replace('=', '').replace('.', '')}.png"
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        lines += [f"![{mode}]({fname})", ""]
    lines += ["## Under load (stack)", "", "Aggregate output tokens/s of every prompt at each "
              "number of concurrent streams, one pass off and one on.", "",
              format_on_off(results["load"]), "", _plot_load(results["load"], out, plt), ""]
    if "shapes" in results:
        lines += ["", "## Tree shapes (engine-only, greedy)", "",
                  "| shape | accepted/step | tok/s |", "|---|---|---|"]
        lines += [f"| {r['shape']} {'' if r.get('dynamic') else r['expansion']} | "
                  f"{r['accepted_per_step']:.2f} | {r['tokens_per_s']:.1f} |"
                  for r in results["shapes"]]
        lines += ["", _plot_shapes(results["shapes"], out, plt), ""]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _plot_load(rows: list[dict], out: Path, plt) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, color, label in (("off", "#888888", "speculation off"),
                              ("on", "#4c72b0", "speculation on (adaptive)")):
        mine = [r[key] for r in rows]
        ax.errorbar([r["streams"] for r in rows], [m["tokens_per_s"] for m in mine],
                    yerr=[[m["tokens_per_s"] - m["spread"][0] for m in mine],
                          [m["spread"][1] - m["tokens_per_s"] for m in mine]],
                    marker="o", capsize=3, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s (median, spread)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "load.png", dpi=110)
    plt.close(fig)
    return "![under load](load.png)"


def _plot_shapes(rows: list[dict], out: Path, plt) -> str:
    """Accepted tokens per step against speed: the tree worth defaulting to is up and right."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(r["accepted_per_step"], r["tokens_per_s"],
                   color="#dd8452" if r.get("dynamic") else "#4c72b0")
        ax.annotate(r["shape"], (r["accepted_per_step"], r["tokens_per_s"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("accepted tokens per LLM step")
    ax.set_ylabel("tokens/s (engine-only, batch 1)")
    ax.set_title("tree shapes: static (blue), dynamic by node budget (orange)")
    fig.tight_layout()
    fig.savefig(out / "shapes.png", dpi=110)
    plt.close(fig)
    return "![tree shapes](shapes.png)"


if __name__ == "__main__":
    main()
