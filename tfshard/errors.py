"""The one family of errors tfshard raises, and turning a TF op error into a ShardError.

Every error derives from `TfshardError`. Errors caused by bad input also derive
from `ValueError`, so code that already catches `ValueError` keeps working;
errors about the state of the machine (no driver, TensorFlow already started)
derive from `RuntimeError`.

This module imports no TensorFlow: `tfshard.utilization` uses it without TF.
"""

from __future__ import annotations

import os
import threading
from typing import Any

# Frames in this folder are tfshard's own: a shard's error leaves them out.
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class TfshardError(Exception):
    """Base class of every error tfshard raises."""

    # Autograph re-raises an error from inside a user's tf.function as its own type
    # only when that type's constructor is Exception's (else as a StagingError, which
    # no `except ArgumentError` catches); ValueError's would be found first.
    __init__ = Exception.__init__


class DeviceError(TfshardError, ValueError):
    """A device name or spec that does not resolve to a device that exists."""


class ContextMapError(TfshardError, ValueError):
    """A malformed context map such as ``"dev0->GPU:0;dev1->GPU:1"``."""


class ArgumentError(TfshardError, ValueError):
    """Bad arguments to a tfshard function or to a parallelized function."""


class DeviceSetupError(TfshardError, RuntimeError):
    """Devices cannot be configured now (for example after TensorFlow started)."""


class ShardError(TfshardError):
    """A shard failed while running; the message names its device and rows.

    The error raised is also an instance of the TensorFlow error the shard
    raised (for example `tf.errors.InvalidArgumentError`), so existing
    ``except tf.errors.OpError`` handlers keep working.
    """


class UtilizationError(TfshardError, RuntimeError):
    """``nvidia-smi`` is missing, failed, hung, or printed something unreadable."""


class ClusterError(TfshardError, RuntimeError):
    """A TensorFlow cluster is unreachable, or a worker in it went away.

    The message names the worker's job, task and address, and how to bring it
    back (``python -m tfshard.worker ...``, then ``tfshard.connect(...)`` again).
    """


class WorkerError(TfshardError, RuntimeError):
    """A worker process failed, exited without a result, or outlived the timeout.

    Attributes:
      index: the worker's position in `per_device_args`.
      device: the worker's device, as given (``"gpu:1"``, ``"cpu"``).
      traceback: the worker's formatted traceback when it raised, else None.
    """

    def __init__(
        self, message: str, *, index: int, device: str, traceback: str | None = None
    ) -> None:
        super().__init__(message)
        self.index = index
        self.device = device
        self.traceback = traceback


class _ShardTypes:
    """One ShardError subclass per TensorFlow error type, made on first use.

    `shard_error` needs a class that is both a ShardError and the shard's TF
    error type, so ``except tf.errors.InvalidArgumentError`` still catches it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._types: dict[type, type] = {}

    def of(self, error_type: type) -> type:
        if issubclass(error_type, ShardError):
            return error_type
        with self._lock:
            cls = self._types.get(error_type)
            if cls is None:
                # The TF error's constructor, not TfshardError's plain one.
                namespace = {"__init__": error_type.__init__}
                cls = type(f"Shard{error_type.__name__}", (ShardError, error_type), namespace)
                cls.__module__ = __name__
                self._types[error_type] = cls
            return cls


_shard_types = _ShardTypes()


def shard_error(error: Any, message: str) -> Any:
    """`error` (a `tf.errors.OpError`) with a new message, as a ShardError of its TF type."""
    return _shard_types.of(type(error))(error.node_def, error.op, message)


def user_frames(message: str) -> str:
    """A TF graph error's message without tfshard's own frames, each node's stack once.

    TensorFlow prints "Detected at node N defined at (most recent call last):"
    and the stack that built N once per root error; tfshard's frames in it
    (its trace, body and shard functions) say nothing to the user. The user's
    frames, the failing op and TF's own summary stay.
    """
    lines = message.split("\n")
    kept: list[str] = []
    seen: set[tuple[str, ...]] = set()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("Detected at node "):
            kept.append(lines[i])
            i += 1
            continue
        end = i + 1
        while end < len(lines) and (lines[end].startswith("  File ") or not lines[end]):
            end += 1
        frames = [
            line
            for line in lines[i + 1 : end]
            if line.startswith("  File ") and _OWN_DIR not in line
        ]
        section = (lines[i], *frames)
        if section not in seen:
            seen.add(section)
            kept.extend([lines[i], *frames, ""])
        i = end
    return "\n".join(kept)
