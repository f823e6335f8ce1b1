"""Chat data: offline assets, streaming conversation readers, chat-template rendering with
assistant-only loss masks, the tokenised on-disk cache, and evaluation prompt sets."""
import os
import sys


def quiet() -> bool:
    """True when progress bars should stay off: stderr is not a terminal (logs, pipes) or CI is set.

    The one switch for every long step (data prep, capture, regenerate, train, eval). It lives here
    because data/ sits lowest in the import order, so data/, decode/ and train/ can all use it."""
    return bool(os.environ.get("CI")) or not sys.stderr.isatty()
