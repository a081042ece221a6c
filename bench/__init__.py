"""Development tools beside the pack, never imported by nodes/, compiler/ or kernels/ (a test checks):
the bench and its command line (``python -m unet_compiler.bench``, see ``__main__.py``), the
compatibility tables (printed from the tests' tiny-model builders and patch harness,
``tests/_families.py`` and ``tests/_patch_compat.py``: the bench imports the tests' fixtures, never
the reverse), the starts and soak benches through a real
ComfyUI server (``starts.py``, ``soak.py``, over ``comfy_server.py``, the headless-server harness the
end-to-end tests use too), the per-kernel table (``kernels.py``) and the GPU-target compile check
(``targets.py``)."""
