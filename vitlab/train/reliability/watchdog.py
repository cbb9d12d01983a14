"""`SignalWatchdog`: a termination signal ends the process even when its main thread is blocked.

Python runs signal handlers between bytecodes of the main thread only, so a rank blocked in a collective
another rank never joins ignores SIGTERM until the process-group timeout (30 minutes). torchrun
(`PContext.close(timeout=30)`) and SLURM (KillWait) SIGKILL their ranks after a grace period; Lightning's
own launcher (`_SubprocessScriptLauncher`) and Lightning's SIGTERM handler have nothing of the kind. The
watchdog hears the signal through the wake-up fd CPython's C-level handler writes to, gives the normal
path (finish the batch, save last.ckpt, exit) `timeout_s` seconds, then logs why, runs `on_expire` (end
the ranks this process launched) and exits with `EXIT_CODE`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from contextlib import suppress

log = logging.getLogger("vitlab")

EXIT_CODE = 124  # as `timeout`: the job was stopped, not finished


class SignalWatchdog:
    """Watches for `signals` from a daemon thread. Install from the main thread after the signals' Python
    handlers (the wake-up fd is written only for those)."""

    def __init__(self, timeout_s: float, signals: tuple[int, ...], on_expire: Callable[[], None]) -> None:
        self.timeout_s = timeout_s
        self.signals = {int(s) for s in signals}
        self.on_expire = on_expire
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._closed = threading.Event()

    def install(self) -> bool:
        """Start watching; False (and nothing installed) outside the main thread or when another
        wake-up fd is already set (an event loop's)."""
        if threading.current_thread() is not threading.main_thread() or self._sockets is not None:
            return False
        recv, send = socket.socketpair()
        send.setblocking(False)
        prev = signal.set_wakeup_fd(send.fileno(), warn_on_full_buffer=False)
        if prev != -1:  # someone else's: put it back and stay out of the way
            signal.set_wakeup_fd(prev)
            recv.close()
            send.close()
            return False
        self._sockets = (recv, send)
        threading.Thread(target=self._watch, args=(recv,), name="vitlab-signal-watchdog", daemon=True).start()
        return True

    def uninstall(self) -> None:
        if self._sockets is None or threading.current_thread() is not threading.main_thread():
            return
        signal.set_wakeup_fd(-1)
        self._closed.set()
        send, self._sockets = self._sockets[1], None
        with send, suppress(OSError):  # a full buffer already wakes the thread
            send.send(b"\0")  # wakes the watching thread's recv (0 is no signal number)

    def _watch(self, recv: socket.socket) -> None:
        with recv:
            while not self._closed.is_set():
                hit = [b for b in recv.recv(64) if b in self.signals]
                if hit and not self._closed.wait(self.timeout_s):
                    self._expire(signal.Signals(hit[0]).name)
                if hit:
                    return

    def _expire(self, name: str) -> None:
        log.error(
            "%s received %.0f s ago and this process has not stopped: it is blocked, most likely in a collective "
            "(an all-reduce or a checkpoint barrier) that another rank never joined. Exiting with status %d without "
            "a final checkpoint; last.ckpt holds the last completed save.", name, self.timeout_s, EXIT_CODE,
        )  # fmt: skip
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        sys.stderr.flush()
        try:
            self.on_expire()
        except Exception as exc:  # noqa: BLE001 - exiting matters more than the clean-up
            log.error("while ending the other ranks: %s: %s", type(exc).__name__, exc)
        os._exit(EXIT_CODE)
