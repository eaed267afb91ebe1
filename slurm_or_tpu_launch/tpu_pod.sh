#!/usr/bin/env bash
# Train lingpack on a Cloud TPU VM or pod slice: create it, copy this checkout to every worker, install,
# run `python run.py` on all workers at once (logs stream here), optionally delete it.
#
#   slurm_or_tpu_launch/tpu_pod.sh --name my-tpu --zone us-east5-a --accelerator-type v5p-16 \
#       --ckpt-dir gs://my-bucket/lingpack/run1 -- model=ling3_small train.steps=1000
#   slurm_or_tpu_launch/tpu_pod.sh --dry-run ...    # print every command instead of running it
#
# Everything after `--` goes to run.py as Hydra overrides. See slurm_or_tpu_launch/README.md.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
# shellcheck source=slurm_or_tpu_launch/common.sh
source "$HERE/common.sh"

usage() {
  cat <<'USAGE'
usage: tpu_pod.sh --name NAME --zone ZONE [options] [-- run.py overrides...]
  --name NAME              TPU VM (and queued resource) name
  --zone ZONE              e.g. us-east5-a
  --project PROJECT        default: gcloud's configured project
  --accelerator-type TYPE  default v5litepod-16 (multi-host); v5litepod-N, v5p-N, v6e-N, v4-N, ...
  --version VERSION        TPU software (runtime) version; default follows the accelerator:
                           v5e v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e,
                           v4 and older tpu-ubuntu2204-base
  --queued                 request the TPU through a queued resource and wait until it is ACTIVE
  --spot                   spot (preemptible) capacity
  --skip-create            use an existing TPU VM
  --skip-setup             the code and its venv are already on the workers
  --run-dir DIR            run directory on every worker (default outputs/NAME-<UTC time>)
  --ckpt-dir DIR           checkpoint directory all workers share, e.g. gs://bucket/path
                           (default RUN_DIR/checkpoints: only right on a single-host TPU)
  --remote-dir DIR         where the code goes on the workers (default lingpack, in $HOME)
  --delete                 delete the TPU VM (or queued resource) when the run ends
  --dry-run                print every command instead of running it
USAGE
}

NAME="" ZONE="" PROJECT="" TYPE="v5litepod-16" VERSION="" QUEUED=0 SPOT=0
CREATE=1 SETUP=1 RUN_DIR="" CKPT_DIR="" REMOTE_DIR="lingpack" DELETE=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --name) NAME=$2; shift 2 ;;
    --zone) ZONE=$2; shift 2 ;;
    --project) PROJECT=$2; shift 2 ;;
    --accelerator-type) TYPE=$2; shift 2 ;;
    --version) VERSION=$2; shift 2 ;;
    --queued) QUEUED=1; shift ;;
    --spot) SPOT=1; shift ;;
    --skip-create) CREATE=0; shift ;;
    --skip-setup) SETUP=0; shift ;;
    --run-dir) RUN_DIR=$2; shift 2 ;;
    --ckpt-dir) CKPT_DIR=$2; shift 2 ;;
    --remote-dir) REMOTE_DIR=$2; shift 2 ;;
    --delete) DELETE=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) usage >&2; die "unknown option $1 (run.py overrides go after --)" ;;
  esac
done
[[ -n $NAME ]] || die "--name is required"
[[ -n $ZONE ]] || die "--zone is required"
command -v gcloud >/dev/null || [[ $DRY_RUN == 1 ]] || die "gcloud is not on PATH (install the Google Cloud SDK)"
[[ -n $VERSION ]] || VERSION=$(runtime_for "$TYPE") || die "no default --version for --accelerator-type $TYPE: give --version (see https://cloud.google.com/tpu/docs/runtimes)"
RUN_DIR=${RUN_DIR:-outputs/$NAME-$(date -u +%Y%m%d-%H%M%S)}
CKPT_DIR=${CKPT_DIR:-$RUN_DIR/checkpoints}
if is_multi_host "$TYPE" && [[ $CKPT_DIR != gs://* ]]; then
  warn "$TYPE is multi-host, but the checkpoint directory $CKPT_DIR is not a gs:// path: on each worker's own disk every worker would hold only its shards and no restore could read them; give --ckpt-dir gs://BUCKET/PATH (or a mount all workers share)"
fi

LOCATION=(--zone="$ZONE")
[[ -n $PROJECT ]] && LOCATION+=(--project="$PROJECT")
SPOT_FLAG=()
[[ $SPOT == 1 ]] && SPOT_FLAG=(--spot)
ssh_all() { run gcloud compute tpus tpu-vm ssh "$NAME" "${LOCATION[@]}" --worker=all --command="$1"; }

if [[ $CREATE == 1 ]]; then
  if [[ $QUEUED == 1 ]]; then
    run gcloud compute tpus queued-resources create "$NAME" --node-id="$NAME" "${LOCATION[@]}" \
      --accelerator-type="$TYPE" --runtime-version="$VERSION" "${SPOT_FLAG[@]}"
    state_cmd=(gcloud compute tpus queued-resources describe "$NAME" "${LOCATION[@]}" --format='value(state.state)')
    show "${state_cmd[@]}"
    if [[ $DRY_RUN != 1 ]]; then
      until [[ $("${state_cmd[@]}") == ACTIVE ]]; do echo "waiting for queued resource $NAME..."; sleep 60; done
    fi
  else
    run gcloud compute tpus tpu-vm create "$NAME" "${LOCATION[@]}" --accelerator-type="$TYPE" \
      --version="$VERSION" "${SPOT_FLAG[@]}"
  fi
fi

if [[ $SETUP == 1 ]]; then
  ARCHIVE=${TMPDIR:-/tmp}/lingpack-$NAME.tar.gz
  # The working tree's tracked files (uncommitted edits included), without .venv / outputs.
  echo "+ (cd $(quote "$REPO") && git ls-files -z | tar --null -czf $(quote "$ARCHIVE") -T -)"
  if [[ $DRY_RUN != 1 ]]; then (cd "$REPO" && git ls-files -z | tar --null -czf "$ARCHIVE" -T -); fi
  run gcloud compute tpus tpu-vm scp "$ARCHIVE" "$NAME:lingpack.tar.gz" "${LOCATION[@]}" --worker=all
  ssh_all "mkdir -p $(quote "$REMOTE_DIR") && tar -xzf lingpack.tar.gz -C $(quote "$REMOTE_DIR") && cd $(quote "$REMOTE_DIR") && python3 -m venv .venv && .venv/bin/pip install -q -e . 'jax[tpu]'"
fi

# Every worker runs the same command; process ids come from the TPU runtime (distributed.initialize=true),
# TPU_WORKER_ID tells run.py which worker is 0 (only it writes .hydra and the run log).
# shellcheck disable=SC2016  # expanded on each worker, not here
WORKER_ID='$(curl -s -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number)'
TRAIN=$(join_quoted .venv/bin/python run.py distributed.initialize=true "hydra.run.dir=$RUN_DIR" \
  "checkpoint.directory=$CKPT_DIR" "$@")
status=0
ssh_all "set -o pipefail && cd $(quote "$REMOTE_DIR") && export TPU_WORKER_ID=$WORKER_ID && $(libtpu_export .venv/bin/python "$TYPE") && mkdir -p $(quote "$RUN_DIR") && $TRAIN 2>&1 | tee -a $(quote "$RUN_DIR")/worker-\$TPU_WORKER_ID.log" || status=$?

if [[ $DELETE == 1 ]]; then
  if [[ $QUEUED == 1 ]]; then
    run gcloud compute tpus queued-resources delete "$NAME" "${LOCATION[@]}" --force --quiet
  else
    run gcloud compute tpus tpu-vm delete "$NAME" "${LOCATION[@]}" --quiet
  fi
fi
exit "$status"
