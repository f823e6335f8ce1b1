"""Folders a command writes into: it never replaces a file it did not write itself.

Every command line that writes into a folder (train, decode, train.export, data.capture,
data.regenerate, decode.bench, decode.engine) checks the folder before it writes, and the checks of
a Hydra command run before Hydra creates anything there (its `cli()`): a folder holding another
job's or the user's files is refused with the files named, and the user picks another folder.
These helpers are what those checks share.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional


def override(argv: list[str], key: str) -> Optional[str]:
    """The value a Hydra command line gives `key` (`key=v`, `+key=v`, `++key=v`; the last one
    wins), None when it gives none or the value interpolates (`${...}`: resolved by Hydra)."""
    value = None
    for arg in argv:
        name, sep, v = arg.lstrip("+").partition("=")
        if sep and name == key:
            value = None if "${" in v else v
    return value


def present(folder: Path, names: Iterable[str]) -> list[str]:
    """Which of `names` exist in `folder` (files or folders), in the order given."""
    folder = Path(folder).expanduser()
    return [n for n in names if (folder / n).exists() or (folder / n).is_symlink()]


def contents(folder: Path, ignore: Iterable[str] = ()) -> list[str]:
    """The names in `folder` (sorted; [] when it does not exist), except `ignore`."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return []
    skip = set(ignore)
    return sorted(p.name for p in folder.iterdir() if p.name not in skip)


def listing(names: list[str], most: int = 5) -> str:
    """`a, b, c` (and `, ...` past `most`) for a message."""
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


def refuse_nonempty(folder: Path, key: str, writes: str, ignore: Iterable[str] = ()) -> None:
    """Refuse to write into a folder that already holds anything (except `ignore`): `key` is the
    setting that names it (run_dir, out, --out), `writes` what the command would put there."""
    found = contents(folder, ignore)
    if found:
        raise FileExistsError(f"{key}={folder} already holds files of another job or of yours "
                              f"({listing(found)}); this command writes {writes} and never replaces "
                              f"a file it did not write: give a new {key}=")
