"""``bench beside``'s sampling stand-in (bench/beside.py): its steps take the Python time asked for and
run inside the runtime's model-call bracket, so the compile thread sees sampling (its pacing then
applies). The rows themselves (a real background compile each, a minute or more) are the bench's:
docs/bench.md."""
from __future__ import annotations

import time

from unet_compiler.bench import beside
from unet_compiler.compiler.lifecycle import pacing
from unet_compiler.compiler.lifecycle.scheduler import process_scheduler


def _ms(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t0) * 1e3


def test_the_sampling_stand_in_is_sampling_to_the_compile_thread(monkeypatch):
    monkeypatch.setattr(process_scheduler(), "activity", pacing.Activity())
    n = beside._calibrate(2.0)
    took = min(_ms(beside._python_ms, n) for _ in range(5))   # the least of five: another job's burst aside
    assert 0.5 < took < 8, took                    # about the 2 ms asked (this machine's speed varies)
    seen = []
    monkeypatch.setattr(beside, "_python_ms", lambda k: seen.append(process_scheduler().activity.calls))
    rate = beside._loop(n, 1.0, 0.2)
    assert seen and all(c == 1 for c in seen) and 0 < rate <= 1000   # each step inside a model call
    assert pacing.sampling_now(process_scheduler().activity)    # just sampled: the compile thread would pause
