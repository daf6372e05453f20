r"""Measures tfshard against what a user would use instead, in one process.

Runs on the machine's GPUs when TensorFlow lists one (every logical GPU; the
sweep over the first K of them), else splits the CPU into logical devices with
one intra-op thread each (--device_type=cpu insists on that); runs the
chosen cases (see `cases.py`), prints a table per case and writes every median
and ratio to a JSON file. Typical runs:

  python benchmarks/scaling.py                      # every case, a few minutes
  python benchmarks/scaling.py --case=compute --repeats=21
  python benchmarks/scaling.py --json=bench.json --plot=bench.png
  python benchmarks/report.py --json=bench.json     # rewrites BENCHMARKS.md
  python benchmarks/scaling.py --split_gpu=2        # one GPU as two: overheads only

The number of logical devices is fixed when TensorFlow starts, so the process
creates ``max(--devices, --max_devices)`` of them once; the device sweep of
the scaling case uses the first K of them for each K.
"""

from __future__ import annotations

import sys
import time
import warnings

import _device_flags
import _harness
import cases
import tensorflow as tf
from absl import app, flags

CASE_NAMES = ("compute", "per_sample", "small_batch", "dataset", "scaling")

flags.adopt_module_key_flags(_device_flags)  # --help lists --device_type and the rest
_CASE = flags.DEFINE_multi_enum(
    "case", ["all"], ["all", *CASE_NAMES], "Cases to run (repeat the flag for several)."
)
_DEVICES = flags.DEFINE_integer(
    "devices", 2, "Logical devices K for every case but the sweep (the targets are for 2).",
    lower_bound=1,
)
_MAX_DEVICES = flags.DEFINE_integer(
    "max_devices", 4, "The scaling sweep runs K = 1 .. max_devices (GPUs: all).", lower_bound=1
)
_REPEATS = flags.DEFINE_integer(
    "repeats", 15, "Timed rounds per comparison (>= 10 for the report).", lower_bound=1
)
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed calls of each method first.", lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "Seeds weights and inputs.")
_BATCH = flags.DEFINE_integer("batch", 8192, "Rows per call: compute and scaling cases.")
_WIDTH = flags.DEFINE_integer("width", 256, "Feature size of the matmul cases.")
_DEPTH = flags.DEFINE_integer("depth", 8, "Layers of the matmul cases.")
_SMALL_BATCH = flags.DEFINE_integer("small_batch", 8, "Rows per call: small_batch case.")
_INNER = flags.DEFINE_integer(
    "inner", 50, "small_batch case: calls per timed sample (their mean).", lower_bound=1
)
_SAMPLES = flags.DEFINE_integer("samples", 8192, "Rows per call: per_sample case.")
_SAMPLE_WIDTH = flags.DEFINE_integer("sample_width", 128, "Sample size: per_sample case.")
_SAMPLE_DEPTH = flags.DEFINE_integer("sample_depth", 4, "Layers: per_sample case.")
_STREAM_SAMPLES = flags.DEFINE_integer("stream_samples", 32768, "Rows in the dataset case.")
_STREAM_BATCH = flags.DEFINE_integer("stream_batch", 4096, "Global batch of the dataset case.")
_STREAM_BATCHES = flags.DEFINE_list(
    "stream_batch_sizes", ["1024", "2048", "8192"], "More global batches: dataset case sweep."
)
_BATCH_SIZES = flags.DEFINE_list(
    "batch_sizes", ["64", "256", "1024", "4096", "16384"], "Batch sizes of the batch sweep."
)
_WAIT = flags.DEFINE_float(
    "wait_for_idle", 0.0,
    "Before each case, wait up to this many seconds until other processes use less "
    "than 5% of a core (on a shared machine).",
)
_RETRIES = flags.DEFINE_integer(
    "retries", 0,
    "Run a case again, up to this many times, while other processes use more than "
    "--disturbed cores during it; the least disturbed attempt is reported.",
    lower_bound=0,
)
_DISTURBED = flags.DEFINE_float(
    "disturbed", 0.1, "Cores used by other processes that count as disturbing a case."
)
_JSON = flags.DEFINE_string("json", None, "Write every median and ratio here.")
_PLOT = flags.DEFINE_string(
    "plot", None, "Write a PNG of speed-up against K here (needs matplotlib)."
)


def case_arguments(name: str) -> dict[str, object]:
    """The keyword arguments of case `name`, from the flags."""
    common = dict(repeats=_REPEATS.value, warmup=_WARMUP.value, seed=_SEED.value)
    matmul = dict(width=_WIDTH.value, depth=_DEPTH.value)
    return {
        "compute": dict(batch=_BATCH.value, **matmul, **common),
        "small_batch": dict(batch=_SMALL_BATCH.value, inner=_INNER.value, **matmul, **common),
        "per_sample": dict(
            samples=_SAMPLES.value, width=_SAMPLE_WIDTH.value, depth=_SAMPLE_DEPTH.value,
            **common,
        ),
        "dataset": dict(
            samples=_STREAM_SAMPLES.value,
            batch=_STREAM_BATCH.value,
            batch_sizes=[int(b) for b in _STREAM_BATCHES.value],
            **matmul,
            **common,
        ),
        "scaling": dict(
            batch=_BATCH.value, batch_sizes=[int(b) for b in _BATCH_SIZES.value], **matmul,
            **common,
        ),
    }[name]


def run_case(name: str, devices: list[str]) -> dict[str, object]:
    """Runs one case; again (up to --retries times) while other processes disturb it.

    Args:
      name: the case.
      devices: the devices it uses.

    Returns:
      The case's result from the least disturbed attempt, with the cores other
      processes used before and during it, and how many attempts were made.
    """
    best, best_during = None, float("inf")
    for attempt in range(1, _RETRIES.value + 2):
        before = _harness.wait_for_idle(_WAIT.value)
        start = time.perf_counter()
        with _harness.OtherLoad() as other:
            result = cases.CASES[name](devices, **case_arguments(name))
        result["seconds"] = round(time.perf_counter() - start, 1)
        result["other_processes_cores"] = {"before": before, "during": other.cores}
        result["attempts"] = attempt
        during = other.cores if other.cores is not None else 0.0
        if during < best_during:
            best, best_during = result, during
        if during <= _DISTURBED.value:
            break
        print(
            f"({name}: other processes used {during} cores during attempt {attempt})",
            file=sys.stderr, flush=True,
        )
    return best


def run(
    names: list[str], devices: list[str], k: int, env: dict[str, object]
) -> dict[str, object]:
    """Runs the named cases, printing each, and returns the report.

    Args:
      names: the cases to run, in order.
      devices: every logical device; the scaling case sweeps over them.
      k: how many of them the other cases use.
      env: the environment record (`_harness.environment`).

    Returns:
      The report: environment, settings and one result per case.
    """
    report: dict[str, object] = {
        "environment": env,
        "settings": {"repeats": _REPEATS.value, "warmup": _WARMUP.value, "devices": k},
        "cases": {},
    }
    for name in names:
        result = run_case(name, devices if name == "scaling" else devices[:k])
        report["cases"][name] = result
        print(_harness.format_case(name, result), flush=True)
        print(flush=True)
    report["environment"]["load_average_end"] = _harness.load_average()
    return report


def main(argv: list[str]) -> None:
    del argv
    # MirroredStrategy's INFO lines and the eager loop's retracing warnings drown the tables.
    tf.get_logger().setLevel("ERROR")
    # Raised inside MirroredStrategy's dataset code, about tf.data internals.
    warnings.filterwarnings("ignore", message="To make it possible to preserve tf.data options")
    names = list(CASE_NAMES) if "all" in _CASE.value else list(dict.fromkeys(_CASE.value))
    k = _DEVICES.value
    cpu_count = max(k, _MAX_DEVICES.value if "scaling" in names else k)
    devices = _device_flags.devices(cpu_count, needed=k)  # the GPUs, else the CPU bed
    env = _harness.environment(devices)
    kind = "GPUs" if "GPU" in devices[0] else "logical CPU devices"
    print(
        f"TensorFlow {env['tensorflow']} on {env['cores']} cores ({env['cpu_model']}); "
        f"{len(devices)} {kind}, intra-op threads {env['intra_op_threads']}, "
        f"inter-op threads {env['inter_op_threads']}; load {env['load_average_start']}",
        flush=True,
    )
    print(flush=True)
    report = run(names, devices, k, env)
    missed = [
        f"{name}: {_harness.format_target(t)}"
        for name, result in report["cases"].items()
        for t in result.get("targets", [])
        if not t["met"]
    ]
    print("targets missed:" if missed else "every target met", *missed, sep="\n  ")
    if _JSON.value:
        _harness.write_json(_JSON.value, report)
        print(f"wrote {_JSON.value}")
    if _PLOT.value:
        if _harness.plot(_PLOT.value, report):
            print(f"wrote {_PLOT.value}")
        else:
            print(
                f"no plot written to {_PLOT.value}: it needs matplotlib "
                "(pip install matplotlib) and the scaling case",
                file=sys.stderr,
            )


if __name__ == "__main__":
    app.run(main)
