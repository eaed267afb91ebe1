"""How far does a 1-ulp change of the initial weights carry in this training run? lingpack against itself.

    python -m experiments.loss_parity.sensitivity [--steps 50] [--out experiments/loss_parity/results/sensitivity]

Trains the loss-parity configuration (fp32, MoE) twice with lingpack alone: once as is, once with every
initial weight multiplied by (1 + s * 2^-23), s = +-1 at random (one unit in the last place). The
per-step relative lm-loss difference between the two runs is the run's own sensitivity to rounding, the
yardstick for the lingpack-vs-reference difference (`run_parity.py`). Writes `sensitivity.csv` and `.json`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Perturbed:
    """A Ling3Config stand-in whose model starts from the same weights times (1 +- 2^-23)."""
    base: object
    seed: int = 0

    def make_model(self, rngs):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from lingpack.models.ling3 import Ling3
        model = Ling3(self.base, rngs=rngs)
        params = nnx.state(model, nnx.Param)
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(self.seed), len(leaves))
        ulp = lambda p, k: p * (1 + jnp.where(jax.random.bernoulli(k, shape=p.shape), 1.0, -1.0) * 2.0 ** -23)
        nnx.update(model, jax.tree.unflatten(treedef, [ulp(p, k) for p, k in zip(leaves, keys)]))
        return model

    def __getattr__(self, name):  # everything else (moe, mtp_num_layers, ...) is the base config's
        return getattr(self.base, name)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default=str(ROOT / "experiments" / "loss_parity" / "results" / "sensitivity"))
    args = parser.parse_args()
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from lingpack import config as config_lib
    from lingpack.train import loop
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "experiment=loss_parity", f"train.steps={args.steps}", f"data.num_samples={args.steps * 8}",
            "model.dtype=float32", "logger=none", "train.progress_bar=false"], return_hydra_config=True)
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("hydra")
    plain["checkpoint"]["directory"] = str(out / "ckpt")  # unused: loss_parity disables checkpoints
    plain = OmegaConf.to_container(OmegaConf.create(plain), resolve=True)
    rc = config_lib.build(plain, str(out))
    runs = {}
    for name, model_cfg in (("as is", rc.model), ("1 ulp", Perturbed(rc.model))):
        result = loop.train(model_cfg, rc.data, rc.loss, rc.optim, rc.parallel, rc.checkpoint, rc.train)
        runs[name] = [float(h["lm_loss"]) for h in result.history]
    rows = [{"step": i + 1, "lm_loss": a, "lm_loss_1ulp": b, "rel_diff": abs(a - b) / abs(a)}
            for i, (a, b) in enumerate(zip(runs["as is"], runs["1 ulp"]))]
    with open(out / "sensitivity.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    first_over = next((r["step"] for r in rows if r["rel_diff"] > 1e-4), None)
    summary = {"steps": len(rows), "max_rel_diff": max(r["rel_diff"] for r in rows), "first_step_over_1e-4": first_over}
    (out / "sensitivity.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
