"""A termination signal must end the process even when its main thread is blocked.

Python runs signal handlers between bytecodes of the main thread only, so a rank blocked in a collective
another rank never joins ignores SIGTERM until the process-group timeout (30 minutes). `SignalWatchdog`
hears the signal through the wake-up fd CPython's C-level handler writes to, gives the normal path (finish
the batch, save last.ckpt, exit) `timeout_s` seconds, then logs why, ends the ranks this process launched
and exits with `EXIT_CODE`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress

log = logging.getLogger("vitlab")

EXIT_CODE = 124  # as `timeout`: the job was stopped, not finished


class SignalWatchdog:
    """Watches for `signals` from a daemon thread; `on_expire` runs just before the exit. Install from the
    main thread after the signals' Python handlers (the wake-up fd is written only for those)."""

    def __init__(
        self, timeout_s: float, signals: tuple[int, ...] = (signal.SIGTERM,),
        on_expire: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
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
        recv, send = self._sockets
        with suppress(OSError):
            recv.shutdown(socket.SHUT_RDWR)  # wakes the watching thread's recv
        recv.close()
        send.close()
        self._sockets = None

    def _watch(self, recv: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                data = recv.recv(64)
            except OSError:  # closed by uninstall
                return
            hit = [b for b in data if b in self.signals]
            if hit:
                self._expire_after(signal.Signals(hit[0]).name)
            if hit or not data:
                return

    def _expire_after(self, name: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self._closed.wait(0.2):
                return  # the run ended normally
        log.error(
            "%s received %.0f s ago and this process has not stopped: it is blocked, most likely in a collective "
            "(an all-reduce or a checkpoint barrier) that another rank never joined. Exiting with status %d without "
            "a final checkpoint; last.ckpt holds the last completed save.", name, self.timeout_s, EXIT_CODE,
        )  # fmt: skip
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        sys.stderr.flush()
        if self.on_expire is not None:
            try:
                self.on_expire()
            except Exception as exc:  # noqa: BLE001 - exiting matters more than the clean-up
                log.error("while ending the other ranks: %s: %s", type(exc).__name__, exc)
        os._exit(EXIT_CODE)
