"""The pack's off switch: ``UNET_COMPILER_DISABLE=1`` turns every rewrite off (the model's own code
runs, the report says why). Its own module so the report and the config both read it without
importing each other."""
from __future__ import annotations

import os

DISABLE_ENV = "UNET_COMPILER_DISABLE"


def disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")
