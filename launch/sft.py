r"""Warm start by behaviour cloning and DAgger on TextCraft's oracle (issue 7).

    python -m launch.sft --config=configs/sft_textcraft_tiny.py --workdir=runs/sft \
        --out=bipace_jax/data/textcraft_tiny

What it does, in the exact prompt/response format of the RL loop (`bipace_jax.rollout`):
  1. builds the tokenizer (`launch.build_tokenizer`: byte-level BPE + whole item-name tokens +
     chat template) unless `config.tokenizer_path` names an existing one;
  2. plays the oracle (`env.oracle_action()`) on the training goals and records one example per
     step: prompt = the chat template applied to `build_prompt(...)`, response =
     `<action>{oracle action}</action><|im_end|>`; the loss is on the response tokens only;
  3. trains a fresh tiny Qwen2 actor on it (optax AdamW, global-norm clipping);
  4. DAgger rounds: plays the current policy on fresh seeds, labels every state it visits with
     the oracle's action from that state (the oracle re-plans after mistakes), adds those examples
     and trains on the union;
  5. validates on the fixed, seeded validation panel (`configs.textcraft_tasks`), by depth and with
     held-out goals reported separately, and writes the Hugging Face folder `--out` (weights,
     config.json, tokenizer, chat template) that `load_hf_checkpoint` loads.

The workdir holds orbax checkpoints of the training state after every round (resumed
automatically), `metrics.jsonl` (one JSON line per logged step / round), TensorBoard event files
and `report.json` (the final validation numbers and wall time).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any, Callable, Sequence

import numpy as np

from bipace_jax.rollout import chat_prompt_ids

# -------------------------------------------------------------------------------------------------
# Examples: the RL loop's prompt/response format.


@dataclasses.dataclass
class Example:
    """One behaviour-cloning example: token ids of the chat-formatted prompt and the response.

    `response_ids` are the target tokens: `<action>...</action>` followed by `<|im_end|>`.
    `weight` is 1 for every example (kept for future weighting of DAgger data).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    depth: int = 0
    source: str = "expert"


def response_text(action: str, think: str | None = None) -> str:
    """The assistant turn the policy must produce for `action` (no think for the tiny default)."""
    if think is not None:
        return f"<think>{think}</think><action>{action}</action>"
    return f"<action>{action}</action>"


def encode_prompt(tokenizer, prompt_text: str, system_prompt: str | None = None) -> list[int]:
    """Token ids of the chat-formatted prompt, ending with the opened assistant turn.

    Exactly what `bipace_jax.rollout` feeds the sampler (`rollout.chat_prompt_ids`).
    """
    return chat_prompt_ids(tokenizer, prompt_text, system_prompt)


def encode_response(tokenizer, action: str) -> list[int]:
    """Token ids of `response_text(action)` followed by the end-of-turn token `<|im_end|>`."""
    ids = tokenizer(response_text(action), add_special_tokens=False)["input_ids"]
    return list(ids) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


class PromptBuilder:
    """Builds the user message of a step exactly as the rollout does (history, step, inventory)."""

    def __init__(self, game: str, history_length: int, show_inventory: bool, template=None):
        self.game = game
        self.history_length = history_length
        self.show_inventory = show_inventory
        self.template = template

    def __call__(self, obs, history, step) -> str:
        from environments.prompts import build_prompt

        return build_prompt(self.game, obs, history, step, history_length=self.history_length,
                            template=self.template, show_inventory=self.show_inventory)


# -------------------------------------------------------------------------------------------------
# Episodes: the oracle, and the current policy with oracle labels (DAgger).


def oracle_episodes(make_env: Callable[[], Any], pairs: Sequence[tuple[int, int]],
                    prompt: PromptBuilder, tokenizer, system_prompt=None):
    """Plays the oracle on each (task_id, seed); returns (examples, stats).

    Raises:
      RuntimeError: if the oracle returns None before the episode ends (it must always have a plan).
    """
    env = make_env()
    examples, wins, lengths = [], 0, []
    for task_id, seed in pairs:
        obs = env.reset(task_id, seed)
        depth = int(env.task_info(task_id).get("depth", 0))
        history, done, step = [], False, 0
        while not done:
            action = env.oracle_action()
            if action is None:
                raise RuntimeError(f"oracle has no action for task {task_id} seed {seed} at step {step}")
            text = prompt(obs, history, step)
            examples.append(Example(encode_prompt(tokenizer, text, system_prompt),
                                    encode_response(tokenizer, action), depth, "expert"))
            history.append((obs.text, action))
            obs, _, done, _ = env.step(action)
            step += 1
        wins += int(obs.won)
        lengths.append(step)
    return examples, {"oracle_win_rate": wins / max(len(pairs), 1),
                      "oracle_mean_length": float(np.mean(lengths)) if lengths else 0.0}


def play_policy(generate: Callable[[list[list[int]]], list[str]], make_env: Callable[[], Any],
                pairs: Sequence[tuple[int, int]], prompt: PromptBuilder, tokenizer,
                max_steps: int, *, label: bool, fallback_action: str = "inventory",
                system_prompt=None):
    """Plays the policy on all (task_id, seed) pairs at once (one batched generation per turn).

    Args:
      generate: maps a list of prompt token-id lists to the decoded responses (str).
      label: when True, every visited state is labelled with the oracle's action from that state
        (DAgger) and returned as an `Example`.

    Returns:
      (episodes, examples): episodes are dicts {task_id, seed, depth, won, length, invalid}.
    """
    from environments.prompts import parse_action

    envs = [make_env() for _ in pairs]
    obs = [e.reset(t, s) for e, (t, s) in zip(envs, pairs)]
    depth = [int(e.task_info(t).get("depth", 0)) for e, (t, _) in zip(envs, pairs)]
    history = [[] for _ in pairs]
    live = list(range(len(pairs)))
    won = [False] * len(pairs)
    length = [0] * len(pairs)
    invalid = [0] * len(pairs)
    examples = []
    while live:
        texts = [prompt(obs[i], history[i], length[i]) for i in live]
        ids = [encode_prompt(tokenizer, t, system_prompt) for t in texts]
        if label:
            for i, p in zip(live, ids):
                a = envs[i].oracle_action()
                if a is not None:
                    examples.append(Example(p, encode_response(tokenizer, a), depth[i], "dagger"))
        responses = generate(ids)
        still = []
        for i, r in zip(live, responses):
            action, valid = parse_action(r)
            if not valid:
                invalid[i] += 1
                action = fallback_action
            history[i].append((obs[i].text, action))
            obs[i], _, done, _ = envs[i].step(action)
            length[i] += 1
            if done or length[i] >= max_steps:
                won[i] = bool(obs[i].won)
            else:
                still.append(i)
        live = still
    episodes = [dict(task_id=t, seed=s, depth=depth[i], won=won[i], length=length[i],
                     invalid=invalid[i]) for i, (t, s) in enumerate(pairs)]
    return episodes, examples


def summarize(episodes, heldout: set[int] = frozenset()) -> dict[str, float]:
    """Success rates: overall, by depth, seen vs held-out goals; mean length and invalid rate."""
    out: dict[str, float] = {}

    def rate(eps):
        return float(np.mean([e["won"] for e in eps])) if eps else float("nan")

    out["success"] = rate(episodes)
    out["n"] = len(episodes)
    for d in sorted({e["depth"] for e in episodes}):
        out[f"success_depth{d}"] = rate([e for e in episodes if e["depth"] == d])
    seen = [e for e in episodes if e["task_id"] not in heldout]
    held = [e for e in episodes if e["task_id"] in heldout]
    out["success_seen"] = rate(seen)
    if held:
        out["success_heldout"] = rate(held)
        for d in sorted({e["depth"] for e in held}):
            out[f"success_heldout_depth{d}"] = rate([e for e in held if e["depth"] == d])
    out["mean_length"] = float(np.mean([e["length"] for e in episodes])) if episodes else 0.0
    steps = sum(e["length"] for e in episodes)
    out["invalid_rate"] = sum(e["invalid"] for e in episodes) / max(steps, 1)
    return out


# -------------------------------------------------------------------------------------------------
# Batching: fixed batch size and length buckets so the train step compiles a few times only.


def bucket_length(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n. Raises ValueError naming the longest bucket when n exceeds it."""
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"sequence of {n} tokens exceeds the longest length bucket {buckets[-1]}; "
                     f"raise config.length_buckets")


def make_batch(examples: Sequence[Example], length: int, pad_id: int, response_length: int):
    """Right-padded arrays for a training batch.

    Args:
      length: T, the padded sequence length (prompt + response of every example must fit).
      response_length: R, response tokens kept per example (longer responses raise ValueError).

    Returns:
      input_ids int32[B,T], attention_mask int32[B,T], positions int32[B,R] (the columns whose
      next-token prediction is a response token), targets int32[B,R] (those response tokens),
      target_mask float32[B,R] (1 for real response tokens).
    """
    b = len(examples)
    ids = np.full((b, length), pad_id, np.int32)
    mask = np.zeros((b, length), np.int32)
    pos = np.zeros((b, response_length), np.int32)
    tgt = np.full((b, response_length), pad_id, np.int32)
    tmask = np.zeros((b, response_length), np.float32)
    for r, ex in enumerate(examples):
        seq = ex.prompt_ids + ex.response_ids
        n, p, m = len(seq), len(ex.prompt_ids), len(ex.response_ids)
        if n > length:
            raise ValueError(f"example of {n} tokens does not fit the length bucket {length}")
        if m > response_length:
            raise ValueError(f"response of {m} tokens exceeds config.data.response_length={response_length}")
        ids[r, :n] = seq
        mask[r, :n] = 1
        pos[r, :m] = np.arange(p - 1, n - 1)  # column t predicts token t+1
        tgt[r, :m] = ex.response_ids
        tmask[r, :m] = 1.0
    return ids, mask, pos, tgt, tmask


def batches(examples: Sequence[Example], batch_size: int, buckets: Sequence[int],
            rng: np.random.Generator):
    """One epoch of batches: examples shuffled, grouped by length bucket, each batch padded to its
    bucket; a short last batch of a bucket is filled with random repeats of that bucket's examples."""
    by_bucket: dict[int, list[int]] = {}
    for i, ex in enumerate(examples):
        by_bucket.setdefault(bucket_length(len(ex.prompt_ids) + len(ex.response_ids), buckets),
                             []).append(i)
    chunks = []
    for length, idx in by_bucket.items():
        idx = list(rng.permutation(idx))
        if len(idx) % batch_size:
            idx += list(rng.choice(idx, batch_size - len(idx) % batch_size))
        for s in range(0, len(idx), batch_size):
            chunks.append((length, idx[s:s + batch_size]))
    for k in rng.permutation(len(chunks)):
        length, idx = chunks[k]
        yield length, [examples[i] for i in idx]


# -------------------------------------------------------------------------------------------------
# The model side: a pure train step and a batched KV-cache generator, both jitted over nnx state.


def token_nll(logits, targets, loss_mask):
    """Token-mean negative log-likelihood of `targets` under `logits` on `loss_mask`.

    Args:
      logits float32[B,R,V]; targets int32[B,R] (the token each logit row predicts);
      loss_mask float32[B,R] (1 on real response tokens).

    Returns:
      (loss float32[], accuracy float32[]): mean NLL (nats per response token) and the argmax
      accuracy over the same tokens.
    """
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    denom = jnp.maximum(loss_mask.sum(), 1.0)
    acc = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return (nll * loss_mask).sum() / denom, (acc * loss_mask).sum() / denom


class Learner:
    """A Qwen2 actor with an optax optimizer; `step` runs one jitted update on a batch.

    The actor is split once into (graphdef, params, rest); the train step is a pure function of
    (params, opt_state, batch), jitted with donated buffers and compiled once per length bucket.
    """

    def __init__(self, actor, tx):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        self.graphdef, self.params, self.rest = nnx.split(actor, nnx.Param, ...)
        self.tx = tx
        self.opt_state = tx.init(self.params)
        graphdef = self.graphdef

        def loss_fn(params, rest, ids, mask, pos, tgt, tmask):
            model = nnx.merge(graphdef, params, rest)
            # The LM head only at the R response columns (the full [B,T,V] logits are never used,
            # so XLA drops them): the loss is on response tokens only.
            h, _ = model.forward_hidden(ids, mask)
            h = jnp.take_along_axis(h, pos[..., None], axis=1)
            return token_nll(model.lm_logits(h), tgt, tmask)

        def step(params, opt_state, rest, ids, mask, pos, tgt, tmask):
            (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, rest, ids, mask, pos, tgt, tmask)
            updates, opt_state = tx.update(grads, opt_state, params)
            import optax

            params = optax.apply_updates(params, updates)
            return params, opt_state, {"loss": loss, "token_accuracy": acc,
                                       "grad_norm": optax.tree.norm(grads)}

        self._step = jax.jit(step, donate_argnums=(0, 1))

    def step(self, ids, mask, pos, tgt, tmask) -> dict[str, float]:
        """One update on a batch from `make_batch`; returns {loss, token_accuracy, grad_norm}."""
        self.params, self.opt_state, m = self._step(self.params, self.opt_state, self.rest,
                                                    ids, mask, pos, tgt, tmask)
        return m

    def actor(self):
        """The current actor (an nnx module sharing nothing mutable with the learner)."""
        from flax import nnx

        return nnx.merge(self.graphdef, self.params, self.rest)


class Generator:
    """Batched generation with the actor's KV cache: prefill the left-padded prompts, then decode.

    Rows are padded to a batch bucket and prompts (left-padded) to a length bucket, so a few
    shapes compile; decoding stops a row at `</action>` or `<|im_end|>`. `temperature == 0` is
    greedy. Returns decoded response strings.
    """

    def __init__(self, tokenizer, graphdef, *, max_new_tokens: int, batch_buckets: Sequence[int],
                 length_buckets: Sequence[int], temperature: float = 0.0):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        self.tokenizer = tokenizer
        self.max_new = max_new_tokens
        self.batch_buckets = tuple(batch_buckets)
        self.length_buckets = tuple(length_buckets)
        self.temperature = float(temperature)
        self.pad_id = tokenizer.pad_token_id
        stops = [tokenizer.convert_tokens_to_ids(t) for t in ("</action>", "<|im_end|>")]
        stops = jnp.asarray(stops, jnp.int32)
        max_new = self.max_new

        def gen(params, rest, ids, mask, key, temperature):
            model = nnx.merge(graphdef, params, rest)
            b, p = ids.shape
            cache = model.init_cache(b, p + max_new)
            out, cache = model.prefill(ids, mask, cache)

            def pick(logits, k):
                greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
                t = jnp.maximum(temperature, 1e-6)
                sampled = jax.random.categorical(k, logits / t, axis=-1).astype(jnp.int32)
                return jnp.where(temperature > 0, sampled, greedy)

            def body(carry, k):
                logits, cache, done = carry
                tok = pick(logits, k)
                tok = jnp.where(done, self.pad_id, tok)
                done = done | jnp.isin(tok, stops)
                logits, cache = model.decode_step(tok, cache)
                return (logits, cache, done), tok

            keys = jax.random.split(key, max_new)
            _, toks = jax.lax.scan(body, (out.logits, cache, jnp.zeros((b,), bool)), keys)
            return toks.T

        self._gen = jax.jit(gen)

    def __call__(self, state, prompts: list[list[int]], key, temperature: float | None = None) -> list[str]:
        """Responses to `prompts` (token-id lists) from the actor `state = (params, rest)`.

        `temperature` overrides the generator's default for this call (0 = greedy); it is a
        traced argument, so changing it never recompiles.
        """
        import jax
        import jax.numpy as jnp

        params, rest = state
        temperature = self.temperature if temperature is None else float(temperature)
        out: list[str] = []
        maxb = self.batch_buckets[-1]
        for s in range(0, len(prompts), maxb):
            chunk = prompts[s:s + maxb]
            b = bucket_length(len(chunk), self.batch_buckets)
            p = bucket_length(max(len(x) for x in chunk), self.length_buckets)
            ids = np.full((b, p), self.pad_id, np.int32)
            mask = np.zeros((b, p), np.int32)
            for r, x in enumerate(chunk):
                ids[r, p - len(x):] = x
                mask[r, p - len(x):] = 1
            for r in range(len(chunk), b):  # filler rows: a copy of row 0, ignored
                ids[r], mask[r] = ids[0], mask[0]
            key, sub = jax.random.split(key)
            toks = np.asarray(self._gen(params, rest, jnp.asarray(ids), jnp.asarray(mask), sub,
                                        jnp.float32(temperature)))
            for r in range(len(chunk)):
                row = [int(t) for t in toks[r] if t != self.pad_id]
                out.append(self.tokenizer.decode(row, skip_special_tokens=True))
        return out


# -------------------------------------------------------------------------------------------------
# The run: tokenizer -> expert data -> BC -> DAgger rounds -> validation -> HF folder.




def _save_examples(path: str, examples: Sequence[Example]) -> None:
    rows = [{"p": e.prompt_ids, "r": e.response_ids, "d": e.depth, "s": e.source} for e in examples]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f)
    os.replace(tmp, path)


def _load_examples(path: str) -> list[Example]:
    with open(path) as f:
        return [Example(r["p"], r["r"], r["d"], r["s"]) for r in json.load(f)]


def make_schedule(c, total_steps: int):
    """Linear warmup to `c.train.learning_rate`, cosine decay to 10% of it at `total_steps`."""
    import optax

    return optax.warmup_cosine_decay_schedule(
        0.0, c.train.learning_rate, c.train.warmup_steps, max(total_steps, c.train.warmup_steps + 1),
        end_value=0.1 * c.train.learning_rate)


def validate_config(c) -> None:
    """One-line errors for bad fields, before anything compiles."""
    checks = [
        ("train.batch_size", c.train.batch_size >= 1, ">= 1"),
        ("train.learning_rate", c.train.learning_rate > 0, "> 0"),
        ("train.bc_steps", c.train.bc_steps >= 0, ">= 0"),
        ("train.steps_per_round", c.train.steps_per_round >= 0, ">= 0"),
        ("dagger.rounds", c.dagger.rounds >= 0, ">= 0"),
        ("dagger.episodes", c.dagger.episodes >= 1, ">= 1"),
        ("data.expert_seeds", c.data.expert_seeds >= 1, ">= 1"),
        ("data.length_buckets", list(c.data.length_buckets) == sorted(c.data.length_buckets), "sorted"),
        ("gen.batch_buckets", list(c.gen.batch_buckets) == sorted(c.gen.batch_buckets), "sorted"),
        ("env.history_length", c.env.history_length >= 0, ">= 0"),
        ("val.temperature", c.val.temperature >= 0, ">= 0"),
        ("val.seeds_per_goal", c.val.seeds_per_goal >= 1, ">= 1"),
    ]
    for name, ok, expected in checks:
        if not ok:
            raise ValueError(f"config.{name} must be {expected}, got {eval('c.' + name)!r}")


def run(c, workdir: str, out: str | None, *, progress: bool = True) -> dict[str, Any]:
    """Runs the whole warm start; returns the report dict (also written to workdir/report.json)."""
    import jax
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx
    from tensorboardX import SummaryWriter
    from tqdm import tqdm

    import environments
    from bipace_jax.models import Qwen2Actor, Qwen2Config, load_tokenizer
    from bipace_jax.tiny import tiny_actor_config
    from configs import textcraft_tasks as tasks

    validate_config(c)
    t_start = time.time()
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    metrics_f = open(os.path.join(workdir, "metrics.jsonl"), "a")
    writer = SummaryWriter(os.path.join(workdir, "tb"))

    def log(record: dict[str, Any], step: int):
        metrics_f.write(json.dumps(record) + "\n")
        metrics_f.flush()
        for k, v in record.items():
            if isinstance(v, (int, float)) and k != "step":
                writer.add_scalar(k, v, step)

    # 1. tokenizer
    tok_dir = c.tokenizer_path or os.path.join(workdir, "tokenizer")
    if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        from launch.build_tokenizer import build_textcraft_tokenizer

        build_textcraft_tokenizer(c.tokenizer_vocab_size, c.tokenizer_seeds).save_pretrained(tok_dir)
    tokenizer = load_tokenizer(tok_dir)
    t_tok = time.time() - t_start

    # 2. tasks and expert data
    def make_env():
        return environments.make(tasks.GAME, max_steps=c.env.max_steps)

    train_ids, held_ids = tasks.split(make_env(), c.env.tasks, c.env.holdout_every)
    prompt = PromptBuilder(tasks.GAME, c.env.history_length, c.env.show_inventory,
                           tasks.TEMPLATE if c.env.compact_template else None)
    system = c.env.system_prompt or None
    data_path = os.path.join(workdir, "examples.json")
    if os.path.exists(data_path):
        limit = c.data.length_buckets[-1]
        examples = [e for e in _load_examples(data_path)
                    if len(e.prompt_ids) + len(e.response_ids) <= limit]
        ostats = {}
    else:
        pairs = [(t, s) for s in range(c.data.expert_seeds) for t in train_ids]
        examples, ostats = oracle_episodes(make_env, pairs, prompt, tokenizer, system)
        _save_examples(data_path, examples)

    # 3. model, optimizer, checkpoints
    hf_cfg = tiny_actor_config(
        len(tokenizer), hidden_size=c.model.hidden_size, num_hidden_layers=c.model.num_layers,
        num_attention_heads=c.model.num_heads, num_key_value_heads=c.model.num_kv_heads,
        intermediate_size=c.model.intermediate_size, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    actor = Qwen2Actor(Qwen2Config.from_hf_config(hf_cfg), rngs=nnx.Rngs(c.seed))
    total_steps = c.train.bc_steps + c.dagger.rounds * c.train.steps_per_round
    tx = optax.chain(optax.clip_by_global_norm(c.train.grad_clip),
                     optax.adamw(make_schedule(c, total_steps), weight_decay=c.train.weight_decay))
    learner = Learner(actor, tx)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(learner.params))
    gen = Generator(tokenizer, learner.graphdef, max_new_tokens=c.gen.max_new_tokens,
                    batch_buckets=c.gen.batch_buckets, length_buckets=c.gen.length_buckets,
                    temperature=c.dagger.temperature)
    ckpt = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True))
    start_round, step = 0, 0
    if ckpt.latest_step() is not None:
        target = {"params": learner.params, "opt_state": learner.opt_state, "step": 0}
        restored = ckpt.restore(ckpt.latest_step(), args=ocp.args.StandardRestore(target))
        learner.params, learner.opt_state = restored["params"], restored["opt_state"]
        start_round, step = ckpt.latest_step() + 1, int(restored["step"])

    panel = tasks.validation_panel(train_ids, held_ids, c.val.num_seen, c.val.num_heldout,
                                   c.val.panel_seed, c.val.seeds_per_goal)
    held_set = set(held_ids)
    key = jax.random.key(c.seed)
    rng = np.random.default_rng(c.seed)

    def validate(tag: str, rnd: int):
        nonlocal key
        key, sub = jax.random.split(key)
        eps, _ = play_policy(lambda ids: gen((learner.params, learner.rest), ids, sub, c.val.temperature),
                             make_env, panel, prompt, tokenizer, c.env.max_steps, label=False,
                             fallback_action=c.env.fallback_action, system_prompt=system)
        s = summarize(eps, held_set)
        log({"round": rnd, "step": step, **{f"{tag}/{k}": v for k, v in s.items()}}, step)
        return s, eps

    def train(n_steps: int, rnd: int):
        nonlocal step
        bar = tqdm(total=n_steps, desc=f"round {rnd} train", disable=not progress)
        done_steps, window = 0, []
        while done_steps < n_steps:
            for length, exs in batches(examples, c.train.batch_size, c.data.length_buckets, rng):
                m = learner.step(*make_batch(exs, length, tokenizer.pad_token_id,
                                             c.data.response_length))
                step += 1
                done_steps += 1
                window.append(m)
                bar.update(1)
                if step % c.train.log_every == 0 or done_steps == n_steps:
                    rec = {k: float(np.mean([float(w[k]) for w in window])) for k in window[0]}
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{rec['token_accuracy']:.3f}")
                    log({"round": rnd, "step": step, **{f"train/{k}": v for k, v in rec.items()},
                         "train/examples": len(examples), "time_s": time.time() - t_start}, step)
                    window = []
                if done_steps >= n_steps:
                    break
        bar.close()

    history = []
    for rnd in range(start_round, c.dagger.rounds + 1):
        t0 = time.time()
        train(c.train.bc_steps if rnd == 0 else c.train.steps_per_round, rnd)
        rec = {"round": rnd, "train_s": time.time() - t0}
        if rnd < c.dagger.rounds:
            t1 = time.time()
            goals = [train_ids[i] for i in rng.integers(0, len(train_ids), c.dagger.episodes)]
            pairs = [(t, c.dagger.seed_base + rnd * 10_000 + k) for k, t in enumerate(goals)]
            key, sub = jax.random.split(key)
            eps, new = play_policy(lambda ids: gen((learner.params, learner.rest), ids, sub),
                                   make_env, pairs, prompt, tokenizer, c.env.max_steps, label=True,
                                   fallback_action=c.env.fallback_action, system_prompt=system)
            # States far off the expert's path can grow the prompt past the longest bucket: those
            # examples are left out and counted (dagger/too_long), never truncated.
            limit = c.data.length_buckets[-1]
            fit = [e for e in new if len(e.prompt_ids) + len(e.response_ids) <= limit]
            examples.extend(fit)
            _save_examples(data_path, examples)
            s = summarize(eps)
            rec.update({"dagger/success": s["success"], "dagger/invalid_rate": s["invalid_rate"],
                        "dagger/new_examples": len(fit), "dagger/too_long": len(new) - len(fit),
                        "dagger_s": time.time() - t1})
        if c.val.every_round or rnd == c.dagger.rounds:
            s, _ = validate("val", rnd)
            rec.update({f"val/{k}": v for k, v in s.items()})
        log(rec, step)
        history.append(rec)
        print(json.dumps(rec), flush=True)
        ckpt.save(rnd, args=ocp.args.StandardSave(
            {"params": learner.params, "opt_state": learner.opt_state, "step": step}))
        ckpt.wait_until_finished()

    final, eps = validate("final", c.dagger.rounds)
    geps, _ = play_policy(lambda ids: gen((learner.params, learner.rest), ids, key, 0.0),
                          make_env, panel, prompt, tokenizer, c.env.max_steps, label=False,
                          fallback_action=c.env.fallback_action, system_prompt=system)
    greedy = summarize(geps, held_set)
    log({"round": c.dagger.rounds, "step": step, **{f"final_greedy/{k}": v for k, v in greedy.items()}},
        step)
    wall = time.time() - t_start
    report = {"final_val": final, "panel_temperature": c.val.temperature, "wall_time_s": wall,
              "final_greedy": greedy, "greedy_first_games": summarize(geps[:16], held_set),
              "tokenizer_s": t_tok, "num_params": n_params, "vocab_size": len(tokenizer),
              "expert_examples": sum(e.source == "expert" for e in examples),
              "dagger_examples": sum(e.source == "dagger" for e in examples),
              "oracle": ostats, "rounds": history, "seed": c.seed,
              "train_goals": len(train_ids), "heldout_goals": held_ids,
              "panel": panel, "panel_episodes": eps, "config": c.to_dict()}
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    if out:
        from bipace_jax.models import save_hf_checkpoint

        save_hf_checkpoint(learner.actor(), out, tokenizer=tokenizer)
        # transformers 5's AutoTokenizer, seeing config.json's model_type "qwen2", loads the folder's
        # tokenizer as Qwen2Tokenizer and swaps in Qwen's pre-tokenizer (digits split apart): the
        # tokenizer exactly as trained also goes to <out>/tokenizer (no config.json beside it).
        tokenizer.save_pretrained(os.path.join(out, "tokenizer"))
        small = {k: v for k, v in report.items() if k not in ("panel", "panel_episodes")}
        with open(os.path.join(out, "sft_report.json"), "w") as f:
            json.dump(small, f, indent=1, default=str)
    metrics_f.close()
    writer.close()
    return report


def main(argv):
    del argv
    from absl import flags

    c = flags.FLAGS.config
    report = run(c, flags.FLAGS.workdir, flags.FLAGS.out or None, progress=flags.FLAGS.progress)
    f = report["final_val"]
    print(f"validation success {f['success']:.3f} (seen {f['success_seen']:.3f}, held-out "
          f"{f.get('success_heldout', float('nan')):.3f}); wall {report['wall_time_s']:.0f}s")


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", "configs/sft_textcraft_tiny.py", "SFT config file")
    flags.DEFINE_string("workdir", "runs/sft", "run folder (checkpoints, metrics, report)")
    flags.DEFINE_string("out", "", "HF checkpoint folder to write at the end ('' = none)")
    flags.DEFINE_bool("progress", True, "tqdm progress bars")
    app.run(main)
