"""Context parallelism (CP): every row's T axis split over the `context` mesh axis of N devices.

Files
  reorder.py   the token layout contract: contiguous, or zigzag (device r holds chunks r and 2N-1-r of 2N)
  context.py   `ContextParallel` (mesh + strategy + layout), the ambient `context_parallel` / `current()`,
               `context_attention` (softmax attention under CP)
  ring.py      ring attention (K/V rotate; dK/dV ride a second ring home)
  ulysses.py   Ulysses all-to-all and USP (Ulysses x ring)
  kda_cp.py    KDA state passing (per-block affine summaries, all-gathered and folded in sequence order)
  halo.py      neighbour tokens by ppermute: the short-conv halo and the MTP roll
  expert.py    expert parallelism (not CP): MoE assignments sent to their experts' devices by all-to-all
The per-block math (online softmax, tile skipping, recomputing VJP) is kernels/attention/blockwise.py.

How a layer learns it is under CP (the one rule every layer follows)
  1. The train loop builds `cp = ContextParallel.from_config(parallel_cfg, mesh)` (None when
     parallel.context == 1) and, when `cp.load_balance`, zigzag-reorders EVERY array of each batch once
     (`reorder_batch`: inputs, targets, both segmentations, positions) before sharding it.
  2. `train/step.py` traces model + loss inside `with context_parallel(cp):`.
  3. A layer calls `cp = current()`. None: run the single-device code (also what every caller outside
     the train step gets: tests, evaluation, conversion, packing parity). Otherwise its [B, T, ...]
     inputs are global arrays whose T axis is in `cp`'s layout, sharded over `cp.axis`; the layer runs
     its own `jax.shard_map(..., mesh=cp.mesh)` over that axis (batch / head axes: `cp.batch_axes`,
     `cp.head_axes` when they divide). Original token positions come from `cp.token_index(T)`, never
     from offsets; RoPE uses the batch's `inputs_position`, which the reorder already permuted.
  4. Per-token layers (norms, MLPs, dropless MoE, projections, RoPE) need nothing. Order-dependent
     layers have their own CP: MLA (context_attention), KDA (kda_cp), the short convs and the MTP
     roll (halo); none gathers the row.
"""
