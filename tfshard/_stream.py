"""What a long stream gives back to the person running it: progress, and Ctrl-C.

`tfshard.datasets` runs a whole dataset in few calls of a traced loop, with
Python between them about twice a second (or one call per batch, for
`iterate` and `write`): there it reports progress (`Progress`: a line
rewritten on a terminal, lines at a steady pace in a log, and where a run
stopped) and lets Ctrl-C through (`ctrl_c`).
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

from tfshard.errors import ArgumentError


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


# How often a terminal's progress line is rewritten in place.
_TTY_SECONDS = 0.5
# On a stream that is not a terminal (a log file, a pipe, a batch job's output), each
# line stays, so lines come at a steady pace instead: one this often, after a quicker
# start (`_EARLY`), so a log shows how a run goes without drowning in lines.
LOG_SECONDS = 10.0
# The first gaps between logged lines, as fractions of LOG_SECONDS: after the first
# batch's line, lines about 1, 3 and 8 s in, then every 10 s; a 13 s run logs five.
_EARLY = (0.1, 0.2, 0.5)


class Progress:
    """A progress report: ``batch 12/40  3072 samples  1234.5 samples/s  2.5 s  7.5 s left``.

    On a terminal it is one line, rewritten in place (``\\r``) about twice a
    second. On anything else (a log file, a pipe) each line stays, so lines come
    at a steady pace: the first batch's, then about 1, 3 and 8 s in, then every
    `LOG_SECONDS`, and the last at the end. Where the number of batches is known
    each line from the second batch on says the time left, from the pace since the
    first (which includes tracing). `stopped` writes where a run stopped (Ctrl-C,
    an error), once.

    Args:
      name: what runs, the start of every line.
      total: the number of batches, when known.
      stream: where the lines go; None for stderr.
      done_batches: batches done before this run (a resumed write), counted in
        the lines but not in the rate.
      done_rows: their rows.
    """

    def __init__(
        self,
        name: str,
        total: int | None,
        stream: TextIO | None,
        *,
        done_batches: int = 0,
        done_rows: int = 0,
    ) -> None:
        self._name = name
        self._total = total
        self._stream = stream or sys.stderr
        self._tty = getattr(self._stream, "isatty", lambda: False)()
        self._start = time.perf_counter()
        self._last = 0.0  # when the last line was written
        self._done = (done_batches, done_rows)
        self._batches = done_batches
        self._written = -1  # the batch count the last line showed
        self._logged = 0  # lines written to a stream that is not a terminal
        self._open = False  # a terminal's line is waiting for its newline
        self._stopped = False
        self._paced_from: tuple[float, int] | None = None  # (when, batches) at the first update
        self.samples = done_rows

    def update(self, rows: int, batches: int = 1) -> None:
        """Counts `batches` more batches of `rows` rows in all; writes a line when due."""
        self._batches += batches
        self.samples += rows
        now = time.perf_counter()
        if self._paced_from is None:  # the pace is taken after the first batch, which traces
            self._paced_from = (now, self._batches)
        if self._tty:
            due = now - self._last >= _TTY_SECONDS or self._batches == self._total
        else:
            early = _EARLY[self._logged - 1] if 0 < self._logged <= len(_EARLY) else 1.0
            due = self._logged == 0 or now - self._last >= early * LOG_SECONDS
        if due:
            self._last = now
            self._write(self._line())

    def close(self) -> None:
        """The last line, at the end of a run."""
        if self._tty or self._written != self._batches:  # a log gets each line once
            self._write(self._line(), final=True)

    def stopped(self, error: BaseException, note: str = "") -> None:
        """A line saying where the run stopped and why, then `note`; once per run."""
        if self._stopped or isinstance(error, GeneratorExit):  # the reader stopped reading
            return
        self._stopped = True
        of = f"/{self._total}" if self._total is not None else ""
        why = type(error).__name__
        line = (
            f"{self._name}: stopped at batch {self._batches}{of}, {self.samples} samples, "
            f"after {self._elapsed():.1f} s ({why}){note}"
        )
        self._write(line, final=True, fresh=True)

    def say(self, line: str) -> None:
        """A line of its own, after the report (a terminal's line is ended first)."""
        self._write(line, final=True, fresh=True)

    def _elapsed(self) -> float:
        return max(time.perf_counter() - self._start, 1e-9)

    def _line(self) -> str:
        elapsed = self._elapsed()
        rows = self.samples - self._done[1]
        of = f"/{self._total}" if self._total is not None else ""
        left = ""
        paced = self._paced_from
        if self._total is not None and paced and paced[1] < self._batches < self._total:
            when, since = paced
            per_batch = (time.perf_counter() - when) / (self._batches - since)
            left = f"  {duration((self._total - self._batches) * per_batch)} left"
        return (
            f"{self._name}: batch {self._batches}{of}  {self.samples} samples  "
            f"{rows / elapsed:.1f} samples/s  {elapsed:.1f} s{left}"
        )

    def _write(self, line: str, final: bool = False, fresh: bool = False) -> None:
        if self._tty:
            if fresh and self._open:
                self._stream.write("\n")
            start = "" if fresh else "\r"
            self._stream.write(start + line + ("\n" if final else ""))
            self._open = not final
        else:
            self._stream.write(line + "\n")
            self._logged += 1
        self._written = self._batches
        self._stream.flush()


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 20 s``, ``2 h 05 min``: a time left, as precise as it is worth."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def meter(
    name: str,
    batches: tf.data.Dataset,
    progress: bool | TextIO,
    *,
    done_batches: int = 0,
    done_rows: int = 0,
) -> Progress | None:
    """A `Progress` for a stream of `batches` as ``progress=`` asks (None: no report).

    `done_batches` and `done_rows` were done before this run (a write resumed):
    `batches` is the whole stream, of which the run streams the rest.
    """
    check_progress(progress)
    if progress is False:
        return None
    stream = None if progress is True else progress
    total = _cardinality(batches)
    return Progress(name, total, stream, done_batches=done_batches, done_rows=done_rows)


def check_progress(progress: Any) -> None:
    """Raises ArgumentError unless ``progress=`` is a bool or a stream with ``.write``."""
    if isinstance(progress, bool) or callable(getattr(progress, "write", None)):
        return
    raise ArgumentError(
        f"progress={progress!r}: True for lines on stderr, False for none, or a stream to "
        "write them to (an object with .write, such as sys.stdout or an open file)"
    )


def _cardinality(dataset: tf.data.Dataset) -> int | None:
    count = int(dataset.cardinality())
    return count if count >= 0 else None
