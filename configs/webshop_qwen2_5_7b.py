"""Paper setting: BiPACE_Q on webshop with Qwen2.5-7B-Instruct (fingerprint layer -8, epsilon 0.10).

16 task groups x 8 rollouts, gamma 0.95, omega 1, AdamW lr 1e-6, KL 0.01, entropy 0.001, clip 0.2,
rollout temperature 1.0 (validation 0.4), history 2, invalid penalty 0.1, 150 iterations.
Set the model folder: `--config.model.checkpoint=/path/to/Qwen2.5-7B-Instruct`.
"""

from configs import _paper


def get_config():
    return _paper.paper_config("webshop", "qwen2_5_7b")
