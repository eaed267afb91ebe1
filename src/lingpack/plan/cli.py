"""`python -m lingpack.plan`: what a training step costs on a slice of N chips, before renting it.

    python -m lingpack.plan model=ling3_flagship kernel=pallas_segment data.seq_length=8192 \\
        data.global_batch_size=64 parallel.data=1 parallel.fsdp=8 parallel.expert=8 \\
        plan.devices=64 plan.chip=v5p plan.output=plan.json

Every argument but `plan.*` is a run.py override: the config is composed by Hydra from the same `conf/`
(`plan.conf_dir`, else `./conf` when run from a checkout, else the checkout this package is installed
from) and resolved by `lingpack.config.build`, so a config run.py rejects is rejected here with the same
one-line error. The data is not read (only its shape and vocabulary matter). The planner's own keys
(`PlanConfig`): devices, chip (`lingpack.plan.chips`), output (JSON path), search, layers, export, conf_dir.

Per mesh (`lingpack.plan.measure` does the measuring):
  1. export    the run's TrainProgram traced for the chip's platform (`lingpack.backend.target`): the step
               lowers there, and its Pallas kernels are Mosaic calls, counted by name. A config that
               cannot run on that platform (a TPU-only kernel on a GPU) stops here with its ConfigError.
  2. compile   the same program for N fake CPU devices with each Pallas kernel replaced by its XLA twin
               (XLA:CPU compiles no Pallas TPU or GPU call): KDA pallas_segment -> chunked, pallas_varlen
               -> chunked_aligned; attention (`auto` resolved for the chip) -> flash. Mesh, shardings,
               loss, optimizer, micro-batches: the run's.
  3. report    per device: the train state's exact bytes (its shardings), XLA:CPU's memory_analysis() of
               the compiled step, `fits` against the chip's HBM; FLOPs (train/flops.py's analytic count,
               XLA's cost analysis, the matmul FLOPs the HLO executes); collectives by kind (loop trip
               counts in); a roofline time and the MFU it implies.
On TPU chips the CLI compiles under the XLA:TPU flags the launch scripts train with (`lingpack.tpu_flags` for
the chip; a LIBTPU_INIT_ARGS already set wins, `LIBTPU_INIT_ARGS=" "` plans libtpu's defaults); the plan
records them (`libtpu_init_args`).
`plan.search=true` also plans other meshes of N devices and recommends the cheapest that fits;
`plan.remat_policies=[minimal,save_moe_proj]` also plans the configured mesh under each of those
`model.remat_policy` values (models/remat.py: each saves some projections instead of recomputing them) and
recommends the cheapest of everything planned that fits.
XLA:CPU assigns buffers and fuses differently from XLA:TPU / XLA:GPU: the compiled bytes are this
program's temporaries as XLA:CPU plans them, an estimate; the state bytes are exact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from lingpack.errors import ConfigError

OUTPUT_KEYS = ("compiler", "per_device_bytes", "hbm_bytes", "fits", "step_flops", "collective_bytes", "est_step_s", "mfu_at_est")


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    devices: int = 8             # chips of the slice (fake CPU devices here)
    chip: str = "v5p"            # lingpack.plan.chips: v5e v5p v6e h100 h200
    output: str | None = None    # write the plan's JSON here
    search: bool = False         # also plan other meshes of `devices` and recommend the cheapest that fits
    search_max: int = 4          # meshes compiled by the search, the configured one included
    layers: int | None = None    # compile this many layers (and this + one layer cycle), scale per layer
    export: bool = True          # XLA:CPU twin only: export for the chip's platform (proves lowering, counts kernels)
    conf_dir: str | None = None  # the Hydra config directory (default: ./conf, else the package's checkout)
    compiler: str | None = None  # "tpu" (XLA:TPU via libtpu; the default for TPU chips) or "cpu" (the XLA:CPU twin)
    topology: str | None = None  # TPU slice shape, e.g. 4x4x4 (default: chips.TOPOLOGIES' standard one)
    save_hlo: str | None = None  # write the compiled program's HLO text there (the configured mesh's deepest compile)
    remat_policies: tuple = ()   # also plan the configured mesh under each of these model.remat_policy values

    def __post_init__(self):
        if self.devices < 1:
            raise ConfigError(f"plan.devices={self.devices} must be >= 1 (the slice's chip count)")
        if self.search_max < 1:
            raise ConfigError(f"plan.search_max={self.search_max} must be >= 1")
        from lingpack.plan import chips
        chip = chips.chip(self.chip)
        if self.compiler not in (None, "tpu", "cpu"):
            raise ConfigError(f"plan.compiler={self.compiler!r}: choose tpu (XLA:TPU, TPU chips) or cpu (the XLA:CPU twin)")
        from lingpack.models import remat
        unknown = [p for p in self.remat_policies if p not in remat.POLICIES]
        if unknown:
            raise ConfigError(f"plan.remat_policies: {unknown} not among the policies {list(remat.POLICIES)}")
        if self.compiler == "tpu" and chip.platform != "tpu":
            raise ConfigError(f"plan.compiler=tpu compiles for TPU chips; {chip.name} is a GPU: drop plan.compiler "
                              "(GPUs are planned on the XLA:CPU twin: this JAX cannot compile for CUDA without a GPU)")

    @property
    def backend(self) -> str:
        """The compiler the plan uses: XLA:TPU for TPU chips unless plan.compiler=cpu; the XLA:CPU twin for GPUs."""
        from lingpack.plan import chips
        return self.compiler or ("tpu" if chips.chip(self.chip).platform == "tpu" else "cpu")


def split_arguments(argv: list[str]) -> tuple[list[str], dict]:
    """(run.py overrides, {plan key: value}) from the command line; plan values are parsed like Hydra's."""
    from omegaconf import OmegaConf
    plan = [a for a in argv if a.startswith("plan.")]
    if any("=" not in a for a in plan):
        raise ConfigError(f"plan options take a value: {[a for a in plan if '=' not in a]}; e.g. plan.devices=64")
    values = OmegaConf.to_container(OmegaConf.from_dotlist(plan)).get("plan", {}) if plan else {}
    return [a for a in argv if not a.startswith("plan.")], values


def plan_config(values: dict) -> PlanConfig:
    from lingpack.config import make
    return make(PlanConfig, values, "plan")


def find_conf_dir(explicit: str | None = None) -> Path:
    """The Hydra config directory: `explicit`, else ./conf, else the checkout's (lingpack.config's rule)."""
    from lingpack import config as config_lib
    return Path(config_lib.find_config_dir(explicit))


def compose(overrides: list[str], conf_dir: Path | str | None = None) -> dict:
    """The plain config run.py would see for `overrides`: `lingpack.config.compose`, the run directory a null one."""
    from lingpack import config as config_lib
    return config_lib.compose(list(overrides), run_dir=os.devnull, config_dir=None if conf_dir is None else str(conf_dir))


def run_config(plain: dict):
    """`lingpack.config.build` of the composed config; the data files are not opened (a null vocabulary
    still follows the data's tokenizer record)."""
    from lingpack import config as config_lib
    from lingpack.train import optim as optim_lib
    data = dict(plain.get("data") or {})
    if data.get("vocab_size") is not None:  # nothing to read from the data: no bundled corpus tokenized
        data["paths"] = []
    rc = config_lib.build(dict(plain, data=data), run_dir=os.devnull, open_data=False)
    return dataclasses.replace(rc, optim=optim_lib.resolve(rc.optim, rc.train.steps))   # as train/loop.py does


def use_fake_devices(n: int) -> None:
    """Make this process see `n` CPU devices; must run before JAX initialises its backends."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def configured_mesh(rc, devices: int, log=print):
    """The run's mesh for `devices` chips; `parallel=single` (every axis 1) becomes data parallelism over all of
    them, said in one line; any other mismatch is a one-line ConfigError."""
    from lingpack.train.sharding import mesh_shape
    try:
        mesh_shape(rc.parallel, devices)
        return rc.parallel
    except ValueError as err:
        sizes = rc.parallel.axis_sizes()
        if all(v == 1 for v in sizes.values()) and devices > 1:
            log(f"plan: the config's mesh uses one device; planning data parallelism over all {devices} "
                f"(data={devices}); set parallel.data / fsdp / expert / ... to plan another mesh")
            return dataclasses.replace(rc.parallel, data=devices)
        raise ConfigError(f"plan.devices={devices}: {err}") from None


def plan(rc, cfg: PlanConfig, *, log=print) -> dict:
    """The plan of run config `rc` on `cfg.devices` x `cfg.chip` (see the module docstring)."""
    import jax

    from lingpack.plan import chips
    from lingpack.plan import measure
    chip = chips.chip(cfg.chip)
    compiler = cfg.backend
    if compiler == "tpu":
        devices = chips.tpu_devices(chip, cfg.devices, cfg.topology)
        log(f"plan: XLA:TPU flags (LIBTPU_INIT_ARGS): {chips.libtpu_flags() or 'none (libtpu defaults)'}")
        where = f"XLA:TPU, topology {chips.topology_name(chip, cfg.devices, cfg.topology)}"
    else:
        devices = jax.devices()
        where = "the XLA:CPU twin"
        if len(devices) < cfg.devices:
            raise ConfigError(f"plan.devices={cfg.devices} but this process has {len(devices)} devices: JAX was "
                              "initialised before the planner set the fake device count; run `python -m lingpack.plan` "
                              "in a fresh process")
    configured = configured_mesh(rc, cfg.devices, log)
    variants = [(configured, rc)]
    if cfg.search:
        base = rc if configured is rc.parallel else dataclasses.replace(rc, parallel=configured)
        variants += [(p, rc) for p in measure.candidate_meshes(base, cfg.devices, limit=cfg.search_max - 1)]
    variants += [(configured, dataclasses.replace(rc, model=dataclasses.replace(rc.model, remat=True, remat_policy=p)))
                 for p in cfg.remat_policies]
    results, findings = [], []
    for parallel, run in variants:
        name = measure.mesh_name(parallel, cfg.devices) + (f", remat {run.model.remat_policy}" if run is not rc else "")
        log(f"plan: mesh {name} on {cfg.devices} x {chip.name} ({where}) ...")
        try:
            results.append(measure.measure(run, parallel, chip, devices[:cfg.devices], layers=cfg.layers,
                                           export=cfg.export, compiler=compiler, log=log,
                                           save_hlo=cfg.save_hlo if parallel is configured and run is rc else None))
        except measure.CompileFinding as err:   # the plan's finding: this mesh does not compile (or fit)
            log(f"plan: {name}: {err}")
            findings.append({"mesh": name, "finding": str(err)})
            if len(variants) == 1:
                raise
        except ConfigError as err:
            if parallel is configured and run is rc:
                raise
            log(f"plan: skipped: {err}")
    if not results:
        raise ConfigError(f"no mesh compiled: {findings[0]['finding']}")
    best = min((r for r in results if r["fits"]), key=lambda r: r["est_step_s"], default=None)
    out = dict(results[0])
    if compiler == "tpu":
        out["libtpu_init_args"] = chips.libtpu_flags()
    if len(variants) > 1:
        keys = ("mesh", "remat_policy", "per_device_bytes", "fits", "est_step_s", "mfu_at_est")
        out["candidates"] = [{k: r["config"][k] if k == "remat_policy" else r[k] for k in keys}
                             for r in results] + [dict(f, fits=False) for f in findings]
        remat = f", remat {best['config']['remat_policy']}" if best and cfg.remat_policies else ""
        out["recommended"] = best["mesh"] + remat if best else None
    return out


def gib(b: float) -> str:
    """Bytes in GiB, or MiB / KiB when smaller."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(b) >= size or unit == "KiB":
            return f"{b / size:.2f} {unit}"


def table(result: dict) -> str:
    """The plan as console text."""
    r, b = result, result["breakdown"]
    state = b["state_bytes"]
    tpu = r.get("compiler") == "xla_tpu"
    compiler = "XLA:TPU" if tpu else "XLA:CPU twin"
    lines = [f"plan ({compiler}): {r['config']['model']} T={r['config']['seq_length']} x "
             f"{r['config']['global_batch_size']} rows ({r['config']['micro_batches']} micro-batches) on "
             f"{r['devices']} x {r['chip']['name']}, mesh {r['mesh']}",
             "", "| per device | bytes |", "|---|---|"]
    rows = [("parameters (master)", state["params"]), ("optimizer state", state["optimizer"]),
            ("model state (expert bias, ...)", state["rest"]), ("gradient accumulator (fp32)", b["gradient_bytes"]),
            ("batch", b["batch_bytes"]), (f"temporaries ({compiler}, incl. gradients, activations)", b["compiled"]["temp"]),
            (f"peak ({compiler}: arguments + outputs + temporaries - aliased)", r["per_device_bytes"]),
            ("HBM", r["hbm_bytes"])]
    lines += [f"| {name} | {gib(v)} |" for name, v in rows]
    lines += [f"| fits | {'yes' if r['fits'] else 'NO'} |", ""]
    f = r["step_flops"]
    compiled = f" | compiled {f['compiled']:.3e} (loop trip counts in)" if "compiled" in f else ""
    lines += [f"step FLOPs per device: analytic {f['analytic']:.3e} + remat {f['remat']:.3e}{compiled} | XLA cost "
              f"analysis {f['xla_cost_analysis']:.3e} (loop bodies once)"]
    moved = {k: v for k, v in r["collective_bytes"].items() if v}
    lines += ["collectives per device per step: " + (", ".join(f"{k} {gib(v)}" for k, v in moved.items()) or "none")]
    roof = b["roofline"]
    if tpu:
        c = b["cost"]
        lines += [f"step model: {c['step_s'] * 1e3:.1f} ms (roofline of the same instructions {c['roofline_s'] * 1e3:.1f}"
                  f" ms; collectives and prefetches hidden {c['hidden_s'] * 1e3:.1f} ms; analytic FLOPs at peak "
                  f"{roof['analytic_at_peak_s'] * 1e3:.1f} ms) -> est. step {r['est_step_s'] * 1e3:.1f} ms, "
                  f"MFU {r['mfu_at_est']:.1%}",
                  "by part: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in c["by_part"].items() if v >= 1e-4),
                  "by op: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in list(c["by_kind"].items())[:8])]
    else:
        lines += [f"roofline: compute {roof['compute_s'] * 1e3:.1f} ms, HBM {roof['memory_s'] * 1e3:.1f} ms, "
                  f"collectives {roof['collective_s'] * 1e3:.1f} ms -> est. step {r['est_step_s'] * 1e3:.1f} ms, "
                  f"MFU {r['mfu_at_est']:.1%} (XLA:CPU twin)"]
    export = r.get("export")
    if export:
        calls = export["mosaic_kernels"] if export["platform"] == "tpu" else export.get("triton_kernels", {})
        verb = "compiled by XLA:TPU" if tpu else "export for " + export["platform"] + (
            ": lowers" if export["lowers"] else f": FAILS ({export['error']})")
        lines += [f"{verb}; {'Mosaic' if export['platform'] == 'tpu' else 'Triton'} kernels {calls or 'none'}"
                  + ("" if tpu else f", interpret-mode kernels {export['interpret_kernels'] or 'none'}")]
    if r.get("candidates"):
        lines += ["", "| mesh | remat policy | per device | fits | est. step | MFU |", "|---|---|---|---|---|---|"]
        for c in r["candidates"]:
            if "finding" in c:
                lines.append(f"| {c['mesh']} | - | - | no | {c['finding']} | - |")
                continue
            lines.append(f"| {c['mesh']} | {c.get('remat_policy') or 'none'} | {gib(c['per_device_bytes'])} | "
                         f"{'yes' if c['fits'] else 'no'} | {c['est_step_s'] * 1e3:.1f} ms | {c['mfu_at_est']:.1%} |")
        lines.append(f"recommended: {r['recommended'] or 'none fits'}")
    lines += ["", *("note: " + n for n in r["notes"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        overrides, values = split_arguments(argv)
        cfg = plan_config(values)
        use_fake_devices(cfg.devices)
        if cfg.backend == "tpu":   # compile under the XLA:TPU flags the launch scripts train with (a user's own win)
            from lingpack import tpu_flags
            os.environ.update(tpu_flags.env(cfg.chip))
        rc = run_config(compose(overrides, find_conf_dir(cfg.conf_dir)))
        result = plan(rc, cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    except ConfigError as err:
        print(f"Error: {err}", file=sys.stderr, flush=True)
        return 1
    result["config"]["overrides"] = overrides
    if cfg.output:
        Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.output).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


