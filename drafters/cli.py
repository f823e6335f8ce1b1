"""What every command line of specdistill shares: user errors as one clear line, and the check
of an output path before Hydra creates anything (numeric ranges: drafters/ranges.py).

A mistake a user can make (a bad value, a missing file, a locked or damaged run dir, a full disk)
ends the command with one line — what went wrong, where, and the fix — and exit code 2. The
traceback is shown only with SPECDISTILL_DEBUG=1. Ctrl-C ends with a hint how to continue. Every
command goes through `user_errors`: train, decode, train.export, decode.engine, decode.bench,
data.capture, data.regenerate.
"""
from __future__ import annotations

import contextlib
import errno
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

# conf/ as an absolute path for every @hydra.main: Hydra reads a relative config_path against the
# calling FILE under `python -m train`, but against the calling PACKAGE (pkg://specdistill/conf,
# which does not exist) when the same function runs from a console script (specdistill-train)
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
DEBUG_ENV = "SPECDISTILL_DEBUG"
USAGE_EXIT = 2  # a user error (bad setting, missing or damaged file)
INTERRUPT_EXIT = 130  # Ctrl-C, as shells report SIGINT


def _user_error_types() -> tuple[type[BaseException], ...]:
    from omegaconf.errors import OmegaConfBaseException

    # ValueError covers omegaconf's ValidationError too; KeyError: unknown drafter names
    return (ValueError, KeyError, FileNotFoundError, FileExistsError, PermissionError,
            NotADirectoryError, IsADirectoryError, OmegaConfBaseException, UserError)


class UserError(RuntimeError):
    """An error the user caused and can fix; raised with a message that says how."""


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk or quota: the user's to fix, not a bug


def _user_os_error(e: OSError) -> bool:
    """OSErrors that are the user's to fix: the subclasses in _user_error_types, a full disk."""
    return isinstance(e, _user_error_types()) or e.errno in _DISK_FULL


@contextlib.contextmanager
def user_errors(command: str, interrupt_hint: str | Callable[[], str] = "") -> Iterator[None]:
    """Run a command's body: a user error prints `<command>: error: <message>` and exits 2
    (traceback with SPECDISTILL_DEBUG=1); Ctrl-C prints the hint (a callable: asked then) and
    exits 130."""
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        yield
    except KeyboardInterrupt:
        if debug:
            raise
        hint = interrupt_hint() if callable(interrupt_hint) else interrupt_hint
        print(f"\n{command}: interrupted. {hint}".rstrip(), file=sys.stderr, flush=True)
        sys.exit(INTERRUPT_EXIT)
    except (*_user_error_types(), OSError) as e:
        if debug or (isinstance(e, OSError) and not _user_os_error(e)):
            raise
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            msg = (f"no space left on the disk of {e.filename or 'an output file'} ({e.strerror}): "
                   f"free space, or write to another disk (run_dir= / out=)")
        print(f"{command}: error: {msg} ({type(e).__name__}; set {DEBUG_ENV}=1 for the traceback)",
              file=sys.stderr, flush=True)
        sys.exit(USAGE_EXIT)


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
            print(f"{command}: error: cannot {what} {key}={arg.split('=', 1)[1]} ({reason}); set "
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
