"""The GPU half of ``bench/gpu_smoke.sh``: our runtime on a CUDA device, on a model of
SmolLM2-135M's exact shape with random weights (real weights cannot travel to an offline GPU
machine; a step costs the same whatever the weights hold), in bfloat16, eager and with
CUDA graphs, beside transformers on the same device in the same run.

It measures and prints as one table:
- start-up of each engine, and the graphs' capture time within it;
- a plain step (one query per row, 256-token prefix) at batch 1, 8 and 32: the forward
  pass alone, and a whole engine step (``generate_local``: sampling, acceptance and host
  work included) next to transformers' ``generate`` per token at the same batch;
- a 16- and a 64-node tree step at batch 1, over the plain step;
- exactness on the device: speculative greedy decoding (trees holding the engine's own
  plain continuation among decoys) = plain decoding, token for token, eager and graphs,
  and graphs = eager;
- row invariance: one row's logits alone, beside 7 other rows, and as the root of a 16-
  and a 64-node tree (bitwise equal or the largest difference): what decides whether
  speculation can change greedy text in this format on this device;
- sampling on the device: seeded sampled generation with trees, twice, the same tokens.

``--device cpu`` runs every part on the CPU (graphs: the same buckets and padding,
uncaptured), so that the script is checked without a GPU (``tests/test_gpu_smoke.py``).
Writes ``gpu_smoke.json`` and ``gpu_smoke_table.txt`` to ``--out``.

    python -m bench.gpu_smoke --out DIR [--device cuda] [--layers 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.exactness import first_difference
from bench.trees import random_tree, reference_oracle
from bench.verifier_cost import timed
from services.verifier.engine import EngineConfig, VerifierEngine
from services.verifier.executor import ForwardArgs
from services.verifier.factory import build_engine
from services.verifier.local import generate_local
from specinfer.placement import resolve
from specinfer.sampling import SamplingParams
from specinfer.tree import TokenTree, TreeBatch

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
TREE_SIZES = (16, 64)
TARGETS = {"graphs_over_eager_batch1": 2.0, "ours_over_generate_batch1": 1.5,
           "tree64_over_plain_max": 1.3}
UNTESTED = ["tensor parallel over NCCL (needs 2 GPUs and DeepSpeed)",
            "the gRPC services and the router on the GPU (no tokenizer travels here)",
            "real weights' acceptance rates (random weights; tokens/step from the CPU runs)",
            "float16 and int8 on the GPU (--quantize int8 is CPU-only)"]


def save_random_smollm2(path: Path, layers: int | None = None) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = SMOLLM2_135M | ({"num_hidden_layers": layers} if layers else {})
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(path)
    return str(path)


def timed_ms(fn: Callable[[], object], device: torch.device, reps: int,
             warmup: int = 2) -> float:
    """Median wall time of ``fn`` in ms, the device synchronized after each call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return timed(lambda: (fn(), sync()), reps, warmup)[0]


@dataclasses.dataclass
class Engine:
    name: str
    engine: VerifierEngine
    startup_s: float
    capture_s: float | None  # the graphs' share of start-up

    def forward(self, args: ForwardArgs) -> torch.Tensor:
        return self.engine.executor.forward(args)


def start_engine(model_dir: str, device: str, dtype: str, graphs: bool, slots: int,
                 max_nodes: int, max_context: int) -> Engine:
    """An engine in ``dtype`` on ``device``, with CUDA graphs (``--compile on``) or eager.
    On the CPU, ``graphs`` runs the graphs' bucketed shapes and padding uncaptured."""
    from specinfer.graphs import GraphedLayers

    placement = resolve(device, dtype, compile="on" if graphs and device == "cuda" else "off")
    # Prefix caching off: every run prefills afresh, so a comparison's two sides never
    # share K/V that a third run computed.
    config = EngineConfig(max_context=max_context, slots=slots, max_tree_nodes=max_nodes,
                          prefix_caching=False)
    start = time.perf_counter()
    engine = build_engine(model_dir, config, placement=placement)
    runtime = engine.executor.runtime
    if graphs and not placement.cuda:
        runtime._graphs = GraphedLayers(runtime, max_nodes + 1)
    startup = time.perf_counter() - start
    captured = runtime._graphs.capture_s if runtime._graphs is not None else None
    return Engine("graphs" if graphs else "eager", engine, startup, captured)


# --- step costs ----------------------------------------------------------------------------

def plain_rows(batch: int, prefix: int, vocab: int) -> ForwardArgs:
    """One decode query per row, rows in slots 0..batch-1, each after ``prefix`` keys."""
    tokens = torch.randint(0, vocab, (batch, 1))
    return ForwardArgs(tokens, torch.full((batch, 1), prefix), torch.arange(batch),
                       torch.full((batch,), prefix), None)


def tree_rows(trees: Sequence[TokenTree], roots: Sequence[int], prefix: int) -> ForwardArgs:
    batch = TreeBatch.build(list(trees), list(roots), [prefix] * len(trees))
    q = batch.tokens.shape[1]
    return ForwardArgs(batch.tokens, batch.position_ids, torch.arange(len(trees)),
                       batch.prefix_lens, batch.visibility(prefix + q))


def forward_costs(e: Engine, batches: Sequence[int], prefix: int, vocab: int, reps: int,
                  device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(1)
    out = {}
    for b in batches:
        args = plain_rows(b, prefix, vocab)
        out[f"plain_b{b}_ms"] = timed_ms(lambda a=args: e.forward(a), device, reps)
    for n in TREE_SIZES:
        args = tree_rows([random_tree(n - 1, vocab, gen)], [5], prefix)  # + root = n
        out[f"tree{n}_ms"] = timed_ms(lambda a=args: e.forward(a), device, reps)
    return out


def decode_ms_per_step(e: Engine, batch: int, prefix: int, new_tokens: int,
                       vocab: int) -> float:
    """A whole engine step (``generate_local``, no stop token), prefill excluded."""
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, vocab, (prefix,), generator=gen).tolist() for _ in range(batch)]
    times = []
    for _ in range(2):
        r = generate_local(e.engine, prompts, new_tokens, stop_token_ids=[])[0]
        times.append((r.elapsed_s - r.ttft_s) / (new_tokens - 1))
    return min(times) * 1e3


def transformers_ms_per_step(model_dir: str, device: torch.device, dtype: torch.dtype,
                             batches: Sequence[int], prefix: int, new_tokens: int,
                             vocab: int, reps: int) -> dict:
    """transformers' ``generate`` (greedy, its default cache) per token at each batch:
    (time for ``new_tokens`` - time for 1) / (new_tokens - 1), prefill excluded."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    out = {}
    for b in batches:
        prompt = torch.randint(0, vocab, (b, prefix), device=device)
        mask = torch.ones_like(prompt)

        def run(n: int, prompt=prompt, mask=mask) -> None:
            with torch.no_grad():
                hf.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)

        one = timed_ms(lambda: run(1), device, reps, warmup=1)
        many = timed_ms(lambda: run(new_tokens), device, reps, warmup=1)
        out[f"generate_b{b}_ms"] = (many - one) / (new_tokens - 1)
    return out


# --- exactness on the device ---------------------------------------------------------------

def compare_sequences(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many sequences of ``a`` equal ``b``'s, and where the first that does not parts."""
    parts = [first_difference(x, y) for x, y in zip(a, b, strict=True)]
    differ = [i for i, at in enumerate(parts) if at is not None]
    first = {"sequence": differ[0], "token": parts[differ[0]]} if differ else None
    return {"identical": len(a) - len(differ), "of": len(a), "first_difference": first}


def exactness(eager: Engine, graphs: Engine, prompts: list[list[int]], new_tokens: int,
              vocab: int) -> dict:
    """Speculative greedy = plain greedy, on each engine; graphs = eager. The trees hold the
    eager engine's plain continuation among decoys (``bench.trees.reference_oracle``)."""
    plain = [r.token_ids for r in generate_local(eager.engine, prompts, new_tokens,
                                                 stop_token_ids=[])]
    pairs = list(zip(prompts, plain, strict=True))
    out: dict = {}
    for e in (eager, graphs):
        spec = generate_local(e.engine, prompts, new_tokens, stop_token_ids=[],
                              trees=reference_oracle(pairs, vocab, seed=0))
        out[f"speculative_vs_plain_{e.name}"] = compare_sequences(
            [r.token_ids for r in spec], plain)
        out[f"tokens_per_step_{e.name}"] = sum(len(r.token_ids) - 1 for r in spec) / max(
            1, sum(r.steps for r in spec))
    graphs_plain = [r.token_ids for r in generate_local(graphs.engine, prompts, new_tokens,
                                                        stop_token_ids=[])]
    out["graphs_vs_eager_plain"] = compare_sequences(graphs_plain, plain)
    return out


def row_invariance(e: Engine, prefix: int, vocab: int) -> dict:
    """Row 0's logits computed alone, beside 7 other rows, and as the root of a 16- and a
    64-node tree (the same token, position and cache keys each time)."""
    gen = torch.Generator().manual_seed(7)
    rows = 8
    prompt = TreeBatch.build([TokenTree.chain(torch.randint(0, vocab, (prefix - 1,),
                                                            generator=gen).tolist())
                              for _ in range(rows)], [1] * rows, [0] * rows)
    e.forward(ForwardArgs(prompt.tokens, prompt.position_ids, torch.arange(rows),
                          prompt.prefix_lens, prompt.visibility(prefix), last_only=True))
    out = {}

    def compare(name: str, logits: torch.Tensor) -> None:
        diff = (logits.float() - alone).abs().max().item()
        out[name] = {"bitwise": bool(torch.equal(logits.float(), alone)), "max_abs": diff,
                     "argmax_same": bool(logits.argmax() == alone.argmax())}

    torch.manual_seed(0)  # plain_rows draws the token: the same one every run
    args = plain_rows(1, prefix, vocab)
    token = int(args.tokens[0, 0])
    alone = e.forward(args)[0, 0].float()
    batch = plain_rows(rows, prefix, vocab)
    batch.tokens[0, 0] = token
    compare("beside_7_rows", e.forward(batch)[0, 0])
    for n in TREE_SIZES:
        args = tree_rows([random_tree(n - 1, vocab, gen)], [token], prefix)
        compare(f"tree{n}_root", e.forward(args)[0, 0])
    return out


def sampling(e: Engine, prompts: list[list[int]], new_tokens: int, vocab: int) -> dict:
    """Seeded sampling with trees, twice: the same tokens, all in the vocabulary."""
    params = [SamplingParams(0.8, top_p=0.95, seed=i) for i in range(len(prompts))]
    pairs = [(p, torch.randint(0, vocab, (new_tokens,)).tolist()) for p in prompts]
    runs = [generate_local(e.engine, prompts, new_tokens, params=params, stop_token_ids=[],
                           trees=reference_oracle(pairs, vocab, seed=1)) for _ in range(2)]
    tokens = [[r.token_ids for r in run] for run in runs]
    flat = [t for seq in tokens[0] for t in seq]
    return {"reproducible": compare_sequences(tokens[0], tokens[1]),
            "in_vocabulary": all(0 <= t < vocab for t in flat), "tokens": len(flat)}


# --- the table -----------------------------------------------------------------------------

def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def summarize(report: dict) -> dict:
    """The issue's targets, from the measured figures."""
    eager, graphs = report["configs"]["eager"], report["configs"]["graphs"]
    hf = report["transformers"]
    b1 = min(report["batches"])
    return {
        "graphs_over_eager_batch1": ratio(eager[f"decode_b{b1}_ms"],
                                          graphs[f"decode_b{b1}_ms"]),
        "ours_over_generate_batch1": ratio(hf[f"generate_b{b1}_ms"],
                                           graphs[f"decode_b{b1}_ms"]),
        "tree64_over_plain_max": ratio(graphs["tree64_ms"], graphs[f"plain_b{b1}_ms"]),
    }


def table(report: dict) -> str:
    eager, graphs = report["configs"]["eager"], report["configs"]["graphs"]
    hf = report["transformers"]
    batches = report["batches"]
    lines = [f"GPU smoke: {report['device']}; torch {report['torch']}, transformers "
             f"{report['transformers_version']}, Python {report['python']}; "
             f"{report['dtype']}, SmolLM2-135M's shape ({report['layers']} layers, random "
             f"weights), prefix {report['prefix']}",
             f"start-up: eager {eager['startup_s']:.1f} s, graphs {graphs['startup_s']:.1f} s "
             f"(capture {graphs['capture_s'] or 0:.1f} s)", ""]
    head = f"{'ms per step':<34}" + "".join(f"{'batch ' + str(b):>12}" for b in batches)
    lines.append(head)
    rows = [("forward, eager", eager, "plain_b{}_ms"), ("forward, graphs", graphs, "plain_b{}_ms"),
            ("engine step, eager", eager, "decode_b{}_ms"),
            ("engine step, graphs", graphs, "decode_b{}_ms"),
            ("transformers generate", hf, "generate_b{}_ms")]
    for name, src, key in rows:
        lines.append(f"{name:<34}" + "".join(f"{src[key.format(b)]:>12.3f}" for b in batches))
    lines.append(f"{'graphs: tokens/s (engine step)':<34}" + "".join(
        f"{b * 1e3 / graphs[f'decode_b{b}_ms']:>12.0f}" for b in batches))
    lines.append(f"{'graphs / eager (engine step)':<34}" + "".join(
        f"{ratio(eager[f'decode_b{b}_ms'], graphs[f'decode_b{b}_ms']):>11.2f}x"
        for b in batches))
    lines.append(f"{'graphs / generate (engine step)':<34}" + "".join(
        f"{ratio(hf[f'generate_b{b}_ms'], graphs[f'decode_b{b}_ms']):>11.2f}x"
        for b in batches))
    lines.append("")
    b1 = min(batches)
    for name, cfg in (("eager", eager), ("graphs", graphs)):
        plain = cfg[f"plain_b{b1}_ms"]
        lines.append(f"tree step, {name:<7} " + ", ".join(
            f"{n} nodes {cfg[f'tree{n}_ms']:.3f} ms ({ratio(cfg[f'tree{n}_ms'], plain):.2f}x "
            f"plain)" for n in TREE_SIZES))
    ex = report["exactness"]
    lines.append("")
    for key in ("speculative_vs_plain_eager", "speculative_vs_plain_graphs",
                "graphs_vs_eager_plain"):
        r = ex[key]
        where = "" if r["first_difference"] is None else \
            f" (first difference: sequence {r['first_difference']['sequence']}, token " \
            f"{r['first_difference']['token']})"
        lines.append(f"exactness, {key.replace('_', ' ')}: {r['identical']}/{r['of']} "
                     f"identical{where}")
    lines.append(f"accepted tokens per step with the trees: eager "
                 f"{ex['tokens_per_step_eager']:.2f}, graphs {ex['tokens_per_step_graphs']:.2f}")
    for name in ("eager", "graphs"):
        inv = report["row_invariance"][name]
        lines.append(f"row invariance, {name}: " + "; ".join(
            f"{k.replace('_', ' ')}: " + ("bitwise" if v["bitwise"] else
                                          f"max |diff| {v['max_abs']:.3g}"
                                          + ("" if v["argmax_same"] else ", argmax differs"))
            for k, v in inv.items()))
    s = report["sampling"]
    lines.append(f"sampling with trees, seeded, twice: {s['reproducible']['identical']}/"
                 f"{s['reproducible']['of']} identical, {s['tokens']} tokens, all in the "
                 f"vocabulary: {s['in_vocabulary']}")
    lines.append("")
    got = report["targets"]
    lines.append(f"targets: graphs >= {TARGETS['graphs_over_eager_batch1']}x eager at batch "
                 f"{b1}: {got['graphs_over_eager_batch1']:.2f}x; ours >= "
                 f"{TARGETS['ours_over_generate_batch1']}x generate: "
                 f"{got['ours_over_generate_batch1']:.2f}x; 64-node tree <= "
                 f"{TARGETS['tree64_over_plain_max']}x plain: "
                 f"{got['tree64_over_plain_max']:.2f}x")
    lines.append("untested here: " + "; ".join(UNTESTED))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="cuda (the smoke) or cpu (a dry run)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a dry run)")
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens per timed decode")
    ap.add_argument("--prompts", type=int, default=8, help="sequences checked for exactness")
    ap.add_argument("--exact-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_smoke: no CUDA device visible to torch")
    import transformers

    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = save_random_smollm2(Path(tempfile.mkdtemp()) / "smollm2-shape", args.layers)
    vocab = SMOLLM2_135M["vocab_size"]
    max_nodes = max(TREE_SIZES)
    # Room for the last step's tree too (the engine refuses one that would overflow).
    max_context = args.prefix + max(args.new_tokens, args.exact_tokens) + max_nodes
    report: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
        or "cpu", "torch": torch.__version__, "transformers_version": transformers.__version__,
        "python": platform.python_version(), "dtype": args.dtype, "prefix": args.prefix,
        "layers": args.layers or SMOLLM2_135M["num_hidden_layers"], "batches": batches,
        "configs": {}, "row_invariance": {}}
    engines = {}
    for graphs in (False, True):
        e = start_engine(model_dir, args.device, args.dtype, graphs, max(*batches, 8),
                         max_nodes, max_context)
        row = {"startup_s": e.startup_s, "capture_s": e.capture_s}
        row |= forward_costs(e, batches, args.prefix, vocab, args.reps, device)
        row |= {f"decode_b{b}_ms": decode_ms_per_step(e, b, args.prefix, args.new_tokens,
                                                      vocab) for b in batches}
        report["configs"][e.name] = row
        report["row_invariance"][e.name] = row_invariance(e, args.prefix, vocab)
        print(e.name, {k: round(v, 3) for k, v in row.items() if v is not None}, flush=True)
        engines[e.name] = e
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (int(n),), generator=gen).tolist()
               for n in torch.linspace(8, args.prefix, args.prompts)]
    report["exactness"] = exactness(engines["eager"], engines["graphs"], prompts,
                                    args.exact_tokens, vocab)
    report["sampling"] = sampling(engines["graphs"], prompts[:4], args.exact_tokens // 2, vocab)
    print("exactness", report["exactness"], "sampling", report["sampling"], flush=True)
    del engines
    if device.type == "cuda":
        torch.cuda.empty_cache()
    report["transformers"] = transformers_ms_per_step(
        model_dir, device, getattr(torch, args.dtype), batches, args.prefix, args.new_tokens,
        vocab, max(3, args.reps // 5))
    report["targets"] = summarize(report)
    text = table(report)
    print(text, flush=True)
    (out_dir / "gpu_smoke.json").write_text(json.dumps(report, indent=2))
    (out_dir / "gpu_smoke_table.txt").write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
