"""The routing trace and routing-locked parity: lingpack's MoE selections against the reference's."""
import csv
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from lingpack.models.moe import MoEConfig
from lingpack.parity import routing as routing_lib
from tests.parity.test_parity_harness import KIMI, SMALL, parity_config

DEFAULT_LING3 = SMALL   # with MTP (the default Ling3)
SMALL = SMALL + KIMI   # the model as KimiLinear expresses it (as recorded); the default Ling3: test_parity_harness.py


def test_decision_margin_group_and_expert_gaps():
    cfg = MoEConfig(num_experts=4, top_k=1, n_groups=2, topk_groups=1)
    logit = lambda p: np.log(p / (1 - p))  # sigmoid^-1: choice scores are then exactly p + bias
    logits = logit(np.array([[0.9, 0.1, 0.6, 0.3]]))
    # groups {0,1}: 1.0, {2,3}: 0.9 -> group gap 0.1; inside group 0 the expert gap is 0.9 - 0.1 = 0.8
    np.testing.assert_allclose(routing_lib.decision_margin(logits, np.zeros(4), cfg), [0.1], rtol=1e-9)
    bias = np.array([0.0, 0.0, 0.04, 0.0])  # group {2,3} rises to 0.94: the gap shrinks to 0.06
    np.testing.assert_allclose(routing_lib.decision_margin(logits, bias, cfg), [0.06], rtol=1e-9)
    flat = MoEConfig(num_experts=4, top_k=2)  # no groups: the 2nd best (0.6) vs the 3rd (0.3)
    np.testing.assert_allclose(routing_lib.decision_margin(logits, np.zeros(4), flat), [0.3], rtol=1e-9)


def test_compare_reports_the_first_differing_step_and_layer():
    cfg = MoEConfig(num_experts=4, top_k=2, n_groups=2, topk_groups=1)
    rng = np.random.default_rng(0)
    trace = lambda: {"expert_ids": np.tile(np.array([0, 1]), (3, 2, 5, 1)),
                     "router_logits": rng.normal(size=(3, 2, 5, 4)).astype(np.float32),
                     "expert_bias": np.zeros((3, 4), np.float32)}
    ours = {1: trace(), 2: trace(), 3: trace()}
    theirs = {s: {k: v.copy() for k, v in t.items()} for s, t in ours.items()}
    theirs[1]["expert_ids"] = theirs[1]["expert_ids"][..., ::-1]  # same sets in another order: no flip
    assert routing_lib.compare(ours, theirs, cfg)["first_flip"] is None
    theirs[2]["expert_ids"][2, 1, 4] = [3, 2]
    theirs[3]["expert_ids"][0, 0, 0] = [2, 3]
    report = routing_lib.compare(ours, theirs, cfg)
    first = report["first_flip"]
    assert (first["step"], first["layer"], first["tokens"], first["where"]) == (2, 2, 1, [(1, 4)])
    assert report["flips_per_step"] == {1: 0, 2: 1, 3: 1} and report["total_flips"] == 2


def test_from_lingpack_orders_micro_batches_into_rows():
    M, L, R, T, k = 2, 3, 2, 4, 2
    ids = np.arange(M * L * R * T * k).reshape(M, L, R * T, k)
    out = routing_lib.from_lingpack({"expert_ids": ids, "router_logits": ids[..., :1] * 1.0,
                                     "expert_bias": np.zeros((M, L, 4))}, seq_length=T)
    assert out["expert_ids"].shape == (L, M * R, T, k)
    np.testing.assert_array_equal(out["expert_ids"][1, R + 1, 2], ids[1, 1, T + 2])  # micro 1, row 1, t 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """lingpack trained 10 fp32 steps with its routing recorded, the valid split evaluated at steps 5 and 10
    and at the end with the test split (1 batch each); shared by the tests below."""
    from lingpack.parity.harness import RoutingRecorder
    from lingpack.train import loop
    tmp = tmp_path_factory.mktemp("routing")
    rc = parity_config(tmp, ["train.steps=10", "train.eval_every=5", "train.eval_batches=1", *SMALL])
    recorder = RoutingRecorder(rc.data.seq_length)
    result = loop.train(rc.model, rc.data, rc.loss, rc.optim, rc.parallel, rc.checkpoint, rc.train,
                        routing_callback=recorder)
    return rc, result.history, recorder.steps, result.final_eval


def _with(rc, run_dir, **parity):
    return dataclasses.replace(rc, run_dir=str(run_dir), parity=dataclasses.replace(rc.parity, **parity))


def test_routing_locked_ten_step_parity(trained, tmp_path):
    from lingpack.parity.harness import run_parity
    rc, history, routing, final_eval = trained
    assert set(routing) == set(range(1, 11))
    summary = run_parity(_with(rc, tmp_path, lock_routing=True), history, routing=routing, final_eval=final_eval)
    assert summary["parity_lock_routing"] and summary["parity_steps"] == 10
    assert summary["parity_max_rel"] <= 1e-6, summary  # measured 1.6e-7 (fp32 rounding; float64: test_parity_float64)
    assert summary["moe_z_parity_max_rel"] <= 1e-6, summary  # measured 1.2e-7
    # validation (the reference routes with its own choices there): steps 5, 10, end-of-run valid and test
    rows = list(csv.DictReader(open(tmp_path / "parity" / "validation_parity.csv")))
    assert [r["where"] for r in rows] == ["step 5", "step 10", "end valid", "end test"]
    assert summary["val_parity_passed"] and summary["val_parity_max_rel"] <= 1e-6, summary  # measured 1.9e-7
    for split in ("val", "test"):  # the router z-loss is reported apart, as lingpack's
        assert summary[f"reference_{split}_moe_z_loss"] == pytest.approx(final_eval[f"{split}_moe_z_loss"], rel=1e-6)
    # step 10 and the end-of-run evaluation see the same weights but other valid batches: far apart
    step10, end = float(rows[1]["megatron"]), float(rows[2]["megatron"])
    assert abs(step10 - end) > 1e-4 * end
    trace = json.loads((tmp_path / "parity" / "routing.json").read_text())
    assert trace["steps"] == 10  # the reference's own choices were still traced against lingpack's
    assert trace["first_flip"] is None and summary["routing_total_flips"] == 0


def test_trace_reports_an_injected_flip_and_none_without_one(trained, tmp_path):
    from lingpack.parity.harness import run_parity
    from lingpack.train import loop
    rc, history, routing, _ = trained
    clean = run_parity(_with(rc, tmp_path / "clean"), history[:2], routing=routing)  # routing not locked
    assert clean["routing_first_flip_step"] is None and clean["routing_total_flips"] == 0
    assert clean["parity_max_rel"] <= 1e-6  # measured 7.6e-8

    perturbed = loop.make_model(rc.model, rc.train.seed)  # the reference starts from it; lingpack did not
    moe, index = perturbed.moe_layers()[1]  # index: the layer's place in its scan stack (() if unrolled)
    weights = moe.router[...]
    layer = weights[index]
    moe.router[...] = weights.at[index].set(layer.at[:, [0, 2]].set(layer[:, [2, 0]]))  # swap an expert of each group
    summary = run_parity(_with(rc, tmp_path / "flip"), history[:1], initial_model=perturbed, routing=routing)
    assert (summary["routing_first_flip_step"], summary["routing_first_flip_layer"]) == (1, 1)
    trace = json.loads((tmp_path / "flip" / "parity" / "routing.json").read_text())
    first = trace["first_flip"]
    assert first["tokens"] > 0 and first["flipped_logit_diff_max"] > 0
    assert trace["flips_per_step"] == {"1": trace["total_flips"]}
    assert np.isfinite(first["lingpack_margin_max"]) and first["lingpack_margin_max"] >= 0


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="fp32 rounding drift: run_parity's 'KimiLinear fp32 routing locked' row "
                   "measured 1.7e-3 (over 1e-4 from step 28), its float64 row 1.5e-13 over the same 50 "
                   "steps; docs/parity.md")
def test_routing_locked_fifty_step_parity(tmp_path):
    from lingpack.parity.harness import RoutingRecorder, run_parity
    from lingpack.train import loop
    rc = parity_config(tmp_path, ["train.steps=50", "data.num_samples=400", "logger=none",
                                  "train.progress_bar=false", "parity.lock_routing=true", *KIMI])
    recorder = RoutingRecorder(rc.data.seq_length)
    result = loop.train(rc.model, rc.data, rc.loss, rc.optim, rc.parallel, rc.checkpoint, rc.train,
                        routing_callback=recorder)
    summary = run_parity(rc, result.history, routing=recorder.steps)
    assert summary["parity_max_rel"] <= 1e-4, summary


@pytest.mark.slow
@pytest.mark.parametrize("loss", [["loss.calculate_per_token_loss=true"], ["loss.mode=per_token"],
                                  ["loss.megatron_dp_size=2"]], ids=["per_token_loss", "per_token_mode", "dp2"])
def test_routing_locked_parity_in_every_loss_mode(tmp_path, loss):
    """Both trainers end to end in each loss mode (the default Ling3: MTP too), routing locked, z-loss weight
    raised to 0.05.

    Adam's scale invariance hides small z-loss scaling errors here (a 1% wrong denominator passed); the
    z-loss forms themselves are pinned by tests/parity/test_megatron_reference.py."""
    from lingpack.parity.harness import RoutingRecorder, run_parity
    from lingpack.train import loop
    rc = parity_config(tmp_path, ["train.steps=4", *DEFAULT_LING3, "parity.lock_routing=true",
                                  "model.moe.z_loss_coef=0.05", *loss])
    recorder = RoutingRecorder(rc.data.seq_length)
    result = loop.train(rc.model, rc.data, rc.loss, rc.optim, rc.parallel, rc.checkpoint, rc.train,
                        routing_callback=recorder)
    summary = run_parity(rc, result.history, routing=recorder.steps)
    # measured lm <= 1.6e-7, MTP <= 1.3e-7; per_token mode with the reference reporting Megatron's per-group
    # MTP mean (megatron mode's definition): MTP 2.3e-5 apart (float64: 2.9e-5 beside lm at 2.9e-16)
    assert summary["parity_max_rel"] <= 1e-6, summary
    assert summary["mtp_parity_max_rel"] <= 1e-6, summary
