"""Render a conversation with the target's chat template and mask the loss to what the target writes,
each assistant turn in the context the target sees when it serves that turn.

At serving time the target is given `render(messages[:i], add_generation_prompt=True)` -- the
served prefix, with whatever the template does to the history (Qwen3 strips earlier reasoning) and
to the generation prompt (`enable_thinking=False` adds an empty think block) -- and writes turn i as
the template renders the newest turn:
    head_i = render(messages[:i], add_generation_prompt=True)   # the served prefix
    turn_i = render(messages[:i+1])                             # head_i + turn i as written, newest
turn_i must start with head_i; the trained span is turn_i[len(head_i):] up to and including the
turn's end-of-turn token (the tokenizer's EOS string, else a special token after the content): the
reasoning, the answer and the tool calls exactly as the template lays them out, never the header
(`<|im_start|>assistant\n`), the newline after the end-of-turn token, a user turn or a tool result.
A turn whose rendering does not start with its served prefix (reasoning in the data while the
template kwargs serve with thinking off) cannot be served as written: the record is refused
(`not_as_served`), never trained in another context.

Rows. Where the full rendering of the conversation shows turn i and its served prefix exactly as
served -- turn_i[:end] is a prefix of it, and the tokens before the turn are the served prefix's own
tokens -- the turn is trained in the one row of its conversation, the full rendering (ChatML without
history rewriting: ShareGPT on SmolLM2, encoded exactly as before turns were checked). A
turn the full rendering shows differently (a rewritten history, a think block only in the newest
turn, a prompt ending in whitespace that the tokenizer merges differently inside the conversation)
gets a row of its own: the served prefix's tokens, then the turn's, each tokenised on its own as the
target is given the one and writes the other. `EncodedChat.stats` counts those turns and their tokens.

Refused per record (never altered): content parts other than text, list content, tool calls or
reasoning that the template does not render (a template without tool or thinking support), a
template that raises on the conversation. A turn cut off by max_length counts as a dropped turn;
a conversation with no trained token left is dropped as "too_long".

The texts are tokenised in one batched call, without added special tokens (the template puts BOS
where it wants it); a token is masked when its characters overlap a span, then ids and mask are cut
at max_length. A conversation that starts with assistant has no messages[:0] to render: head_0 is
read off the rendering of a stand-in assistant turn.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import jinja2

Messages = Sequence[dict[str, Any]]  # OpenAI chat-completions messages (data/sharegpt.py)
# Stand-in content used to find the assistant header when a conversation starts with assistant.
_PLACEHOLDER = "\x01SPECDISTILL_PLACEHOLDER\x01"
KINDS = ("answer", "reasoning", "tool_call")  # what a trained token is, for the data report


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used to build assistant masks (applies to every
    conversation, so it stops the run)."""


class Refused(Exception):
    """This conversation cannot be trained as the target serves it: `reason` (counted), `detail`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@dataclass
class Template:
    """What every apply_chat_template call gets besides the messages."""

    tools: Optional[list] = None  # OpenAI tool definitions (the record's, else none)
    kwargs: dict = field(default_factory=dict)  # data.template_kwargs, e.g. {enable_thinking: false}


@dataclass
class EncodedRow:
    input_ids: list[int] = field(default_factory=list)  # (T,) T <= max_length
    loss_mask: list[int] = field(default_factory=list)  # (T,) 1 on what the target writes


@dataclass
class EncodedChat:
    rows: list[EncodedRow] = field(default_factory=list)  # the full rendering first, then own contexts
    drop_reason: Optional[str] = None  # "too_long" | "template_error" | a refusal (rows empty)
    detail: str = ""  # why it was dropped, in words
    # turns (trained / cut by max_length / in their own context), tokens of the extra rows,
    # trained tokens by kind (KINDS)
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def input_ids(self) -> list[int]:  # the first row's (the whole conversation's)
        return self.rows[0].input_ids if self.rows else []

    @property
    def loss_mask(self) -> list[int]:
        return self.rows[0].loss_mask if self.rows else []


# ---------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------
def content_text(message: dict) -> str:
    """The text of a message's content: a string, or the text parts of a list; "" for None."""
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return content or ""


def reasoning_text(message: dict) -> str:
    """The reasoning of an assistant message: `reasoning_content`, else a `<think>` block."""
    if message.get("reasoning_content"):
        return message["reasoning_content"]
    text = content_text(message)
    if "</think>" in text:
        return text.split("</think>")[0].split("<think>")[-1]
    return ""


def answer_text(message: dict) -> str:
    """The answer of an assistant message: its content after any `</think>`."""
    return content_text(message).split("</think>")[-1]


def trains(message: dict) -> bool:
    """An assistant turn with something the target writes (answer, reasoning or tool calls)."""
    return message.get("role") == "assistant" and bool(
        content_text(message).strip() or message.get("tool_calls") or reasoning_text(message).strip())


def _tool_names(message: dict) -> list[str]:
    calls = message.get("tool_calls") or []
    return [str((c.get("function") or c).get("name", "")) for c in calls if isinstance(c, dict)]


def check_parts(messages: Messages) -> None:
    """Refuse content parts the text renderer cannot use (images, audio, files)."""
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            kinds = {p.get("type") for p in content if isinstance(p, dict)}
            if kinds - {"text"}:
                raise Refused("non_text_content", f"message {i} ({m.get('role')}) has content parts "
                              f"of type {sorted(str(k) for k in kinds - {'text'})}; only text is trained")


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------
def render(tokenizer, messages: Messages, generation_prompt: bool, template: Template) -> str:
    return tokenizer.apply_chat_template(list(messages), tools=template.tools or None, tokenize=False,
                                         add_generation_prompt=generation_prompt, **template.kwargs)


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


def served_prefix(tokenizer, before: Messages, template: Template) -> str:
    """What the target is given before it writes the next assistant turn after `before`."""
    if before:
        return render(tokenizer, before, True, template)
    # Nothing before (the conversation starts with assistant): render a stand-in turn.
    text = render(tokenizer, [{"role": "assistant", "content": _PLACEHOLDER}], False, template)
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


def _turn_end(tokenizer, turn: str, start: int, message: dict) -> int:
    """End of the end-of-turn token of the assistant turn rendered at turn[start:] (the turn is the
    last thing `turn` renders before any trailer)."""
    eos = tokenizer.eos_token
    k = turn.rfind(eos, start) if eos else -1  # the last EOS: content may quote the EOS string
    if k >= 0:
        return k + len(eos)
    answer = answer_text(message)
    for shown in (answer, answer.strip()):  # a template that trims (Llama-3)
        at = turn.rfind(shown, start) if shown else -1
        end = _end_of_turn_at(tokenizer, turn, at + len(shown)) if at >= 0 else None
        if end is not None:
            return end
    ends = [turn.rfind(s, start) + len(s) for s in _special_strings(tokenizer) if turn.rfind(s, start) >= 0]
    if not ends:
        raise ChatTemplateError(
            f"cannot find the end-of-turn token of an assistant turn: EOS {eos!r} is not in the "
            f"rendered turn {turn[start:][-80:]!r} and no special token follows it.")
    return max(ends)


@dataclass
class Turn:
    """One assistant turn as the target serves it."""

    index: int  # position in the messages
    text: str  # served prefix + the turn up to its end-of-turn token
    start: int  # where the turn starts in `text` (len of the served prefix)
    regions: dict[str, tuple[int, int]]  # kind -> [start, end) chars in `text` (answer: the rest)


def _regions(message: dict, text: str, start: int) -> dict[str, tuple[int, int]]:
    """Where reasoning and tool calls lie in the turn text[start:]; refuses what is not rendered."""
    regions: dict[str, tuple[int, int]] = {}
    cursor = start
    reasoning = reasoning_text(message).strip()
    if reasoning:
        at = text.find(reasoning, start)
        if at < 0:
            raise Refused("reasoning_not_rendered", "an assistant turn has reasoning that the chat "
                          "template does not render; use a thinking template or drop the reasoning")
        cursor = at + len(reasoning)
        close = text.find("</think>", cursor)
        if close >= 0 and not text[cursor:close].strip():
            cursor = close + len("</think>")
        regions["reasoning"] = (start, cursor)
    elif "</think>" in text[start:]:  # an empty think block the template writes (Qwen3's newest turn)
        close = text.find("</think>", start)
        if not text[start:close].replace("<think>", "").strip():
            cursor = close + len("</think>")
            regions["reasoning"] = (start, cursor)
    names = _tool_names(message)
    if names:
        answer = answer_text(message).strip()
        at = text.find(answer, cursor) if answer else -1
        tool_start = at + len(answer) if at >= 0 else cursor
        if any(text.find(n, tool_start) < 0 for n in names):
            raise Refused("tool_call_not_rendered", f"an assistant turn calls {names} but the chat "
                          "template does not render tool calls; use the target's tool template")
        regions["tool_call"] = (tool_start, len(text))
    return regions


def served_turn(tokenizer, messages: Messages, i: int, template: Template) -> Turn:
    """Assistant turn i in the context the target serves it in."""
    head = served_prefix(tokenizer, messages[:i], template)
    turn = render(tokenizer, messages[: i + 1], False, template)
    if not turn.startswith(head):
        raise Refused("not_as_served", f"assistant turn {i} as the template renders it does not follow "
                      f"the served prefix (e.g. reasoning in the data while the template kwargs serve "
                      f"without thinking): {head[-40:]!r} vs {turn[len(head) - 40:len(head)]!r}")
    end = _turn_end(tokenizer, turn, len(head), messages[i])
    text = turn[:end]
    return Turn(i, text, len(head), _regions(messages[i], text, len(head)))


def _check_rendered(messages: Messages, full: str) -> None:
    """List content is the reader's intact form: refuse it when the template dropped its text."""
    for i, m in enumerate(messages):
        if isinstance(m.get("content"), list) and content_text(m).strip() not in full:
            raise Refused("content_not_rendered", f"message {i} ({m.get('role')}) has list content "
                          f"that the chat template does not render; give the content as a string")


def plan_rows(tokenizer, messages: Messages, template: Template, full: str,
              stop: Optional[int] = None) -> tuple[list[Turn], list[Turn]]:
    """(turns trained in the full rendering `full`, turns that need a row of their own): a turn
    shares the full rendering when it shows the turn and its served prefix as they are served.
    Turns whose served prefix is a prefix of `full` and starts at or after char `stop` are skipped
    (beyond the truncation point).

    Raises Refused for a conversation that cannot be trained as served, ChatTemplateError for a
    template that cannot give masks at all, jinja2.TemplateError when it refuses the conversation.
    """
    _check_rendered(messages, full)
    shared: list[Turn] = []
    own: list[Turn] = []
    for i in [i for i, m in enumerate(messages) if trains(m)]:
        turn = served_turn(tokenizer, messages, i, template)
        in_full = full.startswith(turn.text)
        if stop is not None and turn.start >= stop and full.startswith(turn.text[:turn.start]):
            break
        (shared if in_full else own).append(turn)
    return shared, own


def render_chat(tokenizer, messages: Messages, template: Optional[Template] = None):
    """(full rendering, [(start, end)] char spans of the turns it trains, [own-context turns])."""
    _check_template(tokenizer)
    template = template or Template()
    check_parts(messages)
    full = render(tokenizer, messages, False, template)
    shared, own = plan_rows(tokenizer, messages, template, full)
    return full, [(t.start, len(t.text)) for t in shared], own


# ---------------------------------------------------------------------------------------------
# Tokenising and masking
# ---------------------------------------------------------------------------------------------
def _char_token(encoding: Any, index: int, char: int, step: int, stop: int) -> Optional[int]:
    """Token holding `char`; chars without a token (dropped by a normaliser) move by `step`."""
    while char != stop:
        tok = encoding.char_to_token(index, char)
        if tok is not None:
            return tok
        char += step
    return None


def _tokens(encoding: Any, b: int, start: int, end: int, limit: int) -> tuple[int, int]:
    """[first, last + 1) of the tokens overlapping chars [start, end) of text b, cut at `limit`."""
    if end <= start:
        return 0, 0
    first = _char_token(encoding, b, start, +1, end)
    last = _char_token(encoding, b, end - 1, -1, start - 1)
    if first is None or last is None:
        return 0, 0
    return min(first, limit), min(last + 1, limit)


def _count_kinds(encoding: Any, b: int, turn: Turn, first: int, stop: int, shift: int, limit: int,
                 stats: dict[str, int]) -> None:
    """Trained tokens [first, stop) of a turn by kind; `shift`: chars of `turn.text` before text b."""
    rest = stop - first
    for kind, (a, z) in turn.regions.items():
        lo, hi = _tokens(encoding, b, max(a, turn.start) - shift, z - shift, limit)
        n = max(0, min(hi, stop) - max(lo, first))
        stats[kind] += n
        rest -= n
    stats["answer"] += max(rest, 0)
    stats["turns"] += 1


def _context_tail(encoding: Any, b: int, first: int, added: set[int]) -> int:
    """Index of the first token after the last added token before token `first` of text b: from
    there on, the served prefix is tokenised on its own (added tokens split the text)."""
    ids = encoding["input_ids"][b]
    k = first
    while k > 0 and ids[k - 1] not in added:
        k -= 1
    return k


def _shared_turns(tokenizer, encoding: Any, texts: list[str], turns: dict[int, list[Turn]],
                  max_length: int) -> dict[int, list[tuple[Turn, int, int]]]:
    """Per text b, (turn, first, stop) of each turn the full rendering trains as served, token for
    token: the tokens before the turn must be the served prefix's own tokens (a prefix ending in
    whitespace can merge with the turn's first characters). A turn that fails moves to turns[-b-1]
    (its own row)."""
    added = {int(i) for i in tokenizer.get_added_vocab().values()}
    checks: list[tuple[int, Turn, int, int, int]] = []  # (b, turn, first, stop, tail start token)
    for b, shared in turns.items():
        if b < 0:  # turns that already have rows of their own
            continue
        for turn in shared:
            first, stop = _tokens(encoding, b, turn.start, len(turn.text), max_length)
            if stop <= first:
                continue
            tail = _context_tail(encoding, b, first, added)
            checks.append((b, turn, first, stop, tail))
    tails = [texts[b][encoding.token_to_chars(b, tail).start if tail < first else turn.start:turn.start]
             for b, turn, first, _, tail in checks]
    served = tokenizer(tails, add_special_tokens=False, verbose=False)["input_ids"] if tails else []
    out: dict[int, list[tuple[Turn, int, int]]] = {b: [] for b in turns if b >= 0}
    for (b, turn, first, stop, tail), ids in zip(checks, served):
        starts_clean = encoding.token_to_chars(b, first).start == turn.start
        if starts_clean and encoding["input_ids"][b][tail:first] == ids:
            out[b].append((turn, first, stop))
        else:
            turns.setdefault(-b - 1, []).append(turn)
    return out


def _own_rows(tokenizer, turns: list[Turn], max_length: int) -> list[tuple[EncodedRow, dict]]:
    """A row per turn: the served prefix's tokens, then the turn's (both tokenised on their own, as
    the target is given the one and writes the other), the turn's tokens trained."""
    if not turns:
        return []
    heads = tokenizer([t.text[:t.start] for t in turns], add_special_tokens=False, verbose=False)
    bodies = tokenizer([t.text[t.start:] for t in turns], add_special_tokens=False, verbose=False)
    out = []
    for b, turn in enumerate(turns):
        head, body = heads["input_ids"][b], bodies["input_ids"][b]
        ids = (head + body)[:max_length]
        first, stop = min(len(head), max_length), len(ids)
        stats = dict.fromkeys(("turns",) + KINDS, 0)
        if stop > first:  # regions are chars of turn.text: the body starts at turn.start
            _count_kinds(bodies, b, turn, 0, stop - first, turn.start, max_length - first, stats)
        out.append((EncodedRow(ids, [0] * first + [1] * (stop - first)), stats))
    return out


def _as_templates(templates, n: int) -> list[Template]:
    if templates is None or isinstance(templates, Template):
        return [templates or Template()] * n
    return list(templates)


def _refuse(result: EncodedChat, e: Exception) -> None:
    if isinstance(e, Refused):
        result.drop_reason, result.detail = e.reason, e.detail
    else:  # the template refuses this conversation (raise_exception, or a type it cannot add)
        result.drop_reason, result.detail = "template_error", f"{type(e).__name__}: {e}"


def _plan(tokenizer, conversations, templates, max_length, results):
    """Steps 1-2 of encode_chats: full renderings tokenised in one batched call, and the turns."""
    fulls: dict[int, str] = {}
    for i, messages in enumerate(conversations):
        try:
            check_parts(messages)
            fulls[i] = render(tokenizer, messages, False, templates[i])
        except (Refused, jinja2.TemplateError, TypeError) as e:
            _refuse(results[i], e)
    order = list(fulls)
    enc = tokenizer([fulls[i] for i in order], add_special_tokens=False, verbose=False) if order else None
    shared: dict[int, list[Turn]] = {}
    for b, i in enumerate(order):
        long = len(enc["input_ids"][b]) > max_length
        stop = enc.token_to_chars(b, max_length - 1).end if long else None
        try:
            shared[b], own = plan_rows(tokenizer, conversations[i], templates[i], fulls[i], stop)
        except (Refused, jinja2.TemplateError, TypeError) as e:
            _refuse(results[i], e)
            continue
        if own:
            shared[-b - 1] = own
    return order, fulls, enc, shared


def encode_chats(tokenizer, conversations: Sequence[Messages], max_length: int,
                 templates: Optional[Template | Sequence[Template]] = None) -> list[EncodedChat]:
    """Render, tokenise (batched calls) and mask many conversations; `templates`: one for all, or
    one per conversation (its tools + the template kwargs). Needs a fast tokenizer."""
    _check_template(tokenizer)
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError("building loss masks needs a fast (Rust) tokenizer for char-to-token "
                                f"offsets; got {type(tokenizer).__name__}.")
    templates = _as_templates(templates, len(conversations))
    results = [EncodedChat(stats=dict.fromkeys(
        ("turns", "turns_too_long", "own_context", "extra_tokens") + KINDS, 0)) for _ in conversations]
    # 1-2. render and tokenise every conversation whole; its served turns
    order, fulls, enc, turns = _plan(tokenizer, conversations, templates, max_length, results)
    if not order:
        return results
    # 3. the turns the full rendering trains as served, token for token; the others go to own rows
    texts = [fulls[i] for i in order]
    shared = _shared_turns(tokenizer, enc, texts, turns, max_length)
    own_turns = [(order[-k - 1], t) for k, ts in turns.items() if k < 0 for t in ts]
    own = _own_rows(tokenizer, [t for _, t in own_turns], max_length)
    # 4. the rows: the full rendering first, then a row per turn in its own context
    for b, i in enumerate(order):
        stats, mask = results[i].stats, [0] * min(len(enc["input_ids"][b]), max_length)
        for turn, first, stop in shared.get(b, []):
            mask[first:stop] = [1] * (stop - first)
            _count_kinds(enc, b, turn, first, stop, 0, max_length, stats)
        if 1 in mask:
            results[i].rows.append(EncodedRow(list(enc["input_ids"][b][:max_length]), mask))
    for (i, turn), (row, row_stats) in sorted(zip(own_turns, own), key=lambda x: x[0][1].index):
        if 1 in row.loss_mask:
            results[i].rows.append(row)
            results[i].stats["own_context"] += 1
            results[i].stats["extra_tokens"] += len(row.input_ids)
            for k, v in row_stats.items():
                results[i].stats[k] += v
    for i in order:
        if results[i].drop_reason is None:
            stats = results[i].stats
            stats["turns_too_long"] = sum(trains(m) for m in conversations[i]) - stats["turns"]
            if not results[i].rows:
                results[i].drop_reason = "too_long"
                results[i].detail = f"no trained token within max_length={max_length}"
    return results


def encode_chat(tokenizer, messages: Messages, max_length: int,
                template: Optional[Template] = None) -> EncodedChat:
    """One conversation (see encode_chats)."""
    return encode_chats(tokenizer, [messages], max_length, template)[0]
