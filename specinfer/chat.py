"""Chat-prompt tokenization: the one way the router, training, benchmarks and tests turn
messages into the LLM's prompt ids (the tokenizer's chat template)."""

from __future__ import annotations


def chat_ids(tokenizer, messages: list[dict], generation_prompt: bool = True,
             tools: list[dict] | None = None) -> list[int]:
    """``messages`` (``[{"role", "content"}]``) through the chat template; with
    ``generation_prompt``, ending where the assistant's answer begins; ``tools`` for a
    template that renders them."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                        tokenize=True, **({"tools": tools} if tools else {}))
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """One user turn, ready for the assistant's answer."""
    return chat_ids(tokenizer, [{"role": "user", "content": prompt}], True)
