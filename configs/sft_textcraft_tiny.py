"""Warm start of the embedded default: BC + DAgger of a tiny Qwen2 on TextCraft (`bipace_jax.sft`).

    python -m launch.sft --config=configs/sft_textcraft_tiny.py --workdir=runs/sft \
        --out=runs/warm_start  # a new folder: never over the shipped bipace_jax/data/textcraft_tiny

Every field is overridable (`--config.train.steps_per_round=50`). The sections shared with RL
(``model``, ``env``, ``tasks``, ``rollout``, ``sampler``, ``optim``, ``val``) carry RL's field names
(``configs/base.py``); ``data``, ``train`` and ``dagger`` are the warm start's own. The values of the
task set, prompt options and panel come from `configs/textcraft_tasks.py`, shared with the RL default;
the library reads them only from these fields.
"""

import ml_collections

from configs import textcraft_tasks as tasks


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # model init, data order, DAgger seeds

    # Sections named as in the RL config (configs/base.py), same meaning; the warm start reads these fields only.
    c.model = ml_collections.ConfigDict()
    c.model.tokenizer = ""  # tokenizer folder; "" = build the project's BPE (bipace_jax.tiny.warm_start_tokenizer)
    c.model.vocab_size = 1024  # learned BPE entries of a built tokenizer (item-name tokens come on top)
    c.model.hidden_size = 128
    c.model.num_layers = 3
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.intermediate_size = 384

    c.env = ml_collections.ConfigDict()
    c.env.name = tasks.GAME
    c.env.max_steps = tasks.MAX_STEPS
    c.env.num_workers = 0  # env pool worker processes (0 = one per CPU)

    c.tasks = ml_collections.ConfigDict()
    c.tasks.train = tasks.TRAIN  # task selector (bipace_jax.tasks.select_tasks)
    c.tasks.holdout_every = tasks.HOLDOUT_EVERY  # every n-th selected goal is held out, never trained on

    c.rollout = ml_collections.ConfigDict()
    c.rollout.history_length = tasks.HISTORY_LENGTH
    c.rollout.show_inventory = tasks.SHOW_INVENTORY
    c.rollout.template = "configs.textcraft_tasks:TEMPLATE"  # 'module:ATTR' or JSON ("" = the game's default)
    c.rollout.system_prompt = tasks.SYSTEM_PROMPT
    c.rollout.fallback_action = tasks.FALLBACK_ACTION

    c.sampler = ml_collections.ConfigDict()  # DAgger and validation games
    c.sampler.max_new_tokens = 32
    c.sampler.batch_buckets = (64,)
    c.sampler.length_buckets = (160, 224, 288, 384, 448)

    c.optim = ml_collections.ConfigDict()  # AdamW after global-norm clipping
    c.optim.learning_rate = 3e-3  # peak
    c.optim.warmup_steps = 50
    c.optim.schedule = "warmup_cosine"  # linear warmup, cosine decay to 10% at the last update
    c.optim.weight_decay = 0.01
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.grad_clip = 1.0

    c.val = ml_collections.ConfigDict()
    c.val.rl_every = tasks.RL_EVERY  # panel's seen goals: every n-th training goal (the RL task set)
    c.val.num_tasks = tasks.VAL_NUM_SEEN
    c.val.num_holdout_tasks = tasks.VAL_NUM_HELDOUT
    c.val.seeds_per_goal = tasks.VAL_SEEDS_PER_GOAL  # the RL default's panel: RL goals and held-out goals, 3 seeds each
    c.val.temperature = tasks.VAL_TEMPERATURE
    c.val.seed = tasks.VAL_SEED_BASE  # panel game seeds from here (training seeds stay below)
    c.val.every_round = False  # validate after each round (costs one panel of games)

    # Sections of the warm start only.
    c.data = ml_collections.ConfigDict()
    c.data.expert_seeds = 24  # oracle games per training goal (seeds 0..n-1): distractor variety
    c.data.length_buckets = (160, 224, 288, 384, 448)
    c.data.response_length = 32  # R: response tokens per example (<action>...</action><|im_end|>)
    c.data.tokenizer_seeds = 2  # oracle games per goal in a built tokenizer's corpus

    c.train = ml_collections.ConfigDict()
    c.train.batch_size = 32
    c.train.micro_batch_rows = 0  # rows per forward/backward (0 = the whole batch); same update
    c.train.bc_steps = 600  # updates before the first DAgger round
    c.train.steps_per_round = 100  # updates after each DAgger round
    c.train.log_every = 25
    # a checkpoint every n updates inside a round too, with the data stream's position (0 = round ends only)
    c.train.checkpoint_every = 100
    c.train.log_examples = False  # <workdir>/examples.jsonl: the keys of every update's examples

    c.dagger = ml_collections.ConfigDict()
    c.dagger.rounds = 4
    c.dagger.episodes = 128  # policy games per round (training goals, fresh seeds)
    c.dagger.temperature = 0.4  # policy temperature in DAgger games (0 = greedy)
    c.dagger.seed_base = 100_000  # DAgger game seeds: seed_base + round * 10_000 + k
    return c
