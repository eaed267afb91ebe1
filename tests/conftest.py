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
    "tests/runner/test_runner_smoke.py::test_overflowing_sweep_finishes_with_its_summary":
        "overflow: tests/train/test_train_overflow.py; run.py end to end: the SIGTERM/resume smoke",
    "tests/parity/test_parity_harness.py::test_ten_step_parity_fp32":
        "the harness end to end: tests/parity/test_parity_routing.py (10 locked fp32 steps <= 1e-6) and "
        "tests/parity/test_parity_float64.py (4 float64 steps <= 3e-15)",
    "tests/train/test_train_ling3.py::test_ling3_trains_on_bundled_corpus_and_checkpoints":
        "bundled corpus + checkpoints: the run.py SIGTERM/resume smoke",
    "tests/models/test_ling3.py::test_packed_equals_per_document[reference-splash]":
        "splash itself: tests/kernels/test_attention.py; model packing: the other pairings",
    "tests/models/test_ling3.py::test_no_leakage_between_documents[reference-splash]":
        "splash itself: tests/kernels/test_attention.py; model leakage: the other pairings",
    "tests/kernels/test_kda_pallas_model.py::test_ling3_packed_equals_per_document_with_pallas_kda[pallas_varlen]":
        "the kernel per document: tests/kernels/test_kda_pallas.py; the model on the aligned layout: "
        "tests/models/test_ling3.py::test_packed_equals_per_document[chunked_aligned-dot_product]",
    "tests/models/test_parity_kimi.py::test_lingpack_to_hf_logits":
        "test_hf_to_lingpack_logits (logits, and every tensor and key back to transformers' names exactly) and "
        "test_scanned_model_converts_both_ways",
}


# The heaviest default-suite files (process CPU seconds in one idle run on the 2-core machine), run first: `make test`
# deals whole files (`--dist loadfile`) to whichever worker is free, so a long file started last would leave
# the other worker idle while it runs.
HEAVY_FILES_FIRST = [
    "tests/distributed/test_distributed_multiprocess.py",   # 67 s: 3 run.py processes
    "tests/parity/test_parity_routing.py",                  # 45 s: lingpack + torch reference, 10 steps
    "tests/models/test_ling3.py",                           # 43 s
    "tests/kernels/test_kda_pallas.py",                     # 41 s: Pallas in interpret mode
    "tests/runner/test_runner_smoke.py",                    # 36 s: run.py SIGTERM + resume
    "tests/kernels/test_kda.py",                            # 27 s
    "tests/models/test_stack.py",                           # 24 s
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
