"""`python -m lingpack.plan`: the plan of a model whose bytes and FLOPs are known by hand, `fits` against HBM,
collective bytes of a known sharded matmul, and the config composed as run.py composes it."""
import dataclasses
import functools
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from lingpack.plan import cli as plan
from lingpack.plan import chips, hlo
from lingpack.plan import measure as plan_measure
from lingpack.errors import ConfigError
from lingpack.models.ling3 import Ling3Output
from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class BigramConfig:
    """logits = embed[token] @ head: the only matmul is the head's, 2 D V FLOPs a token forward, twice that backward."""
    vocab_size: int = 512
    emb_dim: int = 64

    def make_model(self, rngs):
        return Bigram(self, rngs)

    def flops_per_token(self, seq_len):
        return 6 * self.emb_dim * self.vocab_size


class Bigram(nnx.Module):
    def __init__(self, cfg: BigramConfig, rngs):
        part = lambda axes: nnx.with_partitioning(nnx.initializers.normal(0.02), axes, eager_sharding=False)
        self.embed = nnx.Param(part(("vocab", "embed"))(rngs.params(), (cfg.vocab_size, cfg.emb_dim)))
        self.head = nnx.Param(part(("embed", "vocab"))(rngs.params(), (cfg.emb_dim, cfg.vocab_size)))

    def __call__(self, inputs_BT, segment_ids_BT, positions_BT):
        h_BTD = self.embed[...][inputs_BT]
        none = jnp.zeros((0,), jnp.float32)
        aux = {"router_z_loss": none, "num_tokens": none, "load_counts": jnp.zeros((0, 1), jnp.float32)}
        return Ling3Output(h_BTD @ self.head[...], [], aux, h_BTD)


@functools.lru_cache(maxsize=None)
def bigram_plan(fsdp: int, chip="v5p", micro_batches=2, rows=16, T=128):
    """(config, plan) of the bigram model on an fsdp mesh (cached: tests share one compile)."""
    cfg = BigramConfig()
    rc = types.SimpleNamespace(model=cfg, loss=LossConfig(), optim=OptimConfig(decay_steps=10),
                               train=TrainConfig(micro_batches=micro_batches),
                               data=types.SimpleNamespace(seq_length=T, global_batch_size=rows))
    parallel = ParallelConfig(data=1, fsdp=fsdp)
    return cfg, plan_measure.measure(rc, parallel, chips.chip(chip), jax.devices()[:fsdp], export=False,
                                     compiler="cpu", log=lambda m: None)


def test_a_model_whose_bytes_and_flops_are_known_by_hand():
    """fsdp=8: every parameter split 8 ways along `embed` (D=64); the head matmul on each device's 2 rows."""
    cfg, result = bigram_plan(8)
    V, D, rows, T, n = cfg.vocab_size, cfg.emb_dim, 16, 128, 8
    params = 2 * V * D * 4 // n                                       # fp32 master, split over fsdp
    state = result["breakdown"]["state_bytes"]
    assert state["params"] == params and state["rest"] == 0
    assert 2 * params <= state["optimizer"] <= 2 * params + 64        # AdamW mu, nu (+ its step counters)
    assert result["breakdown"]["gradient_bytes"] == params            # the fp32 accumulator, sharded like params
    assert result["breakdown"]["batch_bytes"] == 5 * rows * T * 4 // n
    flops = 6 * (rows // n) * T * D * V                               # forward + dX + dW of the head, per device
    assert result["step_flops"]["analytic"] == flops
    assert result["step_flops"]["hlo_dots"] == flops                   # the compiled program's matmuls, both micro-batches
    assert result["step_flops"]["xla_cost_analysis"] < flops          # XLA counts the micro-batch loop body once
    compiled = result["breakdown"]["compiled"]
    assert result["per_device_bytes"] == compiled["peak"] >= params * 4   # params, moments and the accumulator live
    assert set(result["collective_bytes"]) == set(hlo.KINDS)
    assert result["collective_bytes"]["all-gather"] >= V * D * 4   # the fsdp-split head gathered (at least once)


def test_fits_flips_when_hbm_is_too_small():
    _, result = bigram_plan(8)
    need = result["per_device_bytes"]
    roomy = dataclasses.replace(chips.chip("v5e"), hbm_bytes=need)
    small = dataclasses.replace(roomy, hbm_bytes=need - 1)
    assert plan_measure.assess(result, roomy)["fits"] and not plan_measure.assess(result, small)["fits"]
    fast = plan_measure.assess(result, dataclasses.replace(roomy, peak_flops=2 * roomy.peak_flops, hbm_bw=2 * roomy.hbm_bw))
    slow = plan_measure.assess(result, roomy)
    assert slow["breakdown"]["roofline"]["collective_s"] == fast["breakdown"]["roofline"]["collective_s"]
    assert fast["est_step_s"] < slow["est_step_s"]


def test_search_plans_the_neighbouring_meshes_and_recommends_the_cheapest_that_fits():
    cfg = BigramConfig()
    rc = types.SimpleNamespace(model=cfg, loss=LossConfig(), optim=OptimConfig(decay_steps=10),
                               train=TrainConfig(micro_batches=2), parallel=ParallelConfig(data=1, fsdp=8),
                               data=types.SimpleNamespace(seq_length=128, global_batch_size=16))
    out = plan.plan(rc, plan.PlanConfig(devices=8, search=True, search_max=2, export=False, compiler="cpu"), log=lambda m: None)
    assert out["mesh"] == "fsdp=8" and [c["mesh"] for c in out["candidates"]] == ["fsdp=8", "data=2 x fsdp=4"]
    best = min((c for c in out["candidates"] if c["fits"]), key=lambda c: c["est_step_s"])
    assert out["recommended"] == best["mesh"]


def test_collective_bytes_of_a_known_sharded_matmul():
    """x [16, 64] @ w [64, 32] with the contraction split over 8 devices: one all-reduce of each device's [16, 32]
    partial product; the ring sends 2 x (8 - 1) / 8 of it per device."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.device_put(np.ones((16, 64), np.float32), NamedSharding(mesh, P(None, "d")))
    w = jax.device_put(np.ones((64, 32), np.float32), NamedSharding(mesh, P("d", None)))
    with jax.set_mesh(mesh):
        text = jax.jit(lambda x, w: jnp.dot(x, w, out_sharding=P())).lower(x, w).compile().as_text()
    by_kind, unknown = plan_measure.collective_totals(text)
    assert unknown == 0 and by_kind["all-reduce"] == {"count": 1, "bytes": 16 * 32 * 4, "sent": 2 * 16 * 32 * 4 * 7 / 8}
    assert all(v["count"] == 0 for k, v in by_kind.items() if k != "all-reduce")


def test_config_is_composed_like_run_py_and_bad_input_is_one_line():
    overrides, values = plan.split_arguments(["model=ling3_flagship", "kernel=pallas_segment", "data.seq_length=8192",
                                              "parallel.fsdp=8", "plan.devices=64", "plan.chip=v6e"])
    cfg = plan.plan_config(values)
    assert (cfg.devices, cfg.chip) == (64, "v6e") and overrides[0] == "model=ling3_flagship"
    rc = plan.run_config(plan.compose(overrides, plan.find_conf_dir(str(ROOT / "conf"))))
    assert rc.model.num_layers == 24 and rc.model.kda_impl == "pallas_segment" and rc.data.seq_length == 8192
    assert rc.data.paths == () and rc.parallel.fsdp == 8 and rc.optim.decay_steps is not None
    with pytest.raises(ConfigError, match="plan.chip='tpu7'.*v5p"):
        plan.plan_config({"chip": "tpu7"})
    with pytest.raises(ConfigError, match="no run config"):
        plan.find_conf_dir("/nonexistent")
    with pytest.raises(ConfigError, match="kernel.name='nope'"):
        plan.run_config(plan.compose(["kernel.name=nope"], plan.find_conf_dir(str(ROOT / "conf"))))


def test_a_mesh_that_does_not_match_the_devices_is_one_line_and_one_device_becomes_data_parallel():
    from lingpack.plan import cli
    rc = plan.run_config(plan.compose(["model=ling3_tiny"], plan.find_conf_dir(str(ROOT / "conf"))))
    said = []
    assert cli.configured_mesh(rc, 8, log=said.append).data == 8 and "data=8" in said[0]   # parallel=single
    bad = dataclasses.replace(rc, parallel=dataclasses.replace(rc.parallel, fsdp=4, data=1))
    with pytest.raises(ConfigError, match="plan.devices=8: mesh axes .* multiply to 4"):
        cli.configured_mesh(bad, 8)
    proc = subprocess.run([sys.executable, "-m", "lingpack.plan", "model=ling3_tiny", "parallel.fsdp=3",
                           "plan.devices=8", "plan.chip=v5p"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("Error: plan.devices=8")
    assert "Traceback" not in proc.stderr


def test_tpu_topology_devices_come_without_libtpu_host_probe_noise():
    """libtpu looks for this host's TPU workers when it loads; compiling from a CPU host it found none and printed
    4 lines (an INVALID_ARGUMENT about TPU_WORKER_HOSTNAMES) before every plan. Loaded under v5p's XLA:TPU flags
    (what the planner's CLI and the launch scripts set), it takes them without a word and the plan can say so."""
    from lingpack import tpu_flags
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "LIBTPU_INIT_ARGS"))}
    env |= {"JAX_PLATFORMS": "cpu"} | tpu_flags.env("v5p", environ={})
    code = ("from lingpack.plan import chips; print(len(chips.tpu_devices(chips.chip('v5p'), 8)), "
            "chips.libtpu_flags() == " + repr(env["LIBTPU_INIT_ARGS"]) + ")")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split() == ["8", "True"], proc.stderr[-2000:]
    assert proc.stderr == ""


def test_gpu_chips_are_planned_on_the_twin_with_the_gpu_side_of_the_moe():
    rc = plan.run_config(plan.compose(["model=ling3_tiny", "kernel=pallas_segment"], plan.find_conf_dir(str(ROOT / "conf"))))
    assert plan.PlanConfig(chip="h100").backend == "cpu" and plan.PlanConfig(chip="v5e").backend == "tpu"
    assert plan.PlanConfig(chip="v5p", compiler="cpu").backend == "cpu"
    twin = plan_measure.twin(rc.model, "gpu")
    assert twin.kda_impl == "chunked" and twin.moe.grouped_matmul == "tiled"            # XLA ops, the GPU's MoE
    assert twin.attention_impl == plan_measure.platform_attention(rc.model, "gpu") != "splash"
    with pytest.raises(ConfigError, match="plan.compiler=tpu compiles for TPU chips"):
        plan.PlanConfig(chip="h200", compiler="tpu")


@pytest.mark.slow
def test_cli_plans_a_small_model_and_writes_the_json(tmp_path):
    """The command line end to end on ling3_tiny with splash and pallas_segment, compiled by XLA:TPU for 8 v5p."""
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "lingpack.plan", "parallel=fsdp_tensor", "kernel=pallas_segment",
                           "model.attention_impl=splash", "plan.devices=8", "plan.chip=v5p", f"plan.output={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(plan.OUTPUT_KEYS) <= set(result) and result["fits"]
    assert result["compiler"] == "xla_tpu" and result["export"]["interpret_kernels"] == {}
    assert "kda_segment_fwd" in result["export"]["mosaic_kernels"]
    assert any(k.startswith("splash") for k in result["export"]["mosaic_kernels"]), result["export"]["mosaic_kernels"]
    assert result["est_step_s"] >= result["step_flops"]["analytic"] / chips.chip("v5p").peak_flops
    assert "est. step" in proc.stdout and "XLA:TPU" in proc.stdout
    from lingpack import tpu_flags
    if not os.environ.get("LIBTPU_INIT_ARGS"):   # compiled under the flags the launch scripts set
        assert result["libtpu_init_args"] == " ".join(tpu_flags.flags_for("v5p"))


def test_a_tpu_only_kernel_planned_for_a_gpu_is_the_one_line_error():
    overrides = ["model.attention_impl=splash", "model.num_layers=1", "model.inhomogeneous_layer_cycle_interval=1"]
    rc = plan.run_config(plan.compose(overrides, plan.find_conf_dir(str(ROOT / "conf"))))
    with pytest.raises(ConfigError, match="splash attention is a Pallas TPU.*model.attention_impl=auto"):
        plan.plan(rc, plan.PlanConfig(devices=1, chip="h100"), log=lambda m: None)


@pytest.mark.slow
def test_layer_stack_matmul_flops_equal_the_unrolled_models():
    """The layer stack runs its mixers under one `lax.cond`: weighted by the layers' KDA / MLA shares (6 KDA, 2 MLA
    of the 8 scanned), its matmul FLOPs are the unrolled model's (same math); unweighted they are far above."""
    from lingpack.models.kda import KDAConfig
    from lingpack.models.ling3 import Ling3Config
    from lingpack.models.mla import MLAConfig
    from lingpack.models.moe import MoEConfig
    from lingpack.train.program import TrainProgram
    flops = {}
    for scan in (True, False):
        model = Ling3Config(vocab_size=256, emb_dim=32, num_layers=9, mlp_dim=64, kda=KDAConfig(num_heads=2, head_dim=16),
                            kda_chunk_size=16, attention_impl="flash", scan_layers=scan,
                            mla=MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                          v_head_dim=16), moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16))
        program = TrainProgram.build(model, LossConfig(), OptimConfig(decay_steps=3), ParallelConfig(data=1),
                                     TrainConfig(), rows=2, seq_length=64, devices=jax.devices()[:1])
        text = program.lower().compile().as_text()
        weights, hits = plan_measure.branch_weights(model), []
        found = lambda op, scope: hits.append(op.name) or weights(op, scope) if weights(op, scope) else None
        flops[scan] = (hlo.dot_flops(text, found), hlo.dot_flops(text))
        assert bool(hits) == scan, "the layer stack's mixer cond is found by its named scope"
    assert flops[True][0] == pytest.approx(flops[False][0], rel=0.03)
    assert flops[True][1] > 1.2 * flops[False][0]


def test_an_unknown_remat_policy_is_one_line():
    with pytest.raises(ConfigError, match="plan.remat_policies: \\['fastest'\\] not among"):
        plan.PlanConfig(remat_policies=("fastest",))


@pytest.mark.slow   # two XLA:CPU compiles of a small Ling3 (40 s here)
def test_remat_policies_are_planned_beside_the_configured_one_and_ranked():
    """`plan.remat_policies`: the configured mesh is planned again under each policy; the one that saves every
    projection (`minimal`) recomputes less of the forward (train/flops.py) than `nothing_saveable` and holds
    more per device; the recommendation is the cheapest plan that fits, named with its policy."""
    rc = plan.run_config(plan.compose(["model=ling3_tiny", "model.num_layers=2", "data.seq_length=64",
                                       "data.global_batch_size=8", "parallel.data=8"],
                                      plan.find_conf_dir(str(ROOT / "conf"))))
    rc = dataclasses.replace(rc, model=dataclasses.replace(rc.model, remat=True, remat_policy="nothing_saveable"))
    out = plan.plan(rc, plan.PlanConfig(devices=8, remat_policies=("minimal",), export=False, compiler="cpu"),
                    log=lambda m: None)
    full, minimal = out["candidates"]
    assert (full["remat_policy"], minimal["remat_policy"]) == ("nothing_saveable", "minimal")
    assert minimal["per_device_bytes"] > full["per_device_bytes"]
    flops = lambda policy: plan_measure.remat_flops(dataclasses.replace(rc.model, remat_policy=policy), 64, 64)
    assert out["step_flops"]["remat"] == flops("nothing_saveable") > flops("minimal")
    best = min((c for c in out["candidates"] if c["fits"]), key=lambda c: c["est_step_s"])
    assert out["recommended"] == f"{best['mesh']}, remat {best['remat_policy']}"
