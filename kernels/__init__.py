"""Triton kernels, each beside its PyTorch reference and host launcher.

One module per kernel a backend uses (groupnorm, geglu, attention, epilogue; the bench keeps two
no backend uses in bench/spare_kernels), each with the
``@triton.jit`` kernel, a launcher that reads the tensors it is given (weights are live:
nothing derived is cached) and a ``*_reference`` in plain PyTorch. Importing this package
imports nothing heavy: the kernel modules import triton and are imported lazily. Launchers
raise ``_common.KernelUnsupported`` for inputs they cannot run (the caller runs that region
eager). Kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1.
"""
