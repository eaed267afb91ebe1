"""Token layout of a row split over the `context` mesh axis of size N.

Contiguous: device r holds tokens [r*T/N, (r+1)*T/N). Zigzag (dual-chunk swap, for causal load
balance): the row is cut into 2N equal chunks and device r holds chunk r followed by chunk 2N-1-r, so
every device gets one early and one late chunk. The reorder is applied once, in the data pipeline, to
every [B, T] array of a batch; sharding the reordered T axis over `context` then gives each device its
chunks. Kernels never infer order from offsets: they read positions / segment ids, or `local_chunks`.
"""

from __future__ import annotations

import numpy as np


def check_length(length: int, n: int, load_balance: bool, multiple: int = 1) -> None:
    """Raises when a row of `length` tokens cannot be cut into N (or 2N) chunks of `multiple` tokens."""
    parts = 2 * n if load_balance else n
    if length % (parts * multiple):
        raise ValueError(f"sequence length {length} must divide by {'2 x ' if load_balance else ''}context={n}"
                         f"{f' x {multiple}' if multiple > 1 else ''} = {parts * multiple}; pad rows to a "
                         "multiple of it (data.seq_length) or change parallel.context")


def local_chunks(rank: int, n: int, load_balance: bool) -> tuple[int, ...]:
    """Global chunk indices device `rank` holds, in local order (chunks of T/2N zigzag, T/N contiguous)."""
    return (rank, 2 * n - 1 - rank) if load_balance else (rank,)


def zigzag_permutation(length: int, n: int) -> np.ndarray:
    """perm with reordered = x[..., perm]: device r's contiguous slice holds chunks r and 2N-1-r."""
    check_length(length, n, load_balance=True)
    chunk = length // (2 * n)
    order = [c for r in range(n) for c in local_chunks(r, n, True)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in order])


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """inv with x == reordered[..., inv]."""
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size)
    return inv


def reorder_batch(batch: dict, n: int, axis: int = 1) -> dict:
    """Zigzag-reorders the token axis of every array in `batch` (all must share that length)."""
    lengths = {k: np.shape(v)[axis] for k, v in batch.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"batch arrays disagree on the token axis {axis}: {lengths}")
    perm = zigzag_permutation(next(iter(lengths.values())), n)
    return {k: np.take(np.asarray(v), perm, axis=axis) for k, v in batch.items()}


def restore_order(x, n: int, axis: int = 1):
    """The inverse of `reorder_batch` for one array (numpy or jax)."""
    inv = inverse_permutation(zigzag_permutation(x.shape[axis], n))
    return x.take(inv, axis=axis) if hasattr(x, "take") else np.take(x, inv, axis=axis)
