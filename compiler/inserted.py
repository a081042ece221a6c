"""Modules another pack inserts into a planned model (AnimateDiff's motion modules, put into the
UNet's blocks when ComfyUI loads it and taken out when it unloads it): they are no regions, so
they run as they are; this finds them and names them for the report."""
from __future__ import annotations

import weakref
from collections import Counter

from .compat.comfy import class_name


class Inserted:
    """The containers of a plan's regions (their parents), with how many children each held when
    the model was planned: a call finds a container that holds more (:meth:`check`, a length per
    container) and names the children that were not there (``found``: class -> modules)."""

    def __init__(self, root, plan):
        paths = {region.path.rpartition(".")[0] for region in plan.regions if "." in region.path}
        modules = dict(root.named_modules()) if paths else {}
        self._planned = {id(m) for m in modules.values()}
        self._containers = [(weakref.ref(modules[p]), len(modules[p]._modules)) for p in sorted(paths) if p in modules]
        self._seen: set[int] = set()
        #: "module.Class" -> how many such modules were found inserted
        self.found: Counter = Counter()

    def check(self) -> bool:
        """Whether a container holds other children than last time (then ``found`` is brought up to
        date); a length per container, cheap enough for every call."""
        changed = False
        for i, (ref, n) in enumerate(self._containers):
            c = ref()
            if c is not None and len(c._modules) != n:
                self._containers[i] = (ref, len(c._modules))
                changed |= self._scan(c)
        return changed

    def _new(self, container) -> list:
        return [m for m in container._modules.values() if m is not None and id(m) not in self._planned]

    @property
    def video_length(self) -> int | None:
        """The frames per call the inserted modules there now take, where they say it
        (``video_length``, as AnimateDiff's motion modules hold it); None: none says."""
        for ref, _ in self._containers:
            c = ref()
            for m in self._new(c) if c is not None else ():
                frames = getattr(m, "video_length", None)
                if isinstance(frames, int) and frames > 0:
                    return frames
        return None

    def _scan(self, container) -> bool:
        new = False
        for m in self._new(container):
            if id(m) not in self._seen:
                self._seen.add(id(m))
                self.found[class_name(type(m))] += 1
                new = True
        return new

    def line(self) -> str | None:
        """The report's line, or None when nothing was inserted."""
        if not self.found:
            return None
        kinds = ", ".join(f"{n} x {name}" for name, n in self.found.items())
        return (f"modules inserted into the model after it was planned run as they are, not compiled "
                f"(another pack's, such as AnimateDiff's motion modules): {kinds}")
