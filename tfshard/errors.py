"""The one family of errors tfshard raises.

Every error derives from `TfshardError`. Errors caused by bad input also derive
from `ValueError`, so code that already catches `ValueError` keeps working;
errors about the state of the machine (no driver, TensorFlow already started)
derive from `RuntimeError`.
"""

from __future__ import annotations


class TfshardError(Exception):
    """Base class of every error tfshard raises."""


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
