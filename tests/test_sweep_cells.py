"""launch.sweep's cell folders: one folder per distinct cell, readable, stable for plain values."""

from launch import sweep


def test_cells_whose_values_differ_only_in_replaced_characters_get_distinct_folders():
    a = sweep.cell_name([("rollout.system_prompt", "Be brief!"), ("seed", "0")])
    b = sweep.cell_name([("rollout.system_prompt", "Be brief?"), ("seed", "0")])
    assert a != b and a.startswith("rollout.system_prompt=Be_brief_,seed=0~") and len(a.split("~")[1]) == 8
    assert sweep.cell_name([("ckpt", "a/b")]) != sweep.cell_name([("ckpt", "a_b")])
    # a name with nothing to replace is unchanged, so sweeps started before this rule resume
    assert sweep.cell_name([("estimator.name", "grpo"), ("seed", "1")]) == "estimator.name=grpo,seed=1"
    assert sweep.cell_name([("rollout.system_prompt", "Be brief!")]) == sweep.cell_name(
        [("rollout.system_prompt", "Be brief!")]
    )
