#!/usr/bin/env bash
# Train lingpack on a GKE TPU cluster through xpk: build an image from this checkout, create the workload
# (one pod per TPU host, all running `python run.py`), optionally follow its logs and delete it.
#
#   slurm_or_tpu_launch/xpk.sh --cluster my-cluster --workload run1 --tpu-type v5p-32 \
#       --ckpt-dir gs://my-bucket/lingpack/run1 -- model=ling3_small train.steps=1000
#   slurm_or_tpu_launch/xpk.sh --dry-run ...    # print every command instead of running it
#
# Everything after `--` goes to run.py as Hydra overrides. See slurm_or_tpu_launch/README.md.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
# shellcheck source=slurm_or_tpu_launch/common.sh
source "$HERE/common.sh"

usage() {
  cat <<'USAGE'
usage: xpk.sh --cluster CLUSTER --workload NAME --ckpt-dir gs://... [options] [-- run.py overrides...]
  --cluster CLUSTER        the GKE cluster xpk created
  --workload NAME          workload (JobSet) name, lower case and dashes
  --tpu-type TYPE          default v5litepod-16
  --num-slices N           default 1
  --project PROJECT        default: gcloud's configured project
  --zone ZONE              default: gcloud's configured zone
  --base-docker-image IMG  image xpk builds this checkout onto (default python:3.11-slim); the workload
                           installs lingpack and jax[tpu] when it starts
  --docker-image IMG       a ready image with lingpack installed (skips the build and the install)
  --run-dir DIR            run directory inside each pod (default outputs/NAME)
  --ckpt-dir DIR           checkpoint directory every pod shares: a gs:// path (pods have no shared disk)
  --follow                 stream the workload's logs until it ends
  --delete                 delete the workload when --follow ends
  --dry-run                print every command instead of running it
USAGE
}

CLUSTER="" WORKLOAD="" TYPE="v5litepod-16" SLICES=1 PROJECT="" ZONE="" BASE_IMAGE="python:3.11-slim" IMAGE=""
RUN_DIR="" CKPT_DIR="" FOLLOW=0 DELETE=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --cluster) CLUSTER=$2; shift 2 ;;
    --workload) WORKLOAD=$2; shift 2 ;;
    --tpu-type) TYPE=$2; shift 2 ;;
    --num-slices) SLICES=$2; shift 2 ;;
    --project) PROJECT=$2; shift 2 ;;
    --zone) ZONE=$2; shift 2 ;;
    --base-docker-image) BASE_IMAGE=$2; shift 2 ;;
    --docker-image) IMAGE=$2; shift 2 ;;
    --run-dir) RUN_DIR=$2; shift 2 ;;
    --ckpt-dir) CKPT_DIR=$2; shift 2 ;;
    --follow) FOLLOW=1; shift ;;
    --delete) DELETE=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) usage >&2; die "unknown option $1 (run.py overrides go after --)" ;;
  esac
done
[[ -n $CLUSTER ]] || die "--cluster is required"
[[ -n $WORKLOAD ]] || die "--workload is required"
[[ $CKPT_DIR == gs://* ]] || die "--ckpt-dir must be a gs:// path that every pod can reach (got '${CKPT_DIR}')"
command -v xpk >/dev/null || [[ $DRY_RUN == 1 ]] || die "xpk is not on PATH (pip install xpk)"
RUN_DIR=${RUN_DIR:-outputs/$WORKLOAD}

LOCATION=()
[[ -n $PROJECT ]] && LOCATION+=(--project="$PROJECT")
[[ -n $ZONE ]] && LOCATION+=(--zone="$ZONE")
TRAIN=$(join_quoted python run.py distributed.initialize=true "hydra.run.dir=$RUN_DIR" \
  "checkpoint.directory=$CKPT_DIR" "$@")
TRAIN="$(libtpu_export python "$TYPE") && $TRAIN"   # XLA:TPU flags (lingpack.tpu_flags) unless LIBTPU_INIT_ARGS is set
if [[ -n $IMAGE ]]; then
  IMAGE_FLAGS=(--docker-image="$IMAGE")
  COMMAND=$TRAIN
else  # xpk copies --script-dir (this checkout) into the image; install it when the pod starts
  IMAGE_FLAGS=(--base-docker-image="$BASE_IMAGE" --script-dir="$REPO")
  COMMAND="pip install -q -e . 'jax[tpu]' && $TRAIN"
fi

run xpk workload create --cluster="$CLUSTER" --workload="$WORKLOAD" --tpu-type="$TYPE" \
  --num-slices="$SLICES" "${LOCATION[@]}" "${IMAGE_FLAGS[@]}" --command="$COMMAND"

status=0
if [[ $FOLLOW == 1 ]]; then
  selector="jobset.sigs.k8s.io/jobset-name=$WORKLOAD"
  run gcloud container clusters get-credentials "$CLUSTER" "${LOCATION[@]}"
  run kubectl wait --for=condition=Ready pod --selector="$selector" --timeout=60m
  run kubectl logs --follow --prefix --selector="$selector" --max-log-requests=1000 || status=$?
  if [[ $DELETE == 1 ]]; then
    run xpk workload delete --cluster="$CLUSTER" --workload="$WORKLOAD" "${LOCATION[@]}"
  fi
fi
exit "$status"
