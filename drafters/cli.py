"""What every command line of specdistill shares: user errors as one clear line, and range checks
of numeric settings before any work starts.

A mistake a user can make (a bad value, a missing file, a locked or damaged run dir) ends the
command with one line — what went wrong, where, and the fix — and a non-zero exit code. The
traceback is shown only with SPECDISTILL_DEBUG=1. Ctrl-C ends with a hint how to continue.
"""
from __future__ import annotations

import contextlib
import math
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
    except _user_error_types() as e:
        if debug:
            raise
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        print(f"{command}: error: {msg} ({type(e).__name__}; set {DEBUG_ENV}=1 for the traceback)",
              file=sys.stderr, flush=True)
        sys.exit(USAGE_EXIT)


def check_ranges(cfg, rules: dict[str, tuple]) -> None:
    """Check numeric settings: rules maps a dotted key to (lo, hi) with None for an open end, or
    (lo, hi, "open") for lo < x. A missing key or a None value (= off / default) is skipped."""
    from omegaconf import OmegaConf

    bad = []
    for key, rule in rules.items():
        value = OmegaConf.select(cfg, key, default=None)
        if value is None or isinstance(value, bool):
            continue
        lo, hi = rule[0], rule[1]
        strict = len(rule) > 2 and rule[2] == "open"
        if not isinstance(value, (int, float)) or math.isnan(value) \
                or (lo is not None and (value <= lo if strict else value < lo)) \
                or (hi is not None and value > hi):
            left = "(" if strict else "["
            rng = f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
            bad.append(f"{key}={value} is outside {rng}")
    if bad:
        raise UserError("invalid settings: " + "; ".join(bad))


def check_out_dir_arg(command: str, argv: list[str], key: str = "run_dir") -> None:
    """Before Hydra creates its output folder: a `key=<dir>` override that cannot be created
    (a read-only mount, /proc, a file in the way) ends the command with one line and exit 2,
    instead of Hydra's traceback."""
    for arg in argv:
        if arg.startswith(f"{key}=") and "${" not in arg:
            path = arg.split("=", 1)[1]
            try:
                os.makedirs(os.path.expanduser(path), exist_ok=True)
                writable = os.access(os.path.expanduser(path), os.W_OK)
            except OSError as e:
                reason = e.strerror
            else:
                if writable:
                    return
                reason = "not writable"
            print(f"{command}: error: cannot create or write {key}={path} ({reason}); set {key}= "
                  f"to a writable folder", file=sys.stderr, flush=True)
            sys.exit(USAGE_EXIT)
