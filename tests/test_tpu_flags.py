"""lingpack.tpu_flags: the LIBTPU_INIT_ARGS table per TPU generation, a user's own flags left alone."""

import pytest

from lingpack import tpu_flags
from lingpack.errors import ConfigError


def test_v5p_flags_overlap_collectives_with_compute():
    flags = tpu_flags.flags_for("v5p")
    assert "--xla_tpu_enable_async_collective_fusion=true" in flags
    # fusing the all-gathers repeats the flagship's weight gathers inside its loops (docs/planning.md)
    assert not [f for f in flags if "fuse_all_gather" in f]
    assert "--xla_tpu_overlap_compute_collective_tc=true" in flags
    assert "--xla_tpu_enable_data_parallel_all_reduce_opt=true" in flags
    assert len(flags) == len(set(flags)) and all(f.startswith("--xla_") and "=" in f for f in flags)


def test_only_v6e_fuses_all_gathers():
    # v6e's exposed all-gathers cost more than the repeated ones inside the loops (docs/planning.md)
    fuse = "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"
    assert fuse in tpu_flags.flags_for("v6e")
    assert fuse not in tpu_flags.flags_for("v5p") and fuse not in tpu_flags.flags_for("v5e")
    assert set(tpu_flags.flags_for("v5p")) < set(tpu_flags.flags_for("v6e"))


def test_the_expert_exchange_is_asynchronous_where_it_is_ragged():
    # v5e refuses the ragged all-to-all (it takes the dense exchange: backend.expert_exchange)
    flag = "--xla_tpu_enable_async_ragged_all_to_all=true"
    assert flag in tpu_flags.flags_for("v5p") and flag in tpu_flags.flags_for("v6e")
    assert flag not in tpu_flags.flags_for("v5e")


@pytest.mark.parametrize("name,generation", [("v5p-64", "v5p"), ("TPU v5", "v5p"), ("TPU v6 lite", "v6e"),
                                             ("v6e-256", "v6e"), ("v5litepod-16", "v5e"), ("TPU v5 lite", "v5e")])
def test_generation_from_chip_names(name, generation):
    assert tpu_flags.generation(name) == generation


def test_unknown_generation_is_one_line():
    with pytest.raises(ConfigError, match=r"no XLA:TPU flag table for chip 'v9x'; known generations: \["):
        tpu_flags.flags_for("v9x")


def test_env_leaves_a_users_flags_alone():
    assert tpu_flags.env("v5p", environ={"LIBTPU_INIT_ARGS": "--mine=1"}) == {}
    assert tpu_flags.env("v6e", environ={}) == {"LIBTPU_INIT_ARGS": " ".join(tpu_flags.flags_for("v6e"))}
    assert tpu_flags.env("v5p", groups=("data_parallel_all_reduce",), environ={})["LIBTPU_INIT_ARGS"].count("--") == 2
