"""``python -m tfshard.utilization``: how busy the GPUs are, from ``nvidia-smi``.

Prints a table of ``nvidia-smi`` readings, one line per GPU with its TensorFlow device name
(``--watch SECONDS`` to refresh, ``--count`` to stop after so many refreshes, ``--json`` for
the readings as JSON), and exits 0 when every GPU meets ``--threshold`` (90 %), 1 when one
does not, 2 when no reading could be taken; ``--help`` exits 0.

This is the command line of `tfshard.utilization`: the readings come from
`tfshard.utilization.query` and the table from `tfshard.utilization.format_table`; this
module only loops, prints and parses flags (absl). `run_cli` is the command as a function.
"""

# `python -m` imports the package (the core) and then runs this file as __main__; imported
# as tfshard.utilization.__main__ it runs nothing. absl's --help shows the docstring above,
# so it is written for the person at the command line.

from __future__ import annotations

import dataclasses
import json
import operator
import os
import sys
import time
from collections.abc import Sequence

from tfshard.errors import ArgumentError, UtilizationError
from tfshard.utilization import (
    DEFAULT_THRESHOLD,
    GpuReading,
    check_executable,
    check_positive,
    check_threshold,
    format_table,
    query,
)

__all__ = ("main", "run_as_script", "run_cli")


def _exit_status(readings: Sequence[GpuReading], threshold: float) -> int:
    if not readings:
        return 2
    meets = all(r.utilization_gpu is not None and r.utilization_gpu >= threshold for r in readings)
    return 0 if meets else 1


def _refreshes(count: object) -> int:
    # A float count would never equal the number of refreshes, so the loop would not end.
    try:
        whole = None if _is_bool(count) else operator.index(count)
    except TypeError:
        whole = None
    if whole is None or whole < 0:
        raise ArgumentError(
            f"count={count!r}; give a whole number of refreshes >= 0 together with watch "
            "(0: until interrupted)"
        )
    return whole


def _is_bool(value: object) -> bool:
    # NumPy's bool is a flag too; this module reads it without importing NumPy.
    kind = type(value)
    return kind is bool or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


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
        ArgumentError: ``threshold``, ``watch`` or ``count`` is out of range, ``count`` is
            not a whole number (a NumPy integer is one; a bool is not), ``as_json`` is not
            a bool, or ``nvidia_smi`` is not a path.
    """
    check_threshold(threshold)
    if watch is not None:
        check_positive("watch", watch)
    count = _refreshes(count)
    if count and watch is None:
        raise ArgumentError(f"count={count}; give a count >= 0 together with watch")
    if not _is_bool(as_json):
        raise ArgumentError(
            f"as_json={as_json!r} is of type {type(as_json).__name__}; give True or False"
        )
    check_executable(nvidia_smi)
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
    # absl exits 1 on a flag error and after printing --help (--helpshort, --helpfull,
    # --helpxml), which here would read as "a GPU is not busy": 2 and 0 instead.
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except flags.Error as err:
        print(f"tfshard.utilization: {err}; see --help", file=sys.stderr)
        sys.exit(2)
    except SystemExit as done:  # Only absl's help flags exit while the flags are parsed.
        sys.exit(0 if done.code == 1 else done.code)


def run_as_script() -> None:
    """Runs the command line: defines the flags, parses them and exits with `main`'s status."""
    from absl import app

    _define_flags()
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run_as_script()
