"""SIGINT and SIGTERM for the command-line tools: one line, exit status 130 / 143, at any moment.

Python runs a signal handler only between bytecodes of the main thread, so a Ctrl-C during an XLA
compilation (minutes inside C++) used to wait for the compiler and then unwind through it (a
KeyboardInterrupt inside jax's callbacks ended in a segmentation fault), and SIGTERM, which Slurm
and Kubernetes send before killing a job, ended the process with no word. Here the signal is
noticed at once by a watcher thread woken through :func:`signal.set_wakeup_fd` (the C-level
handler writes the signal number there even while the main thread is inside XLA), which prints
the message and leaves with :func:`os._exit`. Leaving without unwinding is safe for a run folder:
every result is written to a temporary file and renamed, checkpoints are complete only with their
manifest, and the folder's lock dies with the process, so the rerun resumes exactly as after a
SIGKILL (tests/test_reliability.py kills studies at random moments and checks the bytes).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading

# A child process (an arm, a replica, the audit's second run) starts in its own session, so a terminal's
# Ctrl-C reaches the parent alone, which prints the one line and exits; the child then gets
# die_with_parent's signal, or sees at start that its parent (PARENT_ENV) is gone.
PARENT_ENV = "NONDET_JAX_PARENT_PID"
CHILD_ENV = "NONDET_JAX_CHILD"  # set by the sweep in the processes it starts for an arm (see study.child)
EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal number, as shells report
MESSAGE = "interrupted: finished arms are kept in the run folder; rerun the same command to resume"

_once = threading.Lock()
_stderr: list[int] = []  # a duplicate of fd 2 taken at install
_sockets: list[socket.socket] = []  # the wakeup socket pair, kept alive while installed (a GC'd one closes its fd)


def _leave(signum: int, message: str) -> None:
    """Print ``message`` on its own line, flush, and exit at once with the signal's status."""
    if not _once.acquire(blocking=False):
        return  # the other path (handler or watcher) is already leaving
    try:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not stop the exit
                pass
        fd = _stderr[0] if _stderr else 2  # stderr as it was at install: fd 2 may be captured meanwhile
        tty = os.isatty(fd)
        prefix = "\n\x1b[?25h" if tty else ""  # off a progress bar's line, cursor shown again
        try:
            if message:  # a child process leaves quietly: its parent says it
                os.write(fd, (prefix + message + "\n").encode())
        except OSError:
            pass
    finally:
        os._exit(EXIT_STATUS.get(signum, 128 + signum))


def install(message: str | None = MESSAGE):
    """Handle SIGINT and SIGTERM from now on in this process: ``message`` on stderr (None: nothing, for
    a child process whose parent prints it), exit 130 / 143.

    Call it first thing in a command's ``main`` (from the main thread). Returns a function that
    restores the previous handlers (for tests and for library callers that want them back).

    Example::

        def main(argv=None):
            signals.install()
            ...
    """
    if not _stderr:
        _stderr.append(os.dup(2))  # where the one line goes, even while a checkpoint save captures fd 2
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    _sockets[:] = [reader, writer]
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    previous = {s: signal.signal(s, lambda signum, frame: _leave(signum, message)) for s in EXIT_STATUS}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in EXIT_STATUS and not stop.is_set():
                    _leave(signum, message)

    threading.Thread(target=watch, name="nondet_jax-signals", daemon=True).start()

    def restore() -> None:
        stop.set()
        for s, h in previous.items():
            signal.signal(s, h)
        signal.set_wakeup_fd(previous_fd)
        writer.close()
        reader.close()
        _sockets.clear()

    return restore


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``signum`` to this process when its parent dies (``PR_SET_PDEATHSIG``): a
    child process training an arm must not go on writing into a folder whose sweep has left. No-op
    elsewhere."""
    if not sys.platform.startswith("linux"):
        return

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signum), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass
    parent = os.environ.get(PARENT_ENV, "")
    if os.getppid() == 1 or (parent.isdigit() and os.getppid() != int(parent)):  # it died before prctl took effect
        _leave(signum, None)

