"""Atomic training checkpoints with orbax: params, optimizer state, RNG, iteration, cursors.

Layout: ``<workdir>/checkpoints/<step>/``, ``step`` the number of *completed* iterations (resuming
from step s starts iteration s), holding ``state`` (``{"params", "opt_state"}`` with
``ocp.args.StandardSave``: every process calls ``save``/``restore``, orbax writes each shard once) and
``meta`` (JSON: the fields of ``CheckpointMeta`` plus ``"step"`` and ``"rng"``: the uint32 key data).
Atomicity is orbax's: a step is written to a temporary folder and renamed when complete, so a process
killed mid-save (SIGKILL included) leaves the previous step as the latest. A step that does not restore
is either torn (set aside, the previous one is tried) or intact but of other arrays than the run asks
for (``CheckpointMismatchError``: another model or optimizer, never set aside).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from bipace_jax import distributed, resume, runfolder

log = logging.getLogger(__name__)

#: The file orbax writes into a step folder once the step is complete (``resume`` reads the folder too).
COMMIT_MARKER = resume.COMMIT_MARKER


class CheckpointMismatchError(ValueError):
    """An intact checkpoint holds other arrays (shape or tree) than the run restores into: another run's."""


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    """The run state saved beside the parameters, RL and warm start alike.

    Attributes:
      iteration: RL: completed iterations; warm start: the DAgger round just finished.
      task_cursor: RL: global index of the next iteration's first task group.
      updates: optimizer updates applied so far (the warm start's step count; RL leaves 0).
      epsilon: RL: the clustering epsilon in use (calibrated or controlled); None when not recorded.
      controller: RL: ``EpsilonController.state_dict()``, or None without a controller.
      estimator: RL: the estimator's registered name ("" = not recorded).
      seed: the run's seed.
      data_stream: warm start, a checkpoint inside a round: the round's updates done, its examples and
        its ``demo_stream.BucketStream.get_state()`` (``sft/loop.py``); None at a round's end (and in RL).
      config: RL: the run's config (``to_dict()`` as JSON holds it), so a resume can check the
        checkpoint against its own config when ``config.json`` is gone; None when not recorded.
    """

    iteration: int = 0
    task_cursor: int = 0
    updates: int = 0
    epsilon: float | None = None
    controller: dict[str, Any] | None = None
    estimator: str = ""
    seed: int = 0
    data_stream: dict[str, Any] | None = None
    config: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, meta: dict[str, Any]) -> CheckpointMeta:
        """The fields of a restored ``meta`` dict (``step``, ``rng`` and unknown keys are left out;
        missing ones take their defaults, so checkpoints of older runs restore)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in meta.items() if k in names})


class Checkpointer:
    """Save/restore training state in ``<workdir>/checkpoints``, keeping the last ``keep`` steps.

    Args:
      workdir: run folder (a local path or ``gs://bucket/path``, see ``bipace_jax.runfolder``).
      keep: number of checkpoints kept (older ones are deleted after a successful save).
      async_save: ``save`` returns once the arrays are copied to host memory and orbax writes them
        in the background (a pod's fp32 params and moments take seconds per host to write); the next
        save, ``latest_step``, a restore and ``close`` wait for it. False: ``save`` returns once the
        step is committed.

    Raises:
      ValueError: ``keep`` < 1.
      RunFolderError: ``workdir`` is a URL of a scheme other than ``gs://``.
    """

    def __init__(self, workdir: str, keep: int = 2, async_save: bool = False):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = os.fspath(runfolder.path(workdir) / "checkpoints")
        self.async_save = bool(async_save)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=self.async_save,
            cleanup_tmp_directories=True,  # remove half-written steps of a killed run
        )
        group = distributed.group()
        # Process roles (asynchronous RL by process): the learner group saves alone. Its arrays live on
        # its devices only, which orbax refuses to save as jax.Arrays while JAX has several processes,
        # so they go through host NumPy (a blocking copy) and are placed back on restore.
        self._host_arrays = len(group) < jax.process_count()
        if self._host_arrays:  # the sampler process joins no checkpoint barrier
            options.multiprocessing_options = ocp.options.MultiprocessingOptions(
                primary_host=group[0], active_processes=set(group)
            )
            options.create = False  # orbax refuses create with active_processes: one group of one process
            epath.Path(self.directory).mkdir(parents=True, exist_ok=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The latest committed step (completed iterations), or None when there is none."""
        self._manager.wait_until_finished()
        self._manager.reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        self._manager.wait_until_finished()
        self._manager.reload()
        return list(self._manager.all_steps())

    def restore_latest(self, params_like: Any, opt_state_like: Any) -> tuple[int, tuple] | None:
        """The newest checkpoint that restores completely: ``(step, restore(step, ...))``, or None.

        A step without orbax's commit marker (a save that never finished) or one that fails to restore
        (a truncated or missing file) is named in a WARNING and moved to ``<checkpoints>/torn/<step>.<n>``,
        so it is kept for inspection and a later save of the same step succeeds.

        Raises:
          CheckpointMismatchError: a committed step whose recorded arrays differ from ``params_like`` /
            ``opt_state_like`` (a shape, or an array stored or requested on one side only): one line
            naming the step, the first differing array and both shapes; every step stays in place.
        """
        for step in sorted(self.all_steps(), reverse=True):
            path = epath.Path(self.directory) / str(step)
            try:
                if not (path / COMMIT_MARKER).exists():
                    raise FileNotFoundError(f"no {COMMIT_MARKER}: the save never committed")
                return step, self.restore(step, params_like, opt_state_like)
            except Exception as e:  # noqa: BLE001 (any failure makes the step unusable; the next one is tried)
                if (path / COMMIT_MARKER).exists() and (diff := self._mismatch(step, params_like, opt_state_like)):
                    raise CheckpointMismatchError(
                        f"checkpoint step {step} in {self.directory} is intact but holds other arrays than this "
                        f"run's model and optimizer ({diff}): it was saved by a run of another config; "
                        "use a new --workdir, or the config it was saved with"
                    ) from None
                log.warning(
                    "checkpoint step %d in %s does not restore (%s: %s); set aside, trying the previous one",
                    step,
                    self.directory,
                    type(e).__name__,
                    str(e).splitlines()[0][:300],
                )
                self._set_aside(path)
        return None

    def _mismatch(self, step: int, params_like: Any, opt_state_like: Any) -> str:
        """The first difference between step ``step``'s recorded array shapes and the requested trees
        ("" when its record does not read, a torn step, or when they agree)."""
        try:
            stored = _shapes(self._manager.item_metadata(step)["state"])
        except Exception:  # noqa: BLE001 (an unreadable record is a torn step, not another run's)
            return ""
        wanted = _shapes(jax.tree.map(_abstract, {"params": params_like, "opt_state": opt_state_like}))
        diffs = []
        for name in sorted(set(stored) | set(wanted)):
            old, new = stored.get(name), wanted.get(name)
            if old is None:
                diffs.append(f"{name}: not stored, requested {new}")
            elif new is None:
                diffs.append(f"{name}: stored {old}, not requested")
            elif old.split("[")[1] != new.split("[")[1]:  # dtypes are cast on restore; shapes must agree
                diffs.append(f"{name}: stored {old}, requested {new}")
        more = f", and {len(diffs) - 1} more arrays differ" if len(diffs) > 1 else ""
        return diffs[0] + more if diffs else ""

    def _set_aside(self, path: epath.Path) -> None:
        if jax.process_index() == 0:
            torn = epath.Path(self.directory) / "torn"
            torn.mkdir(parents=True, exist_ok=True)
            n = sum(1 for p in torn.iterdir() if p.name.split(".")[0] == path.name)
            path.rename(torn / f"{path.name}.{n}")
        if distributed.process_count() > 1:
            multihost_utils.sync_global_devices(f"checkpoint set aside {path.name}")
        self._manager.reload()

    def save(self, step: int, params: Any, opt_state: Any, rng: jax.Array, meta: CheckpointMeta | dict) -> None:
        """Commit checkpoint ``step`` (atomic; blocking unless ``async_save``, see the class). ``rng`` is
        a typed or raw uint32 key; ``meta`` a ``CheckpointMeta`` (or a JSON-able dict)."""
        state = {"params": params, "opt_state": opt_state}
        if self._host_arrays:
            state = jax.tree.map(np.asarray, state)
        meta = meta.to_dict() if isinstance(meta, CheckpointMeta) else meta
        meta = dict(meta, step=int(step), rng=[int(x) for x in np.asarray(_key_data(rng)).ravel()])
        self._manager.save(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        if not self.async_save:
            self._manager.wait_until_finished()

    def restore(self, step: int, params_like: Any, opt_state_like: Any) -> tuple[Any, Any, jax.Array, dict]:
        """Restore ``step`` into the structure, shapes, dtypes and shardings of the given trees.

        Returns:
          ``(params, opt_state, rng, meta)`` with ``rng`` a raw uint32[2] key.

        Raises:
          FileNotFoundError: no checkpoint ``step`` in the folder.
        """
        if step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint step {step} in {self.directory} (have {self.all_steps()})")
        like = {"params": params_like, "opt_state": opt_state_like}
        if self._host_arrays:  # NumPy targets (lazily allocated), placed on the given shardings below
            abstract = jax.tree.map(_host_like, like)
        else:
            abstract = jax.tree.map(_abstract, like)
        out = self._manager.restore(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()),
        )
        st, meta = out["state"], dict(out["meta"])
        if self._host_arrays:
            st = jax.tree.map(lambda v, x: jax.device_put(v, x.sharding) if isinstance(x, jax.Array) else v, st, like)
        return st["params"], st["opt_state"], jnp.asarray(meta["rng"], jnp.uint32), meta

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _key_data(key: jax.Array) -> jax.Array:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key


def _shapes(tree: Any) -> dict[str, str]:
    """``{"params.w": "float32[4]"}`` for every array leaf of ``tree`` (orbax's recorded metadata or
    ShapeDtypeStructs): the dotted names agree whether a node was saved as a dict, a list or a namedtuple."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not hasattr(leaf, "shape"):
            continue
        parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        out[".".join(parts)] = f"{np.dtype(leaf.dtype).name}[{','.join(map(str, leaf.shape))}]"
    return out


def _host_like(x):
    """A NumPy target of ``x``'s shape and dtype for orbax to restore into (``np.empty``: its pages
    are touched only when written)."""
    return np.empty(np.shape(x), x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)


def _abstract(x):
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
