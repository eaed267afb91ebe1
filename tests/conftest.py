"""Every test sees 8 fake CPU devices (set before JAX initialises) and fp32 matmuls at full precision."""
import os
import shutil
import tempfile
from pathlib import Path

# Subprocesses (CLI tests, multi-process runs) import this checkout's package, as pytest itself does.
_SRC = str(Path(__file__).resolve().parents[1] / "src")
os.environ["PYTHONPATH"] = os.pathsep.join([_SRC, *filter(None, [os.environ.get("PYTHONPATH")])])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"
# Tests compile far more than they compute. LLVM -O0 compiles the KDA layer ~2.7x faster, and at -O0 XLA:CPU's
# older elemental emitters another ~3x (bench_train --compile-parts; at -O3 they compile slower and run slower).
if "xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
if "xla_cpu_use_fusion_emitters" not in flags:
    flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = flags.strip()

# One persistent XLA compilation cache per test session, shared by both xdist workers and every subprocess:
# a program that several tests build (the same model, step and shapes) compiles once. Made fresh per session
# (by the controller; workers inherit it), so every `make test` compiles from scratch.
if "LINGPACK_TEST_XLA_CACHE" not in os.environ:
    os.environ["LINGPACK_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="lingpack-test-xla-")
    _OWN_CACHE = True
else:
    _OWN_CACHE = False
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["LINGPACK_TEST_XLA_CACHE"])
# every program, even a tiny eager op: the other worker and the run.py subprocesses build the same small models
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# Heavy cases whose behaviour a lighter default-suite test already covers: run by `make test-all` only.
HEAVY_DUPLICATES = {
    "tests/models/test_remat.py::test_policy_gives_the_loss_and_gradients_of_no_remat[full-overrides0]":
        "remat against none: tests/models/test_ling3.py::test_remat_gives_identical_gradients (the default "
        "policy); what each named policy saves and recomputes: test_saving_policies_recompute_fewer_dots_as_remat_flops_counts",
    "tests/parallel/test_expert.py::test_capacity_buffers_equal_one_device[balanced-ragged]":
        "the ragged exchange against one device: the skewed-ragged case (round 0) and the skewed-unit2-ragged "
        "case (the overflow rounds: at the default unit the skewed cases take one round)",
    "tests/kernels/test_kda_pallas.py::test_lowers_to_mosaic_for_tpu_at_production_shape[pallas_segment-False]":
        "lowering to Mosaic calls: tests/kernels/test_mosaic_compile.py compiles the same kernels with Mosaic",
    "tests/kernels/test_kda_pallas.py::test_lowers_to_mosaic_for_tpu_at_production_shape[pallas_segment-True]":
        "lowering to Mosaic calls: tests/kernels/test_mosaic_compile.py compiles the same kernels with Mosaic; "
        "pallas_segment with the lower-bound gate for TPU at the flagship's shapes: "
        "tests/train/test_flagship_export.py",
    "tests/kernels/test_kda_pallas.py::test_lowers_to_mosaic_for_tpu_at_production_shape[pallas_varlen-False]":
        "lowering to Mosaic calls: tests/kernels/test_mosaic_compile.py compiles the same kernels with Mosaic",
    "tests/kernels/test_kda_pallas.py::test_lowers_to_mosaic_for_tpu_at_production_shape[pallas_varlen-True]":
        "lowering to Mosaic calls: tests/kernels/test_mosaic_compile.py compiles the same kernels with Mosaic",
    "tests/parallel/test_expert.py::test_capacity_buffers_equal_one_device[balanced-dense]":
        "the dense exchange against one device: the skewed-dense case (round 0) and the skewed-unit2-dense case "
        "(the overflow rounds: at the default unit the skewed cases take one round)",
    "tests/train/test_flagship_export.py::test_flagship_step_exports_for_tpu_on_fsdp_tensor_expert":
        "the flagship step for TPU: tests/train/test_flagship_tpu_compile.py (compiled by XLA:TPU); every kernel "
        "inside it by Mosaic at flagship dims: tests/kernels/test_mosaic_compile.py",
    "tests/models/test_layers.py::test_short_conv_vjp_keeps_only_inputs":
        "the short convolution's own VJP: test_short_conv_vjp_matches_torch_autograd_per_document (dx, d_kernel); "
        "what XLA:TPU holds for it at T=8192 x 2048 channels: make test-all",
    "tests/train/test_cuda_export.py::test_flagship_widths_export_for_cuda_with_triton_attention_only":
        "the CUDA export of a train step with Triton attention: the other cases of tests/train/test_cuda_export.py",
    "tests/experiments/test_hardware_step.py::test_dry_run_on_cpu_measures_and_sits_beside_the_plan":
        "the benchmark's step measurement is the train loop's (tests/train); its CPU dry run end to end: make test-all",
    "tests/models/test_remat.py::test_policy_gives_the_loss_and_gradients_of_no_remat[save_qkv_proj-overrides1]":
        "a saving policy against no remat: the full-policy case and test_minimal_saves_the_tagged_projections; "
        "the per-part override: test_saving_policies_recompute_fewer_dots_as_remat_flops_counts",
    "tests/kernels/test_mosaic_compile.py::test_splash_attention_compiles_with_mosaic_at_mla_dims[v5p]":
        "splash by Mosaic at the MLA's dims: the v5e case; v5p's VMEM holds the KDA kernels' larger blocks",
    "tests/kernels/test_mosaic_compile.py::test_splash_attention_compiles_with_mosaic_at_mla_dims[v6e]":
        "splash by Mosaic at the MLA's dims: the v5e case (v6e has v5e's VMEM)",
    "tests/runner/test_runner_smoke.py::test_overflowing_sweep_finishes_with_its_summary":
        "overflow: tests/train/test_train_overflow.py; run.py end to end: the SIGTERM/resume smoke",
    "tests/parity/test_parity_harness.py::test_ten_step_parity_fp32":
        "the harness end to end: tests/parity/test_parity_float64.py (4 float64 steps <= 3e-15)",
    "tests/train/test_train_ling3.py::test_ling3_trains_on_bundled_corpus_and_checkpoints":
        "bundled corpus + checkpoints: the run.py SIGTERM/resume smoke",
    "tests/models/test_ling3.py::test_packed_equals_per_document[reference-splash]":
        "splash itself: tests/kernels/test_attention.py; model packing: the other pairings",
    "tests/models/test_ling3.py::test_no_leakage_between_documents[reference-splash]":
        "splash itself: tests/kernels/test_attention.py; model leakage: the other pairings",
    "tests/kernels/test_kda_pallas_model.py::test_ling3_packed_equals_per_document_with_pallas_kda[pallas_varlen]":
        "the kernel per document: tests/kernels/test_kda_pallas.py; the model on the aligned layout: "
        "tests/models/test_ling3.py::test_packed_equals_per_document[chunked_aligned-dot_product]",
    "tests/models/test_ling3.py::test_conf_model_yaml_builds[ling3_flagship]":
        "the flagship's yaml built and its step traced: tests/train/test_flagship_export.py (TPU) and "
        "tests/train/test_cuda_export.py (CUDA)",
    "tests/models/test_ling3.py::test_packed_equals_per_document[chunked-flash]":
        "flash per document: tests/kernels/test_attention.py; chunked + flash in the model: "
        "test_no_leakage_between_documents[chunked-flash]; model packing: the other pairings",
    "tests/kernels/test_kda_pallas.py::test_bf16_within_fla_tolerances[pallas_varlen]":
        "bf16 in the Pallas KDA kernels: the pallas_segment case; pallas_varlen against the oracle: the fp32 case",
    "tests/kernels/test_kda_pallas_sharded.py::test_train_step_with_pallas_segment_exports_for_tpu_with_fsdp_tensor":
        "a train step with pallas_segment exported for TPU on a sharded mesh: "
        "tests/train/test_flagship_export.py::test_flagship_step_exports_for_tpu_on_fsdp_tensor_expert",
    "tests/runner/test_run_whole_documents.py::test_run_trains_on_whole_document_rows":
        "whole-document rows: tests/data/test_data_packing.py (every token once, order, resume, the config "
        "errors); run.py's data path end to end: the SIGTERM/resume smoke",
    "tests/train/test_batch_sharding.py::test_rows_stay_split[context]":
        "rows under context parallelism: tests/parallel (the CP train step against one device, the ring's HLO)",
    "tests/parity/test_parity_routing.py::test_routing_locked_ten_step_parity":
        "the harness end to end in the default suite: tests/parity/test_parity_float64.py (4 float64 steps, "
        "lm / MTP / z-loss / expert biases / validation <= 3e-15, and two injected differences it catches)",
    "tests/parity/test_parity_routing.py::test_trace_reports_an_injected_flip_and_none_without_one":
        "the trace's comparison: test_compare_reports_the_first_differing_step_and_layer (same file)",
    "tests/models/test_ling3.py::test_bfloat16_compute_tracks_fp32":
        "bf16 in the kernels: tests/kernels/test_kda_pallas.py::test_bf16_within_fla_tolerances; the bf16 model "
        "over 50 steps against the fp32 reference: experiments/loss_parity",
    "tests/models/test_ling3.py::test_conf_model_yaml_builds[ling3_tiny]":
        "ling3_tiny's yaml built and trained: the run.py SIGTERM/resume smoke (the default config); the yaml "
        "schema: test_conf_model_yaml_builds[ling3_small]",
    "tests/train/test_evaluate.py::test_resumed_run_evaluates_the_same_batches_at_the_same_steps":
        "evaluation across a resume: the run.py SIGTERM/resume smoke (evaluations at the same steps over both "
        "tries); which valid batches: test_valid_and_test_batches_are_megatron_samples",
    "tests/kernels/test_kda_pallas_model.py::test_ling3_packed_equals_per_document_with_pallas_kda[pallas_segment]":
        "the kernel per document: tests/kernels/test_kda_pallas.py (random segmentations against the oracle and "
        "the reference, forward and gradients); the model's packing on the segment-native layout: "
        "tests/models/test_ling3.py::test_packed_equals_per_document[chunked_aligned-dot_product]",
    "tests/train/test_batch_sharding.py::test_rows_stay_split[fsdp_tensor]":
        "rows split over a batch axis with no batch collective: the [data] case; the fsdp x tensor train step "
        "against one device: tests/train/test_train_sharding.py",
    "tests/parallel/test_ring_splash.py::test_splash_ring_matches_per_document_oracle[contiguous]":
        "the splash ring against the per-document oracle: the [zigzag] case (same file); the contiguous layout "
        "against the oracle: tests/parallel/test_ring.py::test_ring_matches_per_document_oracle[contiguous]",
    "tests/models/test_parity_kimi.py::test_lingpack_to_hf_logits":
        "test_hf_to_lingpack_logits (logits, and every tensor and key back to transformers' names exactly) and "
        "test_scanned_model_converts_both_ways",
    "tests/parallel/test_ring_splash.py::test_splash_ring_compiles_to_splash_kernels_and_permutes":
        "the splash ring against the per-document oracle: the [zigzag] case (same file); splash by Mosaic and "
        "lowered for TPU at MLA's dims: tests/kernels/test_mosaic_compile.py::"
        "test_splash_attention_compiles_with_mosaic_at_mla_dims[v5e], tests/kernels/test_attention.py::"
        "test_splash_lowers_for_tpu_with_mla_head_dims; splash's tile FLOPs: "
        "tests/kernels/test_pallas_cost_estimates.py::"
        "test_splash_flops_per_tile_within_2_percent_of_xla_cost_analysis; "
        "a ring's permutes without gathers: "
        "tests/parallel/test_ring.py::test_ring_hlo_permutes_and_never_gathers_kv; "
        "that no ring step copies K back to the kernels' head-dim-minor layout: this test only (make test-all)",
    "tests/kernels/test_kda_pallas.py::test_gate_and_l2norm_fused_in_kernel[pallas_varlen-None-64]":
        "the gate and L2 norm fused in a Pallas KDA kernel against the reference: the pallas_segment case (the "
        "tiles' prologue both kernels share); the softplus gate's prologue and its backward: "
        "test_prologue_backward_matches_autodiff[softplus]; pallas_varlen with the gate and L2 norm: "
        "test_gate_and_l2norm_via_api_with_safe_gate",
    "tests/distributed/test_distributed.py::test_run_py_unreachable_coordinator_exits_with_one_line":
        "the unreachable coordinator's error: test_wait_for_coordinator_is_bounded_and_clear (same file); a "
        "distributed start that fails as one line and status 1 in a subprocess: "
        "test_coordinator_alone_exits_with_one_line_in_bounded_time; run.py's one-line exits: "
        "tests/distributed/test_launch_scripts.py::test_slurm_launcher_off_cluster_is_one_line and "
        "tests/runner/test_runner_smoke.py::test_too_few_devices_is_one_line_naming_the_key",
    "tests/kernels/test_kda.py::test_bf16_within_fla_tolerances[chunked_aligned]":
        "bf16 in the XLA chunked kernels: the chunked case (the intra-chunk and scan code chunked_aligned shares); "
        "chunked_aligned against the oracle and the reference's gradients: "
        "test_matches_fla_naive_per_document[chunked_aligned-*], test_gradients_match_reference_fp32[chunked_aligned]",
    "tests/kernels/test_kda.py::test_packing_invariance[chunked_aligned]":
        "each packed document against it run alone: the chunked and reference cases; chunked_aligned per document "
        "against the oracle: test_matches_fla_naive_per_document[chunked_aligned-*]",
    "tests/kernels/test_kda.py::test_other_documents_get_exactly_zero_gradient[False-chunked_aligned]":
        "exactly zero gradient across documents: [True-chunked_aligned] (the same kernel, the safe gate's path) "
        "and [False-chunked]",
    "tests/kernels/test_kda.py::test_chunk_size_not_a_power_of_two_matches_fla[chunked_aligned-False]":
        "a chunk size of 48 in chunked_aligned: [chunked_aligned-True]; without the safe gate: [chunked-False]",
    "tests/kernels/test_kda_float64.py::test_float64_matches_fla_naive_in_float64[chunked_aligned]":
        "float64 in the XLA chunked kernels: the chunked case (whose intra-chunk and scan code chunked_aligned "
        "shares) and the reference; the chunked VJPs in float64: "
        "test_float64_chunked_gradients_match_reference_autodiff",
    "tests/kernels/test_kda_pallas_sharded.py::test_fwd_and_grad_export_for_tpu_on_data_x_tensor_mesh[pallas_varlen]":
        "the Pallas KDA kernels exported for TPU inside the mesh wrapper: the pallas_segment case (the same "
        "kernels/shard.py wrapper); pallas_varlen's kernels by Mosaic: tests/kernels/test_mosaic_compile.py::"
        "test_kda_kernel_compiles_with_mosaic_at_flagship_dims[pallas_varlen-safe-v5e]",
    "tests/parallel/test_expert_tpu.py::test_v5p_layer_scan_allocates_each_exchange_buffer_in_its_layer[lax_empty]":
        "exchange buffers allocated in their layer, no copy: the [per_layer] case; the libtpu fact behind it (a "
        "hoisted lax.empty copied in every layer), as this file's other libtpu facts: make test-all",
    "tests/kernels/test_attention.py::test_matches_per_document_sdpa[splash-T40]":
        "splash against per-document SDPA: the T150 case (several tiles, a 3-token document, padding), as for "
        "pallas_triton; splash's padding rows and document isolation: test_padding_rows_are_zero_and_finite[splash], "
        "test_gradients_never_cross_documents[splash]",
    "tests/kernels/test_attention.py::test_matches_per_document_sdpa[splash-T64]":
        "splash against per-document SDPA: the T150 case (several tiles, a 3-token document, padding), as for "
        "pallas_triton; splash's padding rows and document isolation: test_padding_rows_are_zero_and_finite[splash], "
        "test_gradients_never_cross_documents[splash]",
    "tests/parallel/test_cp_model.py::test_mla_layer_context_parallel_uses_permuted_rope_positions[ulysses]":
        "MLA's permuted RoPE positions under context parallelism: the [ring] case; Ulysses against the "
        "per-document oracle: tests/parallel/test_context_strategies.py::"
        "test_strategy_matches_per_document_oracle[ulysses-zigzag]",
}


# The heaviest default-suite files (the seconds pytest's --durations gave each in one run on the 2-core machine),
# run first: `make test` deals whole files (`--dist loadfile`) to whichever worker is free, so a long file
# started last would leave the other worker idle while it runs.
HEAVY_FILES_FIRST = [
    "tests/kernels/test_kda_pallas.py",                     # 37 s: Pallas in interpret mode
    "tests/kernels/test_kda.py",                            # 28 s
    "tests/parity/test_parity_float64.py",                  # 27 s
    "tests/kernels/test_mosaic_compile.py",                 # 26 s: XLA:TPU compiles of every kernel
    "tests/kernels/test_attention.py",                      # 22 s
    "tests/models/test_stack.py",                           # 19 s
    "tests/parallel/test_expert.py",                        # 17 s
    "tests/models/test_moe.py",                             # 17 s
    "tests/models/test_ling3.py",                           # 16 s
    "tests/parallel/test_ring_splash.py",                   # 15 s
    "tests/train/test_train_loop.py",                       # 15 s
    "tests/train/test_train_overflow.py",                   # 14 s
]


def pytest_collection_modifyitems(config, items):
    import pytest
    for item in items:
        if item.nodeid in HEAVY_DUPLICATES:
            item.add_marker(pytest.mark.slow)
    rank = {path: i for i, path in enumerate(HEAVY_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


def pytest_unconfigure(config):
    if _OWN_CACHE and not hasattr(config, "workerinput"):  # the session that made the cache removes it
        shutil.rmtree(os.environ["LINGPACK_TEST_XLA_CACHE"], ignore_errors=True)
