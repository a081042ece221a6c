"""torch capability probes."""
from __future__ import annotations

import torch

from ..reasons import Reason

MIN_TORCH = (2, 3)


def torch_version() -> tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def torch_too_old() -> Reason | None:
    """Why this torch cannot run the compiled path, else None."""
    if torch_version() < MIN_TORCH:
        why = (f"torch {torch.__version__} is older than {MIN_TORCH[0]}.{MIN_TORCH[1]}, which torch.compile "
               f"regional compilation needs; running eager")
        fix = "upgrade torch (pip install -U torch)"
        return Reason(why, fix, text=f"{why}. Fix: {fix}.")
    return None


def mkldnn_conv_available() -> bool:
    return (bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_convolution_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_convolution_weight"))


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type`` now, None where it is off. torch < 2.4 has
    no per-device queries: the CPU's own there, the GPU's for every other device."""
    try:
        on = torch.is_autocast_enabled(device_type)
    except TypeError:   # (torch < 2.4)
        if device_type == "cpu":
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    return torch.get_autocast_dtype(device_type) if on else None
