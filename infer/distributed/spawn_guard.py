"""Spawned tensor-parallel ranks and the user's script: the missing main guard, and Ctrl-C.

`spawn` starts each rank as a fresh interpreter that imports the parent's `__main__` script again
(to find what was pickled from it). A script that builds a `--tp N` engine at its top level, with
no `if __name__ == "__main__":`, would make every rank build one too: the rank notices it is still
bootstrapping, exits with MAIN_GUARD_EXIT and prints nothing, and the parent ends the script with
one line. A terminal's Ctrl-C goes to the whole process group: the ranks ignore it, so only rank 0
reacts (its engine stops the ranks) and no rank prints a traceback.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import sys
import threading
from typing import Iterator

MAIN_GUARD_EXIT = 86  # a rank's exit code: it found itself running the user's script's top level


def exit_if_rerunning_main() -> None:
    """In a spawned rank importing the parent's script (multiprocessing's own bootstrap test)."""
    # multiprocessing's private flag, set only on a spawned child's process object while it bootstraps
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise SystemExit(MAIN_GUARD_EXIT)


def main_guard_message() -> str:
    """Not an InferError but the script's end: without the guard every rank would run it again."""
    script = getattr(sys.modules.get("__main__"), "__file__", None) or "your script"  # no file: a REPL, -c
    return (
        f"error: tensor-parallel ranks are spawned processes that import {script} again, and its top level "
        f'builds an engine with tensor_parallel_size > 1: put that code under `if __name__ == "__main__":`'
    )


@contextlib.contextmanager
def terminal_interrupts_ignored() -> Iterator[None]:
    """SIGINT ignored while children are started, so they inherit SIG_IGN (Python keeps an ignored
    SIGINT ignored); only the main thread may change handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)  # None: set outside Python
