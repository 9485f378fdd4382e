"""`specinfer up` with the default LLM (SmolLM2-135M-Instruct) and its default speculator:
`specinfer generate --chat` through the whole stack equals transformers'
generate(do_sample=False) token for token on 8 MT-Bench first turns (one per category,
chat template applied, 48 new tokens), with speculation on, two requests at a time."""

from __future__ import annotations

import asyncio
import json

import pytest
from servers import cli, free_port, start

from specinfer.client import AsyncClient
from specinfer.data import mtbench_first_turns

pytestmark = [pytest.mark.slow, pytest.mark.processes]
NEW = 48


@pytest.fixture(scope="module")
def up(smollm2_datastore):
    up = start("up", "--http-port", str(free_port()), "--slots", "4", "--max-context", "1024",
               "--speculation", "always")
    try:
        up.wait(timeout=600)
        yield up.addr, up.proc
    finally:
        assert up.stop() == 0  # stops all of its processes cleanly


def test_stack_greedy_equals_transformers_on_mtbench(up, smollm2_mtbench):
    """Two requests at a time (the default --spec-max-batch: both speculate)."""
    addr, _ = up
    prompts = [p for _, p in mtbench_first_turns(per_category=1)]

    async def in_pairs() -> list:
        async with AsyncClient(addr) as client:
            return [out for i in range(0, len(prompts), 2) for out in await asyncio.gather(
                *(client.generate(messages=[{"role": "user", "content": p}], max_tokens=NEW)
                  for p in prompts[i:i + 2]))]

    multi = 0
    for prompt, out, (_, ref) in zip(prompts, asyncio.run(in_pairs()), smollm2_mtbench,
                                     strict=True):
        assert out.token_ids == ref[:NEW], prompt[:60]
        assert out.stats.speculative_steps == out.steps  # every step verified a tree
        multi += sum(1 for a in out.accepted_per_step if a > 1)
    assert multi > 0  # speculation accepted drafts somewhere


def test_generate_cli_json_contract(up):
    addr, _ = up
    out = cli("generate", "--addr", addr, "--chat", "--json", "--max-tokens", "16",
              "What is 2+2?", timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    for key in ("text", "token_ids", "steps", "accepted_per_step", "elapsed_s", "dtype"):
        assert key in doc
    assert doc["dtype"] == "float32" and len(doc["token_ids"]) <= 16
    assert sum(doc["accepted_per_step"]) == len(doc["token_ids"]) - 1
    assert doc["steps"] == len(doc["accepted_per_step"])
