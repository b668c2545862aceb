"""The benchmark scripts time kernels on a CUDA GPU: without one they say so in one line (not a torch traceback),
and point at the static counter that works without a GPU. Skipped where a GPU is present."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvgen

ROOT = Path(kvgen.__file__).resolve().parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the scripts would run")
@pytest.mark.parametrize("script,args", [("bench.py", ["--formats", "bf16", "--no-sweep"]),
                                         ("tune_splits.py", ["bf16"])])
def test_gpu_scripts_name_the_missing_gpu(script, args, tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, *(
        ["--out", str(tmp_path)] if script == "bench.py" else [])], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "CUDA GPU" in res.stderr and "sass_count.py" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
