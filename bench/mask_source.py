"""Drafts masked at the source against drafts cut to the grammar afterwards, in process.

The default LLM with its bundled draft head and model-free drafts (16 nodes a step), greedy
JSON-schema answers to the structured bench's tasks (``bench.structured``): tokens per step,
engine time per step and tokens/s, with the head drafting from what the grammar allows
(the default) and with it drafting freely (its forbidden drafts cut before verification).
The outputs are identical either way (greedy, exact).

    python -m bench.mask_source [--answers 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json

from bench.structured import SCHEMAS, TASKS
from services.flags import load_datastore
from services.verifier import own_drafts
from services.verifier.engine import EngineConfig
from services.verifier.factory import build_engine
from services.verifier.local import generate_local
from specinfer.chat import chat_ids
from specinfer.constraints import Constraint
from specinfer.drafting import DraftPlan
from specinfer.drafting.head import bundled_head
from specinfer.drafting.model_free import ModelFreeDrafter
from specinfer.models import DEFAULT_LLM, load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    tok = load_tokenizer(DEFAULT_LLM)
    head = bundled_head(DEFAULT_LLM)
    engine = build_engine(DEFAULT_LLM, EngineConfig(max_context=2048, slots=4),
                          drafter=ModelFreeDrafter(load_datastore("auto", DEFAULT_LLM)),
                          head=str(head) if head else None)
    cases = [(chat_ids(tok, [{"role": "user", "content": f"{TASKS[i % len(TASKS)]} "
                              "Answer in JSON."}]),
              Constraint("json_schema", json.dumps(SCHEMAS[i % len(SCHEMAS)])))
             for i in range(args.answers)]
    plan = DraftPlan(("head", "model_free"), 16)
    masked_request = own_drafts.OwnDrafts._request

    def unmasked_request(seq, nodes, source):
        request = masked_request(seq, nodes, source)
        request.allowed = None
        return request

    outputs = {}
    for _ in range(args.rounds):
        for masked in (True, False):
            own_drafts.OwnDrafts._request = staticmethod(
                masked_request if masked else unmasked_request)
            tokens = steps = 0
            seconds, outs = 0.0, []
            for prompt, constraint in cases:
                r = generate_local(engine, [prompt], 96, draft=plan, constraint=constraint)[0]
                tokens, steps = tokens + len(r.token_ids), steps + len(r.accepted_per_step)
                seconds += r.verify_s
                outs.append(r.token_ids)
            outputs.setdefault(masked, outs)
            print(f"masked at the source {masked!s:<5}: {tokens / steps:.2f} tokens/step, "
                  f"{seconds / steps * 1e3:.1f} ms/step, {tokens / seconds:.1f} tokens/s")
    own_drafts.OwnDrafts._request = staticmethod(masked_request)
    print(f"outputs identical: {outputs[True] == outputs[False]}")


if __name__ == "__main__":
    main()
