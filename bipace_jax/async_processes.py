"""Asynchronous RL by process: one ``jax.distributed`` process samples, the other learns.

``config.async_rl.sampler_processes = 1`` in a run of 2 processes (``launch.train`` with
``--coordinator_address/--num_processes/--process_id``): process 0 is the learner (the `Trainer`:
metrics, log lines, validation, checkpoints, transcripts), process 1 the sampler (`SamplerProcess`).
`enter_role` gives each a `distributed.set_group` of its own, so the learner's host gathers, plan,
mesh and orbax checkpoints span the learner process only and the sampler never joins a collective.
The schedule is `async_rl`'s: the sampler plays iteration ``j`` once it holds version ``>= j - k``
(`async_rl.SamplerThread`), each row records its version, k = 0 is on-policy.

What crosses between the processes, all keyed in the ``jax.distributed`` key-value store:

- **start** (learner -> sampler, once): the learner's iteration, task cursor and rng key data after
  its restore, and its transfer server's address; the sampler starts there (a resumed run replays the
  iterations after the checkpoint, as one-process asynchronous RL does).
- **weights** (learner -> sampler, per version): JAX's transfer API (``jax.experimental.transfer``):
  the learner lays its parameters out in the sampler mesh's PartitionSpecs on its own devices (cast
  to the compute dtype, `async_rl.push`) and offers them with ``await_pull(version, ...)``; the
  sampler ``pull``s every version in order into its own shardings. Chosen over a resharding program
  over a global mesh because that program is a collective both processes must enter at the same
  point, which an asynchronous sampler in the middle of a rollout cannot; the pull is point to point
  and the learner never waits for it. Measured with 2 CPU processes of 1 device on one host (the
  tiny actor of ``tests/test_async_rl.py``'s runs, 3 iterations, load average 2-7 on 2 cores):
  ``async/weight_push_s`` (the learner's cast, copy and offer) 2.6-11 ms, ``async/weight_pull_s``
  (the sampler's pull) 1.5-10 ms; 4 MB pulled in ~5 ms.
- **rows** (sampler -> learner, per iteration): the iteration's ``RolloutResult`` pickled (its device
  arrays as host NumPy) into the store as bytes (``async/rows_bytes``, ``async/rows_send_s``,
  ``async/rows_receive_s``); the learner deletes the keys once read. In the same runs 56-73 KB per
  iteration, sent in 1.9-18 ms and received in 1.6-44 ms. Fine on CPU (64 MB took ~2 s); at pod
  scale the rows' arrays would go through the transfer server as the weights do.

Addresses: the transfer servers listen on ``BIPACE_TRANSFER_HOST`` when set, else on the
coordinator's host for process 0 (which hosts the coordinator, so every process reaches that name)
and on this host's resolved name (``socket.gethostname()``) for the others.

Supported: one learner and one sampler process (``AsyncConfig.check_processes``), the learner holding
at least as many devices as the sampler (its copy in the sampler's layout); tested on 1 + 1 CPU
devices, and by hand on 2 + 2 with ``mesh.sampler_tensor=2`` (tensor-sharded pulls: the same
iteration lines up to float32 noise in a ~1e-14 KL). Failures: a process that
fails posts it (``distributed.failures_shared``), which ends the other one too, naming it (a raising
rollout on the sampler stops the learner within a second). A process killed outright takes the other
down with JAX's own fatal line: at once for the learner (process 0 hosts the coordinator), after the
coordination service's missed heartbeats for the sampler (63 s measured); a restart of both resumes
from the learner's checkpoint.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pickle
import socket
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bipace_jax import async_rl, build, distributed, runfolder, sharding, validation
from bipace_jax import metric_keys as keys
from bipace_jax import plan as run_plan
from bipace_jax.config import ConfigError, fail
from bipace_jax.models import load_tokenizer
from bipace_jax.rollout import RolloutResult, collect
from bipace_jax.sampling import Engine

__all__ = [
    "LEARNER",
    "SAMPLER",
    "RowsReceiver",
    "SamplerProcess",
    "WeightSender",
    "enter_role",
    "pack_rows",
    "unpack_rows",
]

LEARNER, SAMPLER = "learner", "sampler"

_PREFIX = "bipace/async/"
START_KEY = _PREFIX + "start"
POLICY_KEY = _PREFIX + "policy/{}"  # version v offered for pull
ROWS_KEY = _PREFIX + "rows/{}"  # iteration j's rows (bytes)
READY_KEY = _PREFIX + "rows_ready/{}"  # ... complete, with the sampler's numbers (JSON)
DONE_KEY = _PREFIX + "done"  # the learner finished its run: the sampler may leave (a failure: failures_shared)


def enter_role(spec: Any) -> str | None:
    """This process's role under ``spec.async_rl.sampler_processes`` (`LEARNER`, `SAMPLER`, or None
    without process roles), its `distributed.set_group` set: the learners are the first processes,
    the samplers the last ``sampler_processes``. Idempotent.

    Raises:
      ConfigError: the roles do not fit the run's processes (``async_rl.sampler_processes``).
    """
    roles = spec.async_rl
    if not roles.by_process:
        return None
    n = jax.process_count()
    roles.check_processes(n)
    learners = range(n - roles.sampler_processes)
    me = jax.process_index()
    distributed.set_group(learners if me in learners else [me])
    return LEARNER if me in learners else SAMPLER


def _client() -> Any:
    client = distributed.kv_client()
    if client is None:
        raise RuntimeError("async_processes: no jax.distributed key-value store (start JAX with jax.distributed)")
    return client


def _get(key: str, *, stop: threading.Event | None = None, poll_ms: int = 1000) -> str | None:
    """The value of ``key`` once another process sets it, waiting as long as it takes (the other
    process's failure ends this one, `distributed.failures_shared`); None when ``stop`` is set first."""
    client = _client()
    while stop is None or not stop.is_set():
        try:
            return client.blocking_key_value_get(key, poll_ms)
        except jax.errors.JaxRuntimeError as e:  # a timeout: "DEADLINE_EXCEEDED: GetKeyValue() timed out ..."
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
    return None


def _host() -> str:
    """The host name the transfer server listens on (module docstring, "Addresses")."""
    if host := os.environ.get("BIPACE_TRANSFER_HOST"):
        return host
    from jax._src import distributed as jax_distributed  # the coordinator's address has no public API

    coordinator = getattr(jax_distributed.global_state, "coordinator_address", None) or ""
    if jax.process_index() == 0 and coordinator:
        return socket.gethostbyname(coordinator.rsplit(":", 1)[0].strip("[]"))
    return socket.gethostbyname(socket.gethostname())


def _transfer_server() -> Any:
    from jax.experimental import transfer

    host = _host()
    return transfer.start_transfer_server(jax.local_devices()[0].client, f"{host}:0", [f"{host}:0"])


def sampler_mesh(spec: Any, devices: list[Any], learner_tensor: int) -> Any:
    """The sampler's (data, 1, tensor) mesh over ``devices``: ``mesh.sampler_tensor`` (0: the
    learner's ``learner_tensor``) consecutive devices per tensor group.

    Raises:
      ConfigError: the tensor size does not divide the devices (``mesh.sampler_tensor``).
    """
    t = spec.mesh.sampler_tensor or learner_tensor
    if len(devices) % t:
        fail("mesh.sampler_tensor", f"divide the sampler process's {len(devices)} devices", t)
    return sharding.make_mesh(len(devices) // t, 1, t, devices=devices)


def _sampler_devices() -> list[Any]:
    mine = set(distributed.group())
    return [d for d in jax.devices() if int(getattr(d, "process_index", 0)) not in mine]


# ------------------------------------------------------------------------------------------------
# Rows: a RolloutResult as bytes.


def _from_host(a: np.ndarray) -> jax.Array:
    return jnp.asarray(a)


class _RowsPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, jax.Array):  # a device array travels as host NumPy
            return _from_host, (np.asarray(obj),)
        return NotImplemented


def pack_rows(res: RolloutResult) -> bytes:
    """``res`` pickled, its device arrays copied to the host (they come back as arrays on the
    receiving process's default device, `unpack_rows`)."""
    buf = io.BytesIO()
    _RowsPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(res)
    return buf.getvalue()


def unpack_rows(blob: bytes) -> RolloutResult:
    """The ``RolloutResult`` of `pack_rows`."""
    return pickle.loads(blob)


# ------------------------------------------------------------------------------------------------
# The learner's side.


class WeightSender:
    """The learner's end of the weight push (the trainer's ``policy`` under process roles).

    Args:
      spec: the run.
      mesh: the learner's mesh; the sampler's mesh has the learner's tensor size unless
        ``mesh.sampler_tensor`` says otherwise (`sampler_mesh`).
      params: the learner's parameters (an ``nnx.State``), for their logical axes.

    Attributes:
      shardings: the sampler's layout on the learner's first devices, for `async_rl.push`.

    Raises:
      ConfigError: the learner holds fewer devices than the sampler (``async_rl.sampler_processes``).
    """

    def __init__(self, spec: Any, mesh: Any, params: Any):
        remote = _sampler_devices()
        own = list(np.asarray(mesh.devices).flat)
        if len(own) < len(remote):
            fail(
                "async_rl.sampler_processes",
                f"leave the learner as many devices as the sampler process ({len(remote)}), not {len(own)}",
                spec.async_rl.sampler_processes,
            )
        tensor = sharding.mesh_axis_sizes(mesh)["tensor"]
        shape = sampler_mesh(spec, remote, tensor).devices.shape
        self.shardings = sharding.param_shardings(params, sampler_mesh(spec, own[: len(remote)], shape[2]))
        self.server = _transfer_server()

    def publish_start(self, iteration: int, task_cursor: int, rng: jax.Array) -> None:
        """Tell the sampler where the run starts (after a restore): iteration, task cursor, rng."""
        raw = jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng
        start = dict(
            iteration=int(iteration),
            task_cursor=int(task_cursor),
            rng=[int(x) for x in np.asarray(raw).ravel()],
            address=self.server.address(),
        )
        _client().key_value_set(START_KEY, json.dumps(start))

    def publish(self, params: Any, version: int) -> None:
        """Offer ``params`` (on `shardings`) to the sampler as ``version``; returns at once. The
        server keeps its own copy, so the learner may donate its arrays to the next update."""
        copy = jax.block_until_ready(jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), params))
        self.server.await_pull(int(version), copy)
        _client().key_value_set(POLICY_KEY.format(int(version)), "")

    def close(self) -> None:
        """The learner finished its run (`Trainer.run`'s end): the sampler process may leave. Not
        called on a failure, which ends the sampler process naming it (`distributed.failures_shared`)."""
        try:
            _client().key_value_set(DONE_KEY, "")
        except Exception:  # noqa: BLE001 (set already, or the store is gone at exit)
            pass


class RowsReceiver:
    """The learner's end of the rows (the trainer's ``sampler`` under process roles): `take`
    returns iteration ``j``'s ``RolloutResult`` once the sampler process has sent it.

    Attributes:
      transfer_stats: the last `take`'s ``async/*`` numbers (``metric_keys``): the sampler's pull of
        the version the iteration started with, its pickling and sending, the learner's receive.
    """

    def __init__(self):
        self.transfer_stats: dict[str, float] = {}

    def take(self, iteration: int) -> RolloutResult:
        client = _client()
        info = json.loads(_get(READY_KEY.format(iteration)))
        t0 = time.perf_counter()
        blob = client.blocking_key_value_get_bytes(ROWS_KEY.format(iteration), 60_000)
        res = unpack_rows(blob)
        for key in (ROWS_KEY, READY_KEY):
            client.key_value_delete(key.format(iteration))
        self.transfer_stats = {
            keys.ASYNC_PULL_SECONDS: float(info["pull_s"]),
            keys.ASYNC_ROWS_SEND_SECONDS: float(info["send_s"]),
            keys.ASYNC_ROWS_RECEIVE_SECONDS: time.perf_counter() - t0,
            keys.ASYNC_ROWS_BYTES: float(len(blob)),
        }
        return res

    def close(self) -> None:
        """Nothing to stop here: the sampler process leaves after the learner's `WeightSender.close`."""


# ------------------------------------------------------------------------------------------------
# The sampler's side.


class _WeightReceiver:
    """A thread pulling every version ``first .. last - 1`` in order into ``source``."""

    def __init__(self, address: str, like: Any, source: async_rl.PolicySource, first: int, last: int):
        self.like, self.source = like, source
        self.server = _transfer_server()
        self.conn = self.server.connect(address)
        self.pull_s: dict[int, float] = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(first, last), name="bipace-pull", daemon=True)
        self._thread.start()

    def _loop(self, first: int, last: int) -> None:
        try:
            for v in range(first, last):
                if _get(POLICY_KEY.format(v), stop=self._stop) is None:
                    return
                t0 = time.perf_counter()
                params = jax.block_until_ready(self.conn.pull(v, self.like))
                self.pull_s[v] = time.perf_counter() - t0
                self.source.publish(params, v)
        except BaseException as e:  # handed to the sampler's main loop
            self.error = e
            self.source.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


class SamplerProcess:
    """The sampler process of a run with process roles: waits for the learner's start, then plays
    iterations ``start .. num_iterations - 1`` (`async_rl.SamplerThread`: at most ``max_staleness``
    ahead, the policy switched at a turn or game boundary) and sends each to the learner. Its own
    actor is built once for the parameters' structure and shardings (a checkpoint is read once);
    every version it samples with is the learner's.

    Args:
      spec: the run (``build.RunSpec``); ``enter_role(spec)`` must be `SAMPLER`.
      workdir: the run folder, shared with the learner (its tokenizer when ``model.tokenizer`` and
        ``model.checkpoint`` are unset: the learner writes it before it starts the run).
      env_factory: as `Trainer`'s.

    Raises:
      ConfigError: a mesh that does not fit this process's devices (``mesh.sampler_tensor``), the
        tokenizer folder missing from ``workdir``.
    """

    def __init__(self, spec: Any, workdir: str, *, env_factory: Any = None):
        if enter_role(spec) != SAMPLER:
            raise ValueError(f"SamplerProcess: process {jax.process_index()} is not a sampler process")
        self.spec, self.workdir = spec, workdir
        self.start = json.loads(_get(START_KEY))  # the learner has restored, and written its tokenizer
        learner = [d for d in jax.devices() if int(getattr(d, "process_index", 0)) == 0]
        layout = run_plan.HostLayout.of(spec, 1, len(learner), len(learner))
        self.game = env_factory if env_factory is not None else spec.env.name
        panels = validation.select(spec, self.game)
        self.train_ids = panels.train_ids
        plan = run_plan.plan(spec, layout, panels.games)
        self.groups = plan.groups_per_host  # one learner process: every task group of the iteration
        self.mesh = sampler_mesh(spec, jax.local_devices(), layout.tensor)
        self.tokenizer = self._tokenizer()
        actor = build.build_actor(spec.model, self.tokenizer, self.mesh, seed=spec.seed)
        graphdef, params, rest = nnx.split(actor, nnx.Param, ...)
        dtype, eos = getattr(actor, "dtype", None), actor.config.eos_token_ids

        def like(x, s):  # the learner sends floating leaves in the compute dtype (async_rl.push)
            dt = dtype if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
            return jax.ShapeDtypeStruct(x.shape, dt, sharding=s)

        self.like = jax.tree.map(like, params, sharding.param_shardings(params, self.mesh))
        rest = jax.device_put(rest, NamedSharding(self.mesh, P()))
        del actor, params  # every version comes from the learner
        self.source = async_rl.PolicySource(graphdef, rest)
        self.pool, _ = validation.start_pools(spec, self.game, panels, 1, plan.games_per_host, validating=False)
        eos = build.stop_token_ids(eos, self.tokenizer, spec.model.checkpoint) or None
        self.engine = Engine(self.tokenizer, dataclasses.replace(spec.sampler, eos_token_ids=eos), mesh=self.mesh)

    def _tokenizer(self) -> Any:
        m = self.spec.model
        if m.tokenizer or m.checkpoint:
            return build.load_model_tokenizer(m)
        path = runfolder.path(self.workdir) / "tokenizer"
        if not (path / "tokenizer.json").exists():
            raise ConfigError(
                f"config.model.tokenizer must be set, got '' (the sampler process does not see the learner's "
                f"{path}: config.checkpoint.shared_workdir needs a folder every host sees)"
            )
        with runfolder.local_copy(path) as local:
            return load_tokenizer(local)

    def _play(self, j: int, key: jax.Array) -> RolloutResult:
        s, start = self.spec, self.start
        cursor, first = start["task_cursor"], start["iteration"]
        groups = async_rl.iteration_tasks(self.train_ids, s.seed, cursor, first, j, s.num_groups, self.groups)
        policy = async_rl.policy_reader(self.source, s.async_rl.switch)
        return collect(None, self.engine, self.pool, groups, s.rollout, key, policy=policy)

    def run(self) -> dict[str, Any]:
        """Play and send every iteration, then wait for the learner to close. Returns
        ``{"iterations": played and sent, "started": [(j, version), ...]}``.

        Raises:
          the rollout's or the weight pull's exception.
        """
        s, first = self.spec, self.start["iteration"]
        last, client = s.num_iterations, _client()
        rng = jnp.asarray(self.start["rng"], jnp.uint32)
        receiver = _WeightReceiver(self.start["address"], self.like, self.source, first, last)
        thread = async_rl.SamplerThread(self._play, self.source, first, last, rng, s.async_rl.max_staleness)
        sent = 0
        try:
            for j in range(first, last):
                try:
                    res = thread.take(j)
                except RuntimeError:
                    if receiver.error is not None:
                        raise receiver.error from None
                    raise
                version = dict(thread.started)[j]
                t0 = time.perf_counter()
                blob = pack_rows(res)
                client.key_value_set_bytes(ROWS_KEY.format(j), blob)
                info = dict(send_s=time.perf_counter() - t0, pull_s=receiver.pull_s.get(version, math.nan))
                client.key_value_set(READY_KEY.format(j), json.dumps(info))
                sent += 1
        finally:
            thread.close()
            receiver.close()
            self.pool.close()
        _get(DONE_KEY)
        return {"iterations": sent, "started": list(thread.started)}
