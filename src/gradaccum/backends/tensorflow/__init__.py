"""gradaccum on Keras's TensorFlow backend.

Keras's TensorFlow trainer is stateful: the accumulation state is `tf.Variable`s
(`state.py`), updated inside the traced step. `accumulator.py` is the public
`GradientAccumulator` (a custom training loop's verbs); `fit.py` attaches it to a model
that `fit` trains, with the steps (`exact_step.py`, `own_step.py`, `split_step.py` over
`split.py`), the micro-batch weight (`weights.py`), resuming inside an epoch
(`resume.py`), the epoch hook (`hook.py`) and the log entries (`logs.py`) beside it.
What touches tf.distribute is in `distributed.py` and `replicas.py`, the non-finite
policies in `screening.py`, loss scaling in `loss_scale.py`, Keras's private TensorFlow
pieces in `keras_compat.py`.
"""
