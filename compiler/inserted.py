"""Modules another pack inserts into a planned model (AnimateDiff's motion modules, put into the
UNet's blocks when ComfyUI loads it and taken out when it unloads it): they are no regions, so
they run as they are; this finds them and names them for the report. It also keeps the modules
that take whole videos per call (inserted or planned), whose frames per call warmup must match."""
from __future__ import annotations

import contextlib
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
        #: modules of the plan that take whole videos per call (motion modules in the model when planned)
        self._planned_videos = [weakref.ref(m) for m in modules.values() if takes_videos(m)]
        self._containers = [(weakref.ref(modules[p]), len(modules[p]._modules)) for p in sorted(paths) if p in modules]
        self._seen: set[int] = set()
        #: "module.Class" -> how many such modules were found inserted
        self.found: Counter = Counter()

    def check(self) -> bool:
        """Whether a container holds more or fewer children than last time (a module inserted or taken
        out; ``found`` is brought up to date); a length per container, cheap enough for every call."""
        changed = False
        for i, (ref, n) in enumerate(self._containers):
            c = ref()
            if c is not None and len(c._modules) != n:
                self._containers[i] = (ref, len(c._modules))
                self._scan(c)
                changed = True
        return changed

    def _new(self, container) -> list:
        return [m for m in container._modules.values() if m is not None and id(m) not in self._planned]

    def video_modules(self) -> list:
        """The modules there now that take whole videos per call (:func:`takes_videos`): inserted
        ones first, then planned ones."""
        out = []
        for ref, _ in self._containers:
            c = ref()
            out += [m for m in (self._new(c) if c is not None else ()) if takes_videos(m)]
        return out + [m for m in (r() for r in self._planned_videos) if m is not None]

    @property
    def video_length(self) -> int | None:
        """The frames per call the modules that take whole videos there now take, as the pack that
        owns them last set it (``video_length``); None: no such module."""
        return next((m.video_length for m in self.video_modules()), None)

    def whole_videos(self, shapes, window: int | None, note):
        """(the frames per call warmup gives the modules that take whole videos, ``shapes`` less the
        entries they cannot take). Such modules (AnimateDiff's motion modules) need a batch that is a
        multiple of the frames they take per call: ``window`` (sliding context windows) where set,
        else their ``video_length`` as their pack last set it. Each entry left out is said through
        ``note(text)`` (the report's) with the entry to give instead; (None, shapes) when the model has no such module."""
        from .shapes import Shape
        self.check()
        n = self.video_length
        if not n:
            return None, shapes
        n, why = (window, "its context windows") if window else (n, "their video length, as that pack last set it")
        kept = [s for s in shapes if s.batch % n == 0]
        for s in shapes:
            if s.batch % n:
                fix = Shape(2 * n, s.width, s.height, s.frames)
                note(f"warmup entry {s.label} left out: modules another pack inserted take whole videos of "
                     f"{n} frames per call ({why}), so a call's batch is a multiple of {n}. Fix: give "
                     f"{fix.label} (one video, cond and uncond) or {n}x{s.width}x{s.height}")
        return n, kept

    @contextlib.contextmanager
    def videos_of(self, frames: int | None):
        """Within: every module that takes whole videos takes ``frames`` per call (its pack's own
        ``set_video_length(frames, frames)``: one video of that many frames); after, each holds what
        it held before. Nothing changes for ``frames`` None."""
        held = [(m, m.video_length, getattr(m, "full_length", m.video_length))
                for m in (self.video_modules() if frames else ())]
        try:
            for m, _, _ in held:
                m.set_video_length(frames, frames)
            yield
        finally:
            for m, length, full in held:
                m.set_video_length(length, full)

    def _scan(self, container) -> None:
        for m in self._new(container):
            if id(m) not in self._seen:
                self._seen.add(id(m))
                self.found[class_name(type(m))] += 1

    def line(self) -> str | None:
        """The report's line, or None when nothing was inserted."""
        if not self.found:
            return None
        kinds = ", ".join(f"{n} x {name}" for name, n in self.found.items())
        return (f"modules inserted into the model after it was planned run as they are, not compiled "
                f"(another pack's, such as AnimateDiff's motion modules): {kinds}")


def frame_count(value) -> int | None:
    """``value`` where it is a count of frames (a positive int, not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def takes_videos(module) -> bool:
    """Whether ``module`` takes whole videos per call, by its shape: a positive int ``video_length``
    and a ``set_video_length(video_length, full_length)`` (AnimateDiff's motion modules: their
    batch is videos x frames and they attend over each video's frames)."""
    return bool(frame_count(getattr(module, "video_length", None))) and callable(
        getattr(module, "set_video_length", None))
