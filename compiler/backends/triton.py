"""Fused Triton kernels: registered name, kernels land with issue #3."""
from . import Backend, register_backend


@register_backend("triton")
class TritonBackend(Backend):
    def available(self, device):
        return False, "not available yet: the fused Triton kernels are not in this release (use inductor)"
