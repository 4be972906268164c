"""Run a test script in a fresh Python process with N emulated CPU devices (JAX reads the device count
once, when it starts, so a test that needs 8 devices cannot get them in the pytest process)."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_on_cpu_devices(script: str, devices: int = 8, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python -c script`` from the repository root on ``devices`` CPU devices; stdout/stderr captured."""
    env = dict(
        os.environ,
        JAX_NUM_CPU_DEVICES=str(devices),
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=REPO,
    )
    return subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
