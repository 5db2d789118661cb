"""A conversation as token ids and labels: the tokenizer's chat template renders it, and only the assistant's
tokens are targets (``-100`` elsewhere).

Templates that mark the assistant's text with ``{% generation %}`` say where it is; most do not (Llama-3.1's and
Qwen3's among them). For those the spans are found by rendering the conversation's prefixes: the text of the
turns before an assistant message plus the generation prompt ends where the assistant's text starts, and the
text up to and including that message ends where it stops (its end-of-turn token included: the model must learn
to stop). transformers has no public helper for templates without the tag, hence this module.
"""
from __future__ import annotations

import os

from ..interface.config import ConfigError
from ..distributed.loss import IGNORE_INDEX


def has_generation_tags(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "generation" in template and "endgeneration" in template.replace(" ", "")


def check_chat_tokenizer(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"data.format=chat: the tokenizer at {where} has no chat template. Fix: use a tokenizer "
                          "that has one (an instruct model's), add chat_template.jinja to that directory, or use "
                          "format: text")
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"data.format=chat: the tokenizer at {where} is not a fast tokenizer (character offsets "
                          "are needed to find the assistant's tokens). Fix: save it with tokenizer.json")


def _render(tokenizer, messages, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_char_spans(tokenizer, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant messages, from its prefixes."""
    full = _render(tokenizer, messages)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[:i + 1])
        if through.startswith(before) and full.startswith(through):
            start, end = len(before), len(through)
        else:  # the template renders a last turn unlike a past one (Qwen3: an empty reasoning block)
            # searched after what the turns before it render to (their common prefix with the full text), so a
            # user message quoting the reply is never taken for it
            shared = len(os.path.commonprefix([before, full]))
            start, end = _past_turn_span(full, through, message, max(shared, spans[-1][1] if spans else 0))
            if start < 0:
                raise ConfigError(f"data.format=chat: {where}: the chat template renders this conversation's "
                                  f"assistant turn {i} differently from its prefixes, so its tokens cannot be "
                                  "found. Fix: use a template that marks the assistant's text with "
                                  "{% generation %} ... {% endgeneration %}")
        spans.append((start, end))
    return full, spans


def _past_turn_span(full: str, through: str, message: dict, after: int) -> tuple[int, int]:
    """The span of an assistant turn in the full rendering when its prefix rendering differs: the turn's own
    content, found after the previous span, through the end-of-turn text the template puts after it (as the
    prefix rendering shows it). ``(-1, -1)`` when the content is not there as written."""
    content = message.get("content")
    if not isinstance(content, str) or not content:
        return -1, -1
    at = full.find(content, after)
    if at < 0:
        return -1, -1
    end = at + len(content)
    tail = through[through.rfind(content) + len(content):] if content in through else ""
    return at, end + len(tail) if tail and full.startswith(tail, end) else end


def chat_sample(tokenizer, messages, where: str) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one conversation, labels ``-100`` except on the assistant's tokens."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m
                                                                 for m in messages):
        raise ConfigError(f"data.format=chat: {where}: expected a list of messages ({{'role': ..., 'content': ..."
                          f"}}), got {str(messages)[:80]!r}. Fix: check data.messages_field and the row")
    if not any(m.get("role") == "assistant" for m in messages):
        raise ConfigError(f"data.format=chat: {where}: the conversation has no assistant message, so nothing "
                          "would be learned from it. Fix: remove the row or add the assistant's reply")
    if has_generation_tags(tokenizer):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        text, spans = assistant_char_spans(tokenizer, messages, where)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, mask, s = list(enc["input_ids"]), [], 0
        for start, end in enc["offset_mapping"]:
            while s < len(spans) and start >= spans[s][1]:
                s += 1
            mask.append(int(s < len(spans) and spans[s][0] <= start < spans[s][1] and end > start))
    labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
    if not any(m for m in mask):
        raise ConfigError(f"data.format=chat: {where}: the assistant's messages render to no tokens. Fix: check "
                          "the row's assistant content")
    return ids, labels
