"""`ShardedFunction.explain`'s table: which rows go where, and what crosses devices."""

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
    rows_cells, start = [], 0
    for size in sizes:
        rows_cells.append(f"[{start}:{start + size})")
        start += size
    width = max(len(d) for d in devices)
    rows_width = max(len("rows"), *(len(r) for r in rows_cells))
    size_width = max(len("size"), *(len(str(n)) for n in sizes))
    remote = [pinning.is_remote(d) for d in devices]
    lines.append(
        f"  {'shard':<5}  {'device':<{width}}  {'rows':<{rows_width}}  "
        f"{'size':>{size_width}}  output"
    )
    for k, (device, size) in enumerate(zip(devices, sizes)):
        lands = output if device == output else f"-> {output}"
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
    lines.extend(_weights(engine, call, name, fn))
    return "\n".join(line.rstrip() for line in lines)


def _weights(engine: Engine, call: Call, name: str, fn: Any) -> list[str]:
    """Lines on the variables each shard reads, and how many bytes cross per call."""
    reads = replicas_lib.variable_reads(engine.trace(call), engine.devices)
    if not any(reads):
        return []
    lines = ["  shard  variables  read from another device per call"]
    for k, shard in enumerate(reads):
        remote = [r for r in shard if r.remote]
        where = sorted({r.device for r in remote})
        cell = replicas_lib.format_bytes(replicas_lib.remote_bytes(shard))
        if where:
            cell += f" ({len(remote)} on {', '.join(where)})"
        lines.append(f"  {k:<5}  {len(shard):>9}  {cell}")
    total = sum(replicas_lib.remote_bytes(shard) for shard in reads)
    size = replicas_lib.format_bytes(total)
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
