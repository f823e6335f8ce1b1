"""Folders a command writes into: it never replaces a file it did not write itself.

Every command line that writes into a folder (train, decode, train.export, data.capture,
data.regenerate, benchmarks.decode_speed, decode.engine) checks the folder before it writes, and the checks of
a Hydra command run before Hydra creates anything there (its `cli()`): a folder holding another
job's or the user's files is refused with the files named, and the user picks another folder.
These helpers are what those checks share.
"""
from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Iterable, Optional

from specdistill.cli.errors import USAGE_EXIT, prog

# conf/ as an absolute path for every @hydra.main: Hydra reads a relative config_path against the
# calling FILE under `python -m train`, but against the calling PACKAGE (pkg://specdistill/conf,
# which does not exist) when the same function runs from a console script (specdistill-train)
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


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


def check_out_dir_arg(command: str, argv: list[str], key: str = "run_dir", file: bool = False) -> None:
    """Before Hydra creates its output folder: a `key=<dir>` override that cannot be created
    (a read-only mount, /proc, a file in the way) ends the command with one line and exit 2,
    instead of Hydra's traceback. file=True: `key` names an output file (its folder is checked,
    and the path must not be a folder). The probe leaves nothing behind: the folders it created
    are removed again while still empty (the command creates them when it writes)."""
    for arg in argv:
        if arg.startswith(f"{key}=") and "${" not in arg:
            path = os.path.abspath(os.path.expanduser(arg.split("=", 1)[1]))
            folder = os.path.dirname(path) if file else path
            new = folder  # the topmost folder the probe creates
            while not os.path.exists(os.path.dirname(new)) and os.path.dirname(new) != new:
                new = os.path.dirname(new)
            created = not os.path.exists(new)
            try:
                if file and os.path.isdir(path):
                    raise IsADirectoryError(errno.EISDIR, "a folder, not a file")
                os.makedirs(folder, exist_ok=True)
                writable = os.access(folder, os.W_OK)
            except OSError as e:
                reason = e.strerror
            else:
                if created:
                    _remove_empty(folder, up_to=new)
                if writable:
                    return
                reason = "not writable"
            what = "write" if file else "create or write"
            print(f"{prog(command)}: error: cannot {what} {key}={arg.split('=', 1)[1]} ({reason}); set "
                  f"{key}= to a writable {'file path' if file else 'folder'}", file=sys.stderr,
                  flush=True)
            sys.exit(USAGE_EXIT)


def _remove_empty(folder: str, up_to: str) -> None:
    """rmdir `folder` and its parents up to `up_to`, stopping at the first that is not empty (a
    folder another process, e.g. another rank, has written into meanwhile is never removed)."""
    while True:
        try:
            os.rmdir(folder)
        except OSError:
            return
        if folder == up_to:
            return
        folder = os.path.dirname(folder)
