"""experiments/gpu/bench.py on CPU with tiny shapes (`--dry-run`): every part runs and writes its JSON entry.

A dry run checks plumbing only (on CPU pallas_triton runs in interpret mode, FLA and cuDNN are skipped);
the benchmark's figures come from a GPU run. The default suite loads the script and checks its packed rows;
the dry runs (tens of CPU seconds of compiles) are `slow`.
"""
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench_module():
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "experiments" / "gpu" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_bench", module)
    spec.loader.exec_module(module)
    return module


def test_packed_rows_positions_and_document_lengths():
    bench = bench_module()
    seg = bench.packed_segments(3, 512, 40, np.random.default_rng(0))
    assert (np.diff(seg, axis=1) >= 0).all() and (seg[:, 0] == 1).all() and (seg > 0).all()
    lengths = bench.document_lengths(seg)
    assert [sum(row) for row in lengths] == [512] * 3 and max(map(len, lengths)) > 5
    pos = bench.positions(seg)
    for b, row in enumerate(lengths):
        assert pos[b].tolist() == [i for n in row for i in range(n)]


def check_part(result: dict, part: str) -> dict:
    entry = result[part]
    assert "error" not in entry, entry.get("traceback")
    return entry


@pytest.mark.slow
def test_dry_run_writes_each_part_as_it_ends(tmp_path):
    """One MoE layer with both grouped matmuls: the JSON is written as each part ends."""
    bench = bench_module()
    out = tmp_path / "dry.json"
    result = bench.main(["--dry-run", "--parts", "moe", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["environment"]["dry_run"] is True and written["environment"]["platform"] == "cpu"
    assert set(check_part(result, "moe")["seconds"]) == {"tiled", "ragged_dot"} and "part_wall_s" in written["moe"]


@pytest.mark.slow
def test_dry_run_kda_attention_and_train_step(tmp_path):
    bench = bench_module()
    result = bench.main(["--dry-run", "--parts", "kda,attention,step", "--out", str(tmp_path / "dry.json")])
    kda = check_part(result, "kda")
    assert kda["fla_skipped"] and set(kda["seconds"]) == {"lingpack_chunked"}
    attention = check_part(result, "attention")
    assert set(attention["seconds"]) == {"pallas_triton", "flash"} and not attention["errors"]
    assert attention["o_rms_ratio_vs_flash"]["pallas_triton"] < 0.01   # bf16 rounding only
    step = check_part(result, "step")["tiny"]
    assert step["tokens_per_s"] > 0 and 0 < step["mfu"] < 1 and step["attention"] == "auto"
