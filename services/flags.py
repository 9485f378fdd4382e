"""Flag values more than one service parses the same way."""

from __future__ import annotations

import logging

from specinfer.models import ModelError

log = logging.getLogger(__name__)

DATASTORE_CHOICES = ("auto (the ShareGPT datastore for the LLM's tokenizer, built once and "
                     "cached; none if the LLM has no tokenizer), none, or a saved .npz")


def parse_expansion(text: str, flag: str, min_width: int = 1) -> list[int]:
    """Tree widths per level from ``1,1,3,1``; the speculator's may be 0 (model-free drafts
    only)."""
    try:
        widths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        widths = []
    if not widths or any(not min_width <= w <= 16 for w in widths):
        raise ModelError(f"{flag} must list tree widths in {min_width}..16, e.g. 1,1,3,1; "
                         f"got {text!r}")
    return widths


def load_datastore(choice: str, llm: str):
    """The corpus datastore ``--datastore`` names (``DATASTORE_CHOICES``), or None."""
    from pathlib import Path

    from specinfer.drafting.datastore import NgramDatastore, sharegpt_datastore
    from specinfer.models import load_tokenizer

    if choice == "none":
        return None
    if choice != "auto":
        return NgramDatastore.load(Path(choice))
    try:
        tokenizer = load_tokenizer(llm)
    except (OSError, ValueError) as e:
        log.info("no datastore: the LLM has no tokenizer", extra={"error": str(e)[:200]})
        return None
    log.info("loading the ShareGPT datastore (built on first use, about a minute)")
    return sharegpt_datastore(tokenizer)
