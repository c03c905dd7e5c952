"""benchmarks/gpu_compile.py on this CPU-only machine: the variants the engine launches by default on
Hopper compile for sm_90a with no spilled registers (the spill budget). That every Triton kernel in
src/gptj is launched by one of its cases is the script's smoke check (tests/test_benchmarks.py). The script runs as a subprocess: conftest.py turns Triton's
interpreter on for this process, and the script compiles, it does not interpret."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_compile.py"

pytest.importorskip("triton", reason="gpu_compile needs Triton (the test extra installs it)")


def run(*args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode in (0, 1), f"gpu_compile exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_default_variants_compile_for_hopper_without_spills():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_compile
    finally:
        sys.path.remove(str(SCRIPT.parent))
    why = gpu_compile.can_compile()
    if why:
        pytest.skip(why)
    rows = run("--arch", "sm_90a", "--json", "--default-only")
    assert rows and all(r["default"] for r in rows)
    failed = [f"{r['kernel']} [{r['variant']}]: {r.get('error')}" for r in rows if not r["ok"]]
    assert not failed, "\n".join(failed)
    spilled = [f"{r['kernel']} w{r['num_warps']} [{r['variant']}]: {r['spill_bytes']} B" for r in rows
               if r["spill_bytes"]]
    assert not spilled, "default variants spill registers:\n" + "\n".join(spilled)
    assert all(0 < r["registers"] <= 255 for r in rows)
