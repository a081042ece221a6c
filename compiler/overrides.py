"""Code another node set on the modules the regions stand in for, found at the start of each UNet call.

A region's body reads its submodules' weights without calling their ``forward`` (a leaf's call aside);
a CUDA graph replays what its capture ran; one graph per UNet call replays the code between the regions
too. A forward hook, or a method set on one instance (ComfyUI's ``add_object_patch`` of
``diffusion_model.blocks.0.cross_attn.forward``, a step cache's ``forward_orig``), would be skipped or
frozen there. :class:`Overrides` finds them; :class:`Found` says where:

- ``regions``: region module -> why it runs the model's own code this call: another node set the method
  its shim stands in for, a ``forward`` on a module inside it, a forward hook inside it, or (a diffusers
  attention) another kind of attention processor than the one it was planned with;
- ``around``: why the code around the regions is not the model's as planned (a method set on the root,
  a container, a region module or a leaf): one graph per UNet call stands aside for the call;
- ``hooked``: a forward hook on a module around the regions (one graph per UNet call finds those itself);
- ``classes``: why the code of a class around the regions is not the model's as planned.

A method set on a class (:meth:`Overrides.check_classes`: AnimateDiff-Evolved's GroupNorm hack sets
``torch.nn.GroupNorm.forward`` inside a diffusion-model wrapper) is skipped by a body as an instance's
is, a graph replays the method it captured, and dynamo inlines a builtin torch module's method
without a guard: the regions with modules of that class run the model's own code while it is set, as do
those with a method at planning that was not written in its class's body (set at import by another
pack); one graph per UNet call stands aside while a class around the regions has one.

With any of the last three the regions' graphs check their weights' addresses before each replay: such
code may move a block's weights inside the call (block swap).

ComfyUI's attention choice is watched with the classes: the bodies compute exact attention, so a region
whose code would call another function (``--use-sage-attention``, a pack that sets
``optimized_attention``, the newest ComfyUI's per-module ``comfy_attention.function``, another function
on the way to it) runs the model's own code for the call (:func:`exact_attention`).

A call that finds nothing costs one pass over the modules' dicts in C (``check``; their hook dicts
only after a hook was registered somewhere: torch counts the handles it makes). The pack's own
callables carry :data:`OWN`.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import logging
import operator
import sys
import types
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils.hooks import RemovableHandle

from . import graphs
from .compat.comfy import class_name

log = logging.getLogger(__name__)

#: the attribute that marks the pack's own callables set on modules (region shims, the root's forward)
OWN = "unet_compiler_own"


def own(fn):
    """``fn``, marked as the pack's (not another node's override)."""
    setattr(fn, OWN, True)
    return fn


def is_code(value) -> bool:
    """Whether an instance attribute of a module is code: a callable that is no submodule, tensor or
    class (a function, a method, a callable object)."""
    return callable(value) and not isinstance(value, (torch.nn.Module, torch.Tensor, type))


def _is_code(value) -> bool:
    """Code another node may have set on a module instance (:func:`is_code`, not the pack's own)."""
    return is_code(value) and not getattr(value, OWN, False)


def _leaf(m) -> bool:
    return next(m.children(), None) is None


def _leftover(m, key: str) -> bool:
    """Whether ``m.__dict__[key]`` is its own class's method bound to it, which ComfyUI's unpatch
    writes back where an object patch was (its ``set_attr`` saved ``getattr``'s bound method); it is
    then removed, so the module reads its class's method again, as before the patch."""
    v = m.__dict__.get(key)
    if isinstance(v, types.MethodType) and v.__self__ is m \
            and v.__func__ is getattr(inspect.getattr_static(type(m), key, None), "__func__",
                                      inspect.getattr_static(type(m), key, None)):
        m.__dict__.pop(key, None)
        return True
    return False


def _len_within(d: dict, base: frozenset) -> int:
    """The key count ``check`` expects of ``d``: its own when every key is in ``base``, else -1, so the
    first check looks (a base kept from an earlier watch may lack a key set since: a count alone would
    not tell a key gone from one added)."""
    return len(d) if d.keys() <= base else -1


#: classes whose methods are not watched (a method set on torch.nn.Module is set on every module)
_UNWATCHED = (object, torch.nn.Module)
_GONE = object()


def _code_attr(value) -> bool:
    """Whether a class attribute is code: a function, a static or class method, a property."""
    return isinstance(value, (types.FunctionType, staticmethod, classmethod, property))


def _function_of(value):
    if isinstance(value, property):
        return value.fget
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


#: methods Python calls without naming them in the code (a call, an attribute's lookup, a container's use)
_IMPLICIT = frozenset({"__call__", "__getattr__", "__getattribute__", "__getitem__", "__iter__", "__len__",
                       "__contains__", "__bool__", "__enter__", "__exit__"})


def _names_in(code) -> set:
    """The names ``code`` and the code nested in it (inner functions, comprehensions) look up."""
    out: set = set()
    codes = [code]
    while codes:
        code = codes.pop()
        if code is not None:
            out.update(code.co_names)
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return out


def _code_names(value) -> set:
    """The names the code of a class attribute (its functions, their decorated originals and the
    code nested in them) looks up."""
    out: set = set()
    fns = [value.fget, value.fset, value.fdel] if isinstance(value, property) else [_function_of(value)]
    seen: set = set()
    for f in fns:
        while f is not None and id(f) not in seen:     # (a __wrapped__ chain may loop)
            seen.add(id(f))
            out |= _names_in(getattr(f, "__code__", None))
            f = getattr(f, "__wrapped__", None)
    return out


def reachable(methods: list, seeds) -> set:
    """The method names the code in ``methods`` (a {name: class attribute} per class) can reach from
    ``seeds`` (``forward``, the shims' methods) by name: a class's other methods (diffusers' loaders,
    ``from_pretrained``) run outside the call."""
    names, done, grew = set(seeds) | _IMPLICIT, set(), True
    while grew:
        grew = False
        for j, code in enumerate(methods):
            for k, v in code.items():
                if k in names and (j, k) not in done and _code_attr(v):
                    done.add((j, k))
                    before = len(names)
                    names |= _code_names(v)
                    grew = grew or len(names) != before
    return names


def written_in(cls: type, value) -> bool:
    """Whether class attribute ``value`` (code) was written in the body of ``cls`` or of one of its
    bases (its innermost function, under its decorators), else another module set it there: a
    monkeypatch. The pack's own, and callables that are no Python function, are not judged."""
    f = _function_of(value)
    if not isinstance(f, types.FunctionType) or getattr(f, OWN, False):
        return True
    try:
        f = inspect.unwrap(f)
    except ValueError:
        return False
    if not isinstance(f, types.FunctionType):
        return True
    where = getattr(f.__code__, "co_qualname", f.__qualname__)   # (where it was written, whatever wraps copied)
    return any(f.__module__ == c.__module__ and where.startswith(c.__qualname__ + ".") for c in cls.__mro__)


def _plain_cell(cell) -> bool:
    """Whether a wrapper's closure cell holds only a function or a constant (no context manager, as
    ``torch.autocast`` or another node's decorator object holds)."""
    try:
        return isinstance(cell.cell_contents, (types.FunctionType, str, int, float, type(None)))
    except ValueError:   # (an empty cell)
        return True


def _own_method(cls: type, key: str, value) -> bool:
    """Whether ``value`` is method ``key`` as written in the body of ``cls`` or of a base, under
    decorators written in the class's own top-level package holding nothing but functions and
    constants (diffusers' ``apply_lora_scale``); a patch made elsewhere with ``functools.wraps`` reads
    as written in the class: the wrapper's own module tells it apart."""
    f = _function_of(value)
    home, seen = str(cls.__module__).split(".")[0], set()
    while isinstance(f, types.FunctionType) and hasattr(f, "__wrapped__"):
        name = f.__globals__.get("__name__")
        if (id(f) in seen or not isinstance(name, str) or name.split(".")[0] != home
                or not all(map(_plain_cell, f.__closure__ or ()))):
            return False
        seen.add(id(f))
        f = f.__wrapped__
    if not isinstance(f, types.FunctionType):
        return False
    where = getattr(f.__code__, "co_qualname", f.__qualname__)
    return any(f.__module__ == c.__module__ and where == f"{c.__qualname__}.{key}" for c in cls.__mro__)


#: the module globals ComfyUI's model code calls its chosen attention by: ``--use-sage-attention``
#: (``--use-flash-attention``, ``--use-ck-attention``) sets them at import, other nodes set them later
ATTENTION_GLOBALS = frozenset({"optimized_attention", "optimized_attention_masked"})
#: ComfyUI's own attention functions that compute exact attention, as the pack's bodies do (SDPA);
#: its sage, sage3 and comfy-kitchen int8 functions quantize
EXACT_ATTENTION = frozenset({"attention_basic", "attention_sub_quad", "attention_split", "attention_pytorch",
                             "attention_xformers", "attention_flash"})
_COMFY_ATTENTION = "comfy.ldm.modules.attention"


def exact_attention(fn) -> bool:
    """Whether attention function ``fn`` computes what the pack's bodies do: one of ComfyUI's own
    exact functions as its attention module wrote it (under its own ``wrap_attn``, no
    ``container_function`` set on it), or None (a module's own choice left unset). Never raises."""
    if fn is None:
        return True
    try:
        if getattr(fn, "container_function", None) is not None:
            return False
        seen = set()
        while isinstance(fn, types.FunctionType) and hasattr(fn, "__wrapped__"):
            if id(fn) in seen or fn.__globals__.get("__name__") != _COMFY_ATTENTION:
                return False
            seen.add(id(fn))
            fn = fn.__wrapped__
        return (isinstance(fn, types.FunctionType) and fn.__globals__.get("__name__") == _COMFY_ATTENTION
                and getattr(fn.__code__, "co_qualname", fn.__code__.co_name) in EXACT_ATTENTION)
    except Exception:   # (an object whose attribute lookup raises: not one of ComfyUI's functions)
        return False


def attention_name(fn) -> str:
    """``module.name`` of an attention function (under its wrappers and partials), for the report.
    Never raises."""
    try:
        f = inspect.unwrap(fn.func if isinstance(fn, functools.partial) else fn)
        return f"{getattr(f, '__module__', None) or '?'}.{getattr(f, '__qualname__', type(f).__qualname__)}"
    except Exception:
        return f"a {type(fn).__module__}.{type(fn).__qualname__}"


#: ComfyUI's top-level package: where its attention choice and the functions on the way to it live
_COMFY = "comfy"


def _comfys(f) -> bool:
    """Whether function ``f``'s code lives in ComfyUI's package (the module its globals are). Never
    raises."""
    try:
        return isinstance(f, types.FunctionType) and str(f.__globals__.get("__name__")).split(".")[0] == _COMFY
    except Exception:   # (an object whose class lookup raises: a lazy proxy)
        return False


#: the most functions one method's walk to ComfyUI's attention choice looks at
_REACH_LIMIT = 5000


def _code_of(v):
    """The Python function a call of ``v`` runs first: ``v`` itself, a partial's or a bound method's
    function, a callable object's ``__call__`` (None: no Python function, a class, a builtin, an object
    that raises when looked at). Never raises."""
    try:
        for _ in range(8):
            if isinstance(v, types.FunctionType):
                return v
            if isinstance(v, functools.partial):
                v = v.func
            elif isinstance(v, types.MethodType):
                v = v.__func__
            elif not isinstance(v, type) and isinstance(call := vars(type(v)).get("__call__"), types.FunctionType):
                v = call
            else:
                return None
    except Exception:   # (a lazy proxy whose class lookup raises)
        return None
    return None


def _attention_reach(fn, planned: dict) -> tuple[list, list]:
    """Where the code of ``fn`` takes ComfyUI's attention choice: (module globals, name) of each
    attention global (:data:`ATTENTION_GLOBALS`) it names, directly or through the module-level
    functions it calls by name or holds in its closure: from ComfyUI's code any Python function
    (a partial's, a callable object's ``__call__``; Flux's blocks call
    ``comfy.ldm.flux.math.attention``, which calls its module's ``optimized_attention``; another
    pack's function set there is followed into), from other code ComfyUI's functions; and (module
    globals, name, function) of each binding in ComfyUI's code on the way to one. ``planned``: {(id of
    module globals, name): function} of the bindings as planned, followed where set."""
    direct: dict[int, list] = {}     # function -> the attention globals its code names
    edges: dict[int, list] = {}      # function -> [((globals, name) or None, what it calls, its function)]
    todo, funcs = [fn], []
    # (a name the code reads as a module's attribute: ComfyUI's attention module's, where the choice is)
    source = getattr(sys.modules.get(_COMFY_ATTENTION), "__dict__", {})
    while todo:
        f = todo.pop()
        if not isinstance(f, types.FunctionType) or id(f) in direct:
            continue
        funcs.append(f)
        g = f.__globals__
        names = _names_in(f.__code__)
        direct[id(f)] = [(g, n) if n in g else (source, n) for n in sorted(names & ATTENTION_GLOBALS)
                         if n in g or n in source]
        # (from ComfyUI's code any Python function it calls by name: another pack's set in its place is
        # followed too; from other code only ComfyUI's functions)
        own = _comfys(f)
        edges[id(f)] = [((g, n), v, c) for n in sorted(names - ATTENTION_GLOBALS)
                        if (c := _code_of(v := planned.get((id(g), n), g.get(n)))) is not None
                        and (own or _comfys(c))]
        wrapped = getattr(f, "__wrapped__", None)
        if isinstance(wrapped, types.FunctionType):
            edges[id(f)].append((None, wrapped, wrapped))
        for cell in f.__closure__ or ():      # (a handler made around the function it calls)
            try:
                v = cell.cell_contents
            except ValueError:   # (an empty cell)
                continue
            c = _code_of(v)
            if c is not None and (own or _comfys(c)):
                edges[id(f)].append((None, v, c))
        todo += reversed([c for _, _, c in edges[id(f)]])
        if len(funcs) > _REACH_LIMIT:   # (bounded: a package calling deep into another)
            break
    reaches = {i for i, d in direct.items() if d}
    grew = True
    while grew:     # (the functions that reach an attention global, through the calls between them)
        grew = False
        for f in funcs:
            if id(f) not in reaches and any(id(c) in reaches for _, _, c in edges[id(f)]):
                reaches.add(id(f))
                grew = True
    chosen = [gn for f in funcs for gn in direct[id(f)]]
    bindings = [(b[0], b[1], v) for f in funcs if _comfys(f) for b, v, c in edges[id(f)]
                if b is not None and id(c) in reaches]
    return chosen, bindings


def _weakly(value):
    """A weak reference to ``value`` where it takes one, else ``value``."""
    try:
        return weakref.ref(value)
    except TypeError:
        return value


def _held(ref):
    """What :func:`_weakly` kept (:data:`_GONE` once it is gone: never a value a slot holds)."""
    if isinstance(ref, weakref.ref):
        value = ref()
        return _GONE if value is None else value
    return ref


def _global_hooks() -> bool:
    from torch.nn.modules import module as nn_module
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


@dataclass
class Found:
    regions: dict = field(default_factory=dict)   # region module -> why
    around: str | None = None
    hooked: bool = False
    classes: str | None = None
    #: why the code around the regions calls another attention function than when planned (it runs as
    #: it is; one graph per UNet call would replay the one it captured, which moves no weights)
    around_attention: str | None = None

    @property
    def moving(self) -> bool:
        """Whether code around the regions may move their weights inside the call."""
        return self.around is not None or self.hooked or self.classes is not None


class Overrides:
    """The watch over one UNet's modules (``root``) for the regions ``modules`` [(region module, the
    method its shim stands in for, its path)]. Built again after a module tree changed
    (:data:`graphs.STRUCTURE`)."""

    def __init__(self, root: torch.nn.Module, regions: list, accepted_procs: tuple = (), before=None):
        self._regions = regions
        # what the model held when planned, kept when the watch is built again (a module tree change,
        # or new shims at a one-shape warmup, while another node's code is set must not make that code
        # the model's own): ``before``, the watch this one replaces
        self._accepted = tuple(accepted_procs)
        self._planned_procs = dict(before._planned_procs) if before is not None else {}
        for m, _, _ in regions:
            if getattr(m, "processor", None) is not None:
                self._planned_procs.setdefault(id(m), type(m.processor))
        self._bases: dict[int, frozenset] = dict(before._bases) if before is not None else {}
        # each watched class's code as planned ({key: value}) and its keys (code or not)
        self._class_code: dict[type, dict] = ({b: dict(c) for b, c in before._class_code.items()}
                                              if before is not None else {})
        self._class_keys: dict[type, frozenset] = dict(before._class_keys) if before is not None else {}
        #: the functions on the way to ComfyUI's attention choice as planned: {(id of the module
        #: globals, name): function}
        self._bindings: dict[tuple, object] = dict(before._bindings) if before is not None else {}
        self._build(root)

    def _build(self, root) -> None:
        self._structure = graphs.STRUCTURE[0]
        self._handles = None     # the hook handle count when the modules last held no hook
        present = {id(m) for m in root.modules()}
        self._bases = {i: b for i, b in self._bases.items() if i in present}   # (bounded)
        own_ids = {id(m) for m, _, _ in self._regions}
        self._inside: list[tuple] = []     # (region index, module path, module) of every module inside a region
        inside_ids: set[int] = set()
        for i, (module, _, _) in enumerate(self._regions):
            for name, m in module.named_modules():
                if m is not module and id(m) not in own_ids:
                    self._inside.append((i, name, m))
                    inside_ids.add(id(m))
        named = [(n, m) for n, m in root.named_modules() if id(m) not in inside_ids]
        self._around_leaves = [(n, m) for n, m in named if _leaf(m)]
        # a `forward` set on a module inside a region (its body skips it) or on a leaf (a graph freezes it)
        self._forward_dicts = [m.__dict__ for _, _, m in self._inside] + [m.__dict__ for _, m in self._around_leaves]
        self._inside_hooks = [d for _, _, m in self._inside for d in (m._forward_hooks, m._forward_pre_hooks)]
        self._own_dicts, self._own_hooks = [m.__dict__ for m, _, _ in self._regions], [h for _, h, _ in self._regions]
        # diffusers' attention processors (``set_attn_processor`` after compiling: PAG, IP-Adapter)
        self._procs = [m for m, _, _ in self._regions if id(m) in self._planned_procs]
        self._proc_types = [self._planned_procs[id(m)] for m in self._procs]
        # around the regions: the root, containers and region modules, each with the keys it had when
        # planned (code among them is the model's as planned: diffusers' attention processors); a key
        # added since is looked at
        # (the root is read from the call's argument, never held: its dict holds the accelerator)
        self._root_base = self._bases.setdefault(id(root), frozenset(root.__dict__))
        self._root_len = _len_within(root.__dict__, self._root_base)
        named = [(n, m) for n, m in named if m is not root]
        self._around = [(n, m) for n, m in named if not _leaf(m)]
        self._around_hooks = [d for _, m in named for d in (m._forward_hooks, m._forward_pre_hooks)]
        self._base = [self._bases.setdefault(id(m), frozenset(m.__dict__)) for _, m in self._around]
        self._lens = [_len_within(m.__dict__, b) for (_, m), b in zip(self._around, self._base, strict=True)]
        self._around_dicts = [m.__dict__ for _, m in self._around]
        # the class of each region module and each module around them, as planned (a ``__class__`` set
        # since, as tomesd and HiDiffusion patch blocks, runs that class's code)
        self._typed = [m for m, _, _ in self._regions] + [m for _, m in self._around]
        self._types = list(map(type, self._typed))
        graphs.track([root, *(m for _, m in named)])
        graphs.track(m for _, _, m in self._inside)
        self._build_classes(root, [m for _, m in named])

    def _build_classes(self, root, around: list) -> None:
        """The methods of every class in the modules' class hierarchies (below torch.nn.Module), and
        which regions (those holding a module of a class with it) and whether the code around them
        (a class of the root, a container or a leaf around) run each."""
        regions_of: dict[type, set] = {}
        outside: set[type] = {type(root), *map(type, around)}
        for i, (module, _, _) in enumerate(self._regions):
            regions_of.setdefault(type(module), set()).add(i)
            if id(module) in self._planned_procs:   # (a diffusers attention's processor, as planned)
                regions_of.setdefault(self._planned_procs[id(module)], set()).add(i)
        for i, _, m in self._inside:
            regions_of.setdefault(type(m), set()).add(i)
        where: dict[type, tuple] = {}
        for cls in {*regions_of, *outside}:
            for b in cls.__mro__:
                if b not in _UNWATCHED:
                    idx, out = where.get(b, (frozenset(), False))
                    where[b] = (idx | regions_of.get(cls, set()), out or cls in outside)
        self._class_where = where
        # the classes (and bases) of the code around the regions that is no region module's
        region_ids = {id(m) for m, _, _ in self._regions}
        self._around_only = frozenset(b for cls in {type(root), *(type(m) for m in around if id(m) not in region_ids)}
                                      for b in cls.__mro__)
        self._class_code = {b: c for b, c in self._class_code.items() if b in where}   # (bounded)
        self._class_keys = {b: k for b, k in self._class_keys.items() if b in where}
        self._cls_types = sorted(where, key=lambda b: (b.__module__, b.__qualname__))
        self._cls_dicts = [vars(b) for b in self._cls_types]
        for b, d in zip(self._cls_types, self._cls_dicts, strict=True):
            # (as planned: a method set since is looked up by the code it replaced)
            self._class_code.setdefault(b, {k: v for k, v in d.items() if _code_attr(v)})
            self._class_keys.setdefault(b, frozenset(d))
        self._slots()

    def _slots(self) -> None:
        """The watched slots from the planned code: (class dict, key, planned value, class), and
        what ``check_classes`` compares in C; then what a call with the classes as planned finds
        (methods another module set before planning), found at the first such call."""
        self._reach = reachable([self._class_code[b] for b in self._cls_types],
                                {"forward", *(hook for _, hook, _ in self._regions)})
        slots = [(d, k, v, b) for b, d in zip(self._cls_types, self._cls_dicts, strict=True)
                 for k, v in self._class_code[b].items() if k in self._reach]
        self._cls_slots = slots
        self._attn_slots = self._attention_slots()
        attn = self._attn_slots
        self._cls_proxies = [d for d, _, _, _ in slots] + [a[0] for a in attn]
        self._cls_names = [k for _, k, _, _ in slots] + [a[1] for a in attn]
        self._cls_values = [v for _, _, v, _ in slots] + [a[2] for a in attn]
        self._cls_lens = [_len_within(d, self._class_keys[b]) for b, d in zip(self._cls_types, self._cls_dicts, strict=True)]
        #: the class code last found changed (weakly, where it can be: what a node set and took back
        #: is let go), its lengths, what was found
        self._cls_last = None
        self._cls_replanned = False
        #: what a call with the classes as planned finds: methods set at import by another pack
        self._cls_static = _GONE

    def _attention_slots(self) -> list:
        """Where the watched code takes ComfyUI's attention choice (:func:`_attention_reach` of the
        methods it reaches: the module globals it calls, and the bindings of the functions on the way)
        and the ``ComfyAttention`` modules inside the regions (the newest ComfyUI: a checkpoint's choice
        per attention module). Each as (dict, key, value as planned (a binding) or now, the regions
        whose code takes it, whether code around the regions does, where, whether it is a binding: any
        change to it is a change; "foreign": another package's function was there when planned)."""
        found: dict[tuple, list] = {}

        def add(d, k, regions, outside, where, binding):
            e = found.setdefault((id(d), k), [d, k, set(), False, where, binding])
            e[2] |= regions
            e[3] = e[3] or outside
        for b in self._cls_types:
            regions, outside = self._class_where[b][0], b in self._around_only
            for k, v in self._class_code[b].items():
                if k in self._reach and _code_attr(v):
                    try:
                        chosen, bindings = _attention_reach(_function_of(v), self._bindings)
                    except Exception:   # (last resort: the objects in its reach are judged one by one)
                        log.debug("UNet Compiler: %s.%s not walked for the attention choice", b.__qualname__, k,
                                  exc_info=True)
                        continue
                    for g, n in chosen:
                        add(g, n, regions, outside, f"{g.get('__name__')}.{n}", False)
                    for g, n, f in bindings:
                        self._bindings.setdefault((id(g), n), f)   # (module globals live as long as the process)
                        # (another package's function there when planned: a pack set it at import)
                        add(g, n, regions, outside, f"{g.get('__name__')}.{n}",
                            "foreign" if not _comfys(self._bindings[(id(g), n)]) else True)
        for i, name, m in self._inside:
            cls = type(m)
            if cls.__name__ == "ComfyAttention" and cls.__module__ == _COMFY_ATTENTION and "function" in m.__dict__:
                add(m.__dict__, "function", {i}, False, f"{name}.function", False)
        return [(d, k, self._bindings[(id(d), k)] if binding else d.get(k), frozenset(r), out, where, binding)
                for d, k, r, out, where, binding in found.values()]

    def check_classes(self) -> Found | None:
        """What another node set on the modules' classes now, None: nothing (the usual call). Made at
        a UNet call's one-graph decision and again at its first region call (after the wrappers ComfyUI
        runs inside the model's forward, which may set them)."""
        try:
            now, lens = list(map(operator.getitem, self._cls_proxies, self._cls_names)), list(map(len, self._cls_dicts))
            if (all(map(operator.is_, now, self._cls_values)) and lens == self._cls_lens
                    and self._cls_static is not _GONE):
                return self._cls_static
            last = self._cls_last
            if last is not None and lens == last[1] and all(map(operator.is_, now, map(_held, last[0]))):
                return last[2]     # (a method set for many calls, or inside each: judged once)
        except Exception:   # (a key gone; a value that does not compare)
            now = None
        found = self._find_classes()
        if self._cls_replanned:     # (a class's own method back where another module's was: planned again)
            self._slots()
            return self.check_classes()
        if now is not None and all(map(operator.is_, now, self._cls_values)) and lens == self._cls_lens:
            self._cls_static = found
        else:
            self._cls_last = (list(map(_weakly, now)), lens, found) if now is not None else None
        return found

    def _find_classes(self) -> Found | None:
        changed = []
        for d, k, v, b in self._cls_slots:
            now = d.get(k, _GONE)
            if now is v:
                if not written_in(b, v):     # (set at planning by another module)
                    changed.append((b, k))
            elif not written_in(b, v) and (now is _GONE or _own_method(b, k, now)):
                # where another module's method was when planned, the class's own (or its base's, the
                # key gone): the model's own code, planned from now on
                if now is _GONE:
                    del self._class_code[b][k]
                    self._class_keys[b] = self._class_keys[b] - {k}
                else:
                    self._class_code[b][k] = now
                self._cls_replanned = True
            else:
                changed.append((b, k))
        for j, (b, d) in enumerate(zip(self._cls_types, self._cls_dicts, strict=True)):
            if len(d) == self._cls_lens[j]:
                continue
            items = dict(d)      # (one read: another thread may set a class attribute meanwhile)
            new = [k for k in items if k not in self._class_keys[b]]
            code = [k for k in new if k in self._reach and _code_attr(items[k])
                    and not getattr(_function_of(items[k]), OWN, False)]
            changed += [(b, k) for k in code]
            if not code:   # only values that are not code (class state another node keeps): the new normal
                self._class_keys[b] = self._class_keys[b] | frozenset(new)
                self._cls_lens[j] = _len_within(d, self._class_keys[b])
        chosen = []
        for d, k, planned, regions, outside, where, binding in self._attn_slots:
            # (the pack's bodies compute exact attention: another choice runs where ComfyUI calls it; the
            # code around the regions runs its own code: only a change since planning matters there)
            now = d.get(k, _GONE)
            moved = now is not planned
            if binding == "foreign" and _comfys(now):
                # ComfyUI's own function back where another pack's was when planned: planned from now on
                self._bindings[(id(d), k)] = now
                self._cls_replanned = True
                continue
            if binding:
                what = f"another node set {where}"
                inside = moved or binding == "foreign"
            else:
                what = f"ComfyUI's attention is {attention_name(now)} ({where})"
                inside = not exact_attention(now)
            if (inside and regions) or (outside and moved):
                chosen.append((what, regions if inside else frozenset(), outside and moved))
        if not changed and not chosen:
            return None
        found = Found()
        for what, regions, outside in chosen:
            for i in sorted(regions):
                module, _, path = self._regions[i]
                found.regions.setdefault(module, f"{path}: {what}")
            if outside:
                found.around_attention = found.around_attention or what
        for b, k in changed:
            what = f"{b.__module__}.{b.__qualname__}.{k}"
            regions, outside = self._class_where[b]
            for i in sorted(regions):
                module, _, path = self._regions[i]
                found.regions.setdefault(module, f"{path}: another node set {what}")
            if outside:
                found.classes = found.classes or f"another node set {what}"
        return found

    def check(self, root) -> Found | None:
        """What is set now on ``root`` (the UNet: None once it is gone), None: nothing (the usual call)."""
        if root is None:
            return None
        if self._structure != graphs.STRUCTURE[0]:
            self._build(root)
        handles = RemovableHandle.next_id
        if handles != self._handles:
            # a hook was registered somewhere since the last look (each registration makes a handle)
            if (any(self._inside_hooks) or any(self._around_hooks) or _global_hooks()
                    or root._forward_hooks or root._forward_pre_hooks):
                return self._find(root)
            self._handles = handles     # none on these modules as of this count
        if not (len(root.__dict__) != self._root_len
                or any(map(operator.contains, self._forward_dicts, itertools.repeat("forward")))
                or any(map(operator.contains, self._own_dicts, self._own_hooks))
                or list(map(len, self._around_dicts)) != self._lens
                or list(map(type, map(getattr, self._procs, itertools.repeat("processor")))) != self._proc_types
                or list(map(type, self._typed)) != self._types):
            return None
        return self._find(root)

    def _find(self, root) -> Found | None:
        found = Found(hooked=bool(root._forward_hooks or root._forward_pre_hooks or any(self._around_hooks)))
        if _global_hooks():   # (registered for every module: those inside the regions too)
            for module, _, path in self._regions:
                found.regions.setdefault(module, f"{path}: a global forward hook")
        code = self._new_code(root, self._root_base, "")
        if code is None:
            self._root_base = self._bases[id(root)] = self._root_base | frozenset(root.__dict__)
            self._root_len = len(root.__dict__)
        elif code:
            found.around = f"another node set {code} on the model"
        for module, hook, path in self._regions:
            fn = module.__dict__.get(hook)
            if fn is not None and not getattr(fn, OWN, False) and not _leftover(module, hook):
                found.regions.setdefault(module, f"{path}: another node set its {hook}")
        for i, (m, planned) in enumerate(zip(self._typed, self._types, strict=True)):
            now = type(m)
            if now is not planned:
                what = f"another node set its class to {class_name(now)}"
                if i < len(self._regions):
                    found.regions.setdefault(m, f"{self._regions[i][2]}: {what}")
                else:
                    found.around = found.around or f"{self._around[i - len(self._regions)][0]}: {what}"
        paths = {id(m): path for m, _, path in self._regions}
        for i, (m, planned) in enumerate(zip(self._procs, self._proc_types, strict=True)):
            now = type(getattr(m, "processor", None))
            if now is planned:
                continue
            if now in self._accepted:   # (another kind the compiled code serves: the new normal)
                self._proc_types[i] = now
                continue
            found.regions.setdefault(m, f"{paths[id(m)]}: attention processor {now.__name__}, not the "
                                        f"{planned.__name__} it was compiled with")
        for i, name, m in self._inside:
            module, _, path = self._regions[i]
            d = m.__dict__
            if "forward" in d and not getattr(d["forward"], OWN, False) and not _leftover(m, "forward"):
                found.regions.setdefault(module, f"{path}.{name}: another node set its forward")
            elif d["_forward_hooks"] or d["_forward_pre_hooks"]:
                found.regions.setdefault(module, f"{path}.{name}: a forward hook")
        for j, (name, m) in enumerate(self._around):
            d = m.__dict__
            if len(d) != self._lens[j]:
                code = self._new_code(m, self._base[j], name + ".")
                if code is None:   # only values that are not code (state another node keeps): the new normal
                    self._base[j] = self._bases[id(m)] = self._base[j] | frozenset(d)
                    self._lens[j] = len(d)
                elif code:
                    found.around = found.around or f"another node set {code}"
        for name, m in self._around_leaves:
            d = m.__dict__
            if "forward" in d and not getattr(d["forward"], OWN, False) and not _leftover(m, "forward"):
                found.around = found.around or f"another node set {name}.forward"
        return found if found.regions or found.moving else None

    @staticmethod
    def _new_code(m, base: frozenset, prefix: str) -> str | None:
        """The first key of ``m`` not in ``base`` that holds code another node set, prefixed; None when
        there is none (leftovers of an unpatch removed on the way)."""
        for k in sorted(k for k in m.__dict__ if k not in base):
            if _is_code(m.__dict__.get(k)) and not _leftover(m, k):
                return prefix + k
        return None
