"""The two test lanes. The quick lane (``bin/test``, the README's command: every module's unit and
in-process tests, 6 to 9 minutes on a 2-core machine) is every test not marked ``full``; the full
lane (``bin/test --full``) is the rest: every test under tests/e2e (real ComfyUI servers, the soak,
the browser) and the in-process tests named here, each a minute or so of compile on such a machine
whose module keeps quicker tests of the same code in the quick lane. ``.ci/run`` runs both; tests
marked ``long`` run in neither unless UNET_COMPILER_LONG_TESTS=1."""
from __future__ import annotations

#: node-id prefixes of the full lane: every server test, every family's parity (the quick lane keeps
#: the families' call shapes and one family's warmed box)
FULL_PREFIXES = ("tests/e2e/", "tests/nodes/test_families.py::test_family[")

FULL = frozenset({
    # the tiny Flux compiled once for the module (a minute): every test that takes it
    "tests/nodes/test_dit.py::test_flux_lora_after_compile_and_a_strength_change",
    "tests/nodes/test_dit.py::test_flux_block_replace_and_the_calls_its_body_declines",
    "tests/nodes/test_dit.py::test_an_image_model_refuses_video_frames_before_work",
    "tests/nodes/test_dit.py::test_flux_controlnet_residuals_reference_latents_and_step_caches",
    "tests/nodes/test_dit.py::test_wan_compiled_over_frames_sizes_and_batches",
    "tests/compiler/test_diffusers_unet.py::test_parity_and_regions_fired[sdxl-inductor]",
    "tests/nodes/test_comfy_patcher.py::test_parity_and_regions_fired[sdxl]",
    "tests/nodes/test_comfy_patcher.py::test_region_graphs_under_comfyui_dispatch[sdxl]",
    "tests/nodes/test_dynamic_vram.py::test_quantized_leaves_keep_comfys_quantized_matmul",
    "tests/nodes/test_dynamic_vram.py::test_unets_over_prompts_with_lora_and_resident_set_changes[sd15]",
    "tests/nodes/test_dynamic_vram.py::test_flux_over_prompts_with_lora_and_resident_set_changes",
    "tests/nodes/test_comfy_compiler.py::test_a_recorded_dit_runs_with_no_graph_break",
    # two devices' copies of the tiny SD1.5 compiled (about 25 s each order)
    "tests/nodes/test_multigpu.py::test_every_devices_copy_runs_its_own_compiled_regions[compile_then_multigpu]",
    "tests/nodes/test_multigpu.py::test_every_devices_copy_runs_its_own_compiled_regions[multigpu_then_compile]",
    "tests/compiler/test_cuda_graphs.py::test_the_fake_allocator_aborts_where_the_h100_did",
    "tests/nodes/test_patch_nodes.py::test_hook_keyframes_reapply_weights_during_sampling",
    "tests/compiler/test_lifetime.py::test_a_dropped_unet_is_freed_with_its_prepacked_weights[inductor]",
    "tests/compiler/test_background.py::test_warmup_shapes_node_in_the_background",
    "tests/nodes/test_dit.py::test_the_other_block_calls_compiled[qwen_image]",
    "tests/nodes/test_dit.py::test_the_other_block_calls_compiled[z_image]",
    "tests/nodes/test_dit.py::test_flux_compiled_is_eager_with_no_recompiles",
    "tests/nodes/test_dit.py::test_wan22_per_frame_timesteps_compiled_and_warmed",
    "tests/nodes/test_dit.py::test_fp8_flux_runs_compiled_with_comfyuis_cast",
    "tests/nodes/test_dit.py::test_flux2_warms_its_own_latent_scale",
    "tests/test_security.py::test_a_real_compile_writes_only_where_it_may",
    "tests/compiler/test_background.py::test_the_compile_thread_makes_no_tracer_patch_the_sampling_thread_can_meet",
    "tests/compiler/test_background.py::test_a_range_in_the_background_traces_as_the_sampling_thread_would",
    "tests/compiler/test_background.py::test_a_new_shape_while_it_runs_is_queued_not_compiled_here",
    "tests/compiler/test_background.py::test_after_it_is_done_a_new_shape_still_compiles_in_the_background",
    "tests/compiler/test_background.py::test_a_background_warmup_names_its_shapes_in_the_entry_once_all_compiled",
    "tests/compiler/test_background.py::test_a_foreground_warmup_ends_background_mode",
    "tests/compiler/test_background.py::test_a_warmup_that_stops_still_ends_with_a_done_line",
    "tests/compiler/test_diffusers_unet.py::test_one_warmup_shape_compiles_that_shape_static",
    "tests/compiler/test_diffusers_unet.py::test_parity_and_regions_fired[sd15-inductor]",
    "tests/nodes/test_comfy_patcher.py::test_parity_and_regions_fired[sd15]",
    "tests/nodes/test_comfy_patcher.py::test_region_graphs_under_comfyui_dispatch[sd15]",
    "tests/nodes/test_comfy_patcher.py::test_lora_after_warmup_does_not_recompile",
    "tests/nodes/test_comfy_patcher.py::test_warmup_status_counts_regions_that_ran_compiled",
    "tests/nodes/test_comfy_patcher.py::test_an_attention_patch_that_casts_gets_fp16s_tolerance_named",
    "tests/compiler/test_precompiled.py::test_a_dynamic_variant_serves_a_size_one_side_without_a_graph_of_its_own",
    "tests/compiler/test_precompiled.py::test_a_call_no_variant_fits_compiles_one_more_and_names_the_input",
    "tests/compiler/test_triton_backend.py::test_comfy_unet_parity",
    "tests/compiler/test_triton_backend.py::test_kernel_variants_do_not_depend_on_spatial_or_token_sizes",
    "tests/compiler/test_triton_backend.py::test_fp8_stored_comfy_unet_runs_the_kernels_on_comfys_cast",
    "tests/compiler/test_triton_backend.py::test_measured_choice_runs_torch_where_it_is_faster",
    "tests/nodes/test_dynamic_vram.py::test_sd15_with_every_weight_streamed[inductor]",
    "tests/nodes/test_dynamic_vram.py::test_sd15_with_every_weight_streamed[op by op]",
    "tests/compiler/test_triton_backend.py::test_streamed_weights_run_the_kernels_op_by_op",
    "tests/nodes/test_dynamic_vram.py::test_warmup_gate_refuses_a_wrong_kernel_and_names_it",
    "tests/nodes/test_dynamic_vram.py::test_a_demoted_model_runs_its_own_code_and_says_why",
    "tests/compiler/test_warmup_patched.py::test_deep_shrink_compiled_matches_eager",
    "tests/compiler/test_cache.py::test_a_restart_runs_no_probe_shape_its_entry_holds_the_code_of",
    "tests/nodes/test_patch_nodes.py::test_patch_node_compiled_equals_eager"
    "[sd15-HyperTile + RescaleCFG + IPAdapter attn2 + ControlNet + hook LoRA-after]",
    "tests/nodes/test_patch_nodes.py::test_deep_shrink_changes_resolution_between_steps",
    "tests/nodes/test_gguf.py::test_a_gguf_model_compiles_in_the_background",
    "tests/nodes/test_inserted_modules.py::test_motion_modules_run_as_they_are_and_are_named[motion_then_compile]",
    "tests/nodes/test_inserted_modules.py::test_motion_modules_in_the_model_when_planned_take_whole_videos_too",
})


#: tests of the full lane moved behind UNET_COMPILER_LONG_TESTS (marked ``long``) for CI's time: a
#: family whose group keeps another member in the lane (SV3D_u and SV3D_p: SVD's video UNet with
#: another ADM width; SD2.1 unCLIP-H: unCLIP-L's with another one; Segmind Vega and KOALA-1B: SDXL
#: pruned to other depths, as SSD-1B and KOALA-700M are; SDXL inpaint: SDXL's UNet with the 9
#: input channels SD1.5 inpaint has and the wider input SDXL instruct-pix2pix has), each 1-2 minutes;
#: the fake CUDA's check against the H100's abort (about a minute of interpreted kernels: run it
#: when tests/_fake_cuda.py changes; the quick lane keeps the fake's captures of the kernels under
#: both allocators); two LoRA strengths queued back to back through a fault server (a minute: the
#: soak varies the LoRA strength per prompt through the server against plain ComfyUI, and the
#: in-process LoRA tests change strengths on one compiled model); SD1.5's family parity (its parity,
#: regions and 0 recompiles are test_comfy_patcher's, in both lanes); a new shape queued while the
#: compile thread runs (the next test queues a later miss the same way, after the thread is done)
LONG = frozenset({
    "tests/nodes/test_families.py::test_family[sd15]",
    "tests/compiler/test_background.py::test_a_new_shape_while_it_runs_is_queued_not_compiled_here",
    "tests/compiler/test_cuda_graphs.py::test_the_fake_allocator_aborts_where_the_h100_did",
    "tests/e2e/test_faults_server.py::test_two_loras_queued_back_to_back_on_one_compiled_model",
    "tests/nodes/test_families.py::test_family[sv3d_u]",
    "tests/nodes/test_families.py::test_family[sv3d_p]",
    "tests/nodes/test_families.py::test_family[sd21_unclip_h]",
    "tests/nodes/test_families.py::test_family[vega]",
    "tests/nodes/test_families.py::test_family[koala_1b]",
    "tests/nodes/test_families.py::test_family[sdxl_inpaint]",
})


def lane(nodeid: str) -> str:
    """'full' or 'quick' for a test's node id (relative to the checkout)."""
    return "full" if nodeid.startswith(FULL_PREFIXES) or nodeid in FULL else "quick"
