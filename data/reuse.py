"""One line for every reuse of a cache entry: a second job that skips a capture, a regeneration,
a self-generation or a tokenisation says which entry it read, when it was made, from which
settings, and the setting that makes a fresh one instead (data/capture.py, data/regenerate.py,
data/selfgen.py, data/dataset.py)."""
from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any, Mapping


def made_at(path: Path) -> str:
    """When `path` (an entry's completion marker) was written, in UTC to the minute."""
    stamp = dt.datetime.fromtimestamp(Path(path).stat().st_mtime, tz=dt.timezone.utc)
    return stamp.strftime("%Y-%m-%d %H:%M UTC")


def settings_text(settings: Mapping[str, Any], most: int = 8) -> str:
    """`k=v, k=v, ...` of the settings an entry was made from (nested dicts flattened, `most`
    shown)."""
    flat: list[str] = []
    for k, v in settings.items():
        if isinstance(v, Mapping):
            flat += [f"{k}.{kk}={vv}" for kk, vv in v.items() if not isinstance(vv, Mapping)]
        else:
            flat.append(f"{k}={v}")
    return ", ".join(flat[:most]) + (", ..." if len(flat) > most else "")


def reuse_line(what: str, entry: Path, marker: Path, settings: Mapping[str, Any], fresh: str) -> str:
    """`reusing <what> <entry> (made <when>, from <settings>); <fresh>`."""
    return (f"reusing {what} {entry} (made {made_at(marker)}, from {settings_text(settings)}); "
            f"{fresh}")
