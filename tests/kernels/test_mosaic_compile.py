"""Every shipped Pallas TPU kernel compiled by Mosaic (libtpu, no TPU attached) for one chip of v5e, v5p
(megacore) and v6e at the flagship's dimensions (conf/model/ling3_flagship.yaml: B=1, T=8192, bf16), forward
and gradient: KDA `pallas_segment` and `pallas_varlen` with the softplus and the lower-bound (safe) gate,
splash attention with segment ids at MLA's head dims (the short convolutions' backward kernel:
tests/kernels/test_short_conv.py).

A kernel whose blocks do not fit VMEM fails its compile (Mosaic's CompileTimeScopedVmemOom, which
`test_a_kernel_over_its_vmem_limit_fails_the_compile` provokes); each compiled kernel's VMEM, as Mosaic
allocated it (`used_scoped_memory_configs` in the compiled HLO), is checked against its limit and the
generation's VMEM. The default suite compiles a subset (DEFAULT_KDA), the rest of the impl x gate x
generation matrix is slow. Without libtpu these tests fail, naming the extra to install.
"""
from pathlib import Path

import jax
import pytest
import yaml

from lingpack.kernels import mosaic
from lingpack.kernels.kda import pallas_common

ROOT = Path(__file__).resolve().parents[2]
FLAGSHIP = yaml.safe_load((ROOT / "conf/model/ling3_flagship.yaml").read_text())
CHUNK = yaml.safe_load((ROOT / "conf/kernel/pallas_segment.yaml").read_text())["chunk_size"]   # the kernel group's
KDA_DIMS = dict(B=1, T=8192, H=FLAGSHIP["kda"]["num_heads"], K=FLAGSHIP["kda"]["head_dim"],
                V=FLAGSHIP["kda"]["head_dim"], chunk_size=CHUNK)
MLA = FLAGSHIP["mla"]
SPLASH_DIMS = dict(B=1, T=8192, H=MLA["num_heads"], K=MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"],
                   V=MLA["v_head_dim"], block=FLAGSHIP["attention_block_size"])
KDA_KERNELS = {"pallas_segment": ("kda_segment_fwd", "kda_segment_states", "kda_segment_bwd"),
               "pallas_varlen": ("kda_varlen_fwd", "kda_varlen_states", "kda_varlen_bwd")}
SPLASH_KERNELS = ("splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv")
GENERATIONS = mosaic.GENERATIONS

# Default suite (compile CPU s measured by experiments/mosaic_compile): the flagship's pallas_segment on v5e and
# v5p (5-10 s each), both gates covered; pallas_varlen (13-16 s: its wrapper's scatter and gather) on v5e with the
# gate pallas_segment does not take there; splash on v5e (~5 s; v5p and v6e: HEAVY_DUPLICATES in tests/conftest.py).
# The rest is slow: no default case compiles for v6e, whose VMEM is v5e's.
DEFAULT_KDA = {("pallas_segment", "v5e", "softplus"), ("pallas_segment", "v5p", "safe"),
               ("pallas_varlen", "v5e", "safe")}
KDA_CASES = [pytest.param(impl, gate, gen, marks=() if (impl, gen, gate) in DEFAULT_KDA else pytest.mark.slow,
                          id=f"{impl}-{gate}-{gen}")
             for impl in KDA_KERNELS for gen in GENERATIONS for gate in mosaic.GATES]


def check_kernels(found, expected_names, generation):
    """Each expected kernel compiled once, its VMEM within its limit and the generation's VMEM."""
    names = [k.name for k in found]
    for expected in expected_names:
        assert sum(expected in n for n in names) == 1, f"{expected} not compiled exactly once: {names}"
    capacity = mosaic.VMEM_BYTES[generation]
    for k in found:
        assert 0 < k.vmem_used <= (k.vmem_limit or capacity) <= capacity, (generation, k)
    return {expected: next(k for k in found if expected in k.name) for expected in expected_names}


@pytest.mark.parametrize("impl,gate,generation", KDA_CASES)
def test_kda_kernel_compiles_with_mosaic_at_flagship_dims(impl, gate, generation):
    fn, args = mosaic.kda_program(impl, gate, **KDA_DIMS)
    compiled, _ = mosaic.compile_for(fn, args, generation)
    by_name = check_kernels(mosaic.kernels(compiled.as_text()), KDA_KERNELS[impl], generation)
    # the compiled kernels carry the pl.CostEstimate each pallas_call declared, unchanged
    declared = {e.params["name"]: e.params for e in pallas_common.pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr)}
    for name, kernel in by_name.items():
        params = next(v for k, v in declared.items() if name in k)
        estimate = params["cost_estimate"]
        assert kernel.cost["flops"] == estimate.flops > 0
        assert kernel.cost["bytes_accessed"] == estimate.bytes_accessed > 0
        assert kernel.cost["transcendentals"] == estimate.transcendentals > 0
        assert kernel.vmem_limit == params["compiler_params"].vmem_limit_bytes   # the limit the kernel set
    # XLA:TPU's own cost analysis counts the declared kernel FLOPs (the wrapper adds a little elementwise work)
    kernel_flops = sum(k.cost["flops"] for k in by_name.values())
    assert kernel_flops <= compiled.cost_analysis()["flops"] <= 1.05 * kernel_flops


@pytest.mark.parametrize("generation", GENERATIONS)
def test_splash_attention_compiles_with_mosaic_at_mla_dims(generation):
    fn, args = mosaic.splash_program(**SPLASH_DIMS)
    compiled, _ = mosaic.compile_for(fn, args, generation)
    by_name = check_kernels(mosaic.kernels(compiled.as_text()), SPLASH_KERNELS, generation)
    # JAX's splash declares no cost estimate and no VMEM limit (lingpack's estimate: kernels/attention/splash.py)
    assert all(k.cost is None and k.vmem_limit is None for k in by_name.values())


def test_a_kernel_over_its_vmem_limit_fails_the_compile(monkeypatch):
    """The fit is Mosaic's: the forward (~1.6 MiB of VMEM at T=512) under a 1 MiB limit does not compile."""
    monkeypatch.setattr(pallas_common, "vmem_limit", lambda budget: 2**20)
    fn, args = mosaic.kda_program("pallas_segment", "safe", **{**KDA_DIMS, "T": 512})
    with pytest.raises(jax.errors.JaxRuntimeError, match="CompileTimeScopedVmemOom"):
        mosaic.compile_for(fn, args, "v5e")


def test_vmem_capacities_are_jax_tpu_info():
    """mosaic.VMEM_BYTES is what JAX's Pallas TPU hardware table says per TensorCore."""
    from jax._src.pallas.mosaic import tpu_info
    chips = {"v5e": tpu_info.ChipVersion.TPU_V5E, "v5p": tpu_info.ChipVersion.TPU_V5P,
             "v6e": tpu_info.ChipVersion.TPU_V6E}
    for generation, version in chips.items():
        assert tpu_info._get_tpu_info_impl(version, 1).vmem_capacity_bytes == mosaic.VMEM_BYTES[generation]


def test_missing_libtpu_is_an_error_naming_the_install(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "libtpu", None)   # `import libtpu` raises ImportError
    with pytest.raises(mosaic.ConfigError, match=r"needs libtpu: pip install -e \"\.\[tpu\]\""):
        mosaic.one_chip("v5e")
