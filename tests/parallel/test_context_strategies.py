"""Every context-parallel strategy x layout against per-document SDPA (fp32, 8 fake devices), HLO, errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lingpack.parallel.context import ContextParallel, context_attention
from tests.parallel import cp_cases as cc

# (strategy, Ulysses degree): all_gather, Ulysses over all 8, USP 2 x 4 and 4 x 2.
STRATEGIES = [("ring", 1), ("all_gather", 1), ("ulysses", 1), ("usp", 2), ("usp", 4)]
DEFAULT = {("all_gather", 1, True), ("ulysses", 1, True), ("usp", 2, False)}  # the rest: slow


def _params():
    for strategy, u in STRATEGIES:
        for lb in (True, False):
            marks = () if (strategy, u, lb) in DEFAULT else (pytest.mark.slow,)
            yield pytest.param(strategy, u, lb, id=f"{strategy}{u if strategy == 'usp' else ''}-"
                               f"{'zigzag' if lb else 'contiguous'}", marks=marks)


@pytest.mark.parametrize("strategy,ulysses,load_balance", list(_params()))
def test_strategy_matches_per_document_oracle(strategy, ulysses, load_balance):
    (q, k, v, seg, w), ref = cc.case(cc.ROWS)
    got, _ = cc.run(strategy, load_balance, q, k, v, seg, w, ulysses)
    perm = ContextParallel(cc.mesh(), load_balance=load_balance).token_index(cc.T)
    cc.assert_matches(got, ref, perm, 8)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,ulysses", STRATEGIES[1:])
def test_strategy_leaks_nothing_across_documents(strategy, ulysses):
    q, k, v, seg, w = cc.case(cc.ROWS)[0]
    base = cc.run(strategy, True, q, k, v, seg, w, ulysses)[0]
    doc = seg == 0
    doc[0] = seg[0] == 3
    q2, k2, v2 = (np.where(doc[..., None, None], -x, x) for x in (q, k, v))
    changed = cc.run(strategy, True, q2, k2, v2, seg, w, ulysses)[0]
    for name, a, b in zip(("o", "dq", "dk", "dv"), base, changed):
        np.testing.assert_array_equal(a[~doc], b[~doc], err_msg=name)


def test_hlo_collectives():
    """Ulysses / USP trade sequence for heads with all-to-alls; all_gather gathers; USP also permutes."""
    ulysses, usp, gather = (cc.compiled(*c)[1] for c in (("ulysses", True, 1), ("usp", False, 2),
                                                          ("all_gather", True, 1)))
    assert "all-to-all" in ulysses and "collective-permute" not in ulysses
    assert "all-to-all" in usp and "collective-permute" in usp
    assert "all-gather" in gather and "all-to-all" not in gather and "collective-permute" not in gather


def _lower(cp, B=1, T=cc.T, H=cc.H, block=cc.BLOCK):
    x = jax.ShapeDtypeStruct((B, T, H, cc.K), jnp.float32)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32)
    return jax.jit(lambda q, s: context_attention(q, q, q, s, cp=cp, scale=1.0, block=block)).lower(x, seg)


@pytest.mark.parametrize("kwargs,T,H,block,match", [
    (dict(strategy="ulysses"), cc.T, 4, 16, "4 attention heads"),
    (dict(strategy="usp", ulysses=8), cc.T, 4, 16, "4 attention heads"),
    (dict(), 520, 8, 16, "sequence length 520 must divide by 2 x context=8"),
    (dict(load_balance=False), 500, 8, 16, "sequence length 500 must divide by context=8"),
    (dict(), cc.T, 8, 24, "attention block 24 does not divide the context-parallel chunk of 32"),
])
def test_errors_name_the_fix(kwargs, T, H, block, match):
    with pytest.raises(ValueError, match=match):
        _lower(ContextParallel(cc.mesh(), **kwargs), T=T, H=H, block=block)


@pytest.mark.parametrize("kwargs,match", [
    (dict(strategy="usp", ulysses=3), "context_ulysses=3 must divide parallel.context=8"),
    (dict(strategy="ring", ulysses=2), "applies only to context_strategy=usp"),
    (dict(strategy="tree"), "context_strategy='tree' is not valid"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ContextParallel(cc.mesh(), **kwargs)
