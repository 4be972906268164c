"""Build a game's oracle demonstrations dataset (`bipace_jax.demos`, TFDS `bipace_demos`, ArrayRecord).

    python -m launch.build_demos --game=textcraft --data_dir=~/tensorflow_datasets

Re-running is a no-op unless the builder version (`bipace_jax.demos.VERSION`) or the recipe changes
(another recipe is another config name). ALFWorld plays the generated fixture games unless
`--alfworld_data` names an `$ALFWORLD_DATA` folder; WebShop plays the shipped sample catalogue.
"""

import json

from absl import app, flags

from bipace_jax import demos

_GAME = flags.DEFINE_enum("game", "textcraft", sorted(demos.DEFAULT_OPTIONS), "game whose oracle plays")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "TFDS data folder (local or gs://)", required=True)
_SEEDS = flags.DEFINE_integer("seeds", None, "oracle games per goal (default: the game's DEFAULT_OPTIONS)")
_ALFWORLD = flags.DEFINE_string("alfworld_data", "", "ALFWorld data folder ('' = the generated fixture games)")


def main(argv):
    del argv
    overrides = {}
    if _SEEDS.value is not None:
        overrides["seeds"] = _SEEDS.value
    if _GAME.value == "alfworld" and _ALFWORLD.value:
        overrides["env_options"] = {"expert_type": "handcoded", "data_path": _ALFWORLD.value}
    b = demos.build(demos.default_config(_GAME.value, **overrides), _DATA_DIR.value)
    splits = {k: v.num_examples for k, v in b.info.splits.items()}
    print(json.dumps({"data_dir": str(b.data_dir), "config": b.builder_config.name, "splits": splits}))


if __name__ == "__main__":
    app.run(main)
