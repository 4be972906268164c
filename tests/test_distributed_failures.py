"""One host's failure ends a multi-process run on every host, in bounded time, with its reason in host 0's
output (``distributed.failures_shared``): two real ``jax.distributed`` CPU processes, one failing while the
other waits in a collective that will never complete."""

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tests.devices import REPO, communicate_all

SCRIPT = textwrap.dedent(r"""
    import sys, time
    import numpy as np
    from bipace_jax import distributed

    coord, pid, failing, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    distributed.initialize(coord, 2, pid)
    distributed.allgather(np.int32(pid))  # both are up
    print(f"process {pid} up", flush=True)
    with distributed.failures_shared(grace_s=2.0):
        if pid == failing:
            time.sleep(1.0)
            if how == "raise":
                raise RuntimeError("every reset on this host raised: injected")
            if how == "exit":
                sys.exit("error: config.env.name='nope' is not a registered game")
            from launch import cli
            cli.fail("--workdir=/x is in use by launch.train (host h, pid 1)")
        distributed.allgather(np.int32(7))  # the other host never joins: this would wait for ever
        time.sleep(600)
""")


def _two(failing: int, how: str, timeout: float = 180):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="1", PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, f"localhost:{port}", str(pid), str(failing), how],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    outs = communicate_all(procs, timeout)
    return time.monotonic() - t0, [p.returncode for p in procs], outs


@pytest.mark.slow
@pytest.mark.parametrize(
    "failing,how,reason",
    [
        (1, "raise", "RuntimeError: every reset on this host raised: injected"),
        (1, "exit", "config.env.name='nope' is not a registered game"),
        (1, "fail", "--workdir=/x is in use by launch.train (host h, pid 1)"),
        (0, "raise", "RuntimeError: every reset on this host raised: injected"),
    ],
)
def test_one_hosts_failure_stops_both_within_bounded_time_naming_it_on_host_0(failing, how, reason):
    # the case 7: process 1 exited after ~12 s, process 0 sat in a collective until both were
    # aborted ~5 minutes later ("Shutdown barrier has failed"), and host 0's log never named the cause
    wall, codes, outs = _two(failing, how)
    assert all("up" in out for out, _ in outs), outs
    assert codes == ([1, 2] if how == "fail" else [1, 1]), outs  # cli.fail keeps its usage exit code
    assert wall < 120, wall  # (the aborts came after ~300 s)
    err0, errf = outs[0][1], outs[failing][1]
    assert errf.count(f"error: {reason}") == 1  # said once
    if failing == 1:
        assert f"error: process 1 of 2 failed: {reason}; process 0 stops too" in err0
    else:
        assert f"error: process 0 of 2 failed: {reason}; process 1 stops too" in outs[1][1]
