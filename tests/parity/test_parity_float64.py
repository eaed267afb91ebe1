"""The loss-parity harness in float64 on both sides (`experiment=loss_parity_fp64`; the 50-step runs: docs/parity.md):
a two-layer Ling3 (a lower-bound-gate KDA layer with a dense FFN, a RoPE MLA layer with MoE, the MoE MTP layer)
agrees to the rounding floor in every term over 4 steps, and the same tolerance fails when one Megatron setting of
the reference is off by 1%.

One lingpack run (module fixture) serves every comparison: each test trains only the reference."""
import dataclasses

import pytest

from lingpack import precision
from tests.parity.test_parity_harness import SMALL, parity_config

# Measured over these 4 steps (lm, MTP, router z-loss, expert bias, 4 evaluations): <= 2.9e-16; x10, rounded up.
TOLERANCE = 3e-15
TWO_LAYERS = ["model.num_layers=2", "model.inhomogeneous_layer_cycle_interval=2"]   # layer 1 is MLA


@pytest.fixture(scope="module")
def float64_run(tmp_path_factory):
    """lingpack trained 4 float64 steps (x64 on for it only), its routing recorded, valid evaluated at steps 2
    and 4 and at the end with the test split."""
    from lingpack.parity.harness import RoutingRecorder
    from lingpack.train import loop
    tmp = tmp_path_factory.mktemp("float64")
    rc = parity_config(tmp, ["experiment=loss_parity_fp64", "train.steps=4", "train.eval_every=2",
                             "train.eval_batches=1", *SMALL, *TWO_LAYERS])
    assert rc.model.dtype == rc.model.param_dtype == rc.optim.master_dtype == "float64"
    assert rc.model.layer_kinds() == [("kda", "dense"), ("mla", "moe")] and rc.model.mtp_num_layers == 1
    recorder = RoutingRecorder(rc.data.seq_length)
    with precision.x64(True):
        result = loop.train(rc.model, rc.data, rc.loss, rc.optim, rc.parallel, rc.checkpoint, rc.train,
                            routing_callback=recorder)
    return rc, result, recorder.steps


def _reference(float64_run, run_dir, steps=None, **replace):
    """run_parity against lingpack's first `steps` steps (all, and the end-of-run evaluations, by default), the
    reference's config changed by `replace` ({group: {key: value}})."""
    from lingpack.parity.harness import run_parity
    rc, result, routing = float64_run
    groups = {group: dataclasses.replace(getattr(rc, group), **values) for group, values in replace.items()}
    rc = dataclasses.replace(rc, run_dir=str(run_dir), **groups)
    history, final_eval = (result.history, result.final_eval) if steps is None else (result.history[:steps], None)
    with precision.x64(True):
        return run_parity(rc, history, routing=routing, final_eval=final_eval)


def test_float64_parity_to_the_rounding_floor(float64_run, tmp_path):
    rc, result, _ = float64_run
    assert {h["step"] for h in result.history} == set(range(1, 5))
    summary = _reference(float64_run, tmp_path)
    assert (summary["parity_lingpack_param_dtypes"], summary["parity_reference_param_dtypes"]) == ("float64", "float64")
    assert summary["parity_tolerance"] == 1e-9 and summary["parity_steps"] == 4
    for key in ("parity_max_rel", "mtp_parity_max_rel", "moe_z_parity_max_rel", "expert_bias_parity_max_rel",
                "val_parity_max_rel"):
        assert summary[key] <= TOLERANCE, (key, summary)
    assert summary["val_parity_evaluations"] == 4 and summary["routing_total_flips"] == 0
    assert result.history[-1]["lm_loss"] < result.history[0]["lm_loss"]  # trained: not agreement at init only


@pytest.mark.parametrize("key, scale", [("bias_update_rate", 1.01), ("z_loss_coef", 1.01)],
                         ids=["bias_update_rate", "router_z_loss_weight"])
def test_a_one_percent_difference_fails_the_same_tolerance(float64_run, tmp_path, key, scale):
    """The reference alone changes one Megatron setting by 1% (3 steps): the bias update moves the expert biases
    apart (the loss only once a choice flips), the router z-loss weight every weight from the first update on."""
    rc = float64_run[0]
    moe = dataclasses.replace(rc.model.moe, **{key: getattr(rc.model.moe, key) * scale})
    summary = _reference(float64_run, tmp_path, steps=3, model={"moe": moe})
    watched = "expert_bias_parity_max_rel" if key == "bias_update_rate" else "parity_max_rel"
    assert summary[watched] > 100 * TOLERANCE, (watched, summary)
