"""Teacher-forcing examples, the LLM's hidden states over them and the optimizer step,
shared by SSM boost-tuning (``boost``) and draft-head training (``head``).

An example is a token sequence (``ids``) and the positions whose next token the draft
model learns (``pos``): the assistant's text in a conversation, or a generated answer.
"""

from __future__ import annotations

import torch

from specinfer.chat import chat_ids


def conversation_example(tokenizer, turns: list[dict], max_seq: int) -> dict | None:
    """Token ids of a conversation (chat template, truncated to ``max_seq``) and the
    positions whose next token is assistant text (the LLM's answer, its end included)."""
    roles = {"human": "user", "gpt": "assistant"}
    messages, positions, ids = [], [], []
    for turn in turns:
        role = roles.get(turn.get("from"))
        if role is None or not turn.get("value"):
            break
        if role == "assistant":
            head = chat_ids(tokenizer, messages, True)
        messages.append({"role": role, "content": turn["value"]})
        full = chat_ids(tokenizer, messages, False)
        if role == "assistant":
            if full[: len(head)] != head:  # a template that rewrites history: stop here
                break
            positions.extend(range(len(head) - 1, min(len(full), max_seq) - 1))
        ids = full
        if len(ids) >= max_seq:
            break
    if not positions:
        return None
    return {"ids": ids[:max_seq], "pos": positions}


def conversation_examples(tokenizer, conversations: list[list[dict]], max_seq: int
                          ) -> list[dict]:
    """``conversation_example`` of each conversation that has an assistant turn."""
    items = (conversation_example(tokenizer, turns, max_seq) for turns in conversations)
    return [e for e in items if e is not None]


def hidden_batches(model, sequences: list[list[int]], batch: int):
    """The LLM's normed last hidden states, ``batch`` sequences at a time, shortest first:
    yields (indices into ``sequences``, the padded ids ``[b, width]``, hidden
    ``[b, width, H]``). Right padding: causal attention never lets a real token see it."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        width = max(len(sequences[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        for j, i in enumerate(idx):
            ids[j, : len(sequences[i])] = torch.as_tensor(sequences[i])
        yield idx, ids, model.model(input_ids=ids).last_hidden_state


def answer_example(sample: dict) -> dict:
    """A generated answer as a teacher-forcing example."""
    ids = sample["prompt"] + sample["answer"]
    start = len(sample["prompt"]) - 1
    return {"ids": ids, "pos": list(range(start, start + len(sample["answer"]))),
            "answer": sample["answer"]}


def optimizer_step(opt, sched, params: list[torch.Tensor], loss: torch.Tensor) -> None:
    """One clipped AdamW step on ``loss`` and one scheduler step."""
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
