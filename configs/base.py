"""Base config: every field of a training run, with its meaning. Settings files override it.

Every field is overridable on the command line through absl/ml_collections, e.g.::

    python -m launch.train --config=configs/alfworld_qwen2_5_7b.py --workdir=runs/x \
        --config.estimator.epsilon=0.1 --config.seed=2

Conventions: "" means "unset" for strings, 0 means "unset/default" where a field says so (no
None-valued fields, so every field keeps a type that the command line can override). Defaults are the
verl-agent / GiGPO / BiPACE paper ones (``configs/_paper.py`` sets them for the paper settings). ``bipace_jax.build.build_spec``
checks every field and decodes the config into a ``RunSpec`` before anything compiles.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # one seed: model init, task order, rollout keys, mini-batch shuffles
    c.num_iterations = 150  # RL iterations in the run (paper: 150)
    # JAX's persistent compilation cache folder (restarts and later runs skip XLA compiles): "auto" = on
    # accelerators $BIPACE_COMPILE_CACHE or ~/.cache/bipace_jax/xla, off on CPU; "" = off; else the folder
    c.compile_cache_dir = "auto"

    # --- the actor -------------------------------------------------------------------------
    c.model = ml_collections.ConfigDict()
    # HF folder, local or gs:// (config.json + model.safetensors [+ tokenizer]); "" = random init
    c.model.checkpoint = ""  # a gs:// folder is copied to local disk ($TMPDIR) once per process
    c.model.tokenizer = ""  # tokenizer folder, local or gs://; "" = the checkpoint's (or, for a random init, one the
    # project builds with `tokenizers` on the game's text, saved in the workdir)
    c.model.preset = (
        "tiny"  # architecture of a random init: tiny | qwen2_5_0_5b | qwen2_5_1_5b | qwen2_5_3b | qwen2_5_7b
    )
    c.model.hidden_size = 128  # tiny preset only (random init)
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.intermediate_size = 256
    c.model.vocab_size = 1024  # tiny preset: size of the BPE the project trains when no tokenizer is given
    c.model.fingerprint_layer = -1  # HF hidden_states index of the BiPACE fingerprint (paper: -12 1.5B, -8 7B)
    c.model.dtype = "float32"  # activations: float32 | bfloat16 (norms, softmax, logits stay fp32)
    c.model.param_dtype = "float32"
    # every actor matmul (sampling, log-probs, loss): default (bf16 passes on TPU, TF32 on NVIDIA, fp32 on
    # CPU) | high | highest (full fp32)
    c.model.matmul_precision = "default"
    # what each decoder layer keeps for the backward pass: none | full (its input only: one extra
    # forward) | save_dots (matmul outputs) | auto (the run plan picks the least recompute whose
    # estimated update fits 80% of a chip's HBM; none on CPU); paper sizes need full at 2048 + 512 tokens
    c.model.remat = "none"
    c.model.scan_layers = False  # one lax.scan over the decoder layers: compile time flat in depth

    # --- the game --------------------------------------------------------------------------
    c.env = ml_collections.ConfigDict()
    c.env.name = "textcraft"  # textcraft | alfworld | webshop
    c.env.max_steps = 50  # step cap per episode (ALFWorld 50, WebShop 15)
    c.env.num_workers = 0  # env pool worker processes (at most one per game of a pool); 0 = the pool's default
    c.env.timeout_s = 30.0  # per-call timeout of the pool before a worker is replaced
    c.env.options = ""  # JSON object of game options for every game, e.g. '{"require_real_data": true}'
    c.env.webshop_scorer = (
        "verl_agent"  # WebShop option rule: verl_agent (the baseline's) | upstream (values on both sides)
    )

    # Task selectors (strings): "all"; "a:b" (ids in range(a, b)); "3,7,9" (ids); "key=v1,v2"
    # (task_info filter, e.g. "depth=2,3" for TextCraft); joined with "&" to intersect.
    c.tasks = ml_collections.ConfigDict()
    c.tasks.train = "all"  # goals RL trains on
    c.tasks.holdout = ""  # goals never trained on, validated separately ("" = none); removed from train
    c.tasks.holdout_every = 0  # also hold out every k-th goal of tasks.train (ascending ids); 0 = none

    # --- rollout ---------------------------------------------------------------------------
    c.rollout = ml_collections.ConfigDict()
    c.rollout.num_groups = 16  # task groups per iteration (over all hosts)
    c.rollout.group_size = 8  # rollouts per task group (G)
    c.rollout.history_length = 2
    c.rollout.max_prompt_length = 2048
    c.rollout.invalid_penalty = 0.1
    c.rollout.success_reward = 10.0
    c.rollout.fallback_action = ""  # action sent to the game for an unparsable response ("" = the game's default)
    c.rollout.require_think = False
    c.rollout.reject_cjk = False  # a response holding a CJK ideograph is invalid (verl-agent)
    # invalid response -> the game gets: fallback (rollout.fallback_action) | projected (verl-agent: the
    # parsed action if tagged, else the response's last rollout.projection_chars characters)
    c.rollout.invalid_action = "fallback"
    c.rollout.projection_chars = 30  # verl-agent: ALFWorld 30, WebShop 20
    c.rollout.length_finish = "parse"  # a response cut by sampler.max_new_tokens: parse (scored as any other) |
    # invalid (fallback action + invalid penalty) | unpenalised (fallback action, no penalty)
    c.rollout.reset_retries = 1  # a task group whose reset faulted is reset again on a fresh seed this often
    c.rollout.show_inventory = False
    # lockstep (one sampler call per turn over all live games) | continuous (slot scheduler:
    # rollout.num_slots slots, 0 = one per game; rollout.chunk_steps decode steps per device chunk)
    c.rollout.scheduler = "lockstep"
    c.rollout.num_slots = 0
    c.rollout.chunk_steps = 8
    # branching rollouts: the turns at which every game forks into rollout.branch_children games from its
    # state (() = off); a task group of G games starts G / branch_children ** len(branch_turns) roots
    c.rollout.branch_turns = ()
    c.rollout.branch_children = 2
    c.rollout.system_prompt = (
        "default"  # "default": the chat template's own (Qwen2.5 inserts one); else the text ("" = empty)
    )
    c.rollout.template = (
        ""  # prompt template: "" = the game's; a JSON object of PromptTemplate fields; or "module:ATTR"
    )

    c.sampler = ml_collections.ConfigDict()
    c.sampler.max_new_tokens = 512  # response budget (paper 512)
    c.sampler.temperature = 1.0  # rollout temperature (paper 1.0); PPO trains softmax(logits / T) (verl)
    c.sampler.top_p = 1.0
    c.sampler.top_k = 0  # 0 = off
    c.sampler.stop_strings = ("</action>",)
    c.sampler.batch_buckets = (8, 16, 32, 64, 128)
    c.sampler.length_buckets = (128, 256, 512, 1024, 2048, 4096)
    # 0 = off, else the shortest prompt head a task group's games prefill once and share (lockstep;
    # not with a batch-sharded sampler mesh): docs/performance.md "Shared prompt heads"
    c.sampler.shared_head_tokens = 0

    # --- advantages (EstimatorConfig) ------------------------------------------------------
    c.estimator = ml_collections.ConfigDict()
    c.estimator.name = "bipace_q"  # grpo | gigpo | bigpo | bipace_q | bipace_diff | hgpo
    c.estimator.gamma = 0.95
    c.estimator.omega = 1.0
    c.estimator.norm = "mean_std"  # mean_std | mean (WebShop)
    c.estimator.epsilon = 0.05  # cosine clustering threshold (paper: 0.05 1.5B, 0.10 7B)
    c.estimator.centroid = "mean"  # mean | leader
    c.estimator.key = "action_tag"  # PACE key: action_tag | first_tokens
    c.estimator.capacity = 0  # clusters per task group; 0 = the group's row capacity (never overflows)
    # Protocol options (docs/estimators.md, "Protocol options"); the defaults are the contract's plain reading.
    c.estimator.penalty = (
        "in_reward"  # in_reward (discounted back like any reward) | own_row (its row only; needs rows)
    )
    c.estimator.episode_stats = "trajectory"  # trajectory (one score per episode) | rows (per row, verl-agent)
    c.estimator.step_norm = "none"  # none | std (bipace_* step term / cluster std, under norm=mean_std)
    c.estimator.pace_fallback = "same_key_cluster"  # same_key_cluster | singleton_pool (per-row LOO, paper)
    c.estimator.similarity_thresh = 0.0  # gigpo step groups: 0 exact text; (0, 1) verl-agent difflib ratio >= it
    # HGPO (name="hgpo"; docs/estimators.md "HGPO"): groups by the last k anchor observations, k = 1 .. history + 1,
    # mixed with weights (k + 1) ** alpha; base_group adds A_ep as a level-0 item. verl-agent: 2, 1.0, False.
    c.estimator.hgpo_history = 2
    c.estimator.hgpo_alpha = 1.0
    c.estimator.hgpo_base_group = False
    # One-shot calibration (the paper's sweep; clustering estimators only): on the first iteration, epsilon becomes the smallest
    # grid value whose singleton step-group rate on that batch's fingerprints is <= the target
    # (paper, TextCraft-7B: clusters 22.4% singletons vs 50.3% for exact hashing). Off: epsilon as set.
    c.estimator.calibration = ml_collections.ConfigDict()
    c.estimator.calibration.enabled = False
    c.estimator.calibration.target_singleton_rate = 0.25
    c.estimator.calibration.grid = (0.0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3)
    # Online epsilon controller (the paper keeps epsilon fixed: off by default).
    c.estimator.controller = ml_collections.ConfigDict()
    c.estimator.controller.enabled = False
    c.estimator.controller.target_singleton_rate = 0.25
    c.estimator.controller.gain = 0.05  # epsilon += clip(gain * (rate - target), -max_step, max_step)
    c.estimator.controller.max_step = 0.01
    c.estimator.controller.min_epsilon = 0.0
    c.estimator.controller.max_epsilon = 0.3

    # --- PPO -------------------------------------------------------------------------------
    c.ppo = ml_collections.ConfigDict()
    c.ppo.clip_eps = 0.2
    c.ppo.dual_clip = 3.0  # 0 = off
    c.ppo.kl_coef = 0.01  # low-variance KL to the frozen initial policy; 0 = no reference pass
    c.ppo.kl_bound = 10.0
    c.ppo.entropy_coef = 0.001
    c.ppo.epochs = 1  # passes over the iteration's rows
    # the most rows per optimizer update over ALL hosts: N rows of an iteration make ceil(N / it) updates of
    # near-equal size, the same rows whatever the host count (ppo.mini_batches); 0 = all rows, one update
    c.ppo.mini_batch_rows = 0
    # rows per forward/backward on EACH host (fixed shape; gradient accumulation): the gradient program's
    # batch is it x hosts, split over mesh data*fsdp; the log-prob pass runs it on each host's own mesh
    c.ppo.micro_batch_rows = 8
    # response positions per LM-head chunk in the loss and log-probs: fp32 logits [rows, chunk, V]
    # instead of [rows, M, V], the head recomputed per chunk in the backward (0 = all M at once)
    c.ppo.logprob_chunk = 0
    c.ppo.old_logprobs = "recompute"  # recompute (a forward of the current policy) | sampler (the sampler's own) |
    # fused (stop_gradient inside the gradient pass; needs epochs 1, mini_batch_rows 0)
    # packed, token-budget micro-batches in the log-prob pass and the update: micro_batch_rows lines of
    # pack_width tokens (0 = the batch's row width), each holding as many rows' real tokens as fit (each row
    # its own attention segment, positions restarting); same values, same optimizer steps (PPOLearner.pack)
    c.ppo.pack = False
    c.ppo.pack_width = 0
    c.ppo.pack_response_width = 0  # response tokens (LM-head positions) per line; 0 = min(pack_width, 2 M)
    # truncated importance sampling (TIS): the policy-gradient term of each token times
    # min(pi_old / pi_sampler, tis_cap), the sampler's log-probs against the recomputed old ones (needs
    # old_logprobs = recompute); 0 = off. Turn it on (e.g. 2.0) for asynchronous runs, or when
    # rollout/logprob_gap shows the sampler and learner forwards disagree (docs/protocol.md)
    c.ppo.tis_cap = 0.0

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-6  # AdamW, constant (paper)
    c.optim.warmup_steps = 0
    c.optim.schedule = "constant"  # after the warmup ("warmup_cosine": decay to 10% at the last step)
    c.optim.weight_decay = 0.01
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.grad_clip = 1.0  # global-norm clip

    # --- validation ------------------------------------------------------------------------
    c.val = ml_collections.ConfigDict()
    c.val.every = 10  # validate every k iterations and after the last; 0 = never after training starts
    c.val.at_start = True  # also validate before the first iteration (val_before/*), whatever val.every is
    c.val.num_tasks = 64  # panel goals from the training goals (with unseen game seeds)
    c.val.num_holdout_tasks = 64  # panel goals from the held-out goals (all when fewer)
    c.val.panel = "spread"  # spread: goals evenly spaced over the sets, seeds val.seed + k; random: drawn with val.seed
    c.val.seeds_per_goal = 1  # game seeds per panel goal (each a distinct unseen game)
    c.val.group_size = 1  # plays per panel game (same seed)
    c.val.temperature = 0.4
    # JSON objects of game options (on top of env.options) for the panels' games; when set, the panel's
    # goals come from that game's tasks (ALFWorld: '{"split": "eval_in_distribution"}' = valid_seen)
    c.val.options = ""
    c.val.holdout_options = ""  # the held-out panel's game (ALFWorld: eval_out_of_distribution = valid_unseen)
    c.val.seed = 1_000_000  # seed base of the panel; >= 1e6, so never a training game seed (those are < 1e6)

    # --- bookkeeping -----------------------------------------------------------------------
    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 1  # save every k iterations (and at the end)
    c.checkpoint.keep = 2  # checkpoints kept in <workdir>/checkpoints
    c.checkpoint.export_hf = True  # write <workdir>/hf_final (HF folder) at the end
    # several hosts need one folder they all see: gs://, or True to declare a local path shared (NFS)
    c.checkpoint.shared_workdir = False
    c.checkpoint.async_save = False  # orbax writes in the background; the next save waits for the last

    c.log = ml_collections.ConfigDict()
    c.log.progress = True  # tqdm bars
    c.log.plots = True  # PNG plots at the end
    c.log.wandb = False  # also log to wandb (pip install -e '.[wandb]'; WANDB_MODE=offline needs no network)
    c.log.wandb_project = "bipace_jax"
    # episode transcripts (prompt hash + observation, response, action, reward, return, advantage, step
    # group, PACE kind per step): episodes/<i>.jsonl for the training rollouts of every k-th iteration
    # and for every validation (python -m launch.transcripts renders them); 0 = off
    c.log.transcripts_every = 0
    c.log.transcripts_max_games = 8  # the most games per phase (rollout, each panel) an iteration writes

    # --- devices ---------------------------------------------------------------------------
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1 = the devices left over
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    # tensor-parallel size of each host's sampler / log-prob mesh (its own chips); 0 = mesh.tensor.
    # E.g. 7B on v5e: train pure FSDP (tensor 1) over the slice, decode tensor-parallel 4 in a host.
    c.mesh.sampler_tensor = 0

    # --- asynchronous RL (docs/protocol.md "Asynchronous RL") -------------------------------
    c.async_rl = ml_collections.ConfigDict()
    c.async_rl.max_staleness = 0  # k: iterations the sampler may play ahead of the learner; 0 = on-policy
    c.async_rl.switch = "turn"  # where the sampler adopts new parameters: turn (partial rollouts) | game
    c.async_rl.sampler_devices = 0  # 0 = colocated (synchronous); n = the first n devices sample, the rest learn
    c.async_rl.sampler_processes = 0  # 0 = no process roles; 1 = the last of 2 jax.distributed processes samples
    return c
