"""Shared settings of the BiPACE paper configs (verl-agent / GiGPO training-script defaults)."""

import ml_collections

from configs import base

# Per model size: fingerprint layer and epsilon (paper), plus a mesh that fits the model.
MODEL_SIZES = {
    # 1.5B: params + AdamW states in fp32 are ~25 GB: shard them over every device (FSDP).
    "qwen2_5_1_5b": dict(fingerprint_layer=-12, epsilon=0.05, mesh=dict(data=1, fsdp=-1, tensor=1), micro_batch_rows=8),
    # 7B: ~122 GB of fp32 params + AdamW states: trained pure FSDP over every chip (tensor 1: on v5e a
    # host-contained tensor group leaves FSDP groups of every 4th chip, whose all-gathers libtpu 0.10.2
    # cannot route), sampled 4-way tensor parallel on each host's own chips (decode reads every weight
    # per token). 4 rows per micro-batch per host: one per chip of a 4-chip host.
    "qwen2_5_7b": dict(
        fingerprint_layer=-8,
        epsilon=0.10,
        mesh=dict(data=1, fsdp=-1, tensor=1, sampler_tensor=4),
        micro_batch_rows=4,
    ),
}

# mini_batch_rows: verl-agent's ppo_mini_batch_size, one AdamW step per that many step rows (ALFWorld
# 256, WebShop 64): about 8-25 optimizer steps per iteration, not one.
# projection_chars: the response tail verl-agent sends the game for an untagged response.
GAMES = {
    "alfworld": dict(max_steps=50, max_prompt_length=2048, norm="mean_std", mini_batch_rows=256, projection_chars=30),
    "webshop": dict(max_steps=15, max_prompt_length=4096, norm="mean", mini_batch_rows=64, projection_chars=20),
    # TextCraft in the paper: same loop as ALFWorld (ADaPT's TextCraft sets no lower cap).
    "textcraft": dict(max_steps=50, max_prompt_length=2048, norm="mean_std", mini_batch_rows=256, projection_chars=30),
}


# Validation panels: ALFWorld plays 128 games of valid_seen (the paper's in-distribution split) and 128
# of valid_unseen (out of distribution); WebShop 256 of the test goals 0-499; TextCraft has no split:
# 64 training goals with unseen distractor seeds.
VALIDATION = {
    "alfworld": dict(
        options='{"split": "eval_in_distribution"}',
        holdout_options='{"split": "eval_out_of_distribution"}',
        num_tasks=128,
        num_holdout_tasks=128,
    ),
    "webshop": dict(options='{"split": "test"}', num_tasks=256, num_holdout_tasks=0),
    "textcraft": dict(num_tasks=64, num_holdout_tasks=0),
}


def paper_config(game: str, size: str) -> ml_collections.ConfigDict:
    """The paper setting for ``game`` x ``size``; ``model.checkpoint`` must be set by the user."""
    c = base.get_config()
    g, m = GAMES[game], MODEL_SIZES[size]
    c.env.name = game
    c.env.max_steps = g["max_steps"]
    c.rollout.max_prompt_length = g["max_prompt_length"]
    c.estimator.norm = g["norm"]
    c.estimator.name = "bipace_q"
    c.estimator.epsilon = m["epsilon"]
    # GiGPO's statistics as verl-agent computes them: the invalid-action charge on its own row only, and
    # the episode mean/std over the task group's rows (compute_mean_std_cross_steps=True).
    c.estimator.penalty = "own_row"
    c.estimator.episode_stats = "rows"
    # The paper's reading of PACE: a drop-in replacement of GiGPO's partition and baseline, so its step
    # term is divided by the cluster std where GiGPO divides (norm="mean_std" games), and a row whose
    # same-action pool is a singleton falls back to leave-one-out ("if the pool is a singleton").
    c.estimator.step_norm = "std" if g["norm"] == "mean_std" else "none"
    c.estimator.pace_fallback = "singleton_pool"
    c.model.preset = size
    c.model.fingerprint_layer = m["fingerprint_layer"]
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    # 2048 + 512 tokens: each layer keeps only its input for the backward, one scanned layer body
    # compiles instead of 28, and the loss's LM head runs 128 response positions at a time
    c.model.remat = "full"
    c.model.scan_layers = True
    c.ppo.logprob_chunk = 128
    c.model.checkpoint = ""  # required: --config.model.checkpoint=/path/to/Qwen2.5-...-Instruct
    for k, v in m["mesh"].items():
        c.mesh[k] = v
    c.rollout.num_groups = 16
    c.rollout.group_size = 8
    # The slot scheduler: modelled 1.37-1.67x less rollout time than lockstep on the committed slices
    # (docs/pod.md section 7); its programs AOT-compile within HBM (benchmarks/aot/*__slots.json)
    c.rollout.scheduler = "continuous"
    c.sampler.max_new_tokens = 512
    c.ppo.micro_batch_rows = m["micro_batch_rows"]
    c.ppo.mini_batch_rows = g["mini_batch_rows"]
    # verl-agent's validity rule and projection of invalid responses (think required, no CJK)
    c.rollout.require_think = True
    c.rollout.reject_cjk = True
    c.rollout.invalid_action = "projected"
    c.rollout.projection_chars = g["projection_chars"]
    # verl-agent's validation: every 5 iterations on the game's evaluation split, not on training games
    c.val.every = 5
    # 7B: 91 GB of fp32 params + AdamW moments, ~6 GB per host of 16 at ~1 GB/s; every 5 iterations (with
    # validation) a crash loses at most 5 of ~8 min each, and the writes run beside the next iteration
    c.checkpoint.every = 5
    c.checkpoint.async_save = True
    for k, v in VALIDATION[game].items():
        c.val[k] = v
    if game == "alfworld":  # a paper run must not fall back to the 12 bundled fixture games
        c.env.options = '{"require_real_data": true}'
    if game == "webshop":  # our engine on $WEBSHOP_DATA; synthetic goals; 10 only for a score of 1
        c.env.options = '{"goals": "synthetic", "reward": "success"}'
    if game == "webshop" and size == "qwen2_5_7b":
        # a 16-row prefill of 4096-token prompts on a 4-chip v5e host peaks at 90.2% of HBM (validation
        # on v5e:8x8, launch.aot): at most 8 rows per sampler call, more are served 8 at a time
        c.sampler.batch_buckets = (8,)
    return c
