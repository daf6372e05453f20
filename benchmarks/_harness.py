"""What every benchmark case shares: devices, timing, checks, environment, output.

The method (DESIGN.md, "Performance method"): one process, the same data and
devices for every method, warm-up calls first, then rounds in which every
method runs once on the round's input, in an order that rotates from round to
round. A method's time is the median over rounds; a ratio between two methods
is the median of their per-round ratios, so load that comes and goes during a
run (other processes on the machine) touches both sides of each ratio alike.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

import tfshard

# Results must equal the one-device run (DESIGN.md: float32 relative error < 1e-5), or to
# TF32's precision where a GPU runs float32 matmuls in TF32 (README, "Numerics on GPUs").
RTOL = 1e-5
TF32_RTOL = 2e-3

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ devices


def setup_devices(count: int) -> list[str]:
    """Splits the CPU into `count` logical devices with one intra-op thread each.

    Must run before TensorFlow starts its runtime. Each logical device then
    behaves like one slow accelerator; the shards of one graph on different
    devices run side by side on TensorFlow's inter-op threads (left at their
    default, one per core).

    Args:
      count: how many logical CPU devices to create.

    Returns:
      The canonical names of the logical devices.
    """
    tfshard.virtual_devices(count)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    return tfshard.list_devices("CPU")


def machine_devices(
    count: int,
    needed: int | None = None,
    device_type: str = "auto",
    split_gpu: int = 0,
    gpu_memory_mb: int = 8192,
) -> list[str]:
    """The devices a benchmark runs on: the machine's GPUs when it has some, else the CPU bed.

    Must run before TensorFlow starts its runtime.

    Args:
      count: logical CPU devices to create for the CPU bed.
      needed: the fewest GPUs the run needs (default `count`).
      device_type: "auto" (the GPUs when TensorFlow lists one, else the CPU), "gpu" or "cpu".
      split_gpu: on GPUs, split GPU 0 into this many logical GPUs of `gpu_memory_mb` each
        (0: no split). On one card they measure tfshard's overheads, not a speed-up: the
        logical GPUs share the card's SMs.
      gpu_memory_mb: memory of each logical GPU of the split.

    Returns:
      The canonical names of the devices: every logical GPU, or the logical CPU devices.

    Raises:
      SystemExit: GPUs asked for and none found, or fewer GPUs than `count`.
    """
    gpus = tf.config.list_physical_devices("GPU")  # does not start the runtime
    if device_type == "cpu" or (device_type == "auto" and not gpus):
        return setup_devices(count)
    if not gpus:
        raise SystemExit("error: --device_type=gpu but TensorFlow lists no GPU on this machine")
    if split_gpu > 1:
        tfshard.virtual_devices(split_gpu, "GPU", memory_limit_mb=gpu_memory_mb)
    devices = tfshard.list_devices("GPU")
    needed = count if needed is None else needed
    if len(devices) < needed:
        raise SystemExit(
            f"error: the run needs {needed} GPUs and this machine has {len(devices)} "
            f"({', '.join(devices)}); pass fewer devices, --split_gpu={needed} to split GPU 0 "
            "(overheads only), or --device_type=cpu for the CPU bed"
        )
    return devices


def cores() -> int:
    """The number of CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # Not Linux.
        return os.cpu_count() or 1


def core_bound(k: int, n_cores: int) -> float:
    """The best speed-up of K equal shards on `n_cores` cores: K / ceil(K / cores)."""
    return k / -(-k // n_cores)


def even_sizes(n: int, count: int) -> list[int]:
    """Sizes of `count` shards of `n` rows differing by at most one, extra rows first."""
    return [n // count + (1 if k < n % count else 0) for k in range(count)]


def random_inputs(shape: Sequence[int], count: int, seed: int, device: str) -> list[tf.Tensor]:
    """`count` different standard-normal float32 tensors on `device` (never zeros)."""
    rng = np.random.default_rng(seed)
    with tf.device(device):
        return [
            tf.constant(rng.standard_normal(shape).astype(np.float32)) for _ in range(count)
        ]


# ------------------------------------------------------------------- checks


def _flat(value: Any) -> list[np.ndarray]:
    return [np.asarray(v) for v in tf.nest.flatten(value)]


def relative_error(reference: Any, value: Any) -> float:
    """max |value - reference| / max |reference| over every leaf (0 for equal)."""
    want, got = _flat(reference), _flat(value)
    if len(want) != len(got):
        return float("inf")
    worst = 0.0
    for a, b in zip(want, got):
        if a.shape != b.shape:
            return float("inf")
        if a.size == 0:
            continue
        scale = max(float(np.max(np.abs(a))), np.finfo(np.float32).tiny)
        worst = max(worst, float(np.max(np.abs(b.astype(np.float64) - a))) / scale)
    return worst


def check_outputs(
    methods: Mapping[str, Callable[[Any], Any]], reference: str, x: Any
) -> dict[str, float]:
    """Runs every method on `x` and checks its output against `reference`'s.

    Args:
      methods: name -> callable taking the input.
      reference: the name of the method every other must equal.
      x: the input.

    Returns:
      name -> relative error against the reference.

    Raises:
      AssertionError: a method's output differs (relative error >= RTOL), in
        which case the benchmark would compare unequal work.
    """
    want = methods[reference](x)
    tf32 = "GPU" in str(getattr(want, "device", "")).upper()
    rtol = (
        TF32_RTOL if tf32 and tf.config.experimental.tensor_float_32_execution_enabled() else RTOL
    )
    errors = {}
    for name, method in methods.items():
        errors[name] = 0.0 if name == reference else relative_error(want, method(x))
        if not errors[name] < rtol:
            raise AssertionError(
                f"{name} differs from {reference}: relative error {errors[name]:.3g} "
                f">= {rtol}; the methods do not compute the same thing"
            )
    return errors


# ------------------------------------------------------------------- timing


def _block(value: Any) -> None:
    """Waits until every output exists (CPU tensors: `.numpy()` makes no copy)."""
    for leaf in tf.nest.flatten(value):
        if hasattr(leaf, "numpy"):
            leaf.numpy()


def time_rounds(
    methods: Mapping[str, Callable[[Any], Any]],
    inputs: Sequence[Any],
    *,
    repeats: int,
    warmup: int,
    inner: int = 1,
) -> dict[str, list[float]]:
    """Times each method once per round on the round's input, rounds interleaved.

    Args:
      methods: name -> callable taking one input.
      inputs: one input per round (reused cyclically if fewer than `repeats`).
      repeats: the number of rounds, the sample size of each median.
      warmup: untimed calls of each method first (tracing, allocation).
      inner: calls per timed sample; the sample is their mean. Use > 1 when a
        call is so short that the clock's resolution and jitter matter.

    Returns:
      name -> seconds per call, one entry per round.
    """
    names = list(methods)
    for name in names:
        for i in range(warmup):
            _block(methods[name](inputs[i % len(inputs)]))
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        x = inputs[r % len(inputs)]
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            method = methods[name]
            # No collection pauses inside a sample; collect between samples, or the
            # cyclic garbage of dataset iterators (holding whole batches) piles up.
            gc.collect(1)  # The young generations: cheap, and where that garbage is.
            gc.disable()
            try:
                start = time.perf_counter()
                for _ in range(inner):
                    out = method(x)
                _block(out)
                times[name].append((time.perf_counter() - start) / inner)
            finally:
                gc.enable()
            del out
    return times


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """The median over rounds of numerator[r] / denominator[r]."""
    return median([a / b for a, b in zip(numerator, denominator)])


def paired_quartiles(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """The 25th and 75th percentiles over rounds of numerator[r] / denominator[r]."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    return [float(np.percentile(ratios, 25)), float(np.percentile(ratios, 75))]


def summarize(
    times: Mapping[str, list[float]],
    errors: Mapping[str, float],
    *,
    baseline: str,
    subject: str = "tfshard",
) -> dict[str, Any]:
    """Medians and ratios of one timed comparison.

    Args:
      times: name -> seconds per round, from `time_rounds`.
      errors: name -> relative error against the reference output.
      baseline: the method speed-ups are measured against (one device).
      subject: the method every other is compared with (tfshard).

    Returns:
      A dict with ``methods`` (median and per-round times, error), and
      ``speedup_vs_<baseline>`` and ``<subject>_vs`` ratios: baseline time over
      method time, and method time over subject time (> 1: subject faster).
    """
    return {
        "methods": {
            name: {
                "median_s": median(t),
                "times_s": [round(v, 9) for v in t],
                "relative_error": errors.get(name),
            }
            for name, t in times.items()
        },
        f"speedup_vs_{baseline}": {
            name: paired_ratio(times[baseline], t) for name, t in times.items()
        },
        f"{subject}_vs": {
            name: paired_ratio(t, times[subject]) for name, t in times.items() if name != subject
        },
        # The spread of the per-round ratios: where it straddles 1, the two are a tie.
        f"{subject}_vs_quartiles": {
            name: paired_quartiles(t, times[subject])
            for name, t in times.items()
            if name != subject
        },
    }


def target(name: str, value: float, op: str, threshold: float, unit: str = "x") -> dict[str, Any]:
    """One target: ``value op threshold`` (op ">=" or "<="), and whether it is met."""
    met = value >= threshold if op == ">=" else value <= threshold
    return {
        "name": name,
        "value": value,
        "op": op,
        "threshold": threshold,
        "unit": unit,
        "met": bool(met),
    }


# ------------------------------------------------------------ other load


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds used by the whole machine, by this process) so far; None off Linux."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal: all but idle and iowait.
    ticks = [int(v) for v in fields[:8]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


class OtherLoad:
    """Measures how many cores other processes kept busy while a block ran.

    A benchmark on a shared machine is only as good as the cores it had; the
    figure goes into the JSON next to the timings it may have disturbed.

    Attributes:
      cores: the mean number of cores other processes used, or None where
        /proc/stat is not available.
    """

    def __init__(self) -> None:
        self.cores: float | None = None
        self._start: tuple[float, float, float] | None = None

    def __enter__(self) -> OtherLoad:
        now = _cpu_seconds()
        self._start = None if now is None else (*now, time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        now = _cpu_seconds()
        if now is None or self._start is None:
            return
        busy, own, start = self._start
        wall = time.perf_counter() - start
        self.cores = round(max(0.0, (now[0] - busy) - (now[1] - own)) / max(wall, 1e-9), 3)


def wait_for_idle(timeout: float, threshold: float = 0.05, window: float = 2.0) -> float | None:
    """Waits until other processes use less than `threshold` cores, up to `timeout` s.

    Args:
      timeout: the longest to wait, in seconds; 0 to measure once and go on.
      threshold: the number of busy cores (of other processes) that counts as idle.
      window: the length of each measurement, in seconds.

    Returns:
      The last measurement: cores busy with other work (None off Linux).
    """
    deadline = time.perf_counter() + timeout
    while True:
        with OtherLoad() as other:
            time.sleep(window)
        if other.cores is None or other.cores < threshold or time.perf_counter() >= deadline:
            return other.cores


# -------------------------------------------------------------- environment


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
            capture_output=True, text=True, timeout=10, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def environment(devices: Sequence[str]) -> dict[str, Any]:
    """What the numbers depend on: versions, machine, devices, threads, load."""
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git": _git_commit(),
        "tensorflow": tf.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cores": cores(),
        "logical_devices": list(devices),
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
        "load_average_start": load_average(),
    }


# ------------------------------------------------------------------- output


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if seconds < 0.01 else f"{seconds * 1e3:.2f}"


def comparison_rows(result: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """(method, median ms, speed-up vs one device, tfshard faster by) per method.

    The last column is the median of the per-round ratios and, in brackets,
    their quartiles.
    """
    speedup = next(v for k, v in result.items() if k.startswith("speedup_vs_"))
    versus = result.get("tfshard_vs", {})
    quartiles = result.get("tfshard_vs_quartiles", {})
    rows = []
    for name, m in result["methods"].items():
        faster = "-"
        if name in quartiles:
            low, high = quartiles[name]
            faster = f"{versus[name]:.2f}x ({low:.2f}-{high:.2f})"
        elif name in versus:  # A report written before the quartiles were recorded.
            faster = f"{versus[name]:.2f}x"
        rows.append((name, _ms(m["median_s"]), f"{speedup[name]:.2f}x", faster))
    return rows


def format_rows(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(row, widths))
        ]
        lines.append(indent + "  ".join(cells).rstrip())
    return "\n".join(lines)


def format_target(t: Mapping[str, Any]) -> str:
    verdict = "met" if t["met"] else "MISSED"
    return f"{t['name']}: {t['value']:.2f}{t['unit']} (target {t['op']} {t['threshold']}) {verdict}"


COMPARISON_HEADER = ("method", "median ms", "vs one device", "tfshard faster by (quartiles)")


def format_case(name: str, result: Mapping[str, Any]) -> str:
    """A readable block for one case: its setting, a table per comparison, targets."""
    lines = [f"== {name}: {result['description']}"]
    params = ", ".join(f"{k}={v}" for k, v in result["params"].items())
    lines.append(f"   {params}")
    other = result.get("other_processes_cores")
    if other:
        lines.append(
            f"   other processes kept {other['during']} cores busy during the case "
            f"({other['before']} just before)"
        )
    for label, comparison in result.get("comparisons", {}).items():
        lines.append(f"  [{label}]  other processes: {comparison['other_processes_cores']} cores")
        lines.append(format_rows(COMPARISON_HEADER, comparison_rows(comparison), indent="    "))
    for sweep_name, sweep in result.get("sweeps", {}).items():
        lines.append(f"  [{sweep_name} sweep: speed-up over one device]")
        lines.append(format_sweep(sweep, indent="    "))
    for t in result.get("targets", []):
        lines.append("  " + format_target(t))
    for note in result.get("notes", []):
        lines.append("  note: " + note)
    return "\n".join(lines)


def format_sweep(sweep: Mapping[str, Any], indent: str = "  ") -> str:
    key = sweep["variable"]
    methods = [m for m in sweep["points"][0]["comparison"]["methods"] if m != "one_device"]
    header = (key, "one device ms", *methods, "other cores")
    rows = []
    for point in sweep["points"]:
        comparison = point["comparison"]
        speedup = comparison["speedup_vs_one_device"]
        one = comparison["methods"]["one_device"]["median_s"]
        rows.append(
            (
                str(point[key]),
                _ms(one),
                *(f"{speedup[m]:.2f}x" for m in methods),
                str(comparison["other_processes_cores"]),
            )
        )
    return format_rows(header, rows, indent=indent)


def format_report(report: Mapping[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"TensorFlow {env['tensorflow']}, {env['cores']} cores ({env['cpu_model']}), "
        f"logical devices: {len(env['logical_devices'])}, intra-op threads "
        f"{env['intra_op_threads']}, inter-op threads {env['inter_op_threads']}, "
        f"load {env['load_average_start']} at start",
        f"medians of {report['settings']['repeats']} rounds after "
        f"{report['settings']['warmup']} warm-up calls",
        "",
    ]
    for name, result in report["cases"].items():
        lines.append(format_case(name, result))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write_json(path: str | os.PathLike[str], report: Mapping[str, Any]) -> None:
    Path(path).write_text(json.dumps(report, indent=1) + "\n")


def plot(path: str | os.PathLike[str], report: Mapping[str, Any]) -> bool:
    """Draws speed-up against device count for each method, with the ideal line.

    Args:
      path: where to write the PNG.
      report: the report holding a ``scaling`` case with a ``devices`` sweep.

    Returns:
      False when matplotlib is not installed or there is no sweep to draw
      (nothing is written), True otherwise.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sweep = report["cases"].get("scaling", {}).get("sweeps", {}).get("devices")
    if not sweep:
        return False
    ks = [p["devices"] for p in sweep["points"]]
    methods = [m for m in sweep["points"][0]["comparison"]["methods"] if m != "one_device"]
    n_cores = report["environment"]["cores"]
    fig, ax = plt.subplots(figsize=(6, 4.2))
    ax.plot(ks, ks, "k--", linewidth=1, label="ideal (K x)")
    ax.plot(
        ks, [core_bound(k, n_cores) for k in ks], color="grey", linestyle=":", linewidth=1.5,
        label=f"bound on {n_cores} cores",
    )
    for m in methods:
        ax.plot(
            ks,
            [p["comparison"]["speedup_vs_one_device"][m] for p in sweep["points"]],
            marker="o",
            linewidth=2.5 if m == "tfshard" else 1.2,
            label=m,
        )
    ax.axvline(n_cores, color="grey", linewidth=0.8)
    ax.text(n_cores, 0.3, f" {n_cores} cores", color="grey")
    ax.set_xlabel("logical CPU devices K (one intra-op thread each)")
    ax.set_ylabel("speed-up over one device")
    ax.set_xticks(ks)
    ax.set_ylim(0, max(ks) + 0.5)
    ax.set_title("tfshard scaling: " + sweep.get("title", ""))
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
