"""Process lifecycle: die with the parent, turn SIGTERM/SIGINT into a clean exit."""

import logging
import os
import signal
import socket
import sys
import threading
import time

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class Shutdown(BaseException):
    """Raised in the main thread when the process is asked to stop. A BaseException,
    so that `except Exception` around a step cannot swallow it."""


def _raise_shutdown(signum, _frame):
    # Only the first signal interrupts: a second one (Ctrl-C reaches the whole process
    # group, then the launcher's SIGTERM follows) must not cut the clean-up short.
    # A handler that does nothing, not SIG_IGN: a signal already pending would then
    # surface as "OSError: Signal 15 ignored due to race condition".
    signal.signal(signal.SIGTERM, _already_stopping)
    signal.signal(signal.SIGINT, _already_stopping)
    raise Shutdown(signal.Signals(signum).name)


def _already_stopping(signum, _frame):
    log.info("%s while shutting down: ignored", signal.Signals(signum).name)


_wakeup: list[socket.socket] = []


def install_signal_handlers() -> socket.socket:
    """SIGTERM/SIGINT raise Shutdown in the main thread. Returns a socket that turns
    readable when one arrives: poll it beside the process's own sockets. The kernel
    may deliver the signal to any thread (a helper thread, one of MLX's or BLAS's);
    the main thread, blocked in a poll that nothing interrupts, would never run the
    handler otherwise."""
    signal.signal(signal.SIGTERM, _raise_shutdown)
    signal.signal(signal.SIGINT, _raise_shutdown)
    if not _wakeup:
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        _wakeup.extend([reader, writer])
    signal.set_wakeup_fd(_wakeup[1].fileno(), warn_on_full_buffer=False)
    return _wakeup[0]


def drain(wakeup: socket.socket) -> None:
    """Empty the wakeup socket (the signal's handler has run or will run next)."""
    try:
        while wakeup.recv(512):
            pass
    except (BlockingIOError, InterruptedError):
        pass


def pid_alive(pid) -> bool:
    """Whether `pid` (a positive int; anything else is not) names a live process,
    ours or another user's."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's live process
        return True
    return True


def _set_linux_pdeathsig() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent(parent_pid: int | None, poll_seconds: float = 0.5) -> None:
    """Make this process exit when `parent_pid` dies.

    On Linux the kernel signals us (prctl PDEATHSIG). Everywhere (macOS
    included) a daemon thread polls the parent pid as the portable backstop;
    if a polite SIGTERM does not end us within 3 s it exits hard.
    """
    if not parent_pid:
        return
    if sys.platform.startswith("linux"):
        _set_linux_pdeathsig()

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(poll_seconds)
        log.error("parent %d died; exiting", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(3.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def setup_logging(process: str, level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {process} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
