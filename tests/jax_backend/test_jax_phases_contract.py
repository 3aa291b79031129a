"""The contract's `fit` and epoch tests (tests/contract) again on JAX, with the two
steps of a window of fixed length running (`gradaccum.backends.jax.phases`): on a
CPU `fit` runs the one step, so what only a GPU would run is checked here. Each test
is the contract's own, collected in this module under the fixture below: the ones
where a window's count could go wrong (epochs' ends, restores, errors and skips,
saves, validation, data that runs out, loss scaling, and JAX's own: errors its step
records and `fit` raises)."""

from __future__ import annotations

import pytest
from test_epochs import (  # noqa: F401
    test_backup_and_restore_inside_an_epoch_given_by_steps_per_epoch,
    test_data_of_unknown_length_that_runs_out_inside_a_call,
    test_data_that_runs_out_before_the_epoch_ends_as_plain_keras_does,
    test_each_partial_policy_closes_the_epochs_rest_as_it_says,
    test_fit_twice_goes_on_where_the_first_ended_with_a_carried_window,
    test_validation_sees_the_epochs_last_update_on_the_batches_asked_for,
)
from test_fit import (  # noqa: F401
    test_a_checkpoint_saved_in_a_fit_does_not_bring_back_its_epoch_length,
    test_backup_and_restore_resumes_inside_an_epoch,
    test_carry_keeps_the_window_open_across_epochs,
    test_finite_gradients_whose_sum_overflows_are_not_skipped,
    test_masked_sequences_of_unequal_length_with_sample_weights_are_exact,
    test_nonfinite_micro_batch_is_skipped_with_its_weight,
    test_partial_window_at_the_end_of_each_epoch,
    test_save_weights_in_the_middle_of_a_window_resumes_exactly,
    test_train_on_batch_after_an_interrupted_fit_closes_windows_by_their_rule_only,
)
from test_jax_accumulate import (  # noqa: F401
    test_a_fit_stopped_by_a_callback_leaves_no_step_error_to_the_next_fit,
    test_an_error_in_the_epochs_last_call_is_raised_before_validation_applies_the_window,
    test_nonfinite_raise_stops_fit_naming_the_micro_batch,
)
from test_jax_mixed_precision import (  # noqa: F401
    test_an_overflowing_micro_batch_is_skipped_and_the_scale_halves,
    test_the_scale_doubles_after_its_growth_steps_of_micro_batches,
)

from gradaccum.backends.jax import phases


@pytest.fixture(autouse=True)
def everywhere(monkeypatch):
    monkeypatch.setattr(phases, "worth_it", lambda: True)
