"""Intel Extension for PyTorch on the leaf regions, weights kept live.

Each leaf region runs on a private copy that ``ipex.optimize`` prepared (conv /
linear weights prepacked into oneDNN's layout, bf16 when precision=bf16 and the
CPU can); the model itself is never touched. Weights are live: the copy is a
cache keyed on the region's parameters and ComfyUI's weight epoch, rebuilt
before the call whenever any of them changed. BatchNorm folding and
concat_linear are deliberately not asked of IPEX (``NOT_REQUESTED``).
"""
from __future__ import annotations

import copy
import logging
import warnings
from collections import Counter

import torch

from .. import regions
from .. import weights
from ..compat import ipex as ipex_compat
from ..plan import PROJECTION
from ..reasons import Reason
from . import Backend, register_backend

log = logging.getLogger(__name__)

_PLAIN = (torch.nn.Conv2d, torch.nn.Linear, torch.nn.GroupNorm, torch.nn.LayerNorm)
NOT_REQUESTED = ("not asked of IPEX: BatchNorm folding (a UNet has no BatchNorm) and concat_linear (it would "
                 "merge to_q/to_k/to_v, which LoRA and attention patches address by name)")


def _plain_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A detached copy of one region with ComfyUI op subclasses mapped to the
    torch classes IPEX prepacks (same math once ComfyUI does not cast: the
    runtime sends casting regions down the eager path before they get here)."""
    shadow = copy.deepcopy(module)
    for m in shadow.modules():
        m.__dict__.pop("forward", None)  # a runtime shim copied along with the instance dict
        for base in _PLAIN:
            if isinstance(m, base) and type(m) is not base and type(m).__module__.startswith("comfy."):
                m.__class__ = base
                break
    return shadow.eval()


@register_backend("ipex")
class IpexBackend(Backend):
    auto_rank = 1
    summary = "Intel Extension for PyTorch (an Intel CPU, IPEX beside torch 2.8)"
    specialises_on_shapes = False  # ipex.optimize'd copies run any shape; no probe shapes to prime

    def __init__(self):
        self.stats: Counter = Counter()
        self._copies = weights.DerivedCache(self.stats)
        self.dtype = None

    def available(self, device):
        if getattr(device, "type", "cpu") != "cpu":
            return False, Reason(f"IPEX accelerates CPU models here; this model is on {device}")
        ipex, why = ipex_compat.load()
        if ipex is None:
            return False, why
        return True, (f"IPEX {ipex_compat.ipex_version()}: ipex.optimize on each leaf region (oneDNN weight "
                      f"prepacking, redone when weights change)")

    def auto_ok(self, device):
        if not ipex_compat.is_intel_cpu():
            return False, Reason("not an Intel CPU (auto picks IPEX only on Intel; choose ipex to force it)")
        return True, ""

    def cast_problem(self) -> Reason:
        return Reason("IPEX optimizes a copy of each region's weights once, and weights ComfyUI casts per call "
                      "would be optimized again on every call", "choose inductor in Select Backend to compile them")

    # ---- the copies -----------------------------------------------------
    def _dtype_for(self, config, ipex):
        if config.precision == "bf16":
            try:
                ok = bool(ipex._C.onednn_has_bf16_support())
            except Exception:
                ok = False
            if ok:
                return torch.bfloat16
            self.stats["bf16_unsupported"] += 1
        return None

    def _build(self, module, ipex):
        shadow = _plain_copy(module)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            shadow = ipex.optimize(shadow, dtype=self.dtype, inplace=True, conv_bn_folding=False,
                                   linear_bn_folding=False, concat_linear=False, weights_prepack=True,
                                   replace_dropout_with_identity=True, graph_mode=False)
        for w in caught:  # summarised in the report; the raw text only at debug level
            log.debug("IPEX: %s", w.message)
            self.stats["ipex_warnings"] += 1
        return shadow

    def shadow(self, module, ipex):
        return self._copies.derived(module, weights.fingerprint(module.parameters()),
                                    lambda: self._build(module, ipex))

    def impls(self, config, scheduler) -> dict:
        ipex, why = ipex_compat.load()
        if ipex is None:  # resolve() checked; a direct caller gets the reason
            raise RuntimeError(why)
        self.dtype = self._dtype_for(config, ipex)

        def wrap(body):
            def run(module, *args):
                return body(self.shadow(module, ipex), *args)
            return run

        out = {key: wrap(body) for key, body in regions.BODIES.items()}
        out[("comfy", PROJECTION)] = out[("diffusers", PROJECTION)] = wrap(lambda conv, x: conv(x))
        return out

    def status_lines(self, modules=()) -> list[str]:
        s, live = self.stats, self._copies.values()
        if not live:
            return ["  ipex: regions are prepared on the first call"]
        packed = sum(1 for shadow in live for m in shadow.modules() if type(m).__name__.startswith("_IPEX"))
        lines = [f"  ipex: {len(live)} region copies optimized, {packed} conv/linear weights "
                 f"prepacked (oneDNN blocked layout, dtype {str(self.dtype or 'as the model').replace('torch.', '')})"
                 f"; rebuilt after weight changes: {s['rederived']}", f"  ipex: {NOT_REQUESTED}"]
        if s["bf16_unsupported"]:
            lines.append("  ipex: bf16 asked for but this CPU's oneDNN has no bf16 support: kept the model dtype")
        if s["ipex_warnings"]:
            lines.append(f"  ipex: {s['ipex_warnings']} IPEX warning(s) (log level DEBUG shows them)")
        return lines
