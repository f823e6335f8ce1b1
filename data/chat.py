"""Render a conversation with the target's chat template and mask the loss to assistant text.

The drafter learns to predict what the target writes, so the loss mask is 1 exactly on the tokens
of each assistant turn's content plus the turn's end-of-turn token (`<|im_end|>` for ChatML /
SmolLM2 / Qwen, `<|eot_id|>` for Llama-3) -- the drafter must also learn when a turn ends -- and 0
on everything the template or the user wrote: system and user turns, the assistant header
(`<|im_start|>assistant\n`) and the newline after the end-of-turn token.

Templates of most chat models have no `{% generation %}` block, so the assistant spans are found by
rendering prefixes and diffing the strings (steps in `assistant_spans`):
    head_i = render(messages[:i], add_generation_prompt=True)   # ends where turn i's content starts
head_i must be a prefix of the full rendering. When the full rendering continues with the content
(verbatim, or trimmed as Llama-3's template does) and an end-of-turn token (the tokenizer's EOS
string, else a special token), that token ends the span: one render per assistant turn. Otherwise
    turn_i = render(messages[:i+1])                              # ends after turn i's trailer
must also be a prefix, and the span ends after the last EOS in turn_i[len(head_i):]. A template
that breaks these prefixes (e.g. one that rewrites earlier turns) raises ChatTemplateError rather
than produce wrong masks. A conversation that starts with assistant has no messages[:0] to render:
head_0 is read off the rendering of a stand-in assistant turn.

The full text is tokenised once, without added special tokens (the template already put BOS where
it wants it); a token is masked when its characters overlap a span (so a rare token that merges the
header's newline with content starting with a newline is masked too), then ids and mask are cut at
max_length. A conversation with no masked token left is dropped as "too_long". Assistant turns with
empty content stay in the text as context but are not masked: there is nothing to learn from them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import jinja2

Messages = Sequence[dict[str, str]]  # [{"role": "system"|"user"|"assistant", "content": str}]
# Stand-in content used to find the assistant header when a conversation starts with assistant.
_PLACEHOLDER = "\x01SPECDISTILL_PLACEHOLDER\x01"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used to build assistant masks (applies to every
    conversation, so it stops the run)."""


@dataclass
class RenderedChat:
    text: str  # the full rendered conversation
    spans: list[tuple[int, int]]  # [start, end) char spans: assistant content + end-of-turn token


@dataclass
class EncodedChat:
    input_ids: list[int] = field(default_factory=list)  # (T,) T <= max_length
    loss_mask: list[int] = field(default_factory=list)  # (T,) 1 on assistant content + end-of-turn
    drop_reason: Optional[str] = None  # "too_long" | "template_error" when unusable (ids empty)


def _render(tokenizer, messages: Messages, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=generation_prompt)


def _check_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the tokenizer has no chat_template; set one (tokenizer.chat_template)"
                                " or use an instruct/chat model's tokenizer.")


def _special_strings(tokenizer) -> list[str]:
    """Special-token strings, longest first (for matching at a position)."""
    specials = {str(t) for t in getattr(tokenizer, "all_special_tokens", [])}
    specials |= {str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                 if getattr(t, "special", False)}
    return sorted((s for s in specials if s), key=len, reverse=True)


def _assistant_head(tokenizer, before: Messages) -> str:
    """Rendered text up to where an assistant turn's content starts, after `before`."""
    if before:
        return _render(tokenizer, before, generation_prompt=True)
    # Nothing before (the conversation starts with assistant): render a stand-in turn.
    text = _render(tokenizer, [{"role": "assistant", "content": _PLACEHOLDER}], False)
    at = text.find(_PLACEHOLDER)
    if at < 0:
        raise ChatTemplateError("the chat template drops or rewrites assistant content "
                                "(a stand-in turn's text is not in the rendering).")
    return text[:at]


def _end_of_turn_at(tokenizer, text: str, pos: int) -> Optional[int]:
    """End of the end-of-turn token starting at text[pos] (EOS, else any special token), or None."""
    eos = tokenizer.eos_token
    if eos and text.startswith(eos, pos):
        return pos + len(eos)
    for special in _special_strings(tokenizer):
        if text.startswith(special, pos):
            return pos + len(special)
    return None


def _content_end(tokenizer, text: str, start: int, content: str) -> Optional[int]:
    """End of the end-of-turn token when text[start:] is `content` (verbatim or trimmed by the
    template) followed by an end-of-turn token; None otherwise."""
    for shown in (content, content.strip()):
        if text.startswith(shown, start):
            end = _end_of_turn_at(tokenizer, text, start + len(shown))
            if end is not None:
                return end
    return None


def _turn_end(tokenizer, turn: str, start: int, content: str) -> int:
    """End of the end-of-turn token of the assistant turn rendered at turn[start:], where `turn`
    renders the conversation up to and including this turn."""
    eos = tokenizer.eos_token
    k = turn.rfind(eos, start) if eos else -1  # the last EOS: content may quote the EOS string
    if k >= 0:
        return k + len(eos)
    end = _content_end(tokenizer, turn, start, content)
    if end is None:
        raise ChatTemplateError(
            f"cannot find the end-of-turn token of an assistant turn: EOS {eos!r} is not in the "
            f"rendered turn {turn[start:][-80:]!r} and no special token follows the content.")
    return end


def _inconsistent(i: int) -> ChatTemplateError:
    return ChatTemplateError(
        f"the chat template renders a conversation prefix inconsistently (turn {i}: the rendering "
        f"of messages[:{i}] with add_generation_prompt=True, or of messages[:{i + 1}], is not a "
        f"prefix of the full rendering), so assistant spans cannot be found by diffing. Templates "
        f"that rewrite earlier turns (e.g. strip reasoning) are not supported.")


def assistant_spans(tokenizer, messages: Messages, full: str,
                    stop: Optional[int] = None) -> list[tuple[int, int]]:
    """[start, end) char spans in `full` (the rendering of `messages`) of each non-empty assistant
    turn's content + end-of-turn token. Turns that start at or after char `stop` are skipped (they
    fall beyond the truncation point).

    Raises ChatTemplateError when the template does not render consistent prefixes.
    """
    spans: list[tuple[int, int]] = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant" or not msg["content"].strip():
            continue  # empty assistant turns stay as context: nothing to learn from them
        # 1. where the content starts: the generation prompt after the turns before it
        head = _assistant_head(tokenizer, messages[:i])
        if not full.startswith(head):
            raise _inconsistent(i)
        if stop is not None and len(head) >= stop:
            break
        # 2. usually the content follows verbatim, then an end-of-turn token: one render per turn
        end = _content_end(tokenizer, full, len(head), msg["content"])
        if end is None:
            # 3. else diff against the rendering of the conversation up to this turn
            turn = _render(tokenizer, messages[: i + 1], generation_prompt=False)
            if not turn.startswith(head) or not full.startswith(turn):
                raise _inconsistent(i)
            end = _turn_end(tokenizer, turn, len(head), msg["content"])
        spans.append((len(head), end))
    return spans


def render_chat(tokenizer, messages: Messages) -> RenderedChat:
    """Render `messages` with the tokenizer's chat template and find the assistant spans.

    Raises ChatTemplateError when the template cannot give consistent prefixes, and lets
    jinja2.TemplateError through when the template refuses this conversation.
    """
    _check_template(tokenizer)
    full = _render(tokenizer, messages, generation_prompt=False)
    return RenderedChat(full, assistant_spans(tokenizer, messages, full))


def _char_token(encoding: Any, index: int, char: int, step: int, stop: int) -> Optional[int]:
    """Token holding `char`; chars without a token (dropped by a normaliser) move by `step`."""
    while char != stop:
        tok = encoding.char_to_token(index, char)
        if tok is not None:
            return tok
        char += step
    return None


def encode_chats(tokenizer, conversations: Sequence[Messages], max_length: int) -> list[EncodedChat]:
    """Render, tokenise (one batched call) and mask many conversations. Needs a fast tokenizer."""
    _check_template(tokenizer)
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError("building loss masks needs a fast (Rust) tokenizer for char-to-token "
                                f"offsets; got {type(tokenizer).__name__}.")
    results = [EncodedChat() for _ in conversations]
    # 1. render every conversation whole
    texts, rows = [], []  # rendered texts and the conversation each belongs to
    for i, messages in enumerate(conversations):
        try:
            texts.append(_render(tokenizer, messages, generation_prompt=False))
            rows.append(i)
        except jinja2.TemplateError:  # the template refuses this conversation (raise_exception)
            results[i].drop_reason = "template_error"
    if not texts:
        return results
    # 2. tokenise them in one batched call (the Rust tokenizer runs it on every core)
    enc = tokenizer(texts, add_special_tokens=False, verbose=False)
    for b, (i, text) in enumerate(zip(rows, texts)):
        ids = enc["input_ids"][b][:max_length]
        # 3. find the assistant spans that start before the truncation point
        cut = enc.token_to_chars(b, max_length - 1) if len(enc["input_ids"][b]) > max_length else None
        try:
            spans = assistant_spans(tokenizer, conversations[i], text, cut.end if cut else None)
        except jinja2.TemplateError:
            results[i].drop_reason = "template_error"
            continue
        # 4. mask every token that overlaps a span, then cut at max_length
        mask = [0] * len(enc["input_ids"][b])
        for start, end in spans:
            first = _char_token(enc, b, start, +1, end)
            last = _char_token(enc, b, end - 1, -1, start - 1)
            if first is not None and last is not None:
                mask[first: last + 1] = [1] * (last + 1 - first)
        mask = mask[:max_length]
        if 1 not in mask:
            results[i].drop_reason = "too_long"
        else:
            results[i].input_ids, results[i].loss_mask = ids, mask
    return results


def encode_chat(tokenizer, messages: Messages, max_length: int) -> EncodedChat:
    """One conversation (see encode_chats)."""
    return encode_chats(tokenizer, [messages], max_length)[0]
