"""Rollout schedulers: lockstep vs continuous (slot) batching on a paced fake game, same games and keys.

    python -m launch.bench_rollout                  # CPU, about 7 minutes: writes benchmarks/rollout.json
    python -m launch.bench_rollout --mean_tokens=40 --new_tokens=128 --reps=3   # responses 4x shorter, ~2 min

The regime modelled is decode-dominated agentic RL at the paper's response lengths: short prompts
(about 54 tokens; a row's prefill costs a few decode steps), lognormal response lengths with a long
tail (mean ``--mean_tokens`` 150, cap ``--new_tokens`` 512, sigma 0.8, as the paper's configs),
games = slots = 16, 16 turns, and an env step taking ``--latency_steps`` (4) decode steps (the
issue's "at 16 slots, sigma 0.8, env latency ~4x a decode step").

* **Game** (``PacedPool``): every game lasts ``--turns`` turns. The response length L of (game, turn)
  is drawn up front from a seeded lognormal (mean ``--mean_tokens``, ``--sigma``, rounded, clipped to
  [1, ``--new_tokens``]); the observation ends with the length token ``<L{L}>``. A pool ``step`` sleeps
  the env latency (all games step in parallel); a ``submit``-ted step is answered by ``poll`` that long
  after its submit, while the continuous scheduler keeps decoding.
* **Actor** (``LengthScriptedActor``): the bench Qwen2 (random weights, ``--model``) runs its real
  prefill / decode step, then its logits are replaced by a one-hot "countdown": the prefill's token is
  (the prompt's last length token - 1) and each decode step's is (its input token - 1); ``<L0>`` is the
  only EOS id. A response is therefore ``<L{L-1}> ... <L0>``: exactly L tokens, stateless, the same in
  both schedulers, token for token (checked: ``tokens_match``).

Measured, in one run: the wall time of ``collect`` per scheduler (the fastest of ``--reps`` runs, the schedulers
interleaved, after a 2-turn warm-up run; every insert and prefill shape is compiled before timing), its decode steps (lockstep: the longest
response of each turn, summed; continuous: the chunk steps run), slot use, env / prefill / decode
time, and the unit costs a schedule model needs: one decode step at ``--slots`` rows for each scheduler,
one prefill (lockstep) / insert (continuous) call by rows, the env latency. ``speedup_wall`` and
``speedup_decode_steps`` are lockstep / continuous.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import numpy as np
from absl import app, flags
from flax import nnx

from environments.testing import InstantPool

FLAGS = flags.FLAGS
flags.DEFINE_integer("games", 16, "games (task groups of 8)")
flags.DEFINE_integer("slots", 16, "continuous scheduler slots")
flags.DEFINE_integer("turns", 16, "turns per game (paper: episodes of up to 50)")
flags.DEFINE_integer("new_tokens", 512, "sampler max_new_tokens (the response length cap)")
flags.DEFINE_float("mean_tokens", 150.0, "mean response length of the lognormal, tokens")
flags.DEFINE_float("sigma", 0.8, "lognormal sigma of the response length")
flags.DEFINE_integer("seed", 0, "seed of the drawn response lengths")
flags.DEFINE_integer("chunk", 16, "decode steps per continuous chunk")
flags.DEFINE_float("latency_steps", 4.0, "env step latency, in measured lockstep decode steps at --slots rows")
flags.DEFINE_float("latency_s", None, "env step latency in seconds (overrides --latency_steps)")
flags.DEFINE_enum("model", "small", ["tiny", "small"], "bench Qwen2: tiny (D 64, 2 layers) or small (D 256, 4 layers)")
flags.DEFINE_integer("reps", 2, "timed runs per scheduler, interleaved; wall_s is the fastest (least disturbed)")
flags.DEFINE_string("out", "benchmarks/rollout.json", "result file")

OTHER_ENTRIES = ("cpu_default",)  # written by launch.bench_rollout_default into the same file; kept

MODELS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2),
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4),
}
# A short prompt: the game's goal, the last two (observation, action) pairs, the current observation.
TEMPLATE = dict(
    first="Goal: {task}\nNow: {observation}\nAct.",
    later="Goal: {task}\n{history}\nNow: {observation}\nAct.",
    history_entry="[{index}: {observation} -> {action}]",
)


def length_tokens(n: int) -> list[str]:
    """The length tokens ``<L0>`` .. ``<L{n}>`` (single tokens of the bench tokenizer, in id order)."""
    return [f"<L{i}>" for i in range(n + 1)]


class LengthScriptedActor(nnx.Module):
    """A ``Qwen2Actor`` whose next token is scripted: real compute, logits replaced by a countdown.

    The actor contract of ``sampling.Engine`` (lockstep and slots) (``config``, ``init_cache``,
    ``prefill``, ``decode_step``). Token ids ``base`` .. ``base + top`` are the length tokens; ``base``
    is the EOS id. ``prefill`` answers (the last length token of each row's real prompt - 1) (``base``
    when the prompt has none), ``decode_step`` answers (its input token - 1), floored at ``base``. The
    replacement logits are +-30 one-hot plus 1e-3 tanh of the real logits, so the forward is not dead
    code and a temperature-1 draw picks the scripted token but for odds of about e^-60.
    """

    def __init__(self, inner, base: int, top: int):
        self.inner, self.base, self.top = inner, base, top

    @property
    def config(self):
        return self.inner.config

    def _script(self, logits, nxt):
        import jax
        import jax.numpy as jnp

        hot = jax.nn.one_hot(nxt, logits.shape[-1], dtype=bool)
        return jnp.where(hot, 30.0, -30.0) + 1e-3 * jnp.tanh(logits)

    def init_cache(self, batch_size: int, max_length: int):
        return self.inner.init_cache(batch_size, max_length)

    def prefill(self, input_ids, attention_mask, cache):
        import jax.numpy as jnp

        out, cache = self.inner.prefill(input_ids, attention_mask, cache)
        ids = jnp.asarray(input_ids, jnp.int32)
        is_len = (ids >= self.base) & (ids <= self.base + self.top) & (jnp.asarray(attention_mask) > 0)
        col = jnp.argmax(jnp.where(is_len, jnp.arange(ids.shape[1]), -1), axis=1)
        last = jnp.take_along_axis(ids, col[:, None], axis=1)[:, 0]
        nxt = jnp.where(jnp.any(is_len, axis=1), jnp.maximum(last - 1, self.base), self.base)
        return out.replace(logits=self._script(out.logits, nxt)), cache

    def decode_step(self, token_ids, cache):
        import jax.numpy as jnp

        logits, cache = self.inner.decode_step(token_ids, cache)
        nxt = jnp.clip(jnp.asarray(token_ids, jnp.int32) - 1, self.base, self.base + self.top)
        return self._script(logits, nxt), cache


class PacedPool(InstantPool):
    """``n`` fake games of ``turns`` turns with scripted response lengths ``lengths[env, turn]``.

    ``step`` sleeps ``latency_s`` (games step in parallel); a ``submit``-ted step is answered by
    ``poll`` ``latency_s`` after its submit. The observation of turn t ends with ``<L{lengths[env, t]}>``.
    """

    def __init__(self, lengths: np.ndarray, latency_s: float):
        super().__init__(*lengths.shape)
        self.lengths, self.latency_s = lengths, latency_s
        self._due: dict[int, tuple[float, int]] = {}  # ticket -> (when it is answered, env)

    def submit(self, jobs):
        now, tickets = time.monotonic(), []
        for job in jobs:
            self._due[self.ticket] = (now + self.latency_s, job.env)
            tickets.append(self.ticket)
            self.ticket += 1
        return tickets

    def poll(self, timeout=0.0):
        if not self._due:
            return []
        first = min(due for due, _ in self._due.values())
        wait = first - time.monotonic()
        if wait > 0:
            time.sleep(wait if timeout is None else min(wait, timeout))
        now, out = time.monotonic(), []
        for ticket in sorted(self._due):
            due, i = self._due[ticket]
            if due <= now:
                del self._due[ticket]
                out.append((ticket, self._advance(i)))
        return out

    @property
    def in_flight(self) -> int:
        return len(self._due)

    def _obs(self, i):
        from environments.base import Observation

        length = int(self.lengths[i, min(self.t[i], self.turns - 1)])
        return Observation(text=f"turn {self.t[i]} <L{length}>", anchor=f"turn {self.t[i]}", task=f"craft item {i % 7}")

    def step(self, envs, actions):
        time.sleep(self.latency_s)
        return super().step(envs, actions)


def draw_lengths(n: int, turns: int, mean: float, sigma: float, cap: int, seed: int) -> np.ndarray:
    """int64[n, turns] response lengths: lognormal with mean ``mean`` (mu = ln mean - sigma^2 / 2), rounded,
    clipped to [1, cap]."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, size=(n, turns))
    return np.clip(np.rint(raw), 1, cap).astype(np.int64)


def _median_time(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def unit_costs(actor, sampler, slot_sampler, prompt_of, n_slots: int, row_buckets) -> dict:
    """Measured unit costs: decode step s at ``n_slots`` rows (lockstep ``generate``'s decode loop;
    continuous full-slot ``SlotHandle.decode`` chunks), prefill / insert s per call by rows, all compiled first."""
    import jax

    m = sampler.config.max_new_tokens
    full = [prompt_of(m) for _ in range(n_slots)]  # every row runs the whole budget
    key = jax.random.key(0)

    def lock_decode():
        return sampler.generate(actor, full, key).timing.decode_s

    lock_decode()
    lock_step = statistics.median(lock_decode() for _ in range(3)) / (m - 1)
    prefill = {}
    for n in row_buckets:
        rows = [prompt_of(1) for _ in range(n)]  # first token is EOS: prefill only
        sampler.generate(actor, rows, key)
        prefill[n] = statistics.median(sampler.generate(actor, rows, key).timing.prefill_s for _ in range(3))
    keys = np.zeros((n_slots, 2), np.uint32)
    inserts = {}
    for n in row_buckets:
        slots = slot_sampler.empty()
        rows = [prompt_of(m)] * n
        slots = slot_sampler.insert(slots, rows, list(range(n)), keys[:n])  # compile
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            slots = slot_sampler.insert(slots, rows, list(range(n)), keys[:n])
            slots.done.block_until_ready()
            times.append(time.perf_counter() - t0)
        inserts[n] = statistics.median(times)
    slots = slot_sampler.empty()
    slots = slot_sampler.insert(slots, full, list(range(n_slots)), keys)
    slots, _ = slot_sampler.decode(slots)  # compile
    t0, steps = time.perf_counter(), 0
    while steps < m - 2 * slot_sampler.chunk:
        slots, k = slot_sampler.decode(slots)
        steps += k
    cont_step = (time.perf_counter() - t0) / max(steps, 1)
    return dict(
        decode_step_s=dict(lockstep=lock_step, continuous=cont_step),
        prefill_s_by_rows={str(n): v for n, v in prefill.items()},
        insert_s_by_rows={str(n): v for n, v in inserts.items()},
    )


def warm_programs(actor, sampler, slot_sampler, prompt_of, row_buckets, length_buckets) -> None:
    """Compiles every shape the run can meet outside the timing: each insert (rows bucket x prompt
    bucket) and the lockstep prefill / decode of all games at each prompt bucket."""
    import jax

    for t in length_buckets:
        sampler.generate(actor, [prompt_of(2, pad=t)] * slot_sampler.num_slots, jax.random.key(0))
    slots = slot_sampler.empty()
    keys = np.zeros((max(row_buckets), 2), np.uint32)
    for t in length_buckets:
        for n in row_buckets:
            rows = [prompt_of(1, pad=t) for _ in range(n)]
            slots = slot_sampler.insert(slots, rows, list(range(n)), keys[:n])
    slots.done.block_until_ready()


def main(_):
    import jax

    from bipace_jax.models import Qwen2Actor
    from bipace_jax.rollout import RolloutConfig, Scheduler, collect, encode_prompt
    from bipace_jax.sampling import Engine, SamplerConfig
    from bipace_jax.tiny import tiny_actor_config, train_tokenizer
    from environments.base import Observation

    m = FLAGS.new_tokens
    corpus = [f"Goal: craft item {k}\nNow: turn {k}\nAct. [{k}: turn {k} -> inventory]" for k in range(50)]
    tok = train_tokenizer(corpus * 4, vocab_size=400, phrase_tokens=length_tokens(m))
    base = tok.convert_tokens_to_ids("<L0>")
    assert tok.convert_tokens_to_ids(f"<L{m}>") == base + m, "length tokens must have consecutive ids"
    inner = Qwen2Actor(tiny_actor_config(len(tok), eos_token_id=None, **MODELS[FLAGS.model]), rngs=nnx.Rngs(0))
    actor = LengthScriptedActor(inner, base, m)
    length_buckets, max_prompt = (64, 128), 128
    scfg = SamplerConfig(
        max_new_tokens=m,
        length_buckets=length_buckets,
        batch_buckets=(1, 2, 4, 8, 16, 32, 64),
        eos_token_ids=(base,),
    )
    engine = Engine(tok, scfg)
    groups = [(k, k) for k in range(max(1, FLAGS.games // 8))]
    n_games = len(groups) * 8
    rcfg = RolloutConfig(
        game="textcraft",
        group_size=8,
        max_steps=FLAGS.turns,
        max_prompt_length=max_prompt,
        num_slots=FLAGS.slots,
        chunk_steps=FLAGS.chunk,
        template=TEMPLATE,
    )
    hist = [("turn 0 <L99>", "inventory"), ("turn 1 <L99>", "inventory")]

    def prompt_of(length: int, pad: int | None = None) -> list[int]:
        """A game-like prompt asking for ``length`` tokens (``pad``: grown to exactly ``pad`` tokens)."""
        obs = Observation(text=f"turn 2 <L{length}>", anchor="turn 2", task="craft item 3")
        ids, _ = encode_prompt(tok, rcfg, obs, hist, 2)
        if pad is not None:
            ids = [ids[0]] * (pad - len(ids)) + ids
        return ids

    row_buckets = [b for b in scfg.batch_buckets if b <= FLAGS.slots]
    slot_sampler = engine.slots(actor, FLAGS.slots, max_prompt=max_prompt, chunk=FLAGS.chunk)
    warm_programs(actor, engine, slot_sampler, prompt_of, row_buckets, [b for b in length_buckets if b <= max_prompt])
    units = unit_costs(actor, engine, slot_sampler, prompt_of, FLAGS.slots, row_buckets)
    lock_step = units["decode_step_s"]["lockstep"]
    latency = FLAGS.latency_s if FLAGS.latency_s is not None else FLAGS.latency_steps * lock_step
    lengths = draw_lengths(n_games, FLAGS.turns, FLAGS.mean_tokens, FLAGS.sigma, m, FLAGS.seed)
    pool = PacedPool(lengths, latency)
    key = jax.random.key(0)
    report, results, walls = {}, {}, {"lockstep": [], "continuous": []}
    warm = dataclasses.replace(rcfg, max_steps=2)  # compiles what warm_programs did not (the chunk loop)
    for sched in walls:
        collect(actor, engine, pool, groups, dataclasses.replace(warm, scheduler=Scheduler(sched)), key)
    for _ in range(FLAGS.reps):  # interleaved, so both see the same load of the shared machine
        for sched in walls:
            t0 = time.perf_counter()
            res = collect(actor, engine, pool, groups, dataclasses.replace(rcfg, scheduler=Scheduler(sched)), key)
            walls[sched].append(time.perf_counter() - t0)
            if walls[sched][-1] == min(walls[sched]):  # the timing fields come from the run wall_s is
                results[sched] = res
    for sched, res in results.items():
        got = res.response_mask.sum(1)
        if sched == "lockstep":
            steps = np.asarray(res.steps.step)[: res.num_rows]
            per_turn = [(got[steps == t].max() - 1, (steps == t).sum()) for t in np.unique(steps)]
            decode_steps = int(sum(s for s, _ in per_turn))
            use = float((got - 1).sum() / max(sum(s * n for s, n in per_turn), 1))
        else:
            decode_steps, use = int(res.timing["decode_steps"]), float(res.stats.values()["slot_use"])
        report[sched] = dict(
            wall_s=min(walls[sched]),
            wall_s_median=statistics.median(walls[sched]),
            wall_s_runs=walls[sched],
            decode_steps=decode_steps,
            slot_use=use,
            env_s=res.timing["env_s"],
            prefill_s=res.timing["prefill_s"],
            decode_s=res.timing["decode_s"],
            host_s=res.timing["host_s"],
            calls=dict(prefill=len(per_turn), decode=len(per_turn), rows_per_prefill=float(len(got) / len(per_turn)))
            if sched == "lockstep"
            else dict(
                insert=int(res.timing["inserts"]),
                decode_chunk=int(res.timing["chunks"]),
                rows_per_insert=float(len(got) / res.timing["inserts"]),
                steps_per_chunk=float(decode_steps / res.timing["chunks"]),
            ),
        )
    lock, cont = results["lockstep"], results["continuous"]
    got = lock.response_mask.sum(1)
    report.update(
        regime=(
            f"decode-dominated agentic RL: lognormal responses (mean {FLAGS.mean_tokens:g}, cap {m}, sigma "
            f"{FLAGS.sigma:g}; paper 150 / 512 / 0.8), short prompts, games = slots, env step "
            f"{FLAGS.latency_steps:g} decode steps"
        ),
        setup=dict(
            model=FLAGS.model,
            games=n_games,
            slots=FLAGS.slots,
            turns=FLAGS.turns,
            new_tokens=m,
            mean_tokens=FLAGS.mean_tokens,
            sigma=FLAGS.sigma,
            seed=FLAGS.seed,
            chunk=FLAGS.chunk,
            prompt_tokens_mean=float(np.asarray(lock.prompt_mask).sum(1).mean()),
            length_buckets=list(length_buckets),
            backend=jax.default_backend(),
            load_avg=os.getloadavg(),
        ),
        unit_costs=dict(**units, env_latency_s=latency),
        response_len=dict(
            mean=float(got.mean()),
            std=float(got.std()),
            p50=float(np.percentile(got, 50)),
            p90=float(np.percentile(got, 90)),
            max=int(got.max()),
            scripted_match=bool(np.array_equal(np.sort(got), np.sort(lengths.ravel()))),
        ),
        tokens_match=bool(
            np.array_equal(lock.response_ids, cont.response_ids) and np.array_equal(lock.prompt_ids, cont.prompt_ids)
        ),
        rows_differ=_rows_differ(lock, cont),
        speedup_wall=report["lockstep"]["wall_s"] / report["continuous"]["wall_s"],
        speedup_wall_median=report["lockstep"]["wall_s_median"] / report["continuous"]["wall_s_median"],
        speedup_decode_steps=report["lockstep"]["decode_steps"] / max(report["continuous"]["decode_steps"], 1),
    )
    report["predicted"] = predicted(report, lengths, units, latency)
    report["speedup_wall_predicted"] = report["predicted"]["speedup_wall"]
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    kept = {}
    if os.path.exists(FLAGS.out):  # other benchmarks' entries (launch.bench_rollout_default's cpu_default)
        with open(FLAGS.out) as fh:
            kept = {k: v for k, v in json.load(fh).items() if k in OTHER_ENTRIES}
    with open(FLAGS.out, "w") as fh:
        json.dump({**report, **kept}, fh, indent=2)
    print(f"{'':12s} {'wall s':>8s} {'steps':>6s} {'slot use':>8s} {'env s':>7s} {'prefill s':>9s} {'decode s':>8s}")
    for sched in ("lockstep", "continuous"):
        r = report[sched]
        print(
            f"{sched:12s} {r['wall_s']:8.3f} {r['decode_steps']:6d} {r['slot_use']:8.2f} {r['env_s']:7.3f} "
            f"{r['prefill_s']:9.3f} {r['decode_s']:8.3f}"
        )
    u = units["decode_step_s"]
    print(
        f"decode step at {FLAGS.slots} rows: lockstep {u['lockstep'] * 1e3:.2f} ms, continuous "
        f"{u['continuous'] * 1e3:.2f} ms; env latency {latency * 1e3:.2f} ms"
    )
    print("prefill s by rows:", {k: round(v, 4) for k, v in units["prefill_s_by_rows"].items()})
    print("insert s by rows: ", {k: round(v, 4) for k, v in units["insert_s_by_rows"].items()})
    print(f"response length: {report['response_len']}")
    print(
        f"tokens_match {report['tokens_match']}  speedup_wall {report['speedup_wall']:.2f}  "
        f"speedup_decode_steps {report['speedup_decode_steps']:.2f}  load {os.getloadavg()}"
    )
    pr = report["predicted"]
    print(
        f"schedule_sim at these unit costs and lengths: lockstep {pr['lockstep']['wall_s']:.3f} s "
        f"({pr['lockstep']['decode_steps']} steps), continuous {pr['continuous']['wall_s']:.3f} s "
        f"({pr['continuous']['decode_steps']} steps), speedup_wall {pr['speedup_wall']:.2f} (measured "
        f"{report['speedup_wall']:.2f})"
    )


def _rows_differ(a, b) -> dict:
    """Rows whose prompt or response tokens differ between two RolloutResults (None: shapes differ)."""
    if a.prompt_ids.shape != b.prompt_ids.shape or a.response_ids.shape != b.response_ids.shape:
        return dict(
            shapes=[
                list(a.prompt_ids.shape),
                list(b.prompt_ids.shape),
                list(a.response_ids.shape),
                list(b.response_ids.shape),
            ]
        )
    prompt = np.any(a.prompt_ids != b.prompt_ids, axis=1)
    response = np.any(a.response_ids != b.response_ids, axis=1)
    return dict(
        prompt=int(prompt.sum()),
        response=int(response.sum()),
        first=int(np.argmax(prompt | response)) if (prompt | response).any() else None,
    )


def predicted(report: dict, lengths: np.ndarray, units: dict, latency: float) -> dict:
    """``schedule_sim``'s lockstep and continuous wall time for this run: its response lengths, the measured
    unit costs (decode step per scheduler, prefill / insert per call by padded rows, env latency) and the
    measured host time per lockstep turn / continuous chunk."""
    from bipace_jax import schedule_sim
    from bipace_jax.buckets import Buckets

    def by_rows(table):
        rows = Buckets(tuple(sorted(int(k) for k in table)), "measured rows")

        def cost(n: int, _tokens: int) -> float:  # the call pads n rows up to the next measured bucket
            return float(table[str(rows.fit(n))])

        return cost

    lock, cont = report["lockstep"], report["continuous"]
    cfg = schedule_sim.SimConfig(
        games=int(lengths.shape[0]),
        slots=FLAGS.slots,
        turns=int(lengths.shape[1]),
        max_new_tokens=FLAGS.new_tokens,
        response_lengths=lengths.tolist(),
        env_step_s=float(latency),
        decode_step_s=float(units["decode_step_s"]["lockstep"]),
        slot_step_s=float(units["decode_step_s"]["continuous"]),
        prefill_s=by_rows(units["prefill_s_by_rows"]),
        insert_s=by_rows(units["insert_s_by_rows"]),
        chunk_steps=FLAGS.chunk,
        host_turn_s=lock["host_s"] / max(lock["calls"]["prefill"], 1),
        host_chunk_s=cont["host_s"] / max(cont["calls"]["decode_chunk"], 1),
    )
    out = schedule_sim.simulate(cfg)
    res = {k: dict(wall_s=out[k]["wall_s"], decode_steps=out[k]["decode_steps"]) for k in ("lockstep", "continuous")}
    res["speedup_wall"] = res["lockstep"]["wall_s"] / res["continuous"]["wall_s"]
    res["measured_over_predicted"] = {k: report[k]["wall_s"] / res[k]["wall_s"] for k in ("lockstep", "continuous")}
    return res


if __name__ == "__main__":
    app.run(main)
