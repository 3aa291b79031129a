"""gradaccum on Keras's JAX backend.

Keras's JAX trainer is stateless: `fit` carries the model's state (trainable,
non-trainable, optimizer and metric variables) through a jitted
`train_step(state, data) -> (logs, state)`. gradaccum's state rides in that state as
the variables of a metric the model tracks (`state.AccumulationState`), so it is
jitted, donated and synced with the rest; the step (`step.py`) is a pure function of
it, and `fit.py` attaches both to the user's model.
"""
