# Helpers shared by tpu_pod.sh and xpk.sh (sourced, not run).
# shellcheck shell=bash

DRY_RUN=${DRY_RUN:-0}

# One argument as the shell would need it typed: bare when safe, else single-quoted.
quote() {
  if [[ $1 =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# Print a command line (quoted so it can be pasted) with a "+ " prefix.
show() {
  local out="+" arg
  for arg in "$@"; do out+=" $(quote "$arg")"; done
  printf '%s\n' "$out"
}

# Run a command, or only print it under --dry-run.
run() {
  show "$@"
  if [[ $DRY_RUN == 1 ]]; then return 0; fi
  "$@"
}

# All arguments quoted into one string: a command line for a remote shell.
join_quoted() {
  local out="" arg
  for arg in "$@"; do out+="${out:+ }$(quote "$arg")"; done
  printf '%s' "$out"
}

die() {
  echo "$(basename "$0"): $*" >&2
  exit 2
}

warn() {
  echo "$(basename "$0"): warning: $*" >&2
}

# The TPU software (runtime) version Google publishes for an accelerator type (cloud.google.com/tpu/docs/runtimes).
runtime_for() {
  case $1 in
    v6e-*) echo v2-alpha-tpuv6e ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v5litepod-*|v5e-*) echo v2-alpha-tpuv5-lite ;;
    v4-*|v3-*|v2-*) echo tpu-ubuntu2204-base ;;
    *) return 1 ;;
  esac
}

# Whether a slice spans several TPU VMs: more than 8 chips (v5e, v6e) or TensorCores (v5p, v4 and older).
is_multi_host() {
  local size=${1##*-}
  [[ $size =~ ^[0-9]+$ ]] && (( size > 8 ))
}

# The LIBTPU_INIT_ARGS export a TPU worker runs before training: the user's own when set here, else the
# XLA:TPU flags lingpack.tpu_flags lists for the accelerator type, computed on the worker by its python
# (libtpu reads the variable once, at backend init). $1 = the worker's python, $2 = the accelerator type.
libtpu_export() {
  if [[ -n ${LIBTPU_INIT_ARGS:-} ]]; then
    printf 'export LIBTPU_INIT_ARGS=%s' "$(quote "$LIBTPU_INIT_ARGS")"
  else
    # shellcheck disable=SC2016  # expanded on the worker
    printf 'export LIBTPU_INIT_ARGS="${LIBTPU_INIT_ARGS:-$(%s -m lingpack.tpu_flags %s)}"' "$1" "$(quote "$2")"
  fi
}
