"""segment_ids -> cu_seqlens and the packing statistics, on every layout the data pipeline produces."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lingpack.kernels.kda import segments


def cu(ids, max_segs):
    cu_seqlens, count = segments.segment_ids_to_cu_seqlens(jnp.asarray(ids, jnp.int32), max_segs)
    return np.asarray(cu_seqlens).tolist(), int(count)


def test_fla_convention_examples():
    assert cu([[1, 1, 1, 2, 2, 2]], 4) == ([0, 3, 6, 6, 6], 2)
    assert cu([[1, 2, 3, 4]], 4) == ([0, 1, 2, 3, 4], 4)
    # trailing padding rides with the last segment as no-op tokens, so cu_seqlens[-1] == B*T as FLA requires
    assert cu([[1, 1, 2, 2, 0, 0]], 4) == ([0, 2, 6, 6, 6], 2)


def test_row_boundary_ends_a_segment_even_with_equal_ids():
    # comparing flattened neighbours (`flat[1:] != flat[:-1]`) misses this boundary and mixes the two rows
    assert cu([[1, 1, 1], [1, 1, 1]], 4) == ([0, 3, 6, 6, 6], 2)
    assert cu([[1, 2, 2], [2, 2, 0]], 4) == ([0, 1, 3, 6, 6], 3)


def test_padding_inside_the_flattened_stream():
    # row 0's padding sits between real tokens once flattened; it must not start or end a segment
    assert cu([[1, 1, 0, 0], [1, 2, 2, 2]], 4) == ([0, 4, 5, 8, 8], 3)
    assert cu([[0, 0, 0], [1, 1, 2]], 3) == ([0, 5, 6, 6], 2)  # all-padding row joins the next span as no-ops


def test_overflow_raises_eagerly_and_is_counted_under_jit():
    ids = jnp.asarray([[1, 2, 3, 4, 5, 6]], jnp.int32)
    with pytest.raises(segments.SegmentError, match="6 segments but max_segs=4"):
        segments.segment_ids_to_cu_seqlens(ids, 4)
    cu_seqlens, count = jax.jit(segments.segment_ids_to_cu_seqlens, static_argnums=1)(ids, 4)
    assert int(count) == 6
    # the overflowing tokens (positions 4, 5) lie outside every span: never merged into the last slot
    assert np.asarray(cu_seqlens).tolist() == [0, 1, 2, 3, 4]
    stats = jax.jit(lambda s: segments.packing_stats(s, max_segs=4, chunk_size=64))(ids)
    assert int(stats["overflow"]) == 2 and int(stats["phantom_segments"]) == 0


def test_packing_stats_and_aligned_length():
    ids = jnp.asarray([[1] * 100 + [2] * 28, [1] * 64 + [0] * 64], jnp.int32)
    stats = segments.packing_stats(ids, max_segs=8, chunk_size=64)
    assert int(stats["segments"]) == 3 and int(stats["phantom_segments"]) == 5
    assert int(stats["segments_per_row_max"]) == 2 and int(stats["invalid_rows"]) == 0
    # T_new = ceil((B*T + max_segs*(C-1)) / C) * C
    assert segments.aligned_length(256, 8, 64) == 768
    assert float(stats["t_new_over_t"]) == pytest.approx(768 / 256)
    assert float(stats["native_t_over_t"]) == 1.0


def test_invalid_rows_counted_under_jit():
    ids = jnp.asarray([[1, 2, 1, 1], [1, 0, 2, 2], [1, 1, 2, 0]], jnp.int32)
    assert int(jax.jit(segments.invalid_rows)(ids)) == 2


def test_align_plan_places_segments_on_chunk_boundaries():
    ids = jnp.asarray([[1] * 5 + [2] * 3, [1] * 2 + [0] * 6], jnp.int32)
    plan = segments.align_plan(ids, max_segs=4, chunk_size=4)
    dest = np.asarray(plan.dest)
    assert dest[:5].tolist() == [0, 1, 2, 3, 4]           # segment 1 (5 tokens) fills chunks 0-1
    assert dest[5:8].tolist() == [8, 9, 10]               # segment 2 starts at chunk 2
    assert dest[8:10].tolist() == [12, 13]                # row 1's segment starts at chunk 3
    assert np.asarray(plan.chunk_starts_seg)[:4].tolist() == [True, False, True, True]
    assert np.asarray(plan.chunk_init_row)[[0, 2, 3]].tolist() == [0, 2, 1]  # row 2 = "zeros" (B)
    assert np.asarray(plan.row_last_seg).tolist() == [1, 2]
