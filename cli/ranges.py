"""Allowed ranges of numeric settings, declared on their fields and checked by one function.

A numeric field of a settings dataclass says its range where it is defined, with its default:

    lr: float = rng(3e-4, 0, 1, lo_open=True)  # peak learning rate (AdamW)
    layers: list[int] = rng([-1], -1, MAX_LAYERS)  # a list: every element is checked
    seed: int = rng(0, *SEED)  # sampling seed

`check_ranges(cfg, Schema)` walks a composed config (OmegaConf node, dict or dataclass) along its
schema: nested dataclasses, Optional ones, lists of numbers, and the drafter's own schema, picked by
its `name` (a field made with `sub(schema_of=...)`). Every value outside its range is collected, and
one UserError names each dotted key, its value and its range, before any work starts. A value of
None (off / the default) and a field the config does not hold are skipped; a range can never name a
key that does not exist, because the walk starts from the fields.

Every range is closed by a number on both sides: an upper bound stops a mistyped value (a block
size that would allocate 320 GB, a learning rate of 1e5) at the command line instead of deep in a
run. Bounds that depend on the target (a layer index, a vocabulary id) are checked where the target
is known, by the code that uses them. A numeric field without a range says why: `unranged(...)`.
tests/test_ranges.py walks every schema and holds each numeric field to one or the other.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

# Shared bounds, so the same kind of setting has the same range everywhere
SEED = (0, 2**32 - 1)  # random seeds (numpy's limit, the strictest of the generators seeded)
MAX_COUNT = 10**9  # steps, conversations, prompts: a count nobody runs to
MAX_TOKENS = 1 << 20  # token budgets and lengths: a million tokens, beyond any context here
MAX_BATCH = 4096  # sequences or conversations per forward
MAX_DRAFT = 64  # draft lengths, unrolled steps, tree levels, children per node: beyond any recipe
MAX_TREE = 1024  # tree nodes verified per round
MAX_LAYERS = 1024  # layer counts and hidden-state indices (the target's own count is checked later)
MAX_VOCAB = 1 << 24  # vocabulary sizes and token ids
MAX_THREADS = 4096  # CPU threads and processes
MAX_SECONDS = 7 * 24 * 3600  # timeouts: a week
MAX_TEMPERATURE = 10.0  # sampling temperatures (0 = greedy)


@dataclass(frozen=True)
class Range:
    """lo <= x <= hi (lo < x with lo_open, x < hi with hi_open)."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def holds(self, x: float) -> bool:
        if math.isnan(x):
            return False
        above = x > self.lo if self.lo_open else x >= self.lo
        below = x < self.hi if self.hi_open else x <= self.hi
        return above and below

    def __str__(self) -> str:
        return (f"{'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}"
                f"{')' if self.hi_open else ']'}")


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) or not float(x).is_integer() else str(int(x))


def rng(default: Any, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Any:
    """A dataclass field with `default` (a list default is copied per instance) and its range."""
    meta = {"range": Range(lo, hi, lo_open, hi_open)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def unranged(default: Any, why: str) -> Any:
    """A numeric field with no range, and the reason (read by the test that holds every numeric
    field to a range)."""
    return dataclasses.field(default=default, metadata={"unranged": why})


def sub(default: Any, schema_of: Callable[[Any], Optional[type]]) -> Any:
    """A field typed `Any` whose schema depends on its value (the drafter: its registered schema
    by `name`); schema_of(value) -> the dataclass to check it against (None: nothing to check)."""
    return dataclasses.field(default=default, metadata={"schema_of": schema_of})


# ---------------------------------------------------------------------------------------------
# Walking a schema
# ---------------------------------------------------------------------------------------------
def strip_optional(tp: Any) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else tp
    return tp


def field_kind(tp: Any) -> str:
    """"number" (int / float), "numbers" (a list of them), "schema" (a dataclass) or "other"."""
    tp = strip_optional(tp)
    if tp in (int, float):
        return "number"
    if typing.get_origin(tp) is list and typing.get_args(tp) and typing.get_args(tp)[0] in (int, float):
        return "numbers"
    if dataclasses.is_dataclass(tp):
        return "schema"
    return "other"


def schema_fields(schema: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, str, Any]]:
    """(dotted key, field, kind, resolved type) of every field of `schema`, nested dataclasses
    walked (their own key first). Fields chosen by value (`sub`) are not followed."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        tp = hints.get(f.name, f.type)
        kind = field_kind(tp)
        key = f"{prefix}{f.name}"
        yield key, f, kind, tp
        if kind == "schema":
            yield from schema_fields(strip_optional(tp), key + ".")


def _get(node: Any, name: str) -> Any:
    """node's value `name` (OmegaConf node, dict or dataclass); None when absent or missing."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(node, DictConfig):
        if name not in node or OmegaConf.is_missing(node, name):
            return None
        return node[name]
    if isinstance(node, dict):
        return node.get(name)
    return getattr(node, name, None)


def range_problems(cfg: Any, schema: type, prefix: str = "") -> list[str]:
    """Every value of `cfg` outside its field's range, as "key=value is outside [lo, hi]"."""
    hints = typing.get_type_hints(schema)
    bad = []
    for f in dataclasses.fields(schema):
        value, key = _get(cfg, f.name), f"{prefix}{f.name}"
        if value is None:
            continue
        kind = field_kind(hints.get(f.name, f.type))
        if "schema_of" in f.metadata:
            sub_schema = f.metadata["schema_of"](value)
            if sub_schema is not None:
                bad += range_problems(value, sub_schema, key + ".")
        elif kind == "schema":
            bad += range_problems(value, strip_optional(hints[f.name]), key + ".")
        elif "range" in f.metadata and kind in ("number", "numbers"):
            items = [(key, value)] if kind == "number" else \
                [(f"{key}[{i}]", v) for i, v in enumerate(value)]
            bad += [_outside(k, v, f.metadata["range"]) for k, v in items
                    if not _is_number(v) or not f.metadata["range"].holds(float(v))]
    return bad


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _outside(key: str, value: Any, r: Range) -> str:
    if not _is_number(value):
        return f"{key}={value!r} is not a number in {r}"
    return f"{key}={value} is outside {r}"


def check_ranges(cfg: Any, schema: type) -> None:
    """Refuse every numeric value of `cfg` outside the range on its `schema` field (UserError
    naming each key, value and range); call it first, before any heavy work."""
    from specdistill.cli.errors import UserError

    bad = range_problems(cfg, schema)
    if bad:
        raise UserError("invalid settings: " + "; ".join(bad) + ": set each inside its range")
