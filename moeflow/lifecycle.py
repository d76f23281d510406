"""How a moeflow process ends: a signal becomes an orderly exit that releases workers and segments.

SIGINT already raises KeyboardInterrupt in Python's main thread; ``handle_signals`` makes SIGTERM
and SIGHUP raise ``SystemExit(128 + signum)`` there too, so every ``with`` block and ``finally``
clause on the stack runs as for an error. ``release_at_exit`` is the net under them: whatever holds
worker processes or shared memory registers itself, and ``atexit`` shuts down what is still
registered (a script that never closed its LLM, a signal that landed outside any ``with``).

A cleanup that a signal must not cut short runs ``shielded``: a SIGTERM/SIGHUP that arrives
meanwhile takes effect when it ends. Another one outside such a block kills the process at once
(the default action: asked twice, or the first ``SystemExit`` was caught). What no handler can
cover: SIGKILL. Then the workers die
with their parent (``die_with_parent``) and the next deployment to start unlinks the dead run's
segments (``comm.segment.reclaim_stale``).
"""
from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import weakref
from contextlib import contextmanager

TERMINATING = (signal.SIGTERM, signal.SIGHUP)  # default action: die at once, skipping all cleanup

_registered: weakref.WeakSet = weakref.WeakSet()  # objects with a shutdown() not yet called
_hooked = False  # our atexit function is registered
_shield_depth = 0  # main thread: inside this many ``shielded`` blocks
_pending: int | None = None  # a signal that arrived while shielded
_raised: int | None = None  # the signal that has already raised SystemExit


def _exit_on_signal(signum, frame) -> None:
    global _pending
    if _shield_depth:
        _pending = signum
    elif _raised is not None:  # asked twice (or the first SystemExit was swallowed): the default action, now
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    else:
        _raise(signum)


def _raise(signum: int):
    global _raised
    _raised = signum
    raise SystemExit(128 + signum)


def signal_exit_code() -> int | None:
    """``128 + signum`` once a SIGTERM/SIGHUP has raised its ``SystemExit``, else None.

    A library whose C++ calls back into Python may catch that ``SystemExit`` and raise its own error
    instead (torch, building a tensor from a sequence, reports "could not determine the shape"): an
    entry point asks this to exit as the signal asked, not as for that error."""
    return None if _raised is None else 128 + _raised


@contextmanager
def shielded():
    """Run a cleanup that SIGTERM/SIGHUP must not interrupt; one that arrives meanwhile raises its
    ``SystemExit`` at the end. (Only the main thread runs signal handlers: elsewhere a no-op.)"""
    global _shield_depth, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _shield_depth += 1
    try:
        yield
    finally:
        _shield_depth -= 1
        if _shield_depth == 0 and _pending is not None:
            signum, _pending = _pending, None
            _raise(signum)


def handle_signals() -> None:
    """From now on SIGTERM and SIGHUP unwind the main thread as ``SystemExit(128 + signum)``.

    Only where the signal still has its default action: an ignored one (``nohup``) stays ignored
    and a program's own handler stays in place. Outside the main thread (where Python runs signal
    handlers) it does nothing; the main thread's own handling then applies."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in TERMINATING:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _exit_on_signal)


def release_at_exit(obj) -> None:
    """Call ``obj.shutdown()`` at interpreter exit unless ``forget(obj)`` came first (held weakly)."""
    global _hooked
    if not _hooked:
        # NOTE: registered after multiprocessing's own exit hook (its import registers it): atexit
        # runs in reverse order, so ours shuts the workers down before that one terminates them.
        import multiprocessing.util  # noqa: F401

        atexit.register(_release_all)
        _hooked = True
    _registered.add(obj)


def forget(obj) -> None:
    _registered.discard(obj)


def release_all() -> None:
    """Now, what the exit hook would do: for a process about to leave by ``os._exit``."""
    _release_all()


def _release_all() -> None:
    global _shield_depth
    _shield_depth += 1  # the process is ending anyway: a signal now must not cut the cleanup short
    for obj in list(_registered):
        try:
            obj.shutdown()
        except Exception as e:  # one failure must not keep the others' segments
            print(f"moeflow: shutting down {obj!r} at exit failed: {e}", file=sys.stderr)


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux PR_SET_PDEATHSIG);
    False where unsupported. NOTE: "parent" is the *thread* that started this process."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return libc.prctl(1, sig) == 0  # 1: PR_SET_PDEATHSIG
    except OSError:  # not Linux: the engine's shutdown still reaps workers
        return False
