"""A child process that ends with its parent: nothing is left behind by a parent that
was SIGKILLed (a pipeline's workers, a data-parallel front end's replicas).

::

    parent (pid P) ──spawns──▶ child: watch_parent(P, grace_s)
                                 thread: every 0.2 s, is P still our parent?
    P gone ────────────────────▶ SIGTERM to itself (a graceful stop: its own children
                                 and ports are released as on Ctrl-C), and _exit after
                                 grace_s if that stop has not ended the process

The parent's pid is passed in, not read at start: a parent that died before the child
ran this would otherwise be missed (the child would see init as its parent from the
first look). Linux's ``PR_SET_PDEATHSIG`` does the same for a thread, not a process, and
needs ``preexec_fn``, which is unsafe in a process with threads.
"""

from __future__ import annotations

import os
import signal
import threading
import time

#: Seconds between looks at the parent.
POLL_S = 0.2
#: The environment variable through which a parent asks a ``hybridkv`` child to watch it.
PARENT_PID_VARIABLE = "HYBRIDKV_PARENT_PID"


def watch_parent(parent: int, *, grace_s: float | None) -> threading.Thread:
    """Start a daemon thread that ends this process once ``parent`` is no longer its
    parent: at once (``grace_s`` None), or by SIGTERM, then ``os._exit`` after
    ``grace_s`` seconds if the process still runs."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)  # a poll of the process table; nothing to wait on instead
        if grace_s is not None:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(grace_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="hybridkv-parent-watch", daemon=True)
    thread.start()
    return thread


def watch_parent_from_environment(*, grace_s: float) -> None:
    """:func:`watch_parent` for the pid in :data:`PARENT_PID_VARIABLE`, if set; the
    variable is removed, so that this process's own children do not inherit it."""
    value = os.environ.pop(PARENT_PID_VARIABLE, None)
    if value is not None:
        watch_parent(int(value), grace_s=grace_s)
