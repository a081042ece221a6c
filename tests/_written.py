"""Classes a test makes to stand for code written elsewhere (another pack's ops, a newer ComfyUI's
method), made to read as written in their class body, as the pack's overrides watch tells a class's
own methods from ones another node set on it (``compiler.overrides.written_in``: the module a
function names and the class its code was compiled in)."""
from __future__ import annotations

import types


def as_written(cls: type, module: str | None = None) -> type:
    """``cls``, moved to ``module`` where given, each function in its body (under a static or class
    method, a property) named as written in it. Returns ``cls``."""
    if module is not None:
        cls.__module__ = module
    for name, value in vars(cls).items():
        f = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if isinstance(f, types.FunctionType):
            written_as(f, cls, name)
    return cls


def written_as(f: types.FunctionType, cls: type, name: str) -> types.FunctionType:
    """Function ``f`` named as written in ``cls``'s body as ``name`` (a test's stand-in for the
    model's own method). Returns ``f``."""
    f.__module__ = cls.__module__
    f.__qualname__ = f"{cls.__qualname__}.{name}"
    if hasattr(f.__code__, "co_qualname"):
        f.__code__ = f.__code__.replace(co_qualname=f.__qualname__)
    return f
