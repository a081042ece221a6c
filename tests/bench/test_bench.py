"""The benchmark CLI (python -m unet_compiler.bench run) runs end to end and writes
what it measured. Small sizes only: the numbers are not checked, the table's
structure and the kernels' agreement with eager torch are."""
import json

import pytest
import torch

pytest.importorskip("diffusers", reason="diffusers not installed")
from unet_compiler.bench.__main__ import main  # noqa: E402


def test_kernel_table_runs_every_kernel_and_agrees_with_torch(tmp_path, capsys):
    pytest.importorskip("triton", reason="triton not installed: the kernel table needs it")
    main(["run", "--size", "tiny", "--latent", "4", "--batch", "1", "--iters", "1", "--kernels-only",
          "--reuse-cache", "--kernels-skip-inductor", "--out", str(tmp_path),
          "--device", "cuda" if torch.cuda.is_available() else "cpu"])
    data = json.loads(next(tmp_path.glob("kernels_tiny_*.json")).read_text())
    kinds = {r["kernel"] for r in data["kernels"]}
    assert kinds == {"groupnorm_silu", "bias_residual", "layernorm", "geglu", "attention"}, kinds
    for r in data["kernels"]:
        assert r["triton_ms"] > 0 and r["eager_ms"] > 0, r
        assert r["max_abs_diff"] < 1e-4, r
    out = capsys.readouterr().out
    assert "attention       cross 1x8h x 16q x 77k, d 4" in out, out


def test_kernel_table_inductor_column(tmp_path):
    pytest.importorskip("triton", reason="triton not installed: the kernel table needs it")
    main(["run", "--size", "tiny", "--latent", "2", "--batch", "1", "--iters", "1", "--kernels-only",
          "--kernels", "bias_residual", "--reuse-cache", "--out", str(tmp_path),
          "--device", "cuda" if torch.cuda.is_available() else "cpu"])
    (row,) = json.loads(next(tmp_path.glob("kernels_tiny_*.json")).read_text())["kernels"]
    assert row["inductor_ms"] > 0 and row["inductor_compile_s"] > 0, row


def _printed_rows(out: str) -> dict:
    """The printed table's rows: path -> (step ms, eager ms, vs eager)."""
    rows = {}
    for line in out.split("\npath ", 1)[1].splitlines()[1:]:
        if not line.strip() or line.startswith("step ms:"):
            break
        step, eager, vs = line[58:].split()[:3]
        rows[line[:58].strip()] = (float(step), float(eager), float(vs.rstrip("x")))
    return rows


def test_unet_table_rows_and_shape_changes(tmp_path, capfd, caplog):
    """The table and its JSON: each row's numbers are one measurement (its ratio is its eager twin's ms
    over its own ms, as printed); progress lines on stderr; diffusers' empty float32 notice is gone."""
    main(["run", "--size", "tiny", "--latent", "8", "--batch", "1", "--iters", "1", "--backend", "eager",
          "--skip-whole", "--reuse-cache", "--device", "cpu", "--out", str(tmp_path)])
    data = json.loads(next(tmp_path.glob("bench_tiny_cpu_lat8_b1.json")).read_text())
    assert [r["path"] for r in data["rows"]] == ["eager", "unet_compiler eager"]
    assert data["rows"][1]["max_abs_diff"] == 0.0  # the eager backend is the model's own code
    assert [c["change"] for c in data["shape_changes"]["unet_compiler eager"]] == \
        ["to 1x64x64", "batch 1->2 (2x64x64)", "64->96 px (2x96x96)"]
    for r in data["rows"]:
        assert r["speedup"] == pytest.approx(r["eager_s"] / r["step_s"]), r
    out, err = capfd.readouterr()
    printed = _printed_rows(out)
    assert list(printed) == ["eager", "unet_compiler eager"], out
    for path, (step_ms, eager_ms, vs_eager) in printed.items():
        assert vs_eager == pytest.approx(eager_ms / step_ms, rel=0.011, abs=0.005), (path, out)
    row = next(r for r in data["rows"] if r["path"] == "unet_compiler eager")
    assert printed["unet_compiler eager"][1] == pytest.approx(row["eager_s"] * 1e3, rel=0.006), out
    assert "row 1/2: eager: timing" in err and "row 2/2: eager: compiling" in err, err
    assert "row 2/2: unet_compiler eager: timing" in err, err
    assert "should be kept in float32" not in out + err, out + err
    assert not [r for r in caplog.records if "should be kept in float32" in r.getMessage()]


def test_rows_run_cold_in_their_own_process(tmp_path):
    """Each row compiles in a fresh process with fresh inductor and Triton caches: no row's
    'cold' seconds reuse what the kernel table or an earlier row compiled."""
    import os
    main(["run", "--size", "tiny", "--latent", "8", "--batch", "1", "--iters", "1", "--backend", "eager,eager",
          "--skip-whole", "--device", "cpu", "--out", str(tmp_path)])
    rows = json.loads(next(tmp_path.glob("bench_tiny_cpu_lat8_b1.json")).read_text())["rows"]
    assert [r["path"] for r in rows] == ["eager", "unet_compiler eager", "unet_compiler eager"]
    a, b = rows[1], rows[2]
    assert os.getpid() not in (a["pid"], b["pid"]) and a["pid"] != b["pid"]
    for kind in ("inductor", "triton"):
        assert a["caches"][kind] and b["caches"][kind] and a["caches"][kind] != b["caches"][kind]
        assert a["caches"][kind] != os.environ.get("TORCHINDUCTOR_CACHE_DIR" if kind == "inductor" else "TRITON_CACHE_DIR")
    assert a["eager_s"] > 0 and a["step_s"] > 0 and a["speedup"] > 0


def test_eager_and_compiled_are_timed_interleaved():
    from unet_compiler.bench.run import _time_pair
    order = []
    e, c, _, _ = _time_pair(lambda: order.append("e") or torch.zeros(1), lambda: order.append("c") or torch.ones(1),
                            4, torch.device("cpu"))
    assert order == ["e", "c", "e", "c", "c", "e", "e", "c", "c", "e"], order
    assert e > 0 and c > 0


def test_backend_suffix_is_checked():
    with pytest.raises(SystemExit, match=r"the only suffix is \+graphs"):
        main(["run", "--size", "tiny", "--latent", "2", "--backend", "triton+fast", "--skip-whole",
              "--reuse-cache", "--device", "cpu"])


def test_bench_prints_the_compatibility_table(tmp_path, capsys, monkeypatch):
    """--compat: after the bench table, the family table and the patch-node table measured in this
    run (here one family and one patch node on the eager backend, to keep it short) or one line
    saying why there are none."""
    from unet_compiler.tests import _families as families, _patch_compat as patch_compat
    real, real_patch, real_dit = families.compat_rows, patch_compat.patch_rows, families.dit_compat_rows
    monkeypatch.setattr(families, "compat_rows", lambda *a, log=None: real("eager", (8, 8), 1, ["sd15"], log))
    # (the DiT table too: unpatched it compiled every DiT family with inductor, 10 min of CI)
    monkeypatch.setattr(families, "dit_compat_rows", lambda *a, log=None: real_dit(
        "eager", cases=((1, 8, 8),), families=["flux_dev"], log=log))
    monkeypatch.setattr(patch_compat, "patch_rows", lambda *a, log=None: real_patch(
        "eager", [("RescaleCFG", "sd15", patch_compat.AFTER)], log))
    argv = ["run", "--size", "tiny", "--latent", "8", "--batch", "1", "--iters", "1", "--backend", "eager",
            "--skip-whole", "--reuse-cache", "--device", "cpu", "--compat"]
    if families.comfy_path() is None:
        main(argv)
        assert "compatibility table: skipped: no ComfyUI tree" in capsys.readouterr().out
        return
    if families.comfy_problem():
        pytest.skip(families.comfy_problem())
    main(argv)
    out = capsys.readouterr().out
    assert "| family | accelerated regions | left eager (why) | max abs diff |" in out, out
    assert "| SD1.5 | none |" in out, out   # the eager backend accelerates nothing, and says so
    assert "ComfyUI's diffusion transformers" in out and "| Flux.1 dev |" in out, out
    assert "| node / stack" in out and "what the report says each patch did" in out, out
    row = next(ln for ln in out.splitlines() if ln.startswith("| RescaleCFG "))
    # parity holds, and the check still fails the row: nothing was accelerated
    assert "sd15 64x64: patch -> Compile UNet" in row and "| none " in row, row
    assert "FAILED: regions ran, accelerated attention ran" in row, row
    monkeypatch.setattr(families, "comfy_path", lambda: None)
    main(argv)
    assert "compatibility table: skipped: no ComfyUI tree" in capsys.readouterr().out


def test_compat_command_runs_the_tables_asked_for(capsys):
    """``python -m unet_compiler.bench compat``: its options reach the table (one family, eager, 8x8,
    batch 1; the patch-node table left out with --only), and a family name it does not know is
    refused by name before anything runs."""
    from unet_compiler.tests import _families as families
    with pytest.raises(SystemExit):
        main(["compat", "--only", "families", "sd16"])
    assert "invalid choice: 'sd16'" in capsys.readouterr().err
    if families.comfy_problem():
        pytest.skip(families.comfy_problem())
    main(["compat", "--only", "families", "--backend", "eager", "--latent", "8x8", "--batch", "1", "sd15"])
    out = capsys.readouterr().out
    assert "eager, latent 8x8, batch 1" in out and "| SD1.5 | none |" in out, out
    assert "| SDXL |" not in out and "node / stack" not in out, out


def test_the_root_alias_forwards_to_the_bench_cli():
    """``python -m unet_compiler bench ...`` (the GPU kit's command) is ``python -m unet_compiler.bench run
    ...``; the other commands keep their names."""
    import subprocess
    import sys
    for argv, usage, option in ((["bench", "--help"], "usage: python -m unet_compiler.bench run", "--kernels-only"),
                                (["targets", "--help"], "usage: python -m unet_compiler.bench targets", "--cap")):
        r = subprocess.run([sys.executable, "-m", "unet_compiler", *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith(usage) and option in r.stdout, r.stdout + r.stderr


def test_the_harness_links_without_symlink_rights(tmp_path, monkeypatch):
    """Windows without Developer Mode refuses symlinks: the server harness then links a folder as a
    directory junction and a file as a hard link (here Windows is simulated: the refusal, and a
    ``_winapi`` whose CreateJunction records the call and makes the link)."""
    import os
    import pathlib
    import sys
    import types
    from unet_compiler.bench import comfy_server as S
    junctions = []
    monkeypatch.setitem(sys.modules, "_winapi", types.SimpleNamespace(
        CreateJunction=lambda src, dst: (junctions.append((src, dst)), os.symlink(src, dst))))
    monkeypatch.setattr(S, "_SIMULATE_WINDOWS", True)

    def refuse(self, target, target_is_directory=False):
        raise OSError(1314, "A required privilege is not held by the client")
    monkeypatch.setattr(pathlib.Path, "symlink_to", refuse)
    folder, file = tmp_path / "pack", tmp_path / "model.safetensors"
    folder.mkdir()
    (folder / "__init__.py").write_text("x = 1\n", encoding="utf-8")
    file.write_bytes(b"weights")
    S.link(tmp_path / "custom_nodes_pack", folder)
    S.link(tmp_path / "linked.safetensors", file)
    assert junctions == [(str(folder.resolve()), str(tmp_path / "custom_nodes_pack"))]
    assert (tmp_path / "custom_nodes_pack" / "__init__.py").read_text(encoding="utf-8") == "x = 1\n"
    linked = tmp_path / "linked.safetensors"
    assert not linked.is_symlink() and os.path.samefile(linked, file)   # a hard link: the same file
    monkeypatch.setattr(S, "_SIMULATE_WINDOWS", False)
    with pytest.raises(OSError):          # elsewhere a refused symlink is an error, not a silent copy
        S.link(tmp_path / "again", folder)


def test_the_kernel_table_shows_the_backends_choice(monkeypatch):
    """On CUDA each kernel row carries what the triton backend runs at that signature, decided by the
    backend's own rule (``_kernel_choice.decide``: wall time without graphs, device time with them),
    not by the table's L2-flushed medians."""
    from unet_compiler.bench import kernels as K  # noqa: N812
    from unet_compiler.compiler.backends import _kernel_choice as KC  # noqa: N812
    times = {("k", "wall"): 0.05, ("t", "wall"): 0.03, ("k", "device"): 0.01, ("t", "device"): 0.02}
    monkeypatch.setattr(KC, "_measure_ms", lambda fn, timing="wall": times[(fn(), timing)])
    row = dict(kernel="groupnorm_silu", shape="2x320x64x64", bytes=1, flops=0.0, triton_ms=0.07, eager_ms=0.08,
               max_abs_diff=0.0)
    for timing in ("wall", "device"):
        choice, tk, tt = KC.decide(lambda: "k", lambda: "t", timing)
        row[f"backend_{timing}"] = dict(choice=choice, triton_ms=tk, torch_ms=tt)
    line = K.format_row(row, torch.device("cuda"))
    assert line.rstrip().endswith("torch/triton"), line
    assert K.header(torch.device("cuda")).rstrip().endswith("backend")
