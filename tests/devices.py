"""Run a test script in a fresh Python process with N emulated CPU devices (JAX reads the device count
once, when it starts, so a test that needs 8 devices cannot get them in the pytest process)."""

from __future__ import annotations

import os
import socket
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


def run_processes(script: str, args: list[list[str]], devices: int, timeout: float = 600) -> list[str]:
    """``python -c script localhost:<port> *args[pid]`` once per process, all at once (a
    ``jax.distributed`` group with its coordinator on a free local port), each on ``devices`` CPU
    devices; returns their stdouts. Raises AssertionError with the stderr tail of a process that fails."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, f"localhost:{port}", *a],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for a in args
    ]
    return [out for out, _ in wait_all(procs, timeout)]


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """The (stdout, stderr) of each of ``procs`` (started with both piped), once all have exited; any still
    running when one times out or fails to be read is killed."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """``communicate_all``, then AssertionError with the stderr tail of a process that exited non-zero."""
    outs = communicate_all(procs, timeout)
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return outs
