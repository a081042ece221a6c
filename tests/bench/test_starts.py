"""The starts benchmark's pieces (``python -m unet_compiler.bench starts``) without a server: the
workflow it sends, how it reads ComfyUI's /history and the pack's report, and its arithmetic.
The two-server fleet run is tests/e2e/test_starts_server.py."""
from __future__ import annotations

from unet_compiler.bench import starts
from unet_compiler.compiler.report import Report
from unet_compiler.bench.starts import StartRow


def test_workflow_places_the_compiler_between_checkpoint_and_sampler():
    eager = starts.workflow("m.safetensors", "eager", 64, 1, 4, seed=1)
    tcm = starts.workflow("m.safetensors", "tcm", 64, 1, 4, seed=1)
    pack = starts.workflow("m.safetensors", "pack", 96, 2, 3, seed=7, shapes="1x64x64, 2x128x128")
    assert eager["5"]["inputs"]["model"] == ["1", 0]
    assert tcm["10"]["class_type"] == "TorchCompileModel" and tcm["5"]["inputs"]["model"] == ["10", 0]
    assert pack["11"]["class_type"] == "UNetCompiler_CompileUNet"
    # every input but the shapes at its default: what the defaults rows measure
    assert pack["12"]["inputs"] == {"model": ["11", 0], "shapes": "1x64x64, 2x128x128"}
    assert pack["11"]["inputs"] == {"model": ["1", 0]}
    bg = starts.workflow("m.safetensors", "pack", 64, 1, 4, seed=1, shapes="2x64x64", background=False)
    assert bg["12"]["inputs"]["background"] is False
    done = "UNet Compiler: background compile: done in 42.7 s, 27 region variant(s) (27 graph(s)); 355 region"
    assert starts.DONE.search(done).groups() == ("42.7", "27", "27", None)
    loaded = ("UNet Compiler: background compile: done in 4.9 s, 0 region variant(s) (0 graph(s)), 27 loaded from "
              "the compile cache; 355 region")
    assert starts.DONE.search(loaded).groups() == ("4.9", "0", "0", "27")
    assert pack["5"]["inputs"]["model"] == ["12", 0] and pack["5"]["inputs"]["seed"] == 7
    assert pack["4"]["inputs"] == {"width": 96, "height": 96, "batch_size": 2}
    # only the seed differs between a row's two prompts: ComfyUI reruns KSampler (and what follows) alone
    a, b = (starts.workflow("m", "pack", 64, 1, 4, seed=s, shapes="1x64x64") for s in (1, 2))
    assert [k for k in a if a[k] != b[k]] == ["5"]


def test_graphs_are_read_from_the_packs_own_report():
    r = Report(backend="inductor", family="SD1.5")
    stats = {"calls": 4, "graphs_compiled": 9}
    assert starts.graphs_of(r.text(stats)) == (9, 0)
    assert starts.graphs_of(r.text(dict(stats, graphs_from_cache=9))) == (9, 9)
    assert starts.graphs_of(r.text()) == (None, None)


def test_prompt_seconds_are_comfyuis_timestamps():
    entry = {"status": {"messages": [["execution_start", {"prompt_id": "p", "timestamp": 1000}],
                                     ["execution_cached", {"nodes": [], "timestamp": 1100}],
                                     ["execution_success", {"prompt_id": "p", "timestamp": 13500}]]}}
    assert starts.prompt_seconds(entry, wall=99.0) == 12.5
    assert starts.prompt_seconds({"status": {"messages": []}}, wall=99.0) == 99.0


def test_report_text_is_the_warmup_nodes_ui_text():
    entry = {"outputs": {"12": {"text": ["UNet Compiler: backend inductor", "  graphs compiled: 3"]}}}
    assert starts.report_text(entry) == "UNet Compiler: backend inductor\n  graphs compiled: 3"
    assert starts.report_text({"outputs": {}}) == ""


def test_table_nets_out_eagers_own_first_prompt_cost():
    rows = [StartRow("eager", 10.0, 2.0, 5.0), StartRow("TorchCompileModel (inductor)", 108.0, 2.0, 5.0),
            StartRow(f"{starts.ONE_SHAPE} (1x64x64)", 33.0, 1.0, 5.0, graphs=7, from_cache=0),
            StartRow("restart of the one-shape row", 11.5, 1.0, 5.0, graphs=7, from_cache=7)]
    base = rows[0].first_s - rows[0].second_s
    for r in rows:
        r.overhead_s = (r.first_s - r.second_s) - base
    assert [r.overhead_s for r in rows] == [0.0, 98.0, 24.0, 2.5]
    text = starts.table(rows)
    lines = text.splitlines()
    assert lines[2].startswith("| eager |") and "| - | - | - | - |" in lines[2]
    assert "| 24.0 | 0.24x | - | 7 (0) |" in lines[4], lines[4]
    assert "| 2.5 | 0.03x | 10% | 7 (7) |" in lines[5], lines[5]


def test_each_restart_is_measured_against_the_row_it_restarts():
    rows = [StartRow("eager", 10.0, 2.0, 5.0), StartRow("TorchCompileModel (inductor)", 108.0, 2.0, 5.0),
            StartRow(f"{starts.ONE_SHAPE} (2x64x64)", 49.0, 1.0, 5.0, graphs=28, from_cache=0),
            StartRow(f"{starts.RANGE} (2x64x64, 4x128x128)", 108.0, 1.0, 5.0, graphs=16, from_cache=0),
            StartRow("restart of the one-shape row", 17.0, 1.0, 5.0, graphs=28, from_cache=28),
            StartRow(starts.RESTART_RANGE, 17.0, 1.0, 5.0, graphs=16, from_cache=16)]
    base = rows[0].first_s - rows[0].second_s
    for r in rows:
        r.overhead_s = (r.first_s - r.second_s) - base
    lines = starts.table(rows).splitlines()
    assert "| 8.0 | 0.08x | 20% | 28 (28) |" in lines[6], lines[6]     # 8 of the one-shape row's 40
    assert "| 8.0 | 0.08x | 8% | 16 (16) |" in lines[7], lines[7]      # 8 of the range row's 99


def test_a_warm_start_with_slower_steps_is_flagged():
    """A restart is cheap if its regions fell back to eager: its step time then says so."""
    rows = [StartRow("eager", 10.0, 6.0, 5.0), StartRow("TorchCompileModel (inductor)", 108.0, 9.0, 5.0),
            StartRow(f"{starts.ONE_SHAPE} (2x64x64)", 49.0, 3.4, 5.0, graphs=28, from_cache=0),
            StartRow("restart of the one-shape row", 14.0, 6.3, 5.0, graphs=4, from_cache=4),
            StartRow("second worker", 14.0, 3.5, 5.0, graphs=28, from_cache=28)]
    lines = starts.table(rows).splitlines()
    assert "steps slower than its cold row: 6.3 s vs 3.4 s" in lines[5], lines[5]
    assert "slower" not in lines[6], lines[6]


def test_the_baseline_is_both_eager_rows_mean_and_says_how_far_apart_they_were():
    rows = [StartRow("eager", 10.0, 2.0, 5.0), StartRow("TorchCompileModel (inductor)", 108.0, 2.0, 5.0),
            StartRow(f"{starts.ONE_SHAPE} (2x64x64)", 49.0, 1.0, 5.0, graphs=28, from_cache=0),
            StartRow("restart of the one-shape row", 14.0, 1.0, 5.0, graphs=28, from_cache=28),
            StartRow(starts.EAGER_AGAIN, 14.0, 2.0, 5.0)]
    starts.net(rows)                     # eager's own cost: 8 s, then 12 s: the baseline is 10 s
    assert [r.overhead_s for r in rows] == [0.0, 96.0, 38.0, 3.0, 0.0]
    lines = starts.table(rows).splitlines()
    assert lines[-1].startswith("| eager, again |") and "| - | - | - | - |" in lines[-1], lines[-1]
    assert "| 3.0 | 0.03x | 8% | 28 (28) |" in lines[5], lines[5]
    line = starts.baseline_line(rows)
    assert "8.0 s and 12.0 s" in line and "mean, 10.0 s" in line and "+-2.0 s" in line, line


def test_the_session_table_times_each_image_from_the_first_prompts_start():
    def entry(start, done):
        return {"status": {"messages": [["execution_start", {"timestamp": start * 1000}],
                                        ["execution_success", {"timestamp": done * 1000}]]}}
    assert starts._stamp(entry(100, 103), "execution_success") == 103
    rows = [starts.SessionRow("eager", {1: 4.0, 5: 16.0, 20: 61.0}, 20),
            starts.SessionRow("TorchCompileModel (inductor)", {1: 60.0, 5: 84.0, 20: 172.0}, 20),
            starts.SessionRow("defaults", {1: 5.0, 5: 20.0, 20: 48.8}, 20)]
    lines = starts.session_table(rows).splitlines()
    assert lines[0] == "| row | image 1 s (vs eager) | image 5 s (vs eager) | image 20 s (vs eager) |"
    assert lines[2] == "| eager | 4.0 | 16.0 | 61.0 |"
    assert lines[4] == "| defaults | 5.0 (1.25x) | 20.0 (1.25x) | 48.8 (0.80x) |"
