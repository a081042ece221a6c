"""No rewrites: ComfyUI's / diffusers' own code, for A/B and debugging."""
from . import Backend, register_backend


@register_backend("eager")
class EagerBackend(Backend):
    auto_rank, fallback = 3, True
    dit_blocks = True     # (it runs them as given, like everything)
    summary = "no rewrites, ComfyUI's own code (A/B, debugging)"

    def available(self, device):
        return True, "no rewrites"
