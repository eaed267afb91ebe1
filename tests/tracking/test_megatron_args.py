"""`python -m lingpack.tracking.megatron_args`: the Megatron-LM command of a run.

Oracles: Megatron-LM's own parser (the flags in megatron_arguments.txt, read off it at recorded commits),
the run config's dataclasses (every field has a rule), and a run directory Hydra itself wrote.
"""
import dataclasses
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from lingpack import config as config_lib
from lingpack.tracking import megatron_args, megatron_rules

BLEND = "data.paths=[0.3,bundled,0.7,bundled:scene]"


def printed(capsys, argv) -> tuple[dict, list[str], str]:
    """({flag: [values]}, unmapped notes, the whole output) of `megatron_args.main(argv)`; every flag printed is
    one of Megatron-LM's (main)."""
    assert megatron_args.main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "pretrain_gpt.py" in line and not line.startswith("#"))
    body = []
    for line in lines[start:]:
        body.append(line.rstrip("\\").strip())
        if not line.endswith("\\"):
            break
    words = shlex.split(" ".join(body))
    words = words[words.index("pretrain_gpt.py") + 1:]
    flags, current = {}, None
    for word in words:
        if word.startswith("--"):
            current = flags.setdefault(word, [])
        else:
            current.append(word)
    _, known = megatron_args.megatron_arguments("main")
    assert not set(flags) - known, f"not Megatron-LM flags: {sorted(set(flags) - known)}"   # every command printed
    notes = []   # one string per note (a note's continuation lines joined)
    for line in lines[start + len(body) + 1:]:
        if line.startswith("#   - "):
            notes.append(line[6:])
        else:
            assert line.startswith("#     "), line
            notes[-1] += " " + line[6:]
    return flags, notes, out


@pytest.fixture(scope="module")
def default_command():
    rc = megatron_args.config_of_overrides([])
    return rc, megatron_args.command(rc)


def config_fields(cls=config_lib.RunConfig, prefix: str = "") -> set[str]:
    """Every field of the resolved run config, nested groups walked, the groups a rule takes whole counted once."""
    names = set()
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key = prefix + field.name
        rule = megatron_rules.RULES.get(key)
        if dataclasses.is_dataclass(hints[field.name]) and not (rule and rule.no_loss):
            names |= config_fields(hints[field.name], key + ".")
        else:
            names.add(key)
    return names


def test_every_config_field_has_exactly_one_rule():
    """A field added to the config without a rule (mapped, unmapped or loss-free) fails here."""
    fields = config_fields()
    rules = set(megatron_rules.RULES)
    assert not fields - rules, f"config fields without a Megatron-LM rule: {sorted(fields - rules)}"
    assert not rules - fields, f"rules for fields the config does not have: {sorted(rules - fields)}"
    assert "model.moe.n_groups" in fields and "data.seed" in fields and "checkpoint" in fields
    for key, rule in megatron_rules.RULES.items():
        if rule.part_of:
            other = megatron_rules.RULES[rule.part_of]
            assert other.flags or other.unmapped, f"{key} is part of {rule.part_of}, which maps nothing"
        kinds = [bool(rule.flags or rule.unmapped), bool(rule.no_loss), bool(rule.part_of)]
        assert sum(kinds) == 1, f"{key}: a rule is one of maps/unmapped, no_loss, part_of"


def test_the_field_check_can_fail(monkeypatch):
    rules = dict(megatron_rules.RULES)
    del rules["model.moe.n_groups"]
    monkeypatch.setattr(megatron_rules, "RULES", rules)
    with pytest.raises(AssertionError, match="model.moe.n_groups"):
        test_every_config_field_has_exactly_one_rule()


def test_every_printed_flag_is_one_of_megatron_lms(default_command):
    rc, cmd = default_command
    refs, known = megatron_args.megatron_arguments("main")
    _, dev = megatron_args.megatron_arguments("dev")
    assert set(refs) == {"main", "dev"} and all("NVIDIA/Megatron-LM@" in v for v in refs.values())
    assert len(known) > 800 and "--calculate-per-token-loss" in known and "--not-a-flag" not in known
    assert not set(cmd.names()) - known, sorted(set(cmd.names()) - known)
    assert not set(cmd.names()) - dev, f"not in Megatron-LM dev: {sorted(set(cmd.names()) - dev)}"
    assert len(cmd.names()) == len(set(cmd.names()))


def test_default_config_prints_a_complete_command(capsys):
    flags, notes, out = printed(capsys, [])
    assert "\ntorchrun --nproc-per-node 1 pretrain_gpt.py \\\n" in out
    expected = {
        "--split": ["969,30,1"], "--seq-length": ["256"], "--micro-batch-size": ["8"], "--global-batch-size": ["8"],
        "--seed": ["1234"], "--vocab-size": ["258"], "--null-tokenizer-eod-id": ["256"],
        "--null-tokenizer-pad-id": ["257"], "--padded-vocab-size": ["384"], "--lr": ["0.003"], "--min-lr": ["0.0003"],
        "--lr-warmup-iters": ["5"], "--lr-decay-iters": ["60"], "--lr-decay-style": ["cosine"],
        "--weight-decay": ["0.1"], "--adam-beta1": ["0.9"], "--adam-beta2": ["0.95"], "--adam-eps": ["1e-08"],
        "--clip-grad": ["1.0"], "--train-iters": ["60"], "--eval-interval": ["20"], "--eval-iters": ["2"],
        "--num-layers": ["4"], "--hidden-size": ["64"], "--ffn-hidden-size": ["128"], "--norm-epsilon": ["1e-06"],
        "--multi-latent-attention": [], "--q-lora-rank": ["32"], "--kv-lora-rank": ["32"], "--qk-head-dim": ["16"],
        "--qk-pos-emb-head-dim": ["16"], "--v-head-dim": ["16"], "--rotary-percent": ["0.5"],
        "--linear-attention-freq": ["4"], "--num-experts": ["4"], "--moe-router-topk": ["2"],
        "--moe-router-num-groups": ["2"], "--moe-router-group-topk": ["1"], "--moe-router-score-function": ["sigmoid"],
        "--moe-router-enable-expert-bias": [], "--moe-router-bias-update-rate": ["0.001"],
        "--moe-z-loss-coeff": ["2.9e-06"], "--moe-shared-expert-intermediate-size": ["32"],
        "--moe-layer-freq": ["([0]*1+[1]*3)"], "--mtp-num-layers": ["1"], "--mtp-loss-scaling-factor": ["0.1"],
        "--eod-mask-loss": [], "--reset-position-ids": [], "--reset-attention-mask": [],
        "--hidden-dropout": ["0.0"], "--attention-dropout": ["0.0"], "--init-method-std": ["0.02"],
    }
    for flag, values in expected.items():
        assert flags.get(flag) == values, (flag, flags.get(flag), values)
    assert flags["--data-path"][0].startswith("data_cache/bundled-"), "a prefix under the working directory is relative"
    assert "--calculate-per-token-loss" not in flags and "--bf16" not in flags
    joined = "\n".join(notes)
    for what in ("seed=0", "model.kda", "Gated DeltaNet", "model.moe.norm_topk_prob=false"):
        assert what in joined, (what, joined)
    assert len(notes) == 3, notes   # nothing else in the default config differs from what the command trains


def test_settings_megatron_cannot_reproduce_are_listed(capsys):
    flags, notes, _ = printed(capsys, ["loss.z_loss_weight=0.01", "data.packing=whole_documents", "model.dtype=bfloat16",
                                       "loss=per_token", "model.moe.norm_topk_prob=true", "train.micro_batches=2",
                                       "loss.megatron_dp_size=2", "kernel=chunked_aligned", "kernel.max_segs=16"])
    joined = "\n".join(notes)
    assert "loss.z_loss_weight=0.01" in joined and "data.packing=whole_documents" in joined
    assert "kernel=chunked_aligned" in joined and "norm_topk_prob" not in joined
    assert "--bf16" in flags and "--calculate-per-token-loss" in flags
    assert flags["--micro-batch-size"] == ["2"] and flags["--global-batch-size"] == ["8"]   # 8 rows / 2 / 2 ranks


def test_synthetic_data_has_no_data_path_and_says_so(capsys):
    flags, notes, _ = printed(capsys, ["data=synthetic"])
    assert "--data-path" not in flags
    assert any("data.source=synthetic" in n and "preprocess" in n for n in notes)


# run.py's Hydra entry with a task that returns at once: Hydra writes the run directory as for a real run.
NOOP_RUN = """
import sys, hydra
@hydra.main(version_base="1.3", config_path=sys.argv.pop(1), config_name="config")
def task(cfg):
    return None
task()
"""


def write_run_dir(tmp_path, overrides) -> str:
    """A run directory as `python run.py OVERRIDES hydra.run.dir=...` starts it (Hydra's own job start; no
    training), in a child process as run.py is."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", NOOP_RUN, config_lib.find_config_dir(), *overrides,
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    return str(run_dir)


def test_run_dir_prints_what_the_overrides_print(tmp_path, capsys):
    overrides = [BLEND, "train.steps=30", "optim.lr=1e-3", "model.moe.top_k=1"]
    run_dir = write_run_dir(tmp_path, overrides)
    _, _, from_run = printed(capsys, ["--run", run_dir])
    flags, _, from_overrides = printed(capsys, overrides)
    assert from_run == from_overrides
    paths = flags["--data-path"]
    assert [paths[0], paths[2]] == ["0.3", "0.7"] and len(paths) == 4 and paths[1] != paths[3]
    assert all(p.startswith("data_cache/bundled-shakespeare-") for p in (paths[1], paths[3]))
    assert flags["--train-iters"] == ["30"] and flags["--lr"] == ["0.001"] and flags["--moe-router-topk"] == ["1"]


@pytest.mark.parametrize("argv, needle", [
    (["--run", "/nonexistent/run"], "/nonexistent/run"),
    (["model.no_such_key=1"], "no_such_key"),
    (["--bogus"], "--bogus"),
    (["--run", "x", "train.steps=3"], "drop the overrides"),
])
def test_bad_input_is_one_line(capsys, argv, needle):
    assert megatron_args.main(argv) == megatron_args.EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], captured.err


def test_a_config_megatron_can_express_leaves_only_the_initialisation(capsys):
    """MLA layers only and normalised top-k weights: nothing but the initialisation is left unmapped."""
    flags, notes, _ = printed(capsys, ["model.inhomogeneous_layer_cycle_interval=1", "model.moe.norm_topk_prob=true"])
    assert len(notes) == 1 and notes[0].startswith("seed=0 (lingpack's initialisation)")
    assert "--experimental-attention-variant" not in flags and "--linear-attention-freq" not in flags


def test_running_md_shows_what_the_default_config_prints(capsys, monkeypatch):
    """docs/running.md's default-config command is the current output (rerun it there when a rule changes)."""
    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "running.md").read_text()
    section = page.split("## The Megatron-LM command of a run", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", section, re.S)[1]
    monkeypatch.chdir(root)
    assert megatron_args.main([]) == 0
    assert block == capsys.readouterr().out, "rerun `python -m lingpack.tracking.megatron_args` into docs/running.md"
