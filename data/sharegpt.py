"""Streaming reader of chat records: the packaged ShareGPT file and local .json/.jsonl/.parquet files.

Records come in ShareGPT form `{"id", "conversations": [{"from", "value"}], "tools"?}` or OpenAI
chat-completions form `{"id", "messages": [{"role", "content", ...}], "tools"?}`; both become a
`Conversation` of OpenAI messages, the form `apply_chat_template` takes, with every field of a
message kept as written: `content` (a string, a list of parts, or None), `name`, `tool_calls`,
`tool_call_id`, `reasoning_content`. Only names change, to the ones chat templates know:
  roles   human/user -> user; gpt/chatgpt/bing/bard/assistant -> assistant; system/developer ->
          system; tool/function/ipython/observation -> tool (a tool result); function_call ->
          assistant with that one call in `tool_calls` (ShareGPT writes the call as the value)
  fields  `from`/`value` -> `role`/`content`; a legacy `function_call` -> `tool_calls`; `reasoning`
          -> `reasoning_content`; a tool call `{"name", "arguments"}` -> `{"type": "function",
          "function": {...}}`; JSON strings (ShareGPT's `tools` and calls) are parsed.
How each form is rendered and trained is the chat template's business (data/chat.py), which refuses
per record what it cannot render (content parts other than text, tool calls or reasoning in a
template without them), never turns it into something else.

Why streaming: the packaged ShareGPT JSON array is 125 MB and cut off mid-record, so `json.load`
fails. `iter_json` reads it in 1 M-character chunks and decodes one array element at a time with
`json.JSONDecoder.raw_decode` on a sliding buffer; only the current record is held as Python
objects. The undecodable tail is reported in `Counts.truncated_tail_bytes` and logged.

Rules (each dropped conversation counts under exactly one reason, checked in this order; the
counts and the first record of each reason are logged as a WARNING):
  * bad_record   -- wrong types: record not a dict, no `conversations`/`messages` list, a turn not a
                    dict, role not a string, content not a string / list of parts / None; in JSONL
                    also a line that is not valid JSON.
  * unknown_role -- a role outside the table above (the whole conversation goes: a conversation
                    with a turn removed would no longer be what was said).
  * bad_tool_call -- a tool call (or `tools`) that is not JSON or names no function.
  * empty        -- no turns, or no turn has text, reasoning or a tool call.
  * no_assistant -- no assistant turn with text, reasoning or tool calls: nothing to learn.
  * too_long, template_error and the renderer's refusals -- counted later, by data.dataset.

A conversation that starts with assistant turns (ShareGPT split long chats into pieces; 6,358 do)
is kept: those assistant turns are training targets with whatever context precedes them -- none,
or the system prompt (the chat template may add its default one). They are real target-style text,
and dropping them would lose a third of the data. Empty turns stay in place as context.

A whole file that is not JSON, or is empty, raises DataFormatError naming the file; so does a
file that is not UTF-8 (with the line and byte offset of the first bad byte). A bad record inside a
readable file is counted, never fatal. A .json array record that is not valid JSON is skipped to
the next record (counted as `corrupt_json`, logged with its byte offset): one broken record never
takes the records after it along.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import logging
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional

from specdistill.data.chat import content_text, reasoning_text, trains

log = logging.getLogger(__name__)

# role names (case-insensitive) -> the OpenAI role a chat template is given
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system",
         "developer": "system",  # OpenAI's system role for reasoning models
         "function_call": "assistant",  # ShareGPT: an assistant turn that is one tool call
         "tool": "tool", "function": "tool", "ipython": "tool", "observation": "tool"}  # results
CHUNK_CHARS = 1 << 20  # characters read per chunk of a .json file
_WS = re.compile(r"[ \t\n\r]*")
_NEXT_RECORD = re.compile(r",[ \t\n\r]*\{")  # where the next element of an array may start


class DataFormatError(ValueError):
    """A data file cannot be read at all (empty, not JSON, unknown suffix); names the file."""


@dataclass
class Counts:
    """What happened to the records of one source. `read` = kept + sum(dropped.values())."""

    read: int = 0  # complete records decoded (or rows/lines seen)
    kept: int = 0  # conversations passed on (data.dataset moves too_long ones back to dropped)
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> count
    truncated_tail_bytes: int = 0  # bytes after the last complete record that did not decode
    first: dict[str, str] = field(default_factory=dict)  # reason -> the first such record and why

    def drop(self, reason: str, was_kept: bool = False, where: str = "") -> None:
        """Count one dropped conversation; `was_kept` when it had been counted as kept; `where`
        names the record (kept for the first of each reason)."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if where:
            self.first.setdefault(reason, where)
        if was_kept:
            self.kept -= 1

    def describe(self) -> str:
        """The counts and, for each drop reason, the first record dropped for it."""
        firsts = "; ".join(f"first {r}: {w}" for r, w in sorted(self.first.items()))
        return f"{self}" + (f" ({firsts})" if firsts else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Counts":
        return cls(**d)

    def __str__(self) -> str:
        drops = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items())) or "none"
        tail = self.truncated_tail_bytes
        return (f"read {self.read}, kept {self.kept}, dropped: {drops}"
                + (f"; truncated tail {tail} bytes" if tail else ""))


@dataclass
class Conversation:
    id: str  # the record's `id`, else a stable hash of its content
    messages: list[dict[str, Any]]  # OpenAI messages: role, content (str | parts | None), tool_calls, ...
    tools: Optional[list] = None  # the record's tool definitions (OpenAI `tools`), if any


# ---------------------------------------------------------------------------------------------
# Raw records
# ---------------------------------------------------------------------------------------------
def iter_json(path: Path, counts: Counts, chunk_chars: int = CHUNK_CHARS) -> Iterator[Any]:
    """Yield the elements of a JSON array (or whitespace-separated JSON values) one at a time.

    Holds one chunk plus the record being decoded. A record that does not decode mid-file is
    skipped to the next record (a `{` after a `,` that decodes to a chat record): counted as
    dropped `corrupt_json` and logged with its byte offset, and every record after it is kept.
    A tail with no record after it (a cut-off file) ends the stream; its size goes to
    counts.truncated_tail_bytes.
    """
    decoder = json.JSONDecoder()
    size = path.stat().st_size
    with open(path, encoding="utf-8", newline="") as f:  # newline="": byte offsets stay exact
        buf, pos, eof, dropped_bytes = "", 0, False, 0

        def more() -> bool:  # append a chunk, dropping what is consumed; False at end of file
            nonlocal buf, pos, eof, dropped_bytes
            chunk = f.read(chunk_chars)
            eof = not chunk
            dropped_bytes += len(buf[:pos].encode("utf-8"))
            buf, pos = buf[pos:] + chunk, 0
            return not eof

        def offset(p: int) -> int:  # byte offset in the file of buffer position p
            return dropped_bytes + len(buf[:p].encode("utf-8"))

        def skip_ws() -> bool:  # move pos to the next non-blank char; False at end of file
            nonlocal pos
            while True:
                pos = _WS.match(buf, pos).end()
                if pos < len(buf) or not more():
                    return pos < len(buf)

        def decode_at() -> tuple[Any, Optional[int]]:  # the value at pos: (value, end) or (None, None)
            while True:
                try:
                    value, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as e:
                    # Cut at the buffer's end (or inside a string): read more. Else it is corrupt.
                    near_end = e.pos >= len(buf) - 64 or e.msg.startswith("Unterminated string")
                    if near_end and more():
                        continue
                    return None, None
                if end == len(buf) and more():  # a number could go on in the next chunk
                    continue
                return value, end

        def resync() -> bool:  # pos to the next chat record after a corrupt one; False: none
            nonlocal pos
            i = pos + 1
            while True:
                m = _NEXT_RECORD.search(buf, i)
                if m is None:
                    pos = max(pos, len(buf) - 64)  # a separator may be cut by the chunk's end
                    if not more():
                        return False
                    i = 0
                    continue
                pos = m.end() - 1  # a `{`: what lies before it is skipped
                value, _ = decode_at()
                if isinstance(value, dict) and ("conversations" in value or "messages" in value):
                    return True
                i = pos + 1

        if not skip_ws():
            raise DataFormatError(f"{path} is empty: expected a JSON array of chat records.")
        if buf[pos] not in "[{":
            raise DataFormatError(f"{path} is not JSON (starts with {buf[pos:pos + 20]!r}); expected "
                                  f"a JSON array of chat records, or JSON Lines in a .jsonl file.")
        in_array = buf[pos] == "["
        pos += in_array
        first, bad_at = True, None
        while skip_ws():
            if in_array and buf[pos] == "]":
                pos += 1
                if skip_ws():  # data after the closing bracket
                    bad_at = offset(pos)
                    break
                return
            value, end = None, None
            if in_array and not first and buf[pos] == ",":
                pos += 1
                if not skip_ws():
                    bad_at = offset(pos)
                    break
                value, end = decode_at()
            elif first or not in_array:
                value, end = decode_at()
            if end is None:  # corrupt here (or no comma): skip to the next record, or a cut-off tail
                bad_at = offset(pos)
                if not resync():
                    break
                counts.read += 1
                counts.drop("corrupt_json", where=f"byte {bad_at}: not valid JSON")
                log.warning("%s: the record at byte %d is not valid JSON; skipped %d bytes to the "
                            "next record, every record after it is kept (dropped as corrupt_json)",
                            path, bad_at, offset(pos) - bad_at)
                bad_at, first = None, True
                continue
            pos, first = end, False
            counts.read += 1
            yield value
        else:  # end of file between two values: complete for JSON Lines, cut off for an array
            if not in_array:
                return
            bad_at = offset(pos)
        # Whatever is left did not decode and holds no further record: a cut-off file.
        tail = size - bad_at
        counts.truncated_tail_bytes += tail
        if counts.read == 0:
            raise DataFormatError(f"{path}: no complete JSON record could be decoded.")
        log.warning("%s: the JSON is cut off or corrupt after %d complete records; the last %d "
                    "bytes (from byte %d, %.2g%% of the file) do not decode and were skipped",
                    path, counts.read, tail, bad_at, 100 * tail / max(size, 1))


def iter_jsonl(path: Path, counts: Counts) -> Iterator[Any]:
    """Yield one value per non-blank line; a line that is not JSON counts as bad_record."""
    bad = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            counts.read += 1
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                counts.drop("bad_record", where=f"line {lineno}: not valid JSON")
                bad += 1
                if bad <= 5:  # enough to find the problem without flooding the log
                    log.warning("%s:%d: not valid JSON (%s); record skipped", path, lineno, e)
                continue
            yield value
    if counts.read == 0:
        raise DataFormatError(f"{path} is empty: expected JSON Lines of chat records.")
    if bad == counts.read:
        raise DataFormatError(f"{path}: no line is valid JSON; expected JSON Lines of chat records.")


def iter_parquet(path: Path, counts: Counts, batch_rows: int = 512) -> Iterator[Any]:
    """Yield rows of a parquet file as dicts, a batch at a time."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError on a non-parquet file
        raise DataFormatError(f"{path} is not a readable parquet file: {e}") from e
    for batch in pf.iter_batches(batch_size=batch_rows):
        for row in batch.to_pylist():
            counts.read += 1
            yield row


def first_invalid_utf8(raw: IO[bytes]) -> tuple[int, int, bytes]:
    """(line number, byte offset, the bytes) of the first bytes of a binary stream that are not
    UTF-8, read in chunks; (0, -1, b"") when it all decodes."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    line, offset = 1, 0
    for chunk in iter(lambda: raw.read(CHUNK_CHARS), b""):
        try:
            decoder.decode(chunk)
        except UnicodeDecodeError as e:
            # the decoder may hold up to 3 bytes of an unfinished character from the last chunk
            start = max(0, e.start - len(e.object) + len(chunk))
            return line + chunk[:start].count(b"\n"), offset + start, chunk[start:start + 4]
        line, offset = line + chunk.count(b"\n"), offset + len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return line, offset, b""
    return 0, -1, b""


def not_utf8(path: Path, opener: Callable[[Path], IO[bytes]] = open) -> "DataFormatError":
    """The error for a file that does not decode as UTF-8: where, and the fix."""
    with opener(path, "rb") as raw:
        line, offset, bad = first_invalid_utf8(raw)
    where = f"line {line}, byte offset {offset} ({bad!r})" if offset >= 0 else "somewhere"
    return DataFormatError(f"{path}:{line}: not UTF-8 text at {where}; save the file as UTF-8 "
                           f"(e.g. iconv -f latin1 -t utf-8) or remove the bad bytes")


def _utf8_checked(records: Iterator[Any], path: Path) -> Iterator[Any]:
    """`records` of a text file; a decoding error becomes DataFormatError naming line and byte."""
    try:
        yield from records
    except UnicodeDecodeError:
        raise not_utf8(path) from None


def iter_records(path: str | Path, counts: Counts) -> Iterator[Any]:
    """Raw records of a .json / .jsonl / .parquet file (dispatch on the suffix)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataFormatError(f"data file {path} does not exist.")
    suffix = path.suffix.lower()
    if suffix == ".json":
        return _utf8_checked(iter_json(path, counts), path)
    if suffix == ".jsonl":
        return _utf8_checked(iter_jsonl(path, counts), path)
    if suffix == ".parquet":
        return iter_parquet(path, counts)
    raise DataFormatError(f"{path}: unknown data file type {suffix!r}; use .json, .jsonl or .parquet.")


# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------
def _first(d: dict, key: str, alt: str) -> Any:
    """d[key], else d[alt]: ShareGPT and OpenAI names (parquet rows may carry both, one None)."""
    value = d.get(key)
    return d.get(alt) if value is None else value


class _Bad(Exception):
    """A record that cannot be read as a conversation: reason + what was wrong."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _maybe_json(value: Any, what: str) -> Any:
    """A JSON string (ShareGPT stores tool calls and tool lists as strings) or the value itself."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise _Bad("bad_tool_call", f"{what} is not valid JSON: {value[:60]!r}") from None
    return value


def _tool_call(call: Any, what: str) -> dict:
    """One OpenAI tool call {"type": "function", "function": {"name", "arguments"}} (a bare
    {"name", "arguments"} call, as ShareGPT and the legacy `function_call` write it, is wrapped)."""
    call = _maybe_json(call, what)
    if isinstance(call, dict) and "function" not in call and "name" in call:
        call = {"type": "function", "function": call}
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _Bad("bad_tool_call", f"{what} has no function name: {str(call)[:60]!r}")
    return call


def _content_ok(content: Any) -> bool:
    """str, None, or a list of parts (dicts with a `type`; text parts with a string `text`)."""
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, dict) and isinstance(p.get("type"), str)
        and (p["type"] != "text" or isinstance(p.get("text"), str)) for p in content)


def _message(turn: Any, n: int) -> dict:
    """One turn as an OpenAI message, every field kept (see module doc for the role names)."""
    if not isinstance(turn, dict):
        raise _Bad("bad_record", f"turn {n} is not an object")
    role, content = _first(turn, "from", "role"), _first(turn, "value", "content")
    if not isinstance(role, str) or not _content_ok(content):
        raise _Bad("bad_record", f"turn {n}: role must be a string and content a string or a list "
                   f"of parts (got {type(role).__name__}, {type(content).__name__})")
    name = role.strip().lower()
    if name not in ROLES:
        raise _Bad("unknown_role", f"turn {n} has role {role!r} (known: {', '.join(sorted(ROLES))})")
    message = {k: v for k, v in turn.items() if k not in ("from", "value") and v is not None}
    message["role"], message["content"] = ROLES[name], content
    if name == "function_call":  # ShareGPT: the value is the call itself
        message["content"] = ""
        message["tool_calls"] = [_tool_call(content, f"turn {n} (function_call)")]
    if "function_call" in message:  # OpenAI's legacy single call
        message.setdefault("tool_calls", []).append(
            _tool_call(message.pop("function_call"), f"turn {n} function_call"))
    if "tool_calls" in message:
        if not isinstance(message["tool_calls"], list):
            raise _Bad("bad_tool_call", f"turn {n}: tool_calls is not a list")
        message["tool_calls"] = [_tool_call(c, f"turn {n} tool call") for c in message["tool_calls"]]
    if "reasoning" in message and "reasoning_content" not in message:
        message["reasoning_content"] = message.pop("reasoning")  # the other common name
    if not isinstance(message.get("reasoning_content", ""), str):
        raise _Bad("bad_record", f"turn {n}: reasoning_content is not a string")
    return message


def _tools(record: dict) -> Optional[list]:
    tools = _maybe_json(record.get("tools"), "tools")
    if tools in (None, [], ""):
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _Bad("bad_record", "tools is not a list of tool definitions")
    return tools


def _record_id(record: dict, messages: list, tools: Optional[list]) -> str:
    rid = record.get("id")
    if isinstance(rid, (str, int)) and not isinstance(rid, bool) and str(rid):
        return str(rid)
    # stable across runs and machines: a hash of the normalised content
    blob = json.dumps(messages if tools is None else [messages, tools], ensure_ascii=False,
                      sort_keys=True).encode("utf-8")
    return "sha1-" + hashlib.sha1(blob).hexdigest()[:16]


def read_record(record: Any) -> Conversation:
    """The conversation of a record; raises _Bad with a reason (see module doc)."""
    if not isinstance(record, dict):
        raise _Bad("bad_record", f"a record is a {type(record).__name__}, not an object")
    turns = _first(record, "conversations", "messages")
    if not isinstance(turns, list):
        raise _Bad("bad_record", "no `conversations` or `messages` list")
    messages = [_message(t, n) for n, t in enumerate(turns)]
    if not any(content_text(m).strip() or m.get("tool_calls") or reasoning_text(m).strip()
               for m in messages):
        raise _Bad("empty", "no turn has text")
    if not any(trains(m) for m in messages):
        raise _Bad("no_assistant", "no assistant turn with text or tool calls")
    tools = _tools(record)
    return Conversation(id=_record_id(record, messages, tools), messages=messages, tools=tools)


def normalise(record: Any) -> tuple[Optional[Conversation], Optional[str]]:
    """(conversation, None) for a usable record, (None, drop reason) otherwise. See module doc."""
    try:
        return read_record(record), None
    except _Bad as e:
        return None, e.reason


def _where(record: Any, counts: Counts) -> str:
    """How a log names a record: its id, else its number in the file."""
    rid = record.get("id") if isinstance(record, dict) else None
    return f"id {rid}" if isinstance(rid, (str, int)) and str(rid) else f"record {counts.read}"


def iter_conversations(path: str | Path, counts: Optional[Counts] = None,
                       limit: Optional[int] = None) -> Iterator[Conversation]:
    """Normalised conversations of `path` in file order, counting into `counts`.

    `limit` stops after that many kept conversations (the rest of the file is not read).
    The counts are logged when the stream ends: a WARNING with the first record of each reason
    when any record was dropped.
    """
    counts = Counts() if counts is None else counts
    if limit is not None and limit <= 0:
        return
    for record in iter_records(path, counts):
        try:
            conv = read_record(record)
        except _Bad as e:
            counts.drop(e.reason, where=f"{_where(record, counts)}: {e.detail}")
            continue
        counts.kept += 1
        yield conv
        if limit is not None and counts.kept >= limit:
            break
    (log.warning if counts.dropped else log.info)("%s: %s", path, counts.describe())
