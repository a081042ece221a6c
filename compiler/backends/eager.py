"""No rewrites: ComfyUI's / diffusers' own code, for A/B and debugging."""
from . import Backend, register_backend


@register_backend("eager")
class EagerBackend(Backend):
    def available(self, device):
        return True, "no rewrites"
