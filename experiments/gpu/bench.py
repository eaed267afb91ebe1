"""lingpack on one NVIDIA GPU: KDA against FLA's Triton kernel, MLA attention kernels, MoE grouped matmuls, train steps.

    python experiments/gpu/bench.py [--parts kda,attention,moe,step] [--out experiments/gpu/results/bench.json]
    python experiments/gpu/bench.py --dry-run --out /tmp/dry.json     # tiny shapes, any platform (plumbing only)

Parts (each writes its entry into the JSON as soon as it ends; a failing part records its error):
  kda        forward + backward of the KDA kernel as the model calls it (bf16 q/k/v/gate, fp32 beta, fused
             safe gate with lower_bound -5 and q/k L2 norm), packed rows of log-normal documents: lingpack
             `chunked` (JAX) against FLA's Triton `chunk_kda` on the same tokens as one varlen sequence
             (`cu_seqlens`), with each one's TFLOP/s (the model's KDA FLOP count, `train.flops`) over the
             chip's bf16 peak, and the RMS ratio between the two outputs.
  attention  MLA attention (q/k 192, v 128, bf16) forward + backward on packed rows: `pallas_triton` (the
             GPU kernel of `attention_impl: auto`) against `flash`, and cuDNN's fused attention through
             JAX's packed-layout API where it runs (a candidate, not in lingpack).
  moe        one MoE layer at flagship width, forward + backward: `tiled` (the GPU side of `auto`) against
             `ragged_dot`.
  step       the real train step (`TrainProgram` on one device: forward, backward, AdamW, expert-bias
             update) of ling3_small and of the flagship's widths at fewer layers: compile seconds,
             median step seconds, tokens/s and MFU (the step log's FLOP count over the bf16 peak).
Timing: JAX calls end in `block_until_ready`, PyTorch's in `torch.cuda.synchronize()`; the implementations
of a part run interleaved (A B A B ...) after warm-up calls and report the median. Imports stay lean:
JAX and lingpack, PyTorch + FLA only for the FLA row (no Hydra, no W&B).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch allocates on the same GPU

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform as host_platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402

from lingpack import backend  # noqa: E402
from lingpack.config import KernelConfig, model_config  # noqa: E402
from lingpack.kernels.attention.api import attention  # noqa: E402
from lingpack.kernels.kda import gate as kda_gate  # noqa: E402
from lingpack.kernels.kda.api import chunk_kda  # noqa: E402
from lingpack.models.moe import MoE  # noqa: E402
from lingpack.train import flops as flops_lib  # noqa: E402
from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig, TrainConfig  # noqa: E402
from lingpack.train.program import TrainProgram  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LOWER_BOUND = -5.0   # Ling3's safe gate
# name: (rows, T, H, K) for KDA; (rows, T, heads) for attention; (tokens, width) for MoE; step models
FULL = {"kda": (4, 8192, 16, 128), "attention": (4, 8192, 16), "moe": (4096, None), "median_doc": 1024,
        "steps": {"ling3_small": ("ling3_small", {}, 8, 4096), "flagship_4_layers": ("ling3_flagship",
                                                                                    {"num_layers": 4}, 4, 8192)},
        "rounds": 10, "warmup": 2}
TINY = {"kda": (2, 256, 2, 32), "attention": (2, 256, 2), "moe": (512, 64), "median_doc": 64,
        "steps": {"tiny": ("ling3_small", {"num_layers": 4, "emb_dim": 64, "mlp_dim": 128, "vocab_size": 512,
                                           "kda": {"num_heads": 2, "head_dim": 32},
                                           "mla": {"num_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32,
                                                   "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
                                                   "v_head_dim": 16},
                                           "moe": {"num_experts": 4, "top_k": 2, "expert_dim": 32,
                                                   "n_groups": 1, "topk_groups": 1}}, 2, 128)},
        "rounds": 2, "warmup": 1}


def packed_segments(rows: int, T: int, median: int, rng) -> np.ndarray:
    """Rows filled with log-normal documents (median `median`, sigma 1), the last one cut at the row end."""
    seg = np.zeros((rows, T), np.int32)
    for b in range(rows):
        t, doc = 0, 1
        while t < T:
            n = min(T - t, max(1, int(rng.lognormal(np.log(median), 1.0))))
            seg[b, t:t + n], t, doc = doc, t + n, doc + 1
    return seg


def document_lengths(seg: np.ndarray) -> list[list[int]]:
    return [np.bincount(row[row > 0])[1:].tolist() for row in seg]


def positions(seg: np.ndarray) -> np.ndarray:
    start = np.concatenate([np.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    index = np.broadcast_to(np.arange(seg.shape[1]), seg.shape)
    return (index - np.maximum.accumulate(np.where(start, index, 0), axis=1)).astype(np.int32)


def interleaved(fns: dict, rounds: int, warmup: int) -> dict:
    """{name: median seconds} of blocking calls, A B A B ... after `warmup` calls of each."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def compiled(fn, *args):
    """(compiled jit of fn, compile seconds: lowering + XLA compile)."""
    start = time.perf_counter()
    out = jax.jit(fn).lower(*args).compile()
    return out, time.perf_counter() - start


def rms_ratio(ref, out) -> float:
    ref, out = np.asarray(ref, np.float32), np.asarray(out, np.float32)
    return float(np.sqrt(np.mean((ref - out) ** 2)) / np.sqrt(np.mean(ref ** 2)))


def fla_kernel():
    """FLA's Triton `chunk_kda` and torch, or the reason they cannot run here."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None, "torch sees no CUDA device"
        from fla.ops.kda import chunk_kda as fla_chunk_kda
        return (torch, fla_chunk_kda), None
    except Exception as err:  # ImportError, or triton failing to initialise
        return None, f"{type(err).__name__}: {err}"


def kda_part(size: dict, peak: float) -> dict:
    B, T, H, K = size["kda"]
    rng = np.random.default_rng(0)
    seg = packed_segments(B, T, size["median_doc"], rng)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    q, k, v, g_raw, do = (normal(B, T, H, K) for _ in range(5))
    beta = 1.0 / (1.0 + np.exp(-normal(B, T, H)))
    A_log = np.asarray(kda_gate.init_a_log(jax.random.key(1), H))
    dt_bias = np.asarray(kda_gate.init_dt_bias(jax.random.key(2), H * K))
    bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
    args = (bf16(q), bf16(k), bf16(v), bf16(g_raw), jnp.asarray(beta), jnp.asarray(A_log), jnp.asarray(dt_bias))
    seg_j, do_j = jnp.asarray(seg), jnp.asarray(do)

    def forward(q, k, v, g, beta, A_log, dt_bias):   # as models/kda.py calls it
        return chunk_kda(q, k, v, g, beta, segment_ids=seg_j, impl="chunked", use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=LOWER_BOUND)[0]

    loss = lambda *a: jnp.sum(forward(*a).astype(jnp.float32) * do_j)
    grad, compile_s = compiled(jax.grad(loss, argnums=tuple(range(7))), *args)
    fwd, _ = compiled(forward, *args)
    fns = {"lingpack_chunked": lambda: jax.block_until_ready(grad(*args))}
    flops = flops_lib.kda_flops_per_token(H, K, 64) * B * T
    out = {"shape": {"rows": B, "T": T, "H": H, "K": K, "V": K, "documents": int(sum(map(len, document_lengths(seg))))},
           "flop_per_call": flops, "lingpack_compile_s": compile_s}
    fla, why = fla_kernel()
    if fla is None:
        out["fla_skipped"] = why
    else:
        torch, fla_chunk_kda = fla
        dev = torch.device("cuda")
        to_t = lambda x, dtype=torch.bfloat16: torch.tensor(np.asarray(x, np.float32), dtype=dtype, device=dev)
        flat = lambda x: x.reshape(1, B * T, *x.shape[2:])   # FLA varlen: one row, documents by cu_seqlens
        lengths = [n for row in document_lengths(seg) for n in row]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.long, device=dev)
        leaves = [to_t(flat(x)).requires_grad_() for x in (q, k, v, g_raw)] + [to_t(flat(beta)).requires_grad_()]
        A_t, dt_t = to_t(A_log, torch.float32).requires_grad_(), to_t(dt_bias, torch.float32).requires_grad_()
        do_t = to_t(flat(do))

        def fla_call():
            return fla_chunk_kda(*leaves, A_log=A_t, dt_bias=dt_t, use_gate_in_kernel=True,
                                 use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND,
                                 cu_seqlens=cu)[0]

        def fla_step():
            for t in leaves + [A_t, dt_t]:
                t.grad = None
            fla_call().backward(do_t)
            torch.cuda.synchronize()
        fns["fla_chunk_kda"] = fla_step
        with torch.no_grad():
            o_fla = fla_call().float().cpu().numpy().reshape(B, T, H, K)
        out["o_rms_ratio_vs_fla"] = rms_ratio(o_fla, fwd(*args))
    times = interleaved(fns, size["rounds"], size["warmup"])
    out["seconds"] = times
    out["tflops"] = {name: flops / s / 1e12 for name, s in times.items()}
    out["fraction_of_peak"] = {name: flops / s / peak for name, s in times.items()}
    if "fla_chunk_kda" in times:
        out["lingpack_over_fla_time"] = times["lingpack_chunked"] / times["fla_chunk_kda"]
    return out


def cudnn_packed(q, k, v, seg: np.ndarray, scale: float):
    """cuDNN fused attention on packed rows through JAX's packed-layout API (q/k/v offsets and lengths per
    document, causal within each): the only JAX entry to cuDNN that keeps documents apart without a dense
    [T, T] mask. A private module (jax._src.cudnn), so it is only a candidate measured here."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
    lengths = document_lengths(seg)
    M = max(map(len, lengths))
    seqlen = np.full((len(lengths), M), -1, np.int32)
    offsets = np.full((len(lengths), M + 1), -1, np.int32)
    for b, row in enumerate(lengths):
        seqlen[b, :len(row)] = row
        offsets[b, :len(row) + 1] = np.concatenate([[0], np.cumsum(row)])
    seqlen, offsets = jnp.asarray(seqlen), jnp.asarray(offsets)
    return dot_product_attention(q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets, kv_offsets=offsets,
                                 scale=scale, mask_type=MaskType.PADDING_CAUSAL, qkv_layout="BTNH")


def attention_part(size: dict, peak: float, on_gpu: bool) -> dict:
    B, T, H = size["attention"]
    Dqk, Dv = 192, 128
    rng = np.random.default_rng(0)
    seg = packed_segments(B, T, size["median_doc"], rng)
    seg_j = jnp.asarray(seg)
    q, k = (jnp.asarray(rng.standard_normal((B, T, H, Dqk)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, H, Dv)), jnp.bfloat16)
    do = jnp.asarray(rng.standard_normal((B, T, H, Dv)), jnp.float32)
    scale = Dqk ** -0.5
    impls = {"pallas_triton": lambda q, k, v: attention(q, k, v, segment_ids_BT=seg_j, impl="pallas_triton"),
             "flash": lambda q, k, v: attention(q, k, v, segment_ids_BT=seg_j, impl="flash", block_size=512)}
    if on_gpu:
        impls["cudnn_packed"] = lambda q, k, v: cudnn_packed(q, k, v, seg, scale)
    pairs = sum(n * (n + 1) // 2 for row in document_lengths(seg) for n in row)
    flops = 3.5 * 2 * H * (Dqk + Dv) * pairs   # forward matmuls on causal in-document pairs; backward 2.5x that
    out = {"shape": {"rows": B, "T": T, "H": H, "qk_head_dim": Dqk, "v_head_dim": Dv}, "flop_per_call": flops,
           "compile_s": {}, "errors": {}}
    fns, outputs = {}, {}
    for name, fn in impls.items():
        try:
            loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) * do)
            grad, out["compile_s"][name] = compiled(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
            outputs[name] = np.asarray(jax.jit(fn)(q, k, v), np.float32)
            fns[name] = lambda grad=grad: jax.block_until_ready(grad(q, k, v))
        except Exception as err:
            out["errors"][name] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    ref = outputs.get("flash")
    out["o_rms_ratio_vs_flash"] = {n: rms_ratio(ref, o * (seg != 0)[..., None, None]) for n, o in outputs.items()
                                   if ref is not None and n != "flash"}
    times = interleaved(fns, size["rounds"], size["warmup"])
    out.update(seconds=times, tflops={n: flops / s / 1e12 for n, s in times.items()},
               fraction_of_peak={n: flops / s / peak for n, s in times.items()})
    return out


def moe_part(size: dict) -> dict:
    from flax import nnx
    tokens, width = size["moe"]
    values = yaml.safe_load((ROOT / "conf/model/ling3_flagship.yaml").read_text())
    cfg = model_config(values, KernelConfig(), values["vocab_size"])
    moe_cfg, D = cfg.moe, width or cfg.emb_dim
    if width:  # tiny shapes: a few experts
        moe_cfg = dataclasses.replace(moe_cfg, num_experts=8, top_k=2, n_groups=1, topk_groups=1, expert_dim=32)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, tokens, D)), jnp.bfloat16)
    out = {"shape": {"tokens": tokens, "emb_dim": D, "experts": moe_cfg.num_experts, "top_k": moe_cfg.top_k,
                     "expert_dim": moe_cfg.expert_dim}, "compile_s": {}}
    fns = {}
    for choice in ("tiled", "ragged_dot"):
        module = MoE(dataclasses.replace(moe_cfg, grouped_matmul=choice), D, dtype=jnp.bfloat16,
                     rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(module)
        loss = lambda params, x: jnp.sum(nnx.merge(graphdef, params)(x)[0].astype(jnp.float32))
        grad, out["compile_s"][choice] = compiled(jax.grad(loss, argnums=(0, 1)), params, x)
        fns[choice] = lambda grad=grad, params=params: jax.block_until_ready(grad(params, x))
    out["seconds"] = interleaved(fns, size["rounds"], size["warmup"])
    out["ragged_dot_over_tiled"] = out["seconds"]["ragged_dot"] / out["seconds"]["tiled"]
    return out


def step_part(size: dict, peak: float) -> dict:
    results = {}
    for label, (file, overrides, rows, T) in size["steps"].items():
        values = yaml.safe_load((ROOT / f"conf/model/{file}.yaml").read_text())
        for key, value in overrides.items():
            values[key] = {**values[key], **value} if isinstance(value, dict) else value
        cfg = model_config(values, KernelConfig(), values["vocab_size"])
        program = TrainProgram.build(cfg, LossConfig(), OptimConfig(decay_steps=1000), ParallelConfig(data=1),
                                     TrainConfig(), rows=rows, seq_length=T, devices=jax.devices()[:1])
        rng = np.random.default_rng(0)
        seg = packed_segments(rows, T, size["median_doc"], rng)
        tokens = rng.integers(0, min(cfg.vocab_size, 150000), (rows, T + 1)).astype(np.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "inputs_segmentation": seg,
                 "targets_segmentation": seg, "inputs_position": positions(seg)}
        batch = jax.device_put({k: jnp.asarray(v) for k, v in batch.items()}, program.batch_sharding)
        state = jax.jit(program.init, out_shardings=program.shardings)()
        start = time.perf_counter()
        step = program.step.lower(state, batch).compile()
        compile_s = time.perf_counter() - start
        holder = [state]

        def run():
            holder[0], metrics = step(holder[0], batch)
            jax.block_until_ready(metrics)
        seconds = interleaved({"step": run}, size["rounds"], size["warmup"])["step"]
        flops = flops_lib.flops_per_token(cfg, T) * rows * T
        stats = jax.devices()[0].memory_stats() or {}
        results[label] = {"layers": cfg.num_layers, "emb_dim": cfg.emb_dim, "rows": rows, "T": T,
                          "attention": cfg.attention_impl, "compile_s": compile_s, "step_s": seconds,
                          "tokens_per_s": rows * T / seconds, "model_flop_per_step": flops,
                          "mfu": flops / seconds / peak, "peak_bytes_in_use": stats.get("peak_bytes_in_use")}
    return results


def environment(dry_run: bool) -> dict:
    device = jax.devices()[0]
    env = {"dry_run": dry_run, "platform": backend.current(), "device_kind": device.device_kind,
           "devices": jax.device_count(), "jax": jax.__version__, "python": host_platform.python_version(),
           "peak_flops_per_device": flops_lib.peak_flops_per_device(device)}
    for module in ("jaxlib", "torch", "triton", "fla"):
        try:
            env[module] = __import__(module).__version__
        except Exception:
            env[module] = None
    try:
        env["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
    except OSError:
        env["commit"] = None
    return env


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="kda,attention,moe,step")
    parser.add_argument("--out", default=str(ROOT / "experiments/gpu/results/bench.json"))
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on any platform: checks the plumbing only")
    args = parser.parse_args(argv)
    size = TINY if args.dry_run else FULL
    if not args.dry_run and backend.current() != "gpu":
        raise SystemExit(f"this benchmark measures a GPU; JAX sees {jax.devices()[0].platform} (use --dry-run)")
    result = {"environment": environment(args.dry_run)}
    peak = result["environment"]["peak_flops_per_device"] or float("nan")
    on_gpu = backend.current() == "gpu"
    runs = {"kda": lambda: kda_part(size, peak), "attention": lambda: attention_part(size, peak, on_gpu),
            "moe": lambda: moe_part(size), "step": lambda: step_part(size, peak)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for part in args.parts.split(","):
        start = time.perf_counter()
        try:
            result[part] = runs[part]()
        except Exception as err:
            result[part] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-2000:]}
        result[part]["part_wall_s"] = time.perf_counter() - start
        out.write_text(json.dumps(result, indent=1, default=float))
        print(f"{part}: {time.perf_counter() - start:.0f} s", flush=True)
    return result


if __name__ == "__main__":
    main()
