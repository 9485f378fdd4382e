"""Where one verifier step goes, per operator class and number format, against the
bandwidth floor of its weights.

For each format (float32; bfloat16; int8 weights with bfloat16 activations) it builds the
verifier's engine on the LLM, fills a 128-token prefix, and times two forwards: a plain step
(one query) and a 16-node tree step (the root and 15 drafts, a random tree). It profiles
each with torch.profiler and sums the operators' own CPU time by class (linears, attention,
norms and rotary, other elementwise, copies and indexing, the rest); what the profiler does
not see inside the forward's wall time is Python and dispatch between operators. The floor
is the bytes a step must read (every linear's weights and scales, the vocabulary head
included, in the format's storage) over the copy bandwidth this script measures in the
same run (a 512 MiB tensor copied, reads + writes counted).

    python -m bench.step_profile [--llm REF] [--formats float32,bfloat16,int8] [--reps 20]

Prints one table and writes bench/results/step-profile-<date>/report.json."""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import date
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.harness import FORMATS, write_report
from bench.trees import random_tree
from bench.verifier_cost import PREFIX
from services.verifier.engine import EngineConfig
from services.verifier.executor import ForwardArgs
from services.verifier.factory import build_engine
from specinfer.models import DEFAULT_LLM
from specinfer.placement import resolve
from specinfer.tree import TokenTree, TreeBatch

# Operator name fragments by class, first match wins (aten and oneDNN names).
CLASSES = [
    ("linear", ("linear", "addmm", "int8pack", "mkldnn", "mkl_")),
    ("attention", ("bmm", "matmul", "softmax", "scaled_dot", "baddbmm", "attention")),
    ("norm+rotary", ("rms_norm", "rsqrt", "pow", "mean", "neg", "rotate", "roll")),
    ("elementwise", ("add", "mul", "silu", "sub", "div", "exp", "where", "masked_fill",
                     "sigmoid", "maximum", "fill")),
    ("copy+index", ("copy", "index", "cat", "clone", "contiguous",
                    "gather", "scatter", "select", "slice", "view", "reshape", "expand",
                    "narrow", "unsqueeze", "transpose", "permute", "as_strided", "empty",
                    "stack", "split", "chunk", "detach", "alias")),
]
# Names matched whole (as fragments they would match nearly every operator).
EXACT = {"aten::t": "copy+index", "aten::to": "copy+index", "aten::mm": "linear"}


def copy_bandwidth(mib: int = 512, reps: int = 5) -> float:
    """Bytes per second moved by a large tensor copy (read + write), best of ``reps``."""
    src = torch.ones(mib << 18, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def weight_bytes(config, fmt: str) -> int:
    """Bytes of every linear's weights (and int8's per-row scales) a step reads."""
    h, inter = config.hidden_size, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    shapes = [((heads + 2 * kv) * head_dim, h), (h, heads * head_dim),
              (2 * inter, h), (h, inter)] * config.num_hidden_layers
    shapes.append((config.vocab_size, h))
    per = {"float32": 4, "bfloat16": 2, "int8": 1}[fmt]
    scales = 4 if fmt == "int8" else 0  # a float32 scale per output row
    return sum(o * i * per + o * scales for o, i in shapes)


def classify(name: str) -> str:
    low = name.lower()
    if low in EXACT:
        return EXACT[low]
    low = low.split("::")[-1]
    for cls, parts in CLASSES:
        if any(p in low for p in parts):
            return cls
    return "other"


def profile_format(llm: str, fmt: str, reps: int) -> dict:
    dtype, quantize = FORMATS[fmt]
    engine = build_engine(llm, EngineConfig(max_context=PREFIX + 64, slots=1, max_tree_nodes=16),
                          placement=resolve("cpu", dtype, quantize))
    executor = engine.executor
    config = executor.runtime.config
    vocab = config.vocab_size
    gen = torch.Generator().manual_seed(0)
    # The queries attend over a 128-token prefix (its KV's values do not change the cost).

    def args_for(tree: TokenTree) -> ForwardArgs:
        batch = TreeBatch.build([tree], [1], [PREFIX])
        q = batch.tokens.shape[1]
        vis = None if q == 1 else batch.visibility(PREFIX + q)
        return ForwardArgs(batch.tokens, batch.position_ids, torch.tensor([0]),
                           batch.prefix_lens, vis)

    rows = {}
    for name, tree in (("plain", TokenTree()), ("tree16", random_tree(15, vocab, gen))):
        fa = args_for(tree)
        for _ in range(3):
            executor.forward(fa)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            executor.forward(fa)
            times.append(time.perf_counter() - start)
        wall_ms = 1e3 * statistics.median(times)
        n_prof = max(3, reps // 4)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(n_prof):
                executor.forward(fa)
        by_class = dict.fromkeys([c for c, _ in CLASSES] + ["other"], 0.0)
        ops = 0
        for event in prof.key_averages():
            by_class[classify(event.key)] += event.self_cpu_time_total / 1e3 / n_prof
            ops += event.count / n_prof
        seen = sum(by_class.values())
        by_class["python+dispatch"] = max(wall_ms - seen, 0.0)
        rows[name] = {"wall_ms": wall_ms, "ms_by_class": by_class, "operators": ops}
    return {"rows": rows, "weight_bytes": weight_bytes(config, fmt)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llm", default=DEFAULT_LLM)
    parser.add_argument("--formats", default="float32,bfloat16,int8")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    bandwidth = copy_bandwidth()
    report = {"llm": args.llm, "threads": torch.get_num_threads(),
              "copy_bandwidth_gb_s": bandwidth / 1e9, "formats": {}}
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write), "
          f"{torch.get_num_threads()} threads")
    classes = [c for c, _ in CLASSES] + ["other", "python+dispatch"]
    print(f"{'format':<9} {'step':<7} {'ms':>6} {'floor':>6} {'x floor':>7} {'ops':>5} "
          + " ".join(f"{c:>12}" for c in classes))
    for fmt in args.formats.split(","):
        out = profile_format(args.llm, fmt, args.reps)
        floor_ms = 1e3 * out["weight_bytes"] / bandwidth
        out["floor_ms"] = floor_ms
        plain = out["rows"]["plain"]["wall_ms"]
        out["tree16_over_plain"] = out["rows"]["tree16"]["wall_ms"] / plain
        for name, row in out["rows"].items():
            print(f"{fmt:<9} {name:<7} {row['wall_ms']:>6.1f} {floor_ms:>6.1f} "
                  f"{row['wall_ms'] / floor_ms:>6.2f}x {row['operators']:>5.0f} "
                  + " ".join(f"{row['ms_by_class'][c]:>12.1f}" for c in classes))
        print(f"{fmt:<9} tree16 / plain: {out['tree16_over_plain']:.2f}x")
        report["formats"][fmt] = out
    write_report(Path("bench/results") / f"step-profile-{date.today().isoformat()}" /
                 "report.json", report)


if __name__ == "__main__":
    main()
