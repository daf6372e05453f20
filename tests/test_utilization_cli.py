"""Tests of ``python -m tfshard.utilization`` (tfshard/utilization/__main__.py).

The readings come from the fake nvidia-smi in tests/fake_nvidia_smi, as in
tests/test_utilization.py. The table itself is the core's (`tfshard.utilization.format_table`,
tested there); this module loops, prints and parses flags.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import children
import numpy as np
import pytest
from fake_nvidia_smi import fake

from tfshard import utilization
from tfshard.errors import ArgumentError
from tfshard.utilization import GpuReading
from tfshard.utilization import __main__ as cli
from tfshard.utilization.__main__ import run_cli

REPO = Path(__file__).resolve().parents[1]
_calls = fake.calls


def test_the_core_never_loads_its_command_line():
    # gpustat's rule: the CLI imports the core, never the reverse, not even lazily.
    code = (
        "import sys, tfshard.utilization as u\n"
        "[getattr(u, name) for name in u.__all__]\n"
        "print('tfshard.utilization.__main__' in sys.modules, 'absl' in sys.modules)"
    )
    done = children.python(code)
    assert done.stdout.split() == ["False", "False"], done.stderr[-2000:]
    assert "run_cli" not in utilization.__all__ and not hasattr(utilization, "run_cli")
    assert cli.format_table is utilization.format_table


def test_run_cli_prints_a_table_and_exits_0_when_every_gpu_is_busy(
    nvidia_smi_several_gpus_busy, capsys
):
    assert run_cli() == 0
    assert capsys.readouterr().out == (
        "gpu  tf device      name                   util %  mem util %  memory MiB     vs 90 %\n"
        "  0  /device:GPU:0  NVIDIA A100-SXM4-40GB      97          41  15012 / 40960  ok\n"
        "  1  /device:GPU:1  NVIDIA A100-SXM4-40GB      93          38  14876 / 40960  ok\n"
        "  2  /device:GPU:2  NVIDIA A100-SXM4-40GB     100          52  15012 / 40960  ok\n"
        "  3  /device:GPU:3  NVIDIA A100-SXM4-40GB      91          36  14990 / 40960  ok\n"
    )


def test_run_cli_exits_1_below_the_threshold(nvidia_smi_one_gpu_idle, capsys):
    assert run_cli() == 1
    assert capsys.readouterr().out.splitlines()[2].endswith("below")
    assert run_cli(threshold=2) == 0
    assert run_cli(threshold=97) == 1


@pytest.mark.parametrize(
    ("scenario", "status", "table"),
    [
        # What `python -m tfshard.utilization` printed on the H100 (scenarios/RECORDED.md).
        (
            "h100_idle",
            1,
            "gpu  tf device      name                   util %  mem util %  memory MiB  vs 90 %\n"
            "  0  /device:GPU:0  NVIDIA H100 80GB HBM3       0           0  0 / 81559   below\n",
        ),
        (
            "h100_busy",
            0,
            "gpu  tf device      name                   util %  mem util %  memory MiB    vs 90 %\n"
            "  0  /device:GPU:0  NVIDIA H100 80GB HBM3     100           9  1651 / 81559  ok\n",
        ),
    ],
)
def test_run_cli_prints_what_it_printed_on_a_real_h100(
    fake_nvidia_smi, capsys, scenario, status, table
):
    fake_nvidia_smi(scenario)
    assert run_cli() == status
    assert capsys.readouterr().out == table


def test_run_cli_json_uses_reading_field_names(nvidia_smi_not_supported_fields, capsys):
    assert run_cli(as_json=True) == 1  # no utilisation reported: not busy
    rows = json.loads(capsys.readouterr().out)
    names = [field.name for field in dataclasses.fields(GpuReading)]
    assert [list(row) for row in rows] == [names, names]
    assert rows[1]["utilization_gpu"] is None and rows[1]["memory_total_mib"] == 11441


def test_run_cli_watch_refreshes_count_times(nvidia_smi_utilization_changes, capsys):
    assert run_cli(watch=0.01, count=3) == 1  # last refresh: 90 % and 50 %
    out = capsys.readouterr().out
    assert out.count("gpu  tf device") == 3
    assert _calls(nvidia_smi_utilization_changes) == 3


def test_run_cli_exits_2_when_no_reading_can_be_taken(nvidia_smi_no_devices, capsys):
    assert run_cli(as_json=True) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "exit status 6" in captured.err and "No devices were found" in captured.err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threshold": 150}, r"threshold=150; give a percentage from 0 to 100"),
        ({"watch": 0}, r"watch=0; give a positive number"),
        ({"count": 2}, r"count=2; give a count >= 0 together with watch"),
        ({"watch": 1, "count": -1}, r"count=-1"),
    ],
)
def test_run_cli_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        run_cli(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # A float count never equals the number of refreshes: the loop would never end.
        ({"count": 2.5}, r"count=2\.5; give a whole number of refreshes >= 0"),
        ({"count": "3"}, r"count='3'; give a whole number"),
        ({"count": None}, r"count=None; give a whole number"),
        ({"count": True}, r"count=True; give a whole number"),
        ({"as_json": "no"}, r"as_json='no' is of type str; give True or False"),
        ({"as_json": 1}, r"as_json=1 is of type int; give True or False"),
        ({"nvidia_smi": 3}, r"nvidia_smi=3 is of type int; give the path of nvidia-smi as a str"),
        ({"nvidia_smi": b"/bin/nvidia-smi"}, r"nvidia_smi=b'/bin/nvidia-smi' is of type bytes"),
    ],
)
def test_run_cli_rejects_wrong_types_before_running_nvidia_smi(
    nvidia_smi_no_devices, kwargs, message
):
    # With no GPU listed the loop returns 2 at once; a wrong type must be refused before it.
    with pytest.raises(ArgumentError, match=message):
        run_cli(watch=0.01, **kwargs)
    assert not (nvidia_smi_no_devices / "calls").exists()


def test_run_cli_takes_a_numpy_count(nvidia_smi_utilization_changes, capsys):
    assert run_cli(watch=0.01, count=np.int64(2), as_json=np.bool_(False)) == 1  # GPU 1 reads [N/A]
    assert capsys.readouterr().out.count("gpu  tf device") == 2
    assert _calls(nvidia_smi_utilization_changes) == 2


def test_main_rejects_positional_arguments(capsys):
    assert cli.main(["tfshard.utilization", "extra"]) == 2
    assert "unexpected arguments ['extra']" in capsys.readouterr().err


# Through a real `python -m`. Each run pays for importing the tfshard package, so the runs
# start together, once per module, and the tests below read their results.

_NO_DRIVER = "<no nvidia-smi on PATH>"
_CLI_RUNS = {
    "flags": ("utilization_changes", "--watch=0.01", "--count=3", "--json", "--threshold=50"),
    "below_threshold": ("one_gpu_idle",),
    "no_driver": (_NO_DRIVER,),
    "bad_flag": ("several_gpus_busy", "--no-such-flag"),
    "help": ("several_gpus_busy", "--help"),
}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict[str, tuple[int, str, str, Path]]:
    """Runs `python -m tfshard.utilization` for each case; (status, stdout, stderr, state)."""
    fake.executable()
    started, states = {}, {}
    for case, (scenario, *args) in _CLI_RUNS.items():
        state = tmp_path_factory.mktemp(case)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "TFSHARD_"))}
        env = children.environ(base, FAKE_NVIDIA_SMI_STATE=str(state))
        if scenario == _NO_DRIVER:
            env["PATH"] = str(state)
        else:
            env["FAKE_NVIDIA_SMI_SCENARIO"] = scenario
            env["PATH"] = fake.search_path()
        process = subprocess.Popen(
            [sys.executable, "-m", "tfshard.utilization", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started[case] = process
        states[case] = state
    return {case: (*run, states[case]) for case, run in children.finished(started, 120).items()}


def test_cli_flags_watch_count_json_threshold(cli_runs):
    status, out, err, state = cli_runs["flags"]
    assert status == 0, err  # the last refresh has 90 % and 50 %, the threshold is 50
    lists = [json.loads(line) for line in out.splitlines()]
    assert [[row["utilization_gpu"] for row in rows] for rows in lists] == [
        [10.0, 0.0],
        [60.0, None],
        [90.0, 50.0],
    ]
    assert list(lists[0][0]) == [field.name for field in dataclasses.fields(GpuReading)]
    assert _calls(state) == 3


def test_cli_exits_1_when_a_gpu_is_below_the_threshold(cli_runs):
    status, out, err, _ = cli_runs["below_threshold"]
    assert status == 1, err
    assert out.splitlines()[2].endswith("below")


def test_cli_without_driver_exits_2_without_traceback(cli_runs):
    status, out, err, _ = cli_runs["no_driver"]
    assert status == 2
    assert "tfshard.utilization: no NVIDIA driver found" in err
    assert "Traceback" not in err
    assert out == ""


def test_cli_flag_errors_exit_2(cli_runs):
    # absl's own exit status for a flag error is 1, which would read as "not busy".
    status, _, err, _ = cli_runs["bad_flag"]
    assert status == 2
    assert "no-such-flag" in err and "Traceback" not in err


def test_cli_help_exits_0_and_lists_the_flags(cli_runs):
    # absl's own exit status after --help is 1, which would read as "not busy".
    status, out, err, state = cli_runs["help"]
    assert status == 0, err
    for flag in ("--threshold", "--watch", "--count", "--[no]json"):
        assert flag in out
    assert not (state / "calls").exists()  # help only: nvidia-smi never ran
