"""Warm start of the embedded default: BC + DAgger of a tiny Qwen2 on TextCraft (`bipace_jax.sft`).

    python -m launch.sft --config=configs/sft_textcraft_tiny.py --workdir=runs/sft \
        --out=bipace_jax/data/textcraft_tiny

Every field is overridable (`--config.train.steps_per_round=50`). The values of the task set, prompt
options and panel come from `configs/textcraft_tasks.py`, shared with the RL default; the library reads
them only from these fields.
"""

import ml_collections

from configs import textcraft_tasks as tasks


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # model init, data order, DAgger seeds
    c.tokenizer_path = ""  # "" = build the project's BPE (bipace_jax.tiny.warm_start_tokenizer)
    c.tokenizer_vocab_size = 1024  # learned BPE entries (item-name tokens come on top)
    c.tokenizer_seeds = 2  # oracle games per goal in the tokenizer corpus

    c.env = ml_collections.ConfigDict()
    c.env.game = tasks.GAME
    c.env.max_steps = tasks.MAX_STEPS
    c.env.history_length = tasks.HISTORY_LENGTH
    c.env.show_inventory = tasks.SHOW_INVENTORY
    c.env.template = "configs.textcraft_tasks:TEMPLATE"  # 'module:ATTR' or JSON ("" = the game's default)
    c.env.system_prompt = tasks.SYSTEM_PROMPT
    c.env.fallback_action = tasks.FALLBACK_ACTION
    c.env.tasks = tasks.TRAIN  # task selector (bipace_jax.tasks.select_tasks)
    c.env.holdout_every = tasks.HOLDOUT_EVERY  # every n-th selected goal is held out, never trained on
    c.env.num_workers = 0  # env pool worker processes (0 = one per CPU)

    c.model = ml_collections.ConfigDict()
    c.model.hidden_size = 128
    c.model.num_layers = 3
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.intermediate_size = 384

    c.data = ml_collections.ConfigDict()
    c.data.expert_seeds = 24  # oracle games per training goal (seeds 0..n-1): distractor variety
    c.data.length_buckets = (160, 224, 288, 384, 448)
    c.data.response_length = 32  # R: response tokens per example (<action>...</action><|im_end|>)

    c.train = ml_collections.ConfigDict()
    c.train.batch_size = 32
    c.train.micro_batch_rows = 0  # rows per forward/backward (0 = the whole batch); same update
    c.train.learning_rate = 3e-3  # peak AdamW lr (linear warmup, cosine decay to 10%)
    c.train.warmup_steps = 50
    c.train.weight_decay = 0.01
    c.train.grad_clip = 1.0
    c.train.bc_steps = 600  # updates before the first DAgger round
    c.train.steps_per_round = 100  # updates after each DAgger round
    c.train.log_every = 25

    c.dagger = ml_collections.ConfigDict()
    c.dagger.rounds = 4
    c.dagger.episodes = 128  # policy games per round (training goals, fresh seeds)
    c.dagger.temperature = 0.4  # policy temperature in DAgger games
    c.dagger.seed_base = 100_000  # DAgger game seeds: seed_base + round * 10_000 + k

    c.gen = ml_collections.ConfigDict()
    c.gen.max_new_tokens = 32
    c.gen.batch_buckets = (64,)
    c.gen.length_buckets = (160, 224, 288, 384, 448)

    c.val = ml_collections.ConfigDict()
    c.val.rl_every = tasks.RL_EVERY  # panel's seen goals: every n-th training goal (the RL task set)
    c.val.num_seen = tasks.VAL_NUM_SEEN
    c.val.num_heldout = tasks.VAL_NUM_HELDOUT
    c.val.seeds_per_goal = tasks.VAL_SEEDS_PER_GOAL  # the RL default's panel: RL goals and held-out goals, 3 seeds each
    c.val.temperature = tasks.VAL_TEMPERATURE
    c.val.seed_base = tasks.VAL_SEED_BASE  # panel game seeds from here (training seeds stay below)
    c.val.every_round = False  # validate after each round (costs one panel of games)
    return c
