"""Progress a log can read, and a terminal's line as it was (tfshard._stream).

The pace is checked against a clock of our own (`Progress` reads
``time.perf_counter`` through the module), and end to end on real streams of
``f(dataset)``, ``f.iterate`` and ``f.write`` with the pace shortened
(``LOG_SECONDS``), so the test runs in about a second.
"""

import io
import time

import numpy as np
import pytest
import tensorflow as tf

import tfshard
from tfshard import _stream, datasets

CPUS = [f"/device:CPU:{i}" for i in range(4)]


class _Clock:
    """A perf_counter that moves only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(_stream, "time", fake)
    return fake


def _run(meter, clock, batches, seconds_each=1.0, rows=10):
    for _ in range(batches):
        clock.now += seconds_each
        meter.update(rows)


def test_a_log_gets_lines_at_a_steady_pace_after_a_quick_start(clock):
    log = io.StringIO()
    meter = _stream.Progress("embed", 60, log)
    _run(meter, clock, 60)  # one batch a second for a minute
    meter.close()
    lines = log.getvalue().splitlines()
    # The first batch, then 1, 2 and 5 s later, then every 10 s, and the end.
    assert [int(line.split()[2].split("/")[0]) for line in lines] == [
        1, 2, 4, 9, 19, 29, 39, 49, 59, 60,
    ]  # fmt: skip
    assert lines[3] == "embed: batch 9/60  90 samples  10.0 samples/s  9.0 s  51 s left"
    assert lines[-1] == "embed: batch 60/60  600 samples  10.0 samples/s  60.0 s"
    assert "\r" not in log.getvalue()


def test_the_time_left_reads_in_minutes_and_hours(clock):
    log = io.StringIO()
    meter = _stream.Progress("embed", 10_000, log)
    _run(meter, clock, 10, seconds_each=1.5)
    assert log.getvalue().splitlines()[-1].endswith("  12.0 s  4 h 09 min left")  # 9992 x 1.5 s
    assert [_stream.duration(s) for s in (41.6, 200, 7500)] == ["42 s", "3 min 20 s", "2 h 05 min"]


def test_a_terminal_keeps_one_line_rewritten_in_place(clock):
    terminal = _Terminal()
    meter = _stream.Progress("embed", 4, terminal)
    _run(meter, clock, 4)
    meter.close()
    text = terminal.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert text.startswith("\rembed: batch 1/4  10 samples")
    assert text.count("\r") == 5  # each update (every 0.5 s at most) and the last line


def test_a_stop_says_where_once_and_ends_a_terminal_line_first(clock):
    terminal = _Terminal()
    meter = _stream.Progress("embed", 4, terminal)
    _run(meter, clock, 2)
    meter.stopped(KeyboardInterrupt())
    meter.stopped(ValueError())  # once
    meter.stopped(GeneratorExit())
    stop = "embed: stopped at batch 2/4, 20 samples, after 2.0 s (KeyboardInterrupt)\n"
    assert terminal.getvalue().endswith("\n" + stop)
    meter.say("what to do next")
    assert terminal.getvalue().endswith(stop + "what to do next\n")


def test_a_resumed_run_counts_from_where_it_was_and_rates_its_own_rows(clock):
    log = io.StringIO()
    meter = _stream.Progress("embed", 10, log, done_batches=6, done_rows=60)
    _run(meter, clock, 2, seconds_each=2.0)
    assert log.getvalue().splitlines() == [
        "embed: batch 7/10  70 samples  5.0 samples/s  2.0 s",  # no pace yet: the first traces
        "embed: batch 8/10  80 samples  5.0 samples/s  4.0 s  4 s left",
    ]


def test_the_time_left_is_paced_after_the_first_batch_which_traces(clock):
    log = io.StringIO()
    meter = _stream.Progress("embed", 10, log, done_batches=4, done_rows=40)
    _run(meter, clock, 1, seconds_each=60.0)  # a resumed run's first batch: tracing
    _run(meter, clock, 1, seconds_each=1.0)
    assert log.getvalue().splitlines()[-1].endswith("  61.0 s  4 s left")  # not 2 min 18 s


# ------------------------------------------------------- end to end, real time


def _slow(s):
    # Each batch of 5 takes at least 25 ms: 20 of them half a second.
    time.sleep(0.025)
    return s


def _lines(stream):
    return stream.getvalue().splitlines()


@pytest.fixture
def quick(monkeypatch):
    """A log line every 0.1 s, and the traced loop back in Python every 0.05 s."""
    monkeypatch.setattr(_stream, "LOG_SECONDS", 0.1)
    monkeypatch.setattr(datasets, "CALL_SECONDS", 0.05)


@pytest.fixture(scope="module")
def slow():
    return tfshard.parallelize(
        lambda x: tf.numpy_function(_slow, [x], tf.float32, stateful=True),
        per_sample=False, devices=CPUS[:2],
    )  # fmt: skip


@pytest.mark.parametrize("way", ["call", "iterate", "write"])
def test_every_stream_logs_at_the_pace_and_ends_with_a_line(quick, slow, tmp_path, way):
    ds = tf.data.Dataset.from_tensor_slices(np.zeros([100, 1], np.float32)).batch(5)
    log = io.StringIO()
    if way == "call":
        slow(ds, progress=log)
    elif way == "iterate":
        list(slow.iterate(ds, progress=log))
    else:
        slow.write(ds, tmp_path / "out", progress=log)
    lines = _lines(log)
    # >= 0.5 s: the first batch's line, lines 0.01, 0.02 and 0.05 s apart, then every
    # 0.1 s, and the last: 7 or more.
    assert len(lines) >= 7, lines
    assert all(line.startswith("<lambda>: batch ") and "samples/s" in line for line in lines)
    assert all(line.endswith(" left") for line in lines[1:-1]), lines
    assert lines[-1].startswith("<lambda>: batch 20/20  100 samples")


@pytest.mark.parametrize("way", ["call", "iterate", "write"])
def test_a_failing_stream_says_where_it_stopped(quick, tmp_path, way):
    def fails_at_batch_3(x):
        tf.debugging.assert_less(tf.reduce_max(x), 10.0, "row 10 reached")
        return x

    f = tfshard.parallelize(fails_at_batch_3, per_sample=False, devices=CPUS[:2])
    ds = tf.data.Dataset.from_tensor_slices(np.arange(20, dtype=np.float32)).batch(4)
    log = io.StringIO()
    with pytest.raises(tf.errors.InvalidArgumentError, match="row 10 reached"):
        if way == "call":
            f(ds, progress=log)
        elif way == "iterate":
            list(f.iterate(ds, progress=log))
        else:
            f.write(ds, tmp_path / "out", progress=log)
    stopped = [line for line in _lines(log) if " stopped at " in line]
    assert len(stopped) == 1, _lines(log)
    assert stopped[0].startswith("fails_at_batch_3: stopped at batch 2/5, 8 samples, after ")
    assert "Error)" in stopped[0]
    if way == "write":
        assert _lines(log)[-1].endswith(
            "8 rows (2 batches) are on disk in "
            f"{str(tmp_path / 'out')!r}; call fails_at_batch_3.write(dataset, "
            f"{str(tmp_path / 'out')!r}) again to resume after them"
        )
