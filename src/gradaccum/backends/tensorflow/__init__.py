"""gradaccum on Keras's TensorFlow backend.

Keras's TensorFlow trainer is stateful: the accumulation state is `tf.Variable`s
(`state.py`), updated inside the traced step. `accumulator.py` is the public
`GradientAccumulator` (a custom training loop's verbs); `fit.py` attaches it to a model
that `fit` trains, with the steps (`step.py`, `own_step.py`, `split_step.py` over
`split.py`), resuming inside an epoch (`resume.py`), `"auto"`'s retries (`retry.py`),
the log entries (`logs.py`) and the followed BatchNormalization layers
(`following.py`) beside it. The window record over the state is `record.py` (with how the step
runs a `steps` callable), the in-place sums `sums.py`. What touches tf.distribute is
in `distributed.py`, `replicas.py` and `communication.py`, the non-finite screen in
`finite.py`, DP-SGD in `privacy.py` (with `vectorized.py`), Keras's private
TensorFlow pieces in `keras_compat.py`.
"""
