"""What a long stream gives back to the person running it: progress, and Ctrl-C.

`tfshard.datasets` runs a whole dataset in few calls of a traced loop, with
Python between them about twice a second: there it reports progress
(`Progress`) and lets Ctrl-C through (`ctrl_c`).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import tensorflow as tf


@contextlib.contextmanager
def ctrl_c() -> Iterator[Callable[[], bool]]:
    """While a traced loop runs: whether Ctrl-C was pressed, however Python met it.

    Python raises KeyboardInterrupt wherever the main thread is when SIGINT
    arrives; raised inside a finalizer (a traced graph freed by the garbage
    collector), it is printed as ignored and lost, and the stream would run to
    its end. So the signal is also recorded here and raised again between
    calls of the loop. Off the main thread, or under a handler of the user's,
    nothing changes.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or (
        previous is not signal.default_int_handler
    ):
        yield lambda: False
        return
    pressed: list[bool] = []

    def handler(signum: int, frame: Any) -> None:
        pressed.append(True)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(pressed)
    finally:
        signal.signal(signal.SIGINT, previous)


class Progress:
    """A one-line progress report, ``batch 12/40  3072 samples  1234.5 samples/s``."""

    def __init__(self, name: str, total: int | None, stream: TextIO | None) -> None:
        self._name = name
        self._total = total
        self._stream = stream or sys.stderr
        self._start = time.perf_counter()
        self._last = 0.0
        self._batches = 0
        self._written = -1  # the batch count the last line showed
        self.samples = 0

    def update(self, rows: int, batches: int = 1) -> None:
        self._batches += batches
        self.samples += rows
        now = time.perf_counter()
        if now - self._last >= 0.5 or self._batches == self._total:
            self._last = now
            self._write(final=False)

    def close(self) -> None:
        tty = getattr(self._stream, "isatty", lambda: False)()
        if tty or self._written != self._batches:  # a stream gets each line once
            self._write(final=True)

    def _write(self, final: bool) -> None:
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        of = f"/{self._total}" if self._total is not None else ""
        line = (
            f"{self._name}: batch {self._batches}{of}  {self.samples} samples  "
            f"{self.samples / elapsed:.1f} samples/s  {elapsed:.1f} s"
        )
        tty = getattr(self._stream, "isatty", lambda: False)()
        if tty:
            self._stream.write("\r" + line + ("\n" if final else ""))
        elif final or self._batches == 1:
            self._stream.write(line + "\n")
            self._written = self._batches
        self._stream.flush()


def meter(name: str, batches: tf.data.Dataset, progress: bool | TextIO) -> Progress | None:
    if not progress:
        return None
    return Progress(name, _cardinality(batches), None if progress is True else progress)


def _cardinality(dataset: tf.data.Dataset) -> int | None:
    count = int(dataset.cardinality())
    return count if count >= 0 else None
