"""What several entry points share: the project root, a stopwatch, the JSON report writer, the CPU default."""

from __future__ import annotations

import glob
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def seconds(fn) -> float:
    """Wall-clock seconds of one call of ``fn()``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def write_json(path: str, obj, **dump_kwargs) -> None:
    """Write ``obj`` as JSON (``json.dump``'s ``dump_kwargs``) to ``path``, making its folder, and say so."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, **dump_kwargs)
    print(f"wrote {path}")


#: Device files of the accelerators JAX drives: TPU VMs (/dev/accel*: v4, v5e; /dev/vfio/<n>: v5p, v6e),
#: NVIDIA GPUs (/dev/nvidia<n>), AMD GPUs (/dev/kfd).
ACCELERATOR_DEVICES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")


def cpu_unless_accelerator() -> bool:
    """Set ``JAX_PLATFORMS=cpu`` when it is unset and this machine has no accelerator device file
    (``ACCELERATOR_DEVICES``); returns whether it did. Without it, libtpu (installed by ``.[tpu]``)
    probes for a TPU on every command and prints five ``E0000 ... INVALID_ARGUMENT`` lines on a
    machine with none. An explicit ``JAX_PLATFORMS`` always wins. Call it before JAX is imported."""
    if "JAX_PLATFORMS" in os.environ or any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES):
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"
    return True


def no_bars_off_terminal() -> bool:
    """Set ``TQDM_DISABLE=1`` when it is unset and stderr is not a terminal (a log file, a pipe, a
    sweep cell's ``train.log``); returns whether it did. A bar redraws itself with ``\\r`` several times
    a second, which a log file keeps as hundreds of frames per phase; the commands' one line per
    iteration and validation (``bipace_jax.loglines``) still reach the log. A ``TQDM_DISABLE`` that is
    set is left alone (tqdm reads any non-empty value as true: ``TQDM_DISABLE=`` keeps the bars)."""
    if "TQDM_DISABLE" in os.environ or sys.stderr.isatty():
        return False
    os.environ["TQDM_DISABLE"] = "1"
    return True
