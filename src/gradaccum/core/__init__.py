"""What accumulation is, with no backend: the options and their checks, when a
window closes, and the combination formula. Written with `keras.ops` and NumPy only
(no TensorFlow, JAX or PyTorch import): every backend's adapter builds on it."""
