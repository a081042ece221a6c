"""Triton kernels, each beside its PyTorch reference and host launcher.

Empty in this release: the fused CUDA kernels land with the triton backend
(issue #3). CPU speed comes from compiler/passes (prepacked oneDNN convs)
and inductor."""
