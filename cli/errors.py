"""User errors as one clear line, for every command of specdistill (output paths: cli/paths.py;
numeric ranges: cli/ranges.py).

A mistake a user can make (a bad value, a missing file, a locked or damaged run dir, a full disk)
ends the command with one line — what went wrong, where, and the fix — and exit code 2. The
traceback is shown only with SPECDISTILL_DEBUG=1. Ctrl-C ends with a hint how to continue. Every
command goes through `user_errors`: train, decode, train.export, decode.engine, benchmarks.decode_speed,
data.capture, data.regenerate.
"""
from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import Callable, Iterator

DEBUG_ENV = "SPECDISTILL_DEBUG"
PROG_ENV = "SPECDISTILL_PROG"  # the command as the user typed it, set by `specdistill <verb>`
USAGE_EXIT = 2  # a user error (bad setting, missing or damaged file)
INTERRUPT_EXIT = 130  # Ctrl-C, as shells report SIGINT


def _user_error_types() -> tuple[type[BaseException], ...]:
    from omegaconf.errors import OmegaConfBaseException

    # ValueError covers omegaconf's ValidationError too; KeyError: unknown drafter names
    return (ValueError, KeyError, FileNotFoundError, FileExistsError, PermissionError,
            NotADirectoryError, IsADirectoryError, OmegaConfBaseException, UserError)


def prog(command: str) -> str:
    """The name a command's messages give it: `specdistill train` when run through the one
    command (cli/main.py), else its own (`python -m train`)."""
    return os.environ.get(PROG_ENV) or command


class UserError(RuntimeError):
    """An error the user caused and can fix; raised with a message that says how."""


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk or quota: the user's to fix, not a bug


def disk_full(e: BaseException) -> OSError | None:
    """The OSError with errno ENOSPC / EDQUOT that caused `e` (`e` itself, or along its
    __cause__ / __context__ chain: a writer that wraps it), else None. Only the errno decides:
    never free space, which says nothing about why this write failed."""
    seen: list[BaseException] = []
    while e is not None and all(e is not s for s in seen):
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            return e
        seen.append(e)
        e = e.__cause__ or e.__context__
    return None


def disk_full_message(e: OSError) -> str:
    """The one line of a full disk or quota: where, and the fix."""
    return (f"no space left on the disk of {e.filename or 'an output file'} ({e.strerror or 'disk full'}"
            f"): free space, or write to another disk (run_dir= / out= / data.cache_dir=); what was "
            f"written before is intact")


def _user_os_error(e: OSError) -> bool:
    """OSErrors that are the user's to fix: the subclasses in _user_error_types, a full disk."""
    return isinstance(e, _user_error_types()) or e.errno in _DISK_FULL


def _report(command: str, msg: str, e: BaseException) -> None:
    msg = " ".join(line.strip() for line in msg.splitlines() if line.strip())  # one line, always
    print(f"{command}: error: {msg} ({type(e).__name__}; set {DEBUG_ENV}=1 for the traceback)",
          file=sys.stderr, flush=True)
    sys.exit(USAGE_EXIT)


@contextlib.contextmanager
def user_errors(command: str, interrupt_hint: str | Callable[[], str] = "") -> Iterator[None]:
    """Run a command's body: a user error prints `<command>: error: <message>` and exits 2
    (traceback with SPECDISTILL_DEBUG=1); Ctrl-C prints the hint (a callable: asked then) and
    exits 130. A full disk (errno ENOSPC / EDQUOT anywhere on the error's chain) is a user error
    whatever the writer wrapped it in."""
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    command = prog(command)
    try:
        yield
    except KeyboardInterrupt:
        if debug:
            raise
        hint = interrupt_hint() if callable(interrupt_hint) else interrupt_hint
        print(f"\n{command}: interrupted. {hint}".rstrip(), file=sys.stderr, flush=True)
        sys.exit(INTERRUPT_EXIT)
    except Exception as e:  # noqa: BLE001 - sorted below: the user's to fix, or re-raised
        full = disk_full(e)
        if debug or (full is None and not isinstance(e, _user_error_types())
                     and not (isinstance(e, OSError) and _user_os_error(e))):
            raise
        if full is not None:
            _report(command, disk_full_message(full), e)
        _report(command, str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e), e)
