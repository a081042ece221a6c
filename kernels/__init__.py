"""Triton kernels, each beside its PyTorch reference and host launcher.

One module per kernel; each holds the ``@triton.jit`` kernel, a launcher that
reads the tensors it is given (weights are live: nothing derived is cached)
and a ``*_reference`` function in plain PyTorch:

  groupnorm   groupnorm(x, num_groups, weight, bias, eps, silu=False)
  layernorm   layernorm(x, weight, bias, eps)
  geglu       geglu(h, approximate="none")
  attention   attention(q, k, v, scale=None)        q/k/v [B, heads, N, d]
  epilogue    bias_residual(x, bias, residual, dim=1, out=None)
  qkv         qkv_projection(x, w_q, w_k, w_v, context=None, b_q=None, b_k=None, b_v=None)

``python -m unet_compiler.kernels.targets`` (a tool, not a kernel) compiles them
all for sm_80/86/89/90a/120 without a GPU and reports registers, spills, shared
memory and access widths per variant (DEVELOPERS.md has the table).

Importing this package imports nothing heavy: the kernel modules import
triton and are imported lazily by the backend. ``_common`` (torch only) holds
:class:`KernelUnsupported`, the ValueError every launcher raises for inputs it
cannot run (device, dtype, size, layout); the caller runs that region eager.
Kernels run on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 was
set before triton was imported (the tests do this).
"""
