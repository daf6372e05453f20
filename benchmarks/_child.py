"""A measurement made in a fresh Python process: its JSON line back.

Memory and first-call numbers need a process of their own (nothing traced or
allocated before them); a benchmark runs itself again with a flag saying which
measurement to make, and prints that measurement as its last stdout line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence


def measured(script: str, way: str, arguments: Sequence[str]) -> dict:
    """Runs `script` with `arguments` in a fresh process; the JSON of its last stdout line.

    Raises:
      RuntimeError: the process failed; the end of its stderr says why.
    """
    command = [sys.executable, os.path.abspath(script), *arguments]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{way}: the measuring process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
