"""llama.cpp's greedy tokens/s per prompt, for ``bench/formats.py``: run by a Python with
llama-cpp-python (it imports neither torch nor specinfer). Reads a JSON job
``{"gguf", "prompts": [[ids]], "new_tokens"}`` from argv[1]; prints one JSON list."""

import json
import os
import sys
import time

from llama_cpp import Llama


def main() -> None:
    job = json.loads(sys.argv[1])
    llm = Llama(job["gguf"], n_ctx=2048, n_threads=os.cpu_count(), verbose=False)
    rates = []
    for ids in job["prompts"]:
        start, n = time.perf_counter(), 0
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            n += 1
            if n >= job["new_tokens"] or token == llm.token_eos():
                break
        rates.append(n / (time.perf_counter() - start))
    print(json.dumps(rates))


if __name__ == "__main__":
    main()
