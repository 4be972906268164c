"""What several entry points share: the project root, a stopwatch, the JSON report writer."""

from __future__ import annotations

import json
import os
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
