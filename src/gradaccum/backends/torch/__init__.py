"""gradaccum on Keras's PyTorch backend: the adapter (`fit.py`), the training step
(`step.py`, `own_step.py`), the window record over torch tensors (`record.py`),
`GradientAccumulator` for custom loops and `torch.distributed` (`accumulator.py`,
`distributed.py`) and DP-SGD's per-example gradients with `torch.func`
(`privacy.py`). What accumulation does is `gradaccum.core`'s."""
