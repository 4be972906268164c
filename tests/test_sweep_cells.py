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


def test_repeated_seeds_or_values_are_refused_they_would_share_a_run_folder():
    # the case 4: --seeds=0,0 --parallel=2 started two runs in one folder
    import pytest

    with pytest.raises(ValueError, match=r"--seeds: a seed is repeated in 0,0 \(two cells would share a run folder\)"):
        sweep.parse_grid([], ["0", "0"])
    with pytest.raises(ValueError, match="--seeds: a seed is repeated"):
        sweep.parse_grid([], ["1", "01"])  # the same seed spelt twice
    with pytest.raises(ValueError, match=r"--grid estimator.name: a value is repeated"):
        sweep.parse_grid(["estimator.name=grpo,grpo"], ["0"])
    assert len(sweep.parse_grid(["estimator.name=grpo,bipace_q"], ["0", "1"])) == 4
