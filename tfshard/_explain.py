"""`ShardedFunction.explain`'s table: which rows go where, and what crosses devices.

`format_bytes` is the one way tfshard writes a size (the timeline's copies too).
"""

from __future__ import annotations

import types
from typing import Any

from tfshard import cluster, pinning
from tfshard import replicas as replicas_lib
from tfshard._arguments import Call
from tfshard._engine import Engine


def table(engine: Engine, call: Call, sizes: list[int], name: str, fn: Any) -> str:
    """The plan of `call` as a table: one line per shard, then what crosses devices.

    Args:
      engine: the function's engine (its devices, options, traced graph).
      call: the classified call (its rows are known).
      sizes: the plan for its rows.
      name: the function's name, for the title and the remedy.
      fn: the user's function (a plain function's name is used in the remedy).
    """
    devices, output = engine.devices, engine.output
    how = "per sample" if engine.options.per_sample else "per shard"
    op = engine.options.reduce
    result = f"reduced with {op.name!r}" if op else "gathered"
    lines = [f"{name}: {call.rows} rows on {len(devices)} devices, {how}, {result} on {output}"]
    lines.extend(_plan_lines(engine))
    rows_cells, start = [], 0
    for size in sizes:
        rows_cells.append(f"[{start}:{start + size})")
        start += size
    width = max(len(d) for d in devices)
    rows_width = max(len("rows"), *(len(r) for r in rows_cells))
    size_width = max(len("size"), *(len(str(n)) for n in sizes))
    remote = [pinning.is_remote(d) for d in devices]
    weights, caps = engine.in_use()
    holding = engine.holding(weights, caps)
    held = range(len(devices)) if holding is None else holding
    lines.append(
        f"  {'shard':<5}  {'device':<{width}}  {'rows':<{rows_width}}  "
        f"{'size':>{size_width}}  output"
    )
    for k, (device, size) in enumerate(zip(devices, sizes)):
        lands = output if device == output else f"-> {output}"
        if k not in held:
            lands = "-"
        if remote[k] or pinning.is_remote(output):
            # Rows go out to the shard and results come back, once per call.
            lands += f"  (network: {cluster.host_of(device) or cluster.host_of(output)})"
        lines.append(
            f"  {k:<5}  {device:<{width}}  {rows_cells[k]:<{rows_width}}  "
            f"{size:>{size_width}}  {lands}"
        )
    crossing = sum(
        r or (d != output and pinning.is_remote(output)) for r, d in zip(remote, devices)
    )
    if crossing:
        lines.append(
            f"  {crossing} of {len(devices)} shards cross the network: each call sends "
            "each its rows and every broadcast argument, and its result comes back to "
            f"{output}"
        )
    lines.extend(_held_lines(devices, held, caps))
    lines.extend(_weights(engine, call, name, fn))
    return "\n".join(line.rstrip() for line in lines)


def _held_lines(devices: tuple[str, ...], held: Any, caps: Any) -> list[str]:
    """What the call's graph leaves out: a device the weights give no rows, or that a cap
    holds to 0; and where one device is left, that it runs the function as a plain trace."""
    capped = [d for k, d in enumerate(devices) if k not in held and caps and caps[k] == 0]
    weighted = [d for k, d in enumerate(devices) if k not in held and d not in capped]
    if not capped and not weighted:
        return []
    lines = []
    for left_out, why in ((weighted, "weighted 0"), (capped, "capped at 0 rows")):
        if left_out:
            are = "is" if len(left_out) == 1 else "are"
            lines.append(
                f"  {', '.join(left_out)} {are} {why}: not in the call's graph (no ops, no "
                "copies; traced again when weights or caps leave a device out)"
            )
    if len(held) == 1:
        lines.append(
            f"  {devices[held[0]]} holds every row: the function runs there as a plain "
            "tf.function does (no split, no gather, nothing on the host)"
        )
    return lines


def _plan_lines(engine: Engine) -> list[str]:
    """What shapes the plan beyond the rows: the weights in use, and ``max_rows``."""
    lines = []
    weights, balance = engine.weights, engine.balance
    shown = None if weights is None else "[" + ", ".join(f"{w:g}" for w in weights) + "]"
    if balance is not None:
        measured = f"{balance.measured} measurement{'s' if balance.measured != 1 else ''}"
        if shown:
            lines.append(f"  weights {shown} (weights='auto', from {measured})")
        elif None in balance.per_row():
            lines.append(f"  weights even (weights='auto': {measured}, not every device yet)")
        else:
            lines.append(
                f"  weights even (weights='auto', from {measured}: no other split is "
                "predicted 5 % and 0.25 ms faster)"
            )
    elif shown:
        lines.append(f"  weights {shown}")
    caps = engine.in_use()[1]
    if caps is not None:
        cells = ", ".join("-" if c is None else str(c) for c in caps)
        lines.append(
            f"  caps [{cells}]: at most that many rows on each device (weights='auto' "
            "learned them where a shard ran out of memory)"
        )
    limits = engine.options.limits(len(engine.devices))
    if limits is not None:
        cells = ", ".join("-" if m is None else str(m) for m in limits)
        lines.append(f"  max_rows [{cells}]: at most that many rows at once on each device")
    return lines


def _weights(engine: Engine, call: Call, name: str, fn: Any) -> list[str]:
    """Lines on the variables each shard reads, and how many bytes cross per call."""
    reads = replicas_lib.variable_reads(engine.trace(call), engine.devices)
    if not any(reads):
        return []
    lines = ["  shard  variables  read from another device per call"]
    for k, shard in enumerate(reads):
        remote = [r for r in shard if r.remote]
        where = sorted({r.device for r in remote})
        cell = format_bytes(replicas_lib.remote_bytes(shard))
        if where:
            cell += f" ({len(remote)} on {', '.join(where)})"
        lines.append(f"  {k:<5}  {len(shard):>9}  {cell}")
    total = sum(replicas_lib.remote_bytes(shard) for shard in reads)
    size = format_bytes(total)
    line = f"  each call reads {size} of variables from other devices"
    lines.append(line)
    if total:
        named = isinstance(fn, types.FunctionType) and name.isidentifier()
        f = name if named and name != "<lambda>" else "f"
        lines.append(
            f"  for a copy on each device, create them inside `with {f}.replicas():`, "
            f"or model = {f}.replicate(model)"
        )
    return lines


def format_bytes(n: int) -> str:
    """``n`` bytes as a short size: ``"512 B"``, ``"12.8 KiB"``, ``"5.0 MiB"``, ``"1.5 GiB"``.

    Binary units (powers of 1024), the units of ``nvidia-smi`` and TensorFlow's out-of-memory
    messages, for every size tfshard prints; one decimal, whole bytes below 1 KiB.

    >>> format_bytes(0), format_bytes(1023), format_bytes(13056), format_bytes(5 * 2**20)
    ('0 B', '1023 B', '12.8 KiB', '5.0 MiB')
    >>> format_bytes(2**20 - 1), format_bytes(3 * 2**40)
    ('1.0 MiB', '3072.0 GiB')
    """
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB"):
        # Rounded as shown, so 1048575 bytes read "1.0 MiB", never "1024.0 KiB".
        if round(size, 1) < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
