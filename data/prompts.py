"""Evaluation prompt sets for the decoder: MT-bench, HumanEval, or any local JSONL file.

    load_prompts("mtbench")              # 80 questions, first turn only
    load_prompts("mtbench", turns=2)     # 80 questions, both turns
    load_prompts("humaneval", limit=20)  # the first 20 of 164 code-completion prompts
    load_prompts("jsonl", path="my.jsonl")

A `Prompt` holds user turns only; the decoder renders each with the target's chat template and
generates the assistant replies in between. Order is the file's order; `limit` keeps the first N.

The sets are a registry (PROMPT_SETS): a new packaged set is one `PromptSet` entry here (its asset
and id field), its file in data/assets.py ASSETS (wheel and path, checked by the installer) and
conf/eval/<name>.yaml (`kind: <name>`); nothing else names the sets.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Optional

from specdistill.data.assets import asset_path
from specdistill.data.sharegpt import not_utf8


@dataclass(frozen=True)
class PromptSet:
    """A named prompt set: where its file comes from and which record fields name a prompt."""

    asset: Optional[str]  # the packaged file: a data/assets.py ASSETS name (None: a user `path`)
    id_field: str  # the record's id field
    id_required: bool = True  # False: a record without it is named by its line number
    category_field: Optional[str] = None  # the record's category field, if any


PROMPT_SETS: dict[str, PromptSet] = {
    "mtbench": PromptSet("mtbench", "question_id", category_field="category"),
    "humaneval": PromptSet("humaneval", "task_id"),
    "jsonl": PromptSet(None, "id", id_required=False, category_field="category"),
}
KINDS = tuple(PROMPT_SETS)


class PromptFormatError(ValueError):
    """A prompt file line is not usable; the message names the file and line."""


@dataclass
class Prompt:
    id: str  # MT-bench question_id, HumanEval task_id, or the JSONL `id` (else the line number)
    category: Optional[str]  # MT-bench category (writing, coding, ...); None when not given
    turns: list[str]  # user turns, in order (at least one)


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; a line that is not a JSON object raises."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist.")
    rows = []
    try:
        with _open_text(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise PromptFormatError(f"{path}:{lineno}: not valid JSON ({e.msg}).") from e
                if not isinstance(obj, dict):
                    raise PromptFormatError(f"{path}:{lineno}: expected a JSON object, got "
                                            f"{type(obj).__name__}.")
                rows.append((lineno, obj))
    except UnicodeDecodeError:  # name the line and byte, as the chat data reader does
        opener = gzip.open if path.suffix == ".gz" else open
        raise PromptFormatError(str(not_utf8(path, opener))) from None
    return rows


def _turns(obj: dict[str, Any], where: str) -> list[str]:
    """The user turns of a record: `turns` (list of str) or `prompt` (str)."""
    if "turns" in obj:
        turns = obj["turns"]
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
            raise PromptFormatError(f"{where}: `turns` must be a non-empty list of strings.")
    elif isinstance(obj.get("prompt"), str):
        turns = [obj["prompt"]]
    else:
        raise PromptFormatError(f"{where}: needs a `prompt` (string) or `turns` (list of strings) field.")
    if any(not t.strip() for t in turns):  # an empty prompt would only measure the chat template
        raise PromptFormatError(f"{where}: an empty prompt; give it text or remove the record.")
    return turns


def load_prompts(kind: str, path: Optional[str] = None, limit: Optional[int] = None,
                 turns: int = 1, offset: int = 0) -> list[Prompt]:
    """Prompts of `kind` (a PROMPT_SETS name), keeping the first `turns` user turns.

    `path` overrides the packaged file (required for jsonl); `offset` skips the first N prompts
    (e.g. a confidence calibration fitted on prompts an eval of the first ones never sees);
    `limit` keeps the next N.
    """
    if kind not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {kind!r}; use one of {KINDS}.")
    if turns < 1:
        raise ValueError(f"turns={turns}: keep at least one turn.")
    if limit is not None and limit < 0:
        raise ValueError(f"limit={limit}: must be >= 0 or None.")
    if offset < 0:
        raise ValueError(f"offset={offset}: must be >= 0.")
    spec = PROMPT_SETS[kind]
    if spec.asset is None and not path:
        raise ValueError(f"prompt set {kind!r} needs a path to a JSONL file.")
    file = Path(path).expanduser() if path else asset_path(spec.asset)
    prompts, seen = [], 0
    for lineno, obj in _read_jsonl(file):
        if limit is not None and len(prompts) >= limit:
            break
        seen += 1
        if seen <= offset:
            continue
        where = f"{file}:{lineno}"
        pid = obj.get(spec.id_field, None if spec.id_required else lineno)
        category = obj.get(spec.category_field) if spec.category_field else None
        if pid is None:
            raise PromptFormatError(f"{where}: no `{spec.id_field}` field.")
        prompts.append(Prompt(id=str(pid), category=category, turns=_turns(obj, where)[:turns]))
    if not prompts:  # nothing decoded would be measured: never a tau of nothing
        raise PromptFormatError(f"{file}: no prompt to decode ("
                                + ("limit=0" if limit == 0 else
                                   f"offset={offset} skips all {seen} records" if offset and seen
                                   else "the file holds no record")
                                + "); give a file with one JSON object per line"
                                + (" or a smaller offset" if offset and seen else ""))
    return prompts
