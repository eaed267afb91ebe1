"""The vocabulary-chunked head and cross-entropy against the whole-vocabulary one, at the flagship's vocabulary.

    python -m experiments.flagship_memory.vocab_chunks [--chunks 0 16384 32768] [--repeats 2] [--time-tokens 1024]

Model: conf/model/ling3_flagship.yaml cut to 2 layers (KDA + dense, KDA + MoE; MTP: MLA + MoE), flash attention,
one row of T=4096, one device, fp32 master weights, z-loss 1e-4 (so the logsumexp's gradient path is used).

* memory: the compiled train step's temporaries (`memory_analysis()`, nothing run) for each `vocab_chunk_size`
  (0 = the whole vocabulary), and their ratio to the whole-vocabulary step's.
* head memory: the compiled temporaries of the head + cross-entropy alone (below) at T=4096: the part of the
  step the chunks change (the 2-layer step's peak is its optimizer update, where the head's arrays are dead).
* time: the head + cross-entropy alone (final-normed hidden [1, `--time-tokens`, 1536] fp32 and the
  [1536, 157184] head weight; loss = masked xent + z-loss; gradients of both), every chunk size called in
  turn, `--repeats` rounds, process CPU seconds per call (median), as a ratio to the whole-vocabulary call
  of the same round. Fewer tokens than the memory study's 4096 keep a call near 20 s on a 2-core host
  (the head is ~6 TFLOP per 4096 tokens); the chunking is per token row, so the ratio does not depend on it.
* exactness: that call's loss and gradients relative to the whole vocabulary's (max |a - b| / max |b|).

Writes results/vocab_chunks.json and results/vocab_chunks.md. The compiles and the calls use several GiB: run
it under `flock /tmp/lingpack-bigmem.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import yaml

from experiments.provenance import commit
from lingpack.models.head import LMHead
from lingpack.models.ling3 import config_from_dict
from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig, TrainConfig
from lingpack.train.program import TrainProgram

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "results"
T, Z_LOSS = 4096, 1e-4


def model_config(chunk: int):
    d = yaml.safe_load((ROOT / "conf/model/ling3_flagship.yaml").read_text())
    d.update(num_layers=2, attention_impl="flash", vocab_chunk_size=chunk)
    return config_from_dict(d)


def step_memory(chunk: int) -> dict:
    program = TrainProgram.build(model_config(chunk), LossConfig(z_loss_weight=Z_LOSS), OptimConfig(decay_steps=10),
                                 ParallelConfig(data=1), TrainConfig(), rows=1, seq_length=T, devices=jax.devices()[:1])
    start = time.process_time()
    compiled = program.lower().compile()
    m = compiled.memory_analysis()
    return {"temp_bytes": int(m.temp_size_in_bytes), "argument_bytes": int(m.argument_size_in_bytes),
            "compile_cpu_s": round(time.process_time() - start, 1)}


def head_fn(chunk: int):
    """Jitted (h, w, targets, mask) -> (loss, (dh, dw)) of the head + cross-entropy + z-loss."""
    def loss(h, w, targets, mask):
        xent, lse = LMHead(h, w, 1, chunk).xent(targets)
        return jnp.sum(xent * mask) / jnp.sum(mask) + Z_LOSS * jnp.sum(lse ** 2 * mask) / jnp.sum(mask)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def head_memory(chunks: list[int]) -> dict:
    cfg = model_config(0)
    args = (jax.ShapeDtypeStruct((1, T, cfg.emb_dim), jnp.float32), jax.ShapeDtypeStruct((cfg.emb_dim, cfg.vocab_size), jnp.float32),
            jax.ShapeDtypeStruct((1, T), jnp.int32), jax.ShapeDtypeStruct((1, T), jnp.float32))
    return {str(c): int(head_fn(c).lower(*args).compile().memory_analysis().temp_size_in_bytes) for c in chunks}


def _rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def head_timing(chunks: list[int], repeats: int, tokens: int) -> dict:
    cfg = model_config(0)
    keys = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(keys[0], (1, tokens, cfg.emb_dim), jnp.float32)
    w = 0.02 * jax.random.normal(keys[1], (cfg.emb_dim, cfg.vocab_size), jnp.float32)
    targets = jax.random.randint(keys[2], (1, tokens), 0, cfg.vocab_size)
    mask = (jnp.arange(tokens) % 7 != 0).astype(jnp.float32)[None]   # some masked tokens
    fns = {c: head_fn(c) for c in chunks}
    outputs = {c: jax.block_until_ready(fns[c](h, w, targets, mask)) for c in chunks}   # compile + warm up
    cpu = {c: [] for c in chunks}
    for _ in range(repeats):
        for c in chunks:
            start = time.process_time()
            jax.block_until_ready(fns[c](h, w, targets, mask))
            cpu[c].append(time.process_time() - start)
    (ref_loss, (ref_dh, ref_dw)) = outputs[0]
    out = {}
    for c in chunks:
        loss, (dh, dw) = outputs[c]
        out[str(c)] = {"cpu_s": [round(x, 3) for x in cpu[c]], "cpu_s_median": round(statistics.median(cpu[c]), 3),
                       "loss_rel": _rel(loss, ref_loss), "dh_rel": _rel(dh, ref_dh), "dw_rel": _rel(dw, ref_dw)}
    return out


def render(result: dict) -> str:
    memory, timing = result["memory"], result["head"]
    base_temp, base_cpu = memory["0"]["temp_bytes"], timing["0"]["cpu_s_median"]
    lines = [f"Vocabulary chunks at V={result['vocab']}, T={result['T']} (memory: commit "
             f"{result.get('memory_commit', result['commit'])}; time and exactness: commit {result['commit']}; {result['machine']})",
             "", f"| vocab_chunk_size | step temp GiB (T={result['T']}) | temp / whole | head+xent temp GiB (T={result['T']}) "
             f"| temp / whole | head+xent CPU s (T={result['time_tokens']}) | CPU / whole | loss rel | dh rel | dw rel |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    head_temp = result.get("head_temp_bytes", {})
    for c in result["chunks"]:
        m, t = memory[str(c)], timing[str(c)]
        ht = head_temp.get(str(c))
        head_cells = f"{ht / 2**30:.2f} | {ht / head_temp['0']:.2f}" if ht else "- | -"
        lines.append(f"| {c or 'whole'} | {m['temp_bytes'] / 2**30:.2f} | {m['temp_bytes'] / base_temp:.2f} | {head_cells} | "
                     f"{t['cpu_s_median']:.2f} | {t['cpu_s_median'] / base_cpu:.2f} | {t['loss_rel']:.1e} | "
                     f"{t['dh_rel']:.1e} | {t['dw_rel']:.1e} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--time-tokens", type=int, default=1024)
    parser.add_argument("--head-memory-only", action="store_true", help="add the head's compiled temporaries to "
                        "results/vocab_chunks.json (compile only)")
    parser.add_argument("--memory-only", action="store_true", help="measure the step's and the head's compiled "
                        "temporaries again into results/vocab_chunks.json, keeping its timing (compile only)")
    args = parser.parse_args()
    chunks = sorted(set([0] + args.chunks))
    if args.head_memory_only or args.memory_only:
        result = json.loads((OUT / "vocab_chunks.json").read_text())
        result["head_temp_bytes"] = head_memory(result["chunks"])
        result["memory_commit"] = commit()
        if args.memory_only:
            result["memory"] = {str(c): step_memory(c) for c in result["chunks"]}
        (OUT / "vocab_chunks.json").write_text(json.dumps(result, indent=1) + "\n")
        (OUT / "vocab_chunks.md").write_text(render(result))
        print(render(result))
        return
    memory = {}
    for c in chunks:
        memory[str(c)] = step_memory(c)
        print(f"vocab_chunk_size={c}: temp {memory[str(c)]['temp_bytes'] / 2**30:.2f} GiB", flush=True)
    result = {"commit": commit(), "machine": "shared 2-core CPU host, fp32", "vocab": model_config(0).vocab_size,
              "T": T, "time_tokens": args.time_tokens, "chunks": chunks, "memory": memory,
              "head": head_timing(chunks, args.repeats, args.time_tokens), "head_temp_bytes": head_memory(chunks)}
    OUT.mkdir(exist_ok=True)
    (OUT / "vocab_chunks.json").write_text(json.dumps(result, indent=1) + "\n")
    (OUT / "vocab_chunks.md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    main()
