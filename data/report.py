"""What a job trains on, in numbers: the data report.

    report = DataReport.from_counts(counts)    # conversations read / kept / dropped by reason
    report.add(encoded.stats)                  # per conversation (data/chat.py EncodedChat.stats)
    report.log(log); report.markdown()         # the log line and the run report's section

Turns are assistant turns with something to train (answer, reasoning or tool calls). A turn is
kept when at least one of its tokens is trained; `turns_dropped` counts turns by why they were not:
`too_long` (past data.max_length) or the reason their whole conversation was refused. Trained
tokens are split by what the target writes in them: `answer`, `reasoning` (a think block or
reasoning_content as the template lays it out) and `tool_call` (the rendered call, through the
end-of-turn token). `own_context` turns are those the full rendering shows differently from how the
target serves them (data/chat.py): they are trained in a row of their own, costing `extra_tokens`.
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdistill.data.chat import KINDS

REPORT_FILE = "data_report.json"  # in the tokenised cache entry and in the run dir


@dataclass
class DataReport:
    read: int = 0  # records read from the file
    conversations: int = 0  # conversations kept (with at least one trained token)
    dropped: dict[str, int] = field(default_factory=dict)  # conversations dropped, by reason
    first: dict[str, str] = field(default_factory=dict)  # reason -> the first record dropped for it
    rows: int = 0  # training rows (a conversation has one, plus one per own context)
    turns: int = 0  # assistant turns trained
    turns_dropped: dict[str, int] = field(default_factory=dict)  # turns not trained, by reason
    own_context: int = 0  # turns trained in a row of their own (history rewritten by the template)
    extra_tokens: int = 0  # tokens of those rows
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))  # trained, by kind

    @classmethod
    def from_counts(cls, counts) -> "DataReport":
        return cls(read=counts.read, dropped=dict(counts.dropped), first=dict(counts.first))

    def add(self, stats: dict[str, int], rows: int) -> None:
        """One kept conversation's stats (EncodedChat.stats) and its row count."""
        self.conversations += 1
        self.rows += rows
        self.turns += stats.get("turns", 0)
        if stats.get("turns_too_long"):
            self.drop_turns("too_long", stats["turns_too_long"])
        self.own_context += stats.get("own_context", 0)
        self.extra_tokens += stats.get("extra_tokens", 0)
        for kind in KINDS:
            self.tokens[kind] = self.tokens.get(kind, 0) + stats.get(kind, 0)

    @classmethod
    def generated(cls, trained_tokens: list[int]) -> "DataReport":
        """The report of rows the target wrote itself (data.selfgen): one answer turn per row, all of
        its trained tokens counted as `answer` (a thinking target's think block included: the store
        keeps no split by kind)."""
        n = len(trained_tokens)
        report = cls(read=n, conversations=n, rows=n, turns=n)
        report.tokens["answer"] = int(sum(trained_tokens))
        return report

    def merged(self, other: "DataReport") -> "DataReport":
        """This report and `other` added up (a mix: the file's rows and the target's own)."""
        both = copy.deepcopy(self)
        both.read += other.read
        both.conversations += other.conversations
        both.rows += other.rows
        both.turns += other.turns
        both.own_context += other.own_context
        both.extra_tokens += other.extra_tokens
        for reason, n in other.dropped.items():
            both.dropped[reason] = both.dropped.get(reason, 0) + n
        for reason, first in other.first.items():
            both.first.setdefault(reason, first)
        for reason, n in other.turns_dropped.items():
            both.drop_turns(reason, n)
        for kind, n in other.tokens.items():
            both.tokens[kind] = both.tokens.get(kind, 0) + n
        return both

    def drop_turns(self, reason: str, n: int) -> None:
        self.turns_dropped[reason] = self.turns_dropped.get(reason, 0) + n

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DataReport":
        return cls(**d)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: Path) -> "DataReport":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def summary(self) -> str:
        """One line: turns, trained tokens by kind, own contexts."""
        total = sum(self.tokens.values())
        kinds = ", ".join(f"{k} {v} ({100 * v / max(total, 1):.1f}%)" for k, v in self.tokens.items())
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(self.turns_dropped.items())) or "none"
        line = (f"{self.conversations} conversations in {self.rows} rows; {self.turns} assistant turns "
                f"trained, dropped: {dropped}; {total} trained tokens: {kinds}")
        if self.own_context:
            line += (f"; {self.own_context} turns trained in a context of their own (the template "
                     f"renders them differently in the full conversation), {self.extra_tokens} tokens")
        return line

    def markdown(self) -> list[str]:
        """The run report's section."""
        total = sum(self.tokens.values())
        drops = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items())) or "none"
        lines = ["## Training data", "",
                 f"{self.read} records read, {self.conversations} conversations kept "
                 f"({self.rows} rows); conversations dropped: {drops}.", "",
                 "| what | turns | trained tokens |", "|---|---:|---:|"]
        lines += [f"| {k} | | {v} ({100 * v / max(total, 1):.1f}%) |" for k, v in self.tokens.items()]
        lines += [f"| turns trained | {self.turns} | {total} |"]
        lines += [f"| turns dropped: {k} | {v} | |" for k, v in sorted(self.turns_dropped.items())]
        if self.own_context:
            lines += [f"| turns in a context of their own | {self.own_context} | {self.extra_tokens} "
                      f"(row tokens) |"]
        return lines + [""]
