"""What every bench shares (``mesh_app.bench.common``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_a_bench_directory_is_gone_once_its_process_exits(tmp_path: Path) -> None:
    # A run of `mesh bench` used to leave every store and log behind (tens of MB each).
    code = (
        "from mesh_app.bench.common import bench_dir; "
        "d = bench_dir('mesh-bench-test-'); (d / 'store').mkdir(); "
        "(d / 'store' / 'data').write_bytes(b'x' * 1024); print(d); "
        "raise SystemExit(3)"  # an exit with an error cleans up too
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 3, done.stderr
    made = Path(done.stdout.strip())
    assert made.name.startswith("mesh-bench-test-")
    assert not made.exists()
