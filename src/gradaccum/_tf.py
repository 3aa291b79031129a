"""A clear message when TensorFlow is missing (it is an install-time choice)."""


def require_tensorflow() -> None:
    try:
        import tensorflow  # noqa: F401
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "gradaccum needs TensorFlow >= 2.16. Install it with one of:\n"
            "  pip install 'gradaccum[cpu]'   # CPU-only TensorFlow (smaller)\n"
            "  pip install 'gradaccum[gpu]'   # TensorFlow with CUDA (Linux GPUs)\n"
            "  pip install 'gradaccum[tf]'    # the standard `tensorflow` wheel"
        ) from error
