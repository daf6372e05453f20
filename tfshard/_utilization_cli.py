"""The command line of `tfshard.utilization`: ``python -m tfshard.utilization``.

It prints a table of ``nvidia-smi`` readings (``--watch SECONDS`` to refresh, ``--threshold``,
``--json``) and exits 0 when every GPU meets the threshold, 1 when one does not, 2 when no
reading could be taken. The readings come from `tfshard.utilization.query`; this module only
formats them and parses flags (absl), as gpustat keeps its CLI apart from its core.
`format_table` and `run_cli` are public as ``tfshard.utilization.format_table`` and
``tfshard.utilization.run_cli``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterable, Sequence

from tfshard.errors import ArgumentError, UtilizationError
from tfshard.utilization import (
    DEFAULT_THRESHOLD,
    GpuReading,
    check_positive,
    check_threshold,
    query,
)

__all__ = ("format_table", "main", "run_as_script", "run_cli")


def format_table(readings: Iterable[GpuReading], threshold: float = DEFAULT_THRESHOLD) -> str:
    """Formats readings as the table ``python -m tfshard.utilization`` prints.

    >>> reading = GpuReading(0, "GPU-8f3a", "NVIDIA A100-SXM4-40GB", 93.0, 41.0, 15012, 40960,
    ...                      "/device:GPU:0")
    >>> print(format_table([reading]))
    gpu  tf device      name                   util %  mem util %  memory MiB     vs 90 %
      0  /device:GPU:0  NVIDIA A100-SXM4-40GB      93          41  15012 / 40960  ok

    Args:
        readings: The readings to show.
        threshold: The utilisation bar, in percent, for the last column.

    Returns:
        The table, one line per GPU under a header line, without a final newline.
    """
    rows = [
        ("gpu", "tf device", "name", "util %", "mem util %", "memory MiB", f"vs {threshold:g} %")
    ]
    for r in readings:
        if r.utilization_gpu is None:
            status = "n/a"
        else:
            status = "ok" if r.utilization_gpu >= threshold else "below"
        rows.append(
            (
                str(r.index),
                ", ".join(r.devices) or "-",
                r.name or "?",
                _show(r.utilization_gpu),
                _show(r.utilization_memory),
                f"{_show(r.memory_used_mib)} / {_show(r.memory_total_mib)}",
                status,
            )
        )
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    right = {0, 3, 4}  # numbers line up on the right
    lines = []
    for row in rows:
        cells = [
            cell.rjust(width) if col in right else cell.ljust(width)
            for col, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _show(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g}"


def _exit_status(readings: Sequence[GpuReading], threshold: float) -> int:
    if not readings:
        return 2
    meets = all(r.utilization_gpu is not None and r.utilization_gpu >= threshold for r in readings)
    return 0 if meets else 1


def run_cli(
    *,
    threshold: float = DEFAULT_THRESHOLD,
    watch: float | None = None,
    count: int = 0,
    as_json: bool = False,
    nvidia_smi: str | os.PathLike[str] | None = None,
) -> int:
    """Does what ``python -m tfshard.utilization`` does and returns its exit status.

    Args:
        threshold: The utilisation bar in percent.
        watch: Seconds between refreshes; None prints once.
        count: With ``watch``, stop after this many refreshes; 0 runs until interrupted.
        as_json: Print a JSON list of readings (field names of `GpuReading`) instead of a
            table; with ``watch``, one list per line.
        nvidia_smi: The executable, as in `query`.

    Returns:
        0 when every GPU met the threshold in the last refresh, 1 when one did not, 2 when
        no reading could be taken (the reason goes to stderr).

    Raises:
        ArgumentError: ``threshold``, ``watch`` or ``count`` is out of range.
    """
    check_threshold(threshold)
    if watch is not None:
        check_positive("watch", watch)
    if count < 0 or (count and watch is None):
        raise ArgumentError(f"count={count}; give a count >= 0 together with watch")
    clear = watch is not None and not as_json and sys.stdout.isatty()
    status, refreshes = 2, 0
    try:
        while True:
            try:
                readings = query(nvidia_smi)
            except UtilizationError as err:
                print(f"tfshard.utilization: {err}", file=sys.stderr)
                return 2
            status = _exit_status(readings, threshold)
            if as_json:
                rows = [dataclasses.asdict(r) for r in readings]
                print(json.dumps(rows, indent=None if watch else 2))
            else:
                if clear:
                    print("\x1b[H\x1b[2J", end="")
                if watch is not None:
                    print(time.strftime("%Y-%m-%d %H:%M:%S"))
                print(format_table(readings, threshold))
            if not readings:
                print("tfshard.utilization: nvidia-smi lists no GPU", file=sys.stderr)
            sys.stdout.flush()
            refreshes += 1
            if watch is None or refreshes == count:
                return status
            time.sleep(watch)
    except KeyboardInterrupt:
        return status


def main(argv: Sequence[str]) -> int:
    """The entry point of ``python -m tfshard.utilization``, after absl parsed the flags.

    Args:
        argv: The program name and any arguments left after the flags.

    Returns:
        The exit status, as `run_cli` returns it (2 for unexpected arguments).
    """
    from absl import flags

    if len(argv) > 1:
        print(f"tfshard.utilization: unexpected arguments {argv[1:]}", file=sys.stderr)
        return 2
    values = flags.FLAGS
    try:
        return run_cli(
            threshold=values.threshold,
            watch=values.watch,
            count=values.count,
            as_json=values.json,
        )
    except ArgumentError as err:
        print(f"tfshard.utilization: {err}", file=sys.stderr)
        return 2


def _define_flags() -> None:
    # Defined only when run as a script: importing the library must not add flags to an
    # application's global absl FLAGS, where names like --json and --threshold would clash.
    from absl import flags

    flags.DEFINE_float("threshold", DEFAULT_THRESHOLD, "Percent utilisation that counts as busy.")
    flags.DEFINE_float("watch", None, "Refresh the table every this many seconds.")
    flags.DEFINE_integer("count", 0, "With --watch, stop after this many refreshes (0: never).")
    flags.DEFINE_bool("json", False, "Print the readings as JSON (GpuReading field names).")


def _parse_flags(argv: list[str]) -> list[str]:
    # absl exits 1 on a flag error, which here would read as "a GPU is not busy".
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except flags.Error as err:
        print(f"tfshard.utilization: {err}; see --help", file=sys.stderr)
        sys.exit(2)


def run_as_script() -> None:
    """Runs the command line: defines the flags, parses them and exits with `main`'s status."""
    from absl import app

    _define_flags()
    app.run(main, flags_parser=_parse_flags)
