"""CPU default: BiPACE_Q on real TextCraft games with a tiny Qwen2-architecture actor.

Runs on a laptop-class CPU with no download. With ``model.checkpoint`` empty the actor is a random
tiny Qwen2 and the tokenizer a small byte-level BPE trained by the project on TextCraft text (saved
in ``<workdir>/tokenizer``); point ``model.checkpoint`` at a warm-start folder (``launch/sft.py``)
to start from a policy that already plays.
"""

from configs import base


def get_config():
    c = base.get_config()
    c.num_iterations = 20
    c.model.preset = "tiny"
    c.model.hidden_size = 192
    c.model.num_layers = 3
    c.model.num_heads = 6
    c.model.num_kv_heads = 2
    c.model.intermediate_size = 512
    c.model.vocab_size = 1024
    c.model.fingerprint_layer = -1
    c.env.name = "textcraft"
    c.env.max_steps = 15
    c.env.num_workers = 2
    c.tasks.train = "depth=2"
    c.tasks.holdout = ""
    c.rollout.num_groups = 4
    c.rollout.group_size = 8
    c.rollout.max_prompt_length = 768
    c.sampler.max_new_tokens = 32
    c.sampler.batch_buckets = (8, 16, 32, 64)
    c.sampler.length_buckets = (256, 512, 768)
    c.estimator.epsilon = 0.05
    c.ppo.micro_batch_rows = 32
    c.optim.learning_rate = 1e-5
    c.val.every = 5
    c.val.num_tasks = 32
    c.val.num_holdout_tasks = 0
    c.checkpoint.every = 1
    return c
