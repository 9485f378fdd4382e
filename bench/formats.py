"""The whole stack per number format, side by side with the anchors in one run: batch 1,
greedy, MT-Bench first turns (one per category), ``--new-tokens`` each.

For each format (float32, bfloat16, int8) it starts ``specinfer up --dtype/--quantize``,
times its start-up (until the router reports SERVING), and generates every prompt through
the gRPC SDK with speculation on (the default adaptive policy) and off. Anchors on the same
prompts in the same run: transformers ``generate`` (float32, greedy), and llama.cpp on the
same GGUF file, run by the Python ``make bench-anchors`` installs llama-cpp-python into
(``.venv-anchors``; or ``--llama-cpp-python``), else reported missing.
Prints tokens/s and speedups; writes JSON.

    python -m bench.formats [--formats float32,bfloat16,int8] [--new-tokens 64]
                            [--llama-cpp-python /path/to/venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.harness import Stack, mtbench_prompts, speculation_on_off, write_report
from specinfer.chat import chat_prompt_ids
from specinfer.models import DEFAULT_LLM, load_model, load_tokenizer, resolve

FORMATS = {"float32": ["--dtype", "float32"], "bfloat16": ["--dtype", "bfloat16"],
           "int8": ["--quantize", "int8"]}


def hf_generate(prompts: list[list[int]], new_tokens: int) -> list[float]:
    model = load_model(DEFAULT_LLM)
    rates = []
    for ids in prompts:
        x = torch.tensor([ids])
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=new_tokens)
        rates.append((out.shape[1] - len(ids)) / (time.perf_counter() - start))
    return rates


# Where ``make bench-anchors`` installs llama-cpp-python (built from source: its own venv,
# so the project's pinned torch and packages stay as they are).
ANCHORS_PYTHON = Path(__file__).resolve().parent.parent / ".venv-anchors" / "bin" / "python"


def anchors_python() -> str:
    """The Python with llama-cpp-python: ``make bench-anchors``' venv if it was made, else
    this one (which may have it)."""
    return str(ANCHORS_PYTHON) if ANCHORS_PYTHON.exists() else sys.executable


def llama_cpp(prompts: list[list[int]], new_tokens: int, python: str) -> list[float] | None:
    """llama.cpp on the LLM's own GGUF file, greedy, the same token ids, all cores; run by
    ``python`` (an environment with llama-cpp-python), or None where it is not installed."""
    source = resolve(DEFAULT_LLM)
    job = {"gguf": str(source.directory / source.gguf_file), "prompts": prompts,
           "new_tokens": new_tokens}
    worker = Path(__file__).with_name("llama_cpp_worker.py")
    done = subprocess.run([python, str(worker), json.dumps(job)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-500:], file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def stack_rates(fmt: list[str], prompts: list[str], new_tokens: int) -> dict:
    """Start-up time of the stack in format ``fmt``; its tokens/s with speculation off and on,
    one request at a time."""
    stack = Stack(fmt).start()
    try:
        startup_s = stack.wait()
        [row] = speculation_on_off(stack.addr, prompts, [1], new_tokens=new_tokens)
    finally:
        stack.stop()
    return {"startup_s": startup_s, **row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--formats", default="float32,bfloat16,int8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/results/formats.json")
    ap.add_argument("--llama-cpp-python", default=anchors_python(),
                    help="a Python with llama-cpp-python installed (the llama.cpp anchor)")
    args = ap.parse_args()
    tok = load_tokenizer(DEFAULT_LLM)
    texts = mtbench_prompts(1)
    ids = [chat_prompt_ids(tok, p) for p in texts]
    report = {"machine": {"platform": platform.platform(), "cores": os.cpu_count(),
                          "torch": torch.__version__},
              "prompts": len(ids), "new_tokens": args.new_tokens, "stack": {}}
    hf = hf_generate(ids, args.new_tokens)
    report["hf_generate_tokens_per_s"] = base = statistics.median(hf)
    print(f"transformers generate (float32): {base:.1f} tok/s", flush=True)
    cpp = llama_cpp(ids, args.new_tokens, args.llama_cpp_python)
    report["llama_cpp_tokens_per_s"] = statistics.median(cpp) if cpp else None
    print("llama.cpp: " + (f"{statistics.median(cpp):.1f} tok/s "
                           f"({statistics.median(cpp) / base:.2f}x)" if cpp
                           else "not installed (make bench-anchors)"), flush=True)
    for name in args.formats.split(","):
        row = stack_rates(FORMATS[name], texts, args.new_tokens)
        report["stack"][name] = row
        print(f"stack {name:<9} start-up {row['startup_s']:5.1f} s  off "
              f"{row['off']['tokens_per_s']:5.1f} tok/s ({row['off']['tokens_per_s'] / base:.2f}x)"
              f"  on {row['on']['tokens_per_s']:5.1f} tok/s "
              f"({row['on']['tokens_per_s'] / base:.2f}x, "
              f"{row['on']['accepted_per_step']:.2f} tokens/step)", flush=True)
    write_report(Path(args.out), report)


if __name__ == "__main__":
    main()
