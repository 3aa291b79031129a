"""What accumulation is, with no backend: the options and their checks, when a
window closes, and the combination formula. Written with `keras.ops` and NumPy only
(no TensorFlow, no JAX import): the TensorFlow and JAX adapters both build on it."""
