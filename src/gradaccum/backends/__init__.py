"""Backend adapters: what differs between Keras's backends, and nothing else.

One folder per Keras backend: `tensorflow` keeps the state in `tf.Variable`s and runs
under tf.distribute; `jax` carries it through Keras's stateless, jitted train step;
`torch` keeps it in Keras variables over torch tensors and runs under
DistributedDataParallel. Each reads the options, the math and the window's rule from
`gradaccum.core` and subclasses the adapter interface, `gradaccum.adapter`.
"""
