"""What the example scripts share: device flags, device set-up, one-line errors.

The flags are defined by functions, not at import, so each script lists in its
``--help`` only the flags it uses, and several examples can be imported into
one process (the smoke tests do) without defining a flag twice.

Device set-up has to happen before TensorFlow starts its runtime (before the
first op or device query), so a script calls `setup_devices` first thing in
``main``:

- ``--virtual_devices=N`` splits the CPU into N logical devices with one
  intra-op thread each, so each behaves like one (slow) accelerator;
- without it, the GPUs are used if there are any, else the CPU is split into
  `DEFAULT_VIRTUAL_DEVICES` logical devices, and the script says so.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple


def quiet_without_gpu(environ: dict[str, str] = os.environ) -> bool:  # noqa: B006
    """Hides TensorFlow's C++ log on a machine with no NVIDIA driver; True if it did.

    There, TensorFlow logs its CUDA probe failing ("failed call to cuInit ...
    (303)", an E-level line) and a few INFO lines on every run: noise that looks
    like an error. Where a driver is installed the log stays, so a real GPU
    failure is seen; a TF_CPP_MIN_LOG_LEVEL the user set is kept. It must run
    before TensorFlow is imported.
    """
    if "TF_CPP_MIN_LOG_LEVEL" in environ:
        return False
    if shutil.which("nvidia-smi") or os.path.exists("/proc/driver/nvidia"):
        return False
    environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return True


class _Deferred:
    """A module imported on its first attribute use (`tf.constant`), not at import.

    TensorFlow takes seconds to import, and an example's --help or a bad flag
    needs none of it: absl parses the flags before `main` uses it. (A
    `importlib.util.LazyLoader` would not do: ``import tensorflow`` anywhere
    reads the module's ``__spec__`` and so loads it.)
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)


quiet_without_gpu()  # before TensorFlow loads, whenever that is
tf: Any = _Deferred("tensorflow")

from absl import flags  # noqa: E402

import tfshard  # noqa: E402

# Flags defined by the functions below belong to the script that calls them,
# so they show up in that script's --help.
flags.disclaim_key_flags()

DEFAULT_VIRTUAL_DEVICES = 2


_defined: dict[str, Any] = {}  # name -> the Flag defined here, shared by the examples


def _define(define: Callable[..., Any], name: str, default: Any, help_: str, **kwargs: Any) -> Any:
    """Defines a flag once per process; a second example in the process shares it."""
    if name in flags.FLAGS and flags.FLAGS[name] is _defined.get(name):
        # Another example defined it first; list it in this one's --help too.
        flags.declare_key_flag(name)
        return flags.FlagHolder(flags.FLAGS, flags.FLAGS[name])
    holder = define(name, default, help_, **kwargs)  # someone else's flag: DuplicateFlagError
    _defined[name] = flags.FLAGS[name]
    return holder


def define_virtual_devices_flag(help_: str | None = None) -> flags.FlagHolder:
    """``--virtual_devices=N``: logical CPU devices for a machine without GPUs."""
    return _define(
        flags.DEFINE_integer,
        "virtual_devices",
        None,
        help_
        or "Split the CPU into N logical devices, one intra-op thread each, before "
        "TensorFlow starts, to run multi-device code without GPUs. Default: the GPUs "
        f"if there are any, else {DEFAULT_VIRTUAL_DEVICES} logical CPU devices.",
        lower_bound=1,
    )


def define_devices_flag(help_: str | None = None) -> flags.FlagHolder:
    """``--devices``: a comma list of device specs or context names."""
    return _define(
        flags.DEFINE_list,
        "devices",
        None,
        help_
        or "Comma-separated devices to use: 'gpu:0,gpu:1', 'cuda1', 'cpu:0,cpu:1', or "
        "names from --contexts. Default: every GPU, else every logical CPU device.",
    )


def _check_contexts(text: str | None) -> bool:
    try:
        tfshard.ContextMap.parse(text or "")
    except tfshard.ContextMapError as error:
        raise flags.ValidationError(str(error)) from None
    return True


def define_contexts_flag() -> flags.FlagHolder:
    """``--contexts``: a context map; --devices may then name its contexts."""
    holder = _define(
        flags.DEFINE_string,
        "contexts",
        None,
        "Context map naming devices, e.g. 'dev0->cpu:0;dev1->cpu:1'; --devices may "
        "then use the names (dev0,dev1). Default: $TFSHARD_CONTEXTS, if set.",
    )
    if not flags.FLAGS["contexts"].validators:
        flags.register_validator("contexts", _check_contexts)
    return holder


def define_batch_size_flag(default: int | None, help_: str) -> flags.FlagHolder:
    """``--batch_size``: samples per global batch of a stream (its meaning is the script's)."""
    return _define(flags.DEFINE_integer, "batch_size", default, help_, lower_bound=1)


def define_progress_flag(default: bool, help_: str) -> flags.FlagHolder:
    """``--progress``: progress lines on stderr while a stream runs."""
    return _define(flags.DEFINE_bool, "progress", default, help_)


def define_repeats_flag() -> flags.FlagHolder:
    """``--repeats``: timed runs per measurement; the median is reported."""
    return _define(
        flags.DEFINE_integer,
        "repeats",
        5,
        "Timed runs per measurement, after one warm-up run; the median is reported.",
        lower_bound=1,
    )


def define_plot_flag(help_: str) -> flags.FlagHolder:
    """``--plot=FILE``: a PNG to write; `check_plot` refuses it without matplotlib."""
    return _define(
        flags.DEFINE_string,
        "plot",
        None,
        f"{help_} (needs matplotlib: pip install 'tfshard[plot]').",
    )


def check_plot(plot: str | None) -> None:
    """Exits with one line when ``--plot`` is given and matplotlib is not installed.

    Call it first thing in ``main``, before any work, so nobody waits for a
    plot that cannot be drawn.
    """
    if not plot:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit(
            "error: --plot needs matplotlib, which is not installed: pip install "
            "'tfshard[plot]' (or pip install matplotlib), or drop --plot"
        )


class Setup(NamedTuple):
    """What `setup_devices` chose."""

    devices: list[str]  # canonical names, in --devices order
    note: str  # one line saying what was chosen and why, for the output


def setup_devices(
    virtual_devices: int | None = None,
    devices: Sequence[str] | None = None,
    contexts: str | None = None,
) -> Setup:
    """Configures devices from the flags' values; call before anything starts TF.

    Args:
      virtual_devices: split the CPU into this many logical devices; None to
        use the GPUs, or `DEFAULT_VIRTUAL_DEVICES` CPU devices without GPUs.
      devices: device specs or context names; None for every GPU, or every
        logical CPU device when the CPU was split.
      contexts: a context map string applied with `tfshard.set_contexts`; None
        leaves ``$TFSHARD_CONTEXTS`` (if set) in force.

    Returns:
      The devices and a note saying what was chosen.

    Raises:
      TfshardError: a bad context map or device, a device named twice in
        `devices`, or TensorFlow already started with another split.
    """
    gpus = tfshard.num_gpus()
    if virtual_devices is None and not gpus:
        virtual_devices = DEFAULT_VIRTUAL_DEVICES
        how = (
            f"no GPU found: split the CPU into {virtual_devices} logical devices, one "
            "intra-op thread each (--virtual_devices=N for another count)"
        )
    elif virtual_devices is not None:
        how = (
            f"--virtual_devices={virtual_devices}: split the CPU into {virtual_devices} "
            "logical devices, one intra-op thread each"
        )
    else:
        how = f"{gpus} GPU(s) found"
    if virtual_devices is not None:
        tfshard.virtual_devices(virtual_devices)
        # One thread per logical device: each then acts like one accelerator, and
        # K shards on K devices run K-way parallel, bounded by the cores.
        tf.config.threading.set_intra_op_parallelism_threads(1)
    if contexts is not None:
        tfshard.set_contexts(contexts)
    if devices:
        names = [tfshard.resolve_device(spec) for spec in devices]
        for i, name in enumerate(names):
            if name in names[:i]:
                first = devices[names.index(name)]
                raise tfshard.ArgumentError(
                    f"--devices={','.join(devices)}: {first!r} and {devices[i]!r} are both "
                    f"{name}, and two shards on one device run one after the other; list "
                    "each device once"
                )
    elif virtual_devices is not None:
        names = tfshard.list_devices("CPU")
    else:
        names = tfshard.try_all_gpus()
    return Setup(names, how)


def ideal_speedup(devices: Sequence[str]) -> str:
    """What speed-up to expect on `devices`, for the output: "ideal 2x" and why."""
    k = len(devices)
    if k > 1 and all("CPU" in d.rsplit("/", 1)[-1] for d in devices):
        cores = os.cpu_count() or 1
        return (
            f"ideal {min(k, cores)}x: {k} logical CPU devices on {cores} cores "
            "(os.cpu_count()), minus whatever else runs there"
        )
    return f"ideal {k}x"


@contextlib.contextmanager
def exit_on_error(flag_words: Sequence[tuple[str, str]] = ()) -> Iterator[None]:
    """Turns a `tfshard.TfshardError` into a one-line message and exit status 1.

    `flag_words` are (what tfshard's message says, what the command line says)
    pairs, replaced in order, so a fix tfshard words as a Python argument
    (``overwrite=True``) is said as the script's flag (``--overwrite``).
    """
    try:
        yield
    except tfshard.TfshardError as error:
        message = str(error)
        for python, flag in flag_words:
            message = message.replace(python, flag)
        sys.exit(f"error: {message}")


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """The median wall time of ``fn()`` over `repeats` runs, after one warm-up run.

    ``fn`` must return its result so that the time includes finishing it: the
    result's tensors are read back (`numpy`) before the clock stops.
    """

    def run() -> None:
        for value in tf.nest.flatten(fn()):
            if hasattr(value, "numpy"):
                value.numpy()

    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
