"""``moeflow.lifecycle`` (signals become an orderly exit; the exit releases what is registered) and
``comm.segment.reclaim_stale`` (a dead deployment's segments go at the next start, nobody else's)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from moeflow import lifecycle
from moeflow.comm import segment


def _python(code: str) -> subprocess.CompletedProcess:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": repo}, preexec_fn=_default_signals)


def _default_signals() -> None:
    """In the child: a suite run under nohup (SIGHUP ignored) must not pass that on, since
    ``handle_signals`` rightly leaves an ignored signal ignored."""
    for sig in lifecycle.TERMINATING:
        signal.signal(sig, signal.SIG_DFL)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_reclaim_stale_takes_only_dead_owners_segments(tmp_path, monkeypatch):
    monkeypatch.setattr(segment, "SHM_DIR", str(tmp_path))
    dead, live = _dead_pid(), os.getpid()
    names = {
        f"moeflow-{dead}-0a1b2c3d.dispatch0": True,  # a SIGKILLed engine's
        f"moeflow-{dead}-0a1b2c3d.combine0.tmp123": True,  # and its half-created one
        f"moeflow-{dead}-bencha64.dispatch0": True,  # bench comm's
        f"moeflow-{live}-0a1b2c3d.dispatch0": False,  # a live owner's
        "moeflow-t0a1b2c3d.dispatch0": False,  # no owner in the name (tests' own ids)
        f"moeflow-{dead}.dispatch0": False,  # not <pid>-...
        f"other-{dead}-0a1b2c3d.dispatch0": False,  # not moeflow's
    }
    for name in names:
        (tmp_path / name).write_bytes(b"\0" * 100)
    freed = segment.reclaim_stale()
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, gone in names.items() if not gone)
    assert freed == {f"{dead}-0a1b2c3d": 200, f"{dead}-bencha64": 100}
    assert segment.reclaim_stale() == {}


def test_owner_pid():
    assert segment.owner_pid("123-abcd") == 123 and segment.owner_pid("123-") == 123
    assert segment.owner_pid("t123-abcd") is None and segment.owner_pid("123") is None


def test_handle_signals_replaces_only_default_actions():
    saved = {s: signal.getsignal(s) for s in lifecycle.TERMINATING}
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup: stays ignored
        lifecycle.handle_signals()
        assert signal.getsignal(signal.SIGTERM) is lifecycle._exit_on_signal
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        def mine(signum, frame) -> None:
            pass

        signal.signal(signal.SIGTERM, mine)  # a program's own handler stays
        lifecycle.handle_signals()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_signal_unwinds_and_releases_at_exit(sig, tmp_path):
    """A signal raises SystemExit(128 + signum): inside ``shielded`` only at the block's end, then
    ``finally`` runs, then atexit shuts down what is still registered (not what was forgotten),
    and a signal during that is dropped rather than cutting it short."""
    out = tmp_path / "out.txt"
    code = textwrap.dedent(f"""
        import os, signal, time
        from moeflow import lifecycle

        def note(line):
            with open({str(out)!r}, "a") as f:
                f.write(line + "\\n")

        class Held:
            def __init__(self, name):
                self.name = name
            def shutdown(self):
                os.kill(os.getpid(), {int(sig)})
                time.sleep(0.2)
                note(self.name + " released")

        lifecycle.handle_signals()
        kept, closed = Held("kept"), Held("closed")
        lifecycle.release_at_exit(kept)
        lifecycle.release_at_exit(closed)
        lifecycle.forget(closed)
        try:
            with lifecycle.shielded():
                os.kill(os.getpid(), {int(sig)})
                time.sleep(0.2)
                note("shielded block done")
            note("not reached")
        finally:
            note("finally ran")
    """)
    res = _python(code)
    assert res.returncode == 128 + sig, res.stderr
    assert out.read_text() == "shielded block done\nfinally ran\nkept released\n", res.stderr


def test_second_signal_outside_a_cleanup_kills_at_once(tmp_path):
    """The first SIGTERM raises SystemExit; if that is caught (or the sender insists), the next one
    is the default action: the process dies by the signal."""
    code = textwrap.dedent("""
        import os, signal, sys, time
        from moeflow import lifecycle

        lifecycle.handle_signals()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
        except SystemExit as e:
            print("caught", e.code, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        print("not reached", flush=True)
    """)
    res = _python(code)
    assert res.returncode == -signal.SIGTERM and res.stdout == "caught 143\n", res.stderr


def test_cli_exits_as_the_signal_asked_when_a_library_converted_its_exit():
    """torch catches an exception raised while its C++ iterates a sequence and raises its own error:
    a SIGTERM there surfaces as a ValueError. The command line still exits 128 + SIGTERM, not 2
    (the CI failure: ``profile`` exited 2 with "could not determine the shape of object type")."""
    code = textwrap.dedent("""
        import os, signal, sys, time
        from moeflow import cli

        def converts(args):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)
            except SystemExit:
                raise ValueError("could not determine the shape of object type 'UntypedStorage'")
            return 0

        cli.cmd_generate = converts
        sys.exit(cli.main(["generate", "--prompt", "x"]))
    """)
    res = _python(code)
    assert res.returncode == 128 + signal.SIGTERM, res.stderr
    assert "stopped by a signal (ValueError" in res.stderr and "moeflow: error" not in res.stderr
