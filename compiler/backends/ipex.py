"""Intel Extension for PyTorch: registered name; probed from package metadata
only (importing a mismatched IPEX crashes the process)."""
from importlib import metadata

import torch

from . import Backend, register_backend


def ipex_version() -> str | None:
    try:
        return metadata.version("intel_extension_for_pytorch")
    except metadata.PackageNotFoundError:
        return None


@register_backend("ipex")
class IpexBackend(Backend):
    def available(self, device):
        v = ipex_version()
        if v is None:
            return False, "not on this machine: intel_extension_for_pytorch is not installed"
        tv = torch.__version__.split("+")[0]
        if v.split(".")[:2] != tv.split(".")[:2]:
            return False, (f"not on this machine: IPEX {v} needs torch {'.'.join(v.split('.')[:2])}.x but torch "
                           f"{tv} is installed (IPEX would crash on import); not importing it")
        return False, "not available yet: the IPEX backend is not in this release (use inductor)"
