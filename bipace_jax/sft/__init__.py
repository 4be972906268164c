"""Warm start: behaviour cloning and DAgger on a game's oracle, through the RL loop's own pieces.

``run(config, workdir, out)`` decodes the config (``build_warm_start``: the sections shared with RL
carry RL's names), builds the tokenizer (``tiny.warm_start_tokenizer``, unless ``config.model.tokenizer``
names one); encodes one ``Example`` per record of the oracle's demonstrations (``bipace_demos``) on the
training goals (``record_example``: the prompt as ``rollout.encode_prompt`` encodes it, the response
``<action>{action}</action>`` + ``<|im_end|>``); trains a fresh tiny Qwen2 with ``learner.Learner`` and
``ResponseNLL`` (token-mean NLL of the response tokens); runs DAgger rounds (the policy plays through
``rollout.collect`` with the oracle as ``labeler``; every visited state becomes a record of the same
schema in ``<workdir>/dagger_<round>.jsonl``, encoded by the same ``record_example``); validates on
``tasks.validation_panel`` and writes the Hugging Face folder ``out``. Run folder, resumption and determinism: docs/warm_start.md.

Modules: ``spec`` (the config decoded into a ``WarmStartSpec``), ``examples`` (demonstrations and DAgger
records as examples), ``batch`` (batches, loss, one update), ``loop`` (the run).
"""

from bipace_jax.sft.batch import (
    ResponseNLL,
    SFTBatch,
    abstract_sft_batch,
    batches,
    make_batch,
    sft_step_specs,
    token_nll,
    train_step,
)
from bipace_jax.sft.examples import (
    Example,
    dagger_file,
    dagger_records,
    demo_examples,
    encode_response,
    expert_dataset,
    expert_examples,
    read_dagger_examples,
    record_example,
)
from bipace_jax.sft.loop import EXAMPLES_FILE, check_resume, first_games, panel_record, play_order, run
from bipace_jax.sft.spec import (
    MAX_POSITIONS,
    MODEL_FIELDS,
    DaggerConfig,
    DataConfig,
    PanelConfig,
    TrainConfig,
    WarmStartSpec,
    build_warm_start,
    rollout_config,
    validate_config,
)

__all__ = [
    "EXAMPLES_FILE",
    "MAX_POSITIONS",
    "MODEL_FIELDS",
    "DaggerConfig",
    "DataConfig",
    "Example",
    "PanelConfig",
    "ResponseNLL",
    "SFTBatch",
    "TrainConfig",
    "WarmStartSpec",
    "abstract_sft_batch",
    "batches",
    "build_warm_start",
    "check_resume",
    "dagger_file",
    "dagger_records",
    "demo_examples",
    "encode_response",
    "expert_dataset",
    "expert_examples",
    "first_games",
    "make_batch",
    "panel_record",
    "play_order",
    "read_dagger_examples",
    "record_example",
    "rollout_config",
    "run",
    "sft_step_specs",
    "token_nll",
    "train_step",
    "validate_config",
]
