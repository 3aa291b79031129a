"""Backend adapters: what differs between Keras's backends, and nothing else.

The TensorFlow adapter is the package's original modules (`gradaccum._fit`,
`gradaccum.accumulator` and their helpers); the JAX adapter lives in `backends.jax`.
"""
