"""What the compile thread runs a recorded region call on: stand-ins for its inputs (``spec`` of
each input, ``stand_ins`` made from them) and the caller thread's dispatch state and dynamo settings
(``modes_now``, entered again with ``modes``), all of which the compiled variant's guards check."""
from __future__ import annotations

import contextlib

import torch


def spec(a):
    """What a stand-in for input ``a`` needs (values are not guarded: zeros will do)."""
    if isinstance(a, torch.Tensor):
        return ("t", tuple(a.shape), tuple(a.stride()), a.dtype, a.device, a.is_inference(), a.requires_grad)
    return ("v", a)


def stand_ins(specs, struct_inputs) -> list:
    args = []
    for i, s in enumerate(specs):
        if struct_inputs[i] not in (-1, i):       # the same tensor as an earlier input
            args.append(args[struct_inputs[i]])
        elif s[0] == "t":
            _, shape, stride, dtype, device, inference, grad = s
            with torch.inference_mode(inference):
                # zeros, not uninitialised memory: the compile thread calls the variant once on them
                # (denormal garbage would make that call slow)
                t = torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()
            args.append(t.requires_grad_() if grad else t)
        else:
            args.append(s[1])
    return args


#: dynamo settings the backends patch around a call (``Backend.dynamo_config``); patches are per thread
_DYNAMO_KEYS = ("force_parameter_static_shapes", "force_nn_module_property_static_shapes",
                "assume_static_by_default", "automatic_dynamic_shapes")


def modes_now(device_type: str) -> tuple:
    """The caller thread's grad / inference / autocast state (variants guard it) and its dynamo
    settings (how it traces): all per thread, so the compile thread takes them over."""
    dynamo = {k: getattr(torch._dynamo.config, k) for k in _DYNAMO_KEYS if hasattr(torch._dynamo.config, k)}
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), device_type,
            torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type), tuple(dynamo.items()))


@contextlib.contextmanager
def modes(state):
    grad, inference, device_type, autocast, dtype, dynamo = state
    with (torch.inference_mode(inference), torch.set_grad_enabled(grad),
          torch.autocast(device_type, dtype=dtype, enabled=autocast), torch._dynamo.config.patch(**dict(dynamo))):
        yield
