"""Backend adapters: what differs between Keras's backends, and nothing else.

`backends.tensorflow` keeps the state in `tf.Variable`s and runs under tf.distribute;
`backends.jax` carries it through JAX's stateless train step. Both read the options,
the math and the window rule from `gradaccum.core`.
"""
