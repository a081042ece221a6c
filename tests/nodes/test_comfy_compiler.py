"""ComfyUI's own compiler (tests/_comfy_compiler.py: comfy-aimdo's allocation recorder, which
replays each block's allocations, and ``comfy.model_prefetch``) around a model the pack
accelerates, under ``--assert-graph-breaks``: ComfyUI's tiny Flux.1 dev opted in as the newest
recorded models are (MiniMax H3, LTX-AV: the forward in ``malloc_graph_scope``, each block after
``prefetch_queue_pop(..., malloc_scope=...)``), nodes separated by ComfyUI's between-node
``cleanup_prefetch_queues``."""

import pytest
import torch

from unet_compiler.compiler.config import CompileConfig
from unet_compiler.nodes import patcher

pytestmark = pytest.mark.comfy

CFG = CompileConfig(backend="inductor")


def _opt_in(dm) -> None:
    """Flux's forward in a recording scope and each of its block loops scoped per block, as the
    recorded models write it (``for block in blocks: prefetch_queue_pop(queue, device, block,
    malloc_scope="block")`` then one pop with no block after the loop; no prefetch queue)."""
    import comfy

    class Scoped(torch.nn.ModuleList):
        def __iter__(self):
            for block in super().__iter__():
                comfy.model_prefetch.prefetch_queue_pop(None, None, block, malloc_scope=self._scope)
                yield block
            comfy.model_prefetch.prefetch_queue_pop(None, None, None, malloc_scope=self._scope)

    from unet_compiler.tests._comfy_compiler import ComfyCompiler
    for name in ("double_blocks", "single_blocks"):
        blocks = getattr(dm, name)
        blocks.__class__, blocks._scope = Scoped, name
    ComfyCompiler.opt_in(dm, "forward_orig")


def _node(compiler, *calls):
    """One ComfyUI node's run: its calls, then the executor's between-node cleanup."""
    try:
        return [call() for call in calls]
    finally:
        compiler.cleanup()


def test_a_recorded_dit_runs_with_no_graph_break(comfy, dynamic_vram):
    """Under ``--assert-graph-breaks``: ComfyUI's own code replays its recording (allocations seen
    and matched, 0 breaks); then Compile UNet, Warmup Shapes of two shapes and three two-step
    prompts, the third turning the single-stream blocks to the model's own code after its first
    step: 0 breaks, every step == eager, both kinds compiled until then."""
    from unet_compiler.tests import _families as F  # noqa: N812
    from unet_compiler.tests._comfy_compiler import ComfyCompiler
    base = dynamic_vram.patcher(F.build_dit(F.DIT_FAMILIES["flux_dev"]), budget=1.0)
    _opt_in(base.model.diffusion_model)

    def step(p):
        return lambda: F.dit_apply(p, 2, 8, 8, seed=3)

    with ComfyCompiler(assert_graph_breaks=True).installed() as compiler:
        want = _node(compiler, step(base), step(base))
        torch.testing.assert_close(want[1], want[0], rtol=0, atol=0)
        graph = compiler.recordings[-1]
        assert graph.allocations > 20 and graph.replayed > graph.allocations and not compiler.breaks(), \
            (graph.allocations, graph.replayed, compiler.breaks())

        cm, _ = patcher.compile_model(base, CFG)
        text = _node(compiler, lambda: patcher.warmup_model(cm, "2x64x64, 1x64x64", 7))[0]
        accel = patcher.accelerator_of(cm)
        assert "4 of 4 regions ran compiled code" in text, text
        assert not compiler.breaks(), compiler.breaks()
        for _ in range(2):
            for got in _node(compiler, step(cm), step(cm)):
                torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-4)
        kinds = set(accel.report.regions)
        assert accel.stats["region_eager"] == 0 and len(kinds) == 2, (accel.text(), kinds)

        def fall_back():
            accel._turn_off("single_block", RuntimeError("a region kind failing mid-prompt (injected)"))
            return want[0]
        got = _node(compiler, step(cm), fall_back, step(cm))
        for g in got:
            torch.testing.assert_close(g, want[0], rtol=1e-4, atol=1e-4)
        assert "single_block" in accel.failed and accel.stats["region_eager"] > 0, accel.text()
        assert not compiler.breaks() and compiler.module.MALLOC_GRAPH_BREAKS == 0, compiler.breaks()
    assert accel.stats["recording_paused"] > 0 and accel.stats["recompiles_after_warmup"] == 0, accel.text()
