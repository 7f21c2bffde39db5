"""What ``scripts/chain_bench.py`` and ``scripts/request_bench.py`` share: the instructions one
run of a script takes under callgrind, and the printout of a side beside its floor."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def instructions(script: str, *args: str) -> int:
    """Instructions ``python script args`` runs under callgrind, start-up and all (the same count
    run after run, to about 0.2% where its input is the same)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("--callgrind needs valgrind (apt-get install valgrind)")
    command = [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable]
    run = subprocess.run(
        [*command, script, *args], capture_output=True, text=True, check=False, timeout=3600
    )
    found = re.search(r"Collected : (\d+)", run.stderr)
    if run.returncode != 0 or found is None:
        raise SystemExit(f"{' '.join(args)} under callgrind failed: {run.stderr[-2000:]}")
    return int(found.group(1))


def report(
    title: str, shown: dict[str, str], figures: dict[str, Any], json_path: str | None
) -> None:
    """Print ``title``, each side's figure (the first side first, its floor second) and their
    ratio (``figures["of_floor"]``); write ``figures`` to ``json_path`` when given."""
    side, floor = shown
    print(title)
    for name, figure in shown.items():
        print(f"  {name:12s} {figure:>12s}")
    print(f"  {side} / {floor}: {figures['of_floor']:.3f}")
    if json_path:
        Path(json_path).write_text(json.dumps(figures, indent=2))
