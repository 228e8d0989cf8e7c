# shellcheck shell=bash
# Shared helpers for the tpu_setup/ scripts. Source it; do not run it.
#
# Every external command that touches Google Cloud or a worker goes through
# run_cmd, so DRY_RUN=1 (or --dry-run) prints the commands instead of running
# them and needs no gcloud installation.

if [[ -n "${DIFFJAX_TPU_COMMON_LOADED:-}" ]]; then
  return 0
fi
DIFFJAX_TPU_COMMON_LOADED=1

TPU_SETUP_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PROJECT_ROOT="$(cd "$TPU_SETUP_DIR/.." && pwd)"
SCRIPT_NAME="$(basename "${0:-tpu_setup}")"

# fd 3: where dry-run command lines go (the caller's stdout, even inside $(...)).
# fd 4: where live-mode command traces and log messages go (the caller's stderr).
exec 3>&1 4>&2

# ----------------------------------------------------------------------------
# Configuration defaults (environment variables; flags override them).
# Derived defaults (RUNTIME_VERSION, QR_ID) are filled in by finalize_common.
# ----------------------------------------------------------------------------
: "${TPU_NAME:=diffjax-tpu}"
: "${ZONE:=}"
: "${PROJECT:=}"
: "${ACCELERATOR_TYPE:=v5litepod-16}"
: "${RUNTIME_VERSION:=}"
: "${QUEUED:=0}"
: "${QR_ID:=}"
: "${SPOT:=0}"
: "${PREEMPTIBLE:=0}"
: "${DRY_RUN:=0}"
: "${INTERNAL_IP:=0}"
: "${SSH_FLAGS:=}"
: "${SSH_RETRIES:=3}"
: "${POLL_INTERVAL:=30}"
: "${RETRY_MAX_DELAY:=900}"
# Paths on each worker; relative paths are relative to the remote $HOME.
: "${REMOTE_DIR:=diffjax}"
: "${VENV_DIR:=diffjax-venv}"
: "${LOG_DIR:=diffjax-logs}"
: "${TRAIN_SCRIPT:=train.py}"

# Names exported to child scripts (babysit.sh calls the other scripts).
COMMON_CONFIG_VARS=(
  TPU_NAME ZONE PROJECT ACCELERATOR_TYPE RUNTIME_VERSION QUEUED QR_ID SPOT
  PREEMPTIBLE DRY_RUN INTERNAL_IP SSH_FLAGS SSH_RETRIES POLL_INTERVAL
  RETRY_MAX_DELAY REMOTE_DIR VENV_DIR LOG_DIR TRAIN_SCRIPT
)

# ----------------------------------------------------------------------------
# Logging
# ----------------------------------------------------------------------------
log() { printf "[%s%s %s] %s\n" "$SCRIPT_NAME" "$(is_true "${DRY_RUN:-0}" && echo " dry-run")" "$(date -u +%H:%M:%S)" "$*" >&4; }
warn() { log "WARNING: $*"; }
die() {
  log "ERROR: $*"
  exit 1
}
die_usage() {
  log "ERROR: $*"
  log "run '$SCRIPT_NAME --help' for usage"
  exit 2
}

is_true() {
  case "${1:-}" in
    1 | true | TRUE | True | yes | YES | y | on) return 0 ;;
    *) return 1 ;;
  esac
}
is_dry_run() { is_true "$DRY_RUN"; }

# ----------------------------------------------------------------------------
# Quoting and the single command runner
# ----------------------------------------------------------------------------

# shquote ARG: print ARG quoted for a POSIX shell (bare when it is safe).
shquote() {
  local s="$1"
  if [[ -z "$s" ]]; then
    printf '""'
  elif [[ "$s" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//\'/\'\\\'\'}"
  fi
}

# quote_cmd ARGS...: the command line, each argument quoted, on one logical line.
quote_cmd() {
  local out="" a
  for a in "$@"; do
    out+="${out:+ }$(shquote "$a")"
  done
  printf '%s' "$out"
}

# Shorten a command for live-mode traces: multi-line or very long arguments
# (the remote scripts) are abbreviated; dry runs print them in full.
short_cmd() {
  local out="" a first
  for a in "$@"; do
    if [[ "$a" == *$'\n'* || ${#a} -gt 160 ]]; then
      first="${a%%$'\n'*}"
      a="${first:0:80}...<$(printf '%s' "$a" | wc -l | tr -d ' ') more lines>"
    fi
    out+="${out:+ }$(shquote "$a")"
  done
  printf '%s' "$out"
}

# run_cmd CMD ARGS...: the one place commands are executed.
#   DRY_RUN=1: print "+ CMD ARGS" (shell-quoted, copy-pasteable) to the
#   caller's stdout and return 0 without running anything. When
#   DRY_RUN_RECORD_DIR is set, each command's arguments are also written there,
#   NUL-separated, one file per command (selftest.sh reads them).
#   Otherwise: trace the command to stderr and run it, returning its status.
run_cmd() {
  if is_dry_run; then
    printf '+ %s\n' "$(quote_cmd "$@")" >&3
    if [[ -n "${DRY_RUN_RECORD_DIR:-}" ]]; then
      local rec
      rec="$(mktemp "$DRY_RUN_RECORD_DIR/cmd.XXXXXX")"
      printf '%s\0' "$@" >"$rec"
    fi
    return 0
  fi
  printf '+ %s\n' "$(short_cmd "$@")" >&4
  "$@"
}

# sleep_s SECONDS: sleep, except in dry-run mode.
sleep_s() {
  if is_dry_run; then
    return 0
  fi
  sleep "$1"
}

# retry ATTEMPTS DELAY CMD...: run CMD until it succeeds, at most ATTEMPTS
# times, with exponential backoff starting at DELAY seconds (plus up to 25%
# jitter), capped at RETRY_MAX_DELAY. An exit status listed in RETRY_FATAL_RC
# (space-separated) is returned at once.
retry() {
  local attempts="$1" delay="$2" n=1 rc=0 wait_s
  shift 2
  while true; do
    "$@" && return 0
    rc=$?
    if [[ " ${RETRY_FATAL_RC:-} " == *" $rc "* ]]; then
      return "$rc"
    fi
    if ((n >= attempts)); then
      warn "giving up after $n attempt(s) (exit $rc): $(short_cmd "$@")"
      return "$rc"
    fi
    wait_s=$((delay + RANDOM % (delay / 4 + 1)))
    warn "attempt $n/$attempts failed (exit $rc); retrying in ${wait_s}s"
    sleep_s "$wait_s"
    n=$((n + 1))
    delay=$((delay * 2))
    if ((delay > RETRY_MAX_DELAY)); then
      delay=$RETRY_MAX_DELAY
    fi
  done
}

require_gcloud() {
  if is_dry_run; then
    return 0
  fi
  command -v gcloud >/dev/null 2>&1 ||
    die "gcloud not found; install the Google Cloud CLI (see tpu_setup/README.md)"
}

# ----------------------------------------------------------------------------
# Flag parsing shared by all scripts
# ----------------------------------------------------------------------------

# take_value "$@": read the value of "--flag=value" or "--flag value" into
# FLAG_VALUE and set NSHIFT to the number of arguments consumed.
take_value() {
  if [[ "$1" == *=* ]]; then
    FLAG_VALUE="${1#*=}"
    NSHIFT=1
  else
    [[ $# -ge 2 ]] || die_usage "flag $1 needs a value"
    FLAG_VALUE="$2"
    NSHIFT=2
  fi
}

# parse_common_flag "$@": handle one common flag. Sets NSHIFT to the number of
# arguments consumed, 0 when $1 is not a common flag.
# shellcheck disable=SC2034  # NSHIFT is read by the caller
parse_common_flag() {
  NSHIFT=1
  case "$1" in
    --name | --name=* | --tpu-name | --tpu-name=*) take_value "$@" && TPU_NAME="$FLAG_VALUE" ;;
    --zone | --zone=*) take_value "$@" && ZONE="$FLAG_VALUE" ;;
    --project | --project=*) take_value "$@" && PROJECT="$FLAG_VALUE" ;;
    --accelerator-type | --accelerator-type=*) take_value "$@" && ACCELERATOR_TYPE="$FLAG_VALUE" ;;
    --runtime-version | --runtime-version=* | --version | --version=*)
      take_value "$@" && RUNTIME_VERSION="$FLAG_VALUE"
      ;;
    --qr-id | --qr-id=*) take_value "$@" && QR_ID="$FLAG_VALUE" ;;
    --queued) QUEUED=1 ;;
    --no-queued) QUEUED=0 ;;
    --spot) SPOT=1 ;;
    --preemptible) PREEMPTIBLE=1 ;;
    --internal-ip) INTERNAL_IP=1 ;;
    --dry-run | -n) DRY_RUN=1 ;;
    --env-file | --env-file=*)
      take_value "$@"
      [[ -f "$FLAG_VALUE" ]] || die_usage "env file not found: $FLAG_VALUE"
      # shellcheck disable=SC1090
      source "$FLAG_VALUE"
      ;;
    *) NSHIFT=0 ;;
  esac
}

# trainer_settings: what a script that launches train.py (run.sh, babysit.sh) starts from:
# the trainer's settings (each may come from the environment; TRAIN_ENV holds KEY=VALUE
# pairs) and TRAINER_FLAGS=1, so that parse_flags takes the trainer flags.
# shellcheck disable=SC2034  # read by the calling script
trainer_settings() {
  : "${CONFIG:=}"
  : "${WORKDIR:=}"
  : "${RUN_NAME:=}"
  : "${TRAIN_ENV:=}"
  OVERRIDES=()
  read -r -a ENV_PAIRS <<<"$TRAIN_ENV"
  TRAINER_FLAGS=1
}

# trainer_flag "$@": the flags of the scripts that launch train.py (run.sh, babysit.sh):
# --config, --config.KEY=VALUE overrides, --workdir, --run-name and --env KEY=VALUE. Sets
# NSHIFT like parse_common_flag.
# shellcheck disable=SC2034  # CONFIG, WORKDIR, RUN_NAME are read by the caller
trainer_flag() {
  NSHIFT=1
  case "$1" in
    --config.*) OVERRIDES+=("$1") ;;
    --config | --config=*) take_value "$@" && CONFIG="$FLAG_VALUE" ;;
    --workdir | --workdir=*) take_value "$@" && WORKDIR="$FLAG_VALUE" ;;
    --run-name | --run-name=*) take_value "$@" && RUN_NAME="$FLAG_VALUE" ;;
    --env | --env=*)
      take_value "$@"
      [[ "$FLAG_VALUE" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die_usage "--env expects KEY=VALUE, got '$FLAG_VALUE'"
      ENV_PAIRS+=("$FLAG_VALUE")
      ;;
    *) NSHIFT=0 ;;
  esac
}

# parse_flags OWN "$@": the command-line loop of every script. OWN is the script's
# function for its own flags: given the remaining arguments it handles "$1" and sets NSHIFT
# to the number it consumed, 0 when "$1" is not one of its flags; the common flags come
# next, and anything else is an error. -h/--help prints the script's usage and exits. A
# script that launches the trainer calls trainer_settings first: it then takes the flags of
# trainer_flag too, and everything after "--" goes to the trainer (OVERRIDES).
parse_flags() {
  local own="$1" hint=""
  shift
  if is_true "${TRAINER_FLAGS:-0}"; then hint=" (pass trainer flags after --)"; fi
  while (($#)); do
    case "$1" in
      -h | --help)
        usage
        exit 0
        ;;
      --)
        if is_true "${TRAINER_FLAGS:-0}"; then
          shift
          OVERRIDES+=("$@")
          break
        fi
        ;;
    esac
    "$own" "$@"
    if ((NSHIFT == 0)) && is_true "${TRAINER_FLAGS:-0}"; then trainer_flag "$@"; fi
    ((NSHIFT)) || parse_common_flag "$@"
    ((NSHIFT)) || die_usage "unknown argument: $1$hint"
    shift "$NSHIFT"
  done
}

# mount_flag VALUE: add one --mount value to MOUNT (repeatable; values may
# themselves be comma-separated lists).
mount_flag() {
  MOUNT="${MOUNT:+$MOUNT,}$1"
}

# parse_mounts: check MOUNT (bootstrap.sh/babysit.sh --mount, comma-separated
# gs://BUCKET[/DIR]:/LOCAL/DIR entries) and split it into MOUNT_BUCKETS,
# MOUNT_DIRS (the DIR prefix, "" for the whole bucket) and MOUNT_POINTS; MOUNT
# is rewritten in a canonical form, for the child scripts of babysit.sh.
# shellcheck disable=SC2034  # the arrays are read by the caller
parse_mounts() {
  local spec rest src mnt bucket dir canon="" p
  local -a specs=()
  local form="gs://BUCKET[/DIR]:/LOCAL/DIR"
  MOUNT_BUCKETS=() MOUNT_DIRS=() MOUNT_POINTS=()
  IFS=, read -r -a specs <<<"${MOUNT:-}"
  for spec in ${specs[@]+"${specs[@]}"}; do
    [[ -n "$spec" ]] || continue
    [[ "$spec" == gs://* ]] || die_usage "--mount '$spec': expected $form (a gs:// bucket)"
    rest="${spec#gs://}"
    [[ "$rest" == *:* ]] || die_usage "--mount '$spec': expected $form (no local directory after ':')"
    src="${rest%%:*}"
    mnt="${rest#*:}"
    bucket="${src%%/*}"
    dir=""
    if [[ "$src" == */* ]]; then dir="${src#*/}"; fi
    while [[ "$dir" == /* ]]; do dir="${dir#/}"; done
    while [[ "$dir" == */ ]]; do dir="${dir%/}"; done
    while [[ "$mnt" == */ && "$mnt" != / ]]; do mnt="${mnt%/}"; done
    [[ "$bucket" =~ ^[a-z0-9][-a-z0-9_.]*[a-z0-9]$ ]] ||
      die_usage "--mount '$spec': invalid bucket name '$bucket' (expected $form)"
    [[ "$dir" =~ ^[^[:cntrl:]]*$ ]] || die_usage "--mount '$spec': invalid DIR '$dir'"
    [[ "$mnt" == /* ]] || die_usage "--mount '$spec': the local directory must be an absolute path (expected $form)"
    [[ "$mnt" =~ ^(/[A-Za-z0-9._@+-]+)+$ ]] ||
      die_usage "--mount '$spec': local directory '$mnt' must be a path of letters, digits and ._@+- (not /)"
    for p in ${MOUNT_POINTS[@]+"${MOUNT_POINTS[@]}"}; do
      [[ "$p" != "$mnt" ]] || die_usage "--mount: $mnt is given more than once"
    done
    MOUNT_BUCKETS+=("$bucket")
    MOUNT_DIRS+=("$dir")
    MOUNT_POINTS+=("$mnt")
    canon+="${canon:+,}gs://$bucket${dir:+/$dir}:$mnt"
  done
  MOUNT="$canon"
}

# shellcheck disable=SC2034  # used by the scripts' usage()
COMMON_USAGE="Common options (each also settable by the environment variable shown):
  --name NAME              TPU VM (node) name                   [TPU_NAME=$TPU_NAME]
  --zone ZONE              e.g. us-east5-a, us-west4-a          [ZONE, required]
  --project PROJECT        GCP project (default: gcloud config) [PROJECT]
  --accelerator-type TYPE  e.g. v5litepod-16, v5p-64           [ACCELERATOR_TYPE=$ACCELERATOR_TYPE]
  --runtime-version V      TPU software version (default from the type:
                           v5litepod-* v2-alpha-tpuv5-lite, v5p-* v2-alpha-tpuv5,
                           v6e-* v2-alpha-tpuv6e, v4-* tpu-ubuntu2204-base)
                                                                [RUNTIME_VERSION]
  --queued / --no-queued   use a queued resource                [QUEUED=0]
  --qr-id ID               queued resource id (default NAME-qr) [QR_ID]
  --spot                   Spot capacity (preemptible)          [SPOT=0]
  --preemptible            legacy preemptible TPU VM            [PREEMPTIBLE=0]
  --internal-ip            ssh/scp over internal IPs            [INTERNAL_IP=0]
  --env-file FILE          source KEY=VALUE settings from FILE (later flags win)
  -n, --dry-run            print the commands instead of running them [DRY_RUN=0]
  -h, --help               show this help
Other environment variables: SSH_FLAGS (extra flags for gcloud ... ssh/scp),
  SSH_RETRIES=$SSH_RETRIES, POLL_INTERVAL=$POLL_INTERVAL (s), RETRY_MAX_DELAY=$RETRY_MAX_DELAY (s),
  REMOTE_DIR=$REMOTE_DIR, VENV_DIR=$VENV_DIR, LOG_DIR=$LOG_DIR (on the workers, relative to \$HOME)."

# Default runtime version for an accelerator type.
default_runtime_version() {
  case "$1" in
    v5litepod-* | v5e-*) echo "v2-alpha-tpuv5-lite" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    v4-*) echo "tpu-ubuntu2204-base" ;;
    *) return 1 ;;
  esac
}

# finalize_common: validate settings and fill in derived defaults. Call after
# flag parsing.
finalize_common() {
  [[ -n "$ZONE" ]] || die_usage "ZONE is required (--zone or ZONE=...)"
  [[ "$TPU_NAME" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] ||
    die_usage "invalid TPU name '$TPU_NAME' (lowercase letters, digits and hyphens; starts with a letter)"
  [[ "$ACCELERATOR_TYPE" =~ ^v[0-9][a-z]*-[0-9]+$ ]] ||
    die_usage "invalid accelerator type '$ACCELERATOR_TYPE' (e.g. v5litepod-16, v5p-64)"
  if [[ -z "$RUNTIME_VERSION" ]]; then
    RUNTIME_VERSION="$(default_runtime_version "$ACCELERATOR_TYPE")" ||
      die_usage "no default runtime version for $ACCELERATOR_TYPE; pass --runtime-version"
  fi
  if [[ -z "$QR_ID" ]]; then
    QR_ID="${TPU_NAME}-qr"
  fi
  if is_true "$QUEUED" && is_true "$PREEMPTIBLE" && ! is_true "$SPOT"; then
    warn "queued resources have no --preemptible; using --spot instead"
    SPOT=1
  fi
  if is_true "$SPOT" && is_true "$PREEMPTIBLE"; then
    warn "both SPOT and PREEMPTIBLE set; using --spot"
    PREEMPTIBLE=0
  fi
  # Location flags shared by every gcloud tpus command.
  GCLOUD_LOC=(--zone="$ZONE")
  if [[ -n "$PROJECT" ]]; then
    GCLOUD_LOC+=(--project="$PROJECT")
  fi
  # Extra ssh/scp flags.
  SSH_ARGS=()
  if is_true "$INTERNAL_IP"; then
    SSH_ARGS+=(--internal-ip)
  fi
  if [[ -n "$SSH_FLAGS" ]]; then
    local -a extra
    read -r -a extra <<<"$SSH_FLAGS"
    SSH_ARGS+=("${extra[@]}")
  fi
}

export_common() {
  local v
  for v in "${COMMON_CONFIG_VARS[@]}"; do
    export "${v?}"
  done
}

# ----------------------------------------------------------------------------
# Resource state
# ----------------------------------------------------------------------------

# describe_state node|qr DRY_DEFAULT: print the state of the TPU node
# (CREATING, READY, PREEMPTED, TERMINATED, ...) or of the queued resource
# (ACCEPTED, WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE, SUSPENDED, FAILED, ...),
# NOT_FOUND when it does not exist, UNKNOWN when the query itself failed.
# In dry-run mode prints the query and then DRY_RUN_STATE / DRY_RUN_QR_STATE
# (or DRY_DEFAULT).
describe_state() {
  local kind="$1" dry_default="$2" out errfile rc=0
  local -a cmd
  if [[ "$kind" == qr ]]; then
    cmd=(gcloud compute tpus queued-resources describe "$QR_ID" "${GCLOUD_LOC[@]}" --format="value(state.state)")
  else
    cmd=(gcloud compute tpus tpu-vm describe "$TPU_NAME" "${GCLOUD_LOC[@]}" --format="value(state)")
  fi
  if is_dry_run; then
    run_cmd "${cmd[@]}"
    if [[ "$kind" == qr ]]; then
      echo "${DRY_RUN_QR_STATE:-$dry_default}"
    else
      echo "${DRY_RUN_STATE:-$dry_default}"
    fi
    return 0
  fi
  errfile="$(mktemp)"
  out="$(run_cmd "${cmd[@]}" 2>"$errfile")" || rc=$?
  if ((rc == 0)); then
    out="$(printf '%s' "$out" | tail -n 1 | tr -d '[:space:]')"
    echo "${out:-UNKNOWN}"
  elif grep -qiE 'NOT_FOUND|not found|was not found' "$errfile"; then
    echo "NOT_FOUND"
  else
    warn "state query failed: $(tr '\n' ' ' <"$errfile")"
    echo "UNKNOWN"
  fi
  rm -f "$errfile"
}

# ----------------------------------------------------------------------------
# Workers: ssh / scp and the remote script pieces
# ----------------------------------------------------------------------------

# tpu_ssh WORKER COMMAND: run COMMAND (a bash script) on WORKER (a number,
# a list such as 1,3, or "all"). With SSH_TIMEOUT=S (> 0) the whole call is
# killed after S seconds (needs coreutils' timeout).
tpu_ssh() {
  local -a prefix=()
  if [[ "${SSH_TIMEOUT:-0}" -gt 0 ]] && { is_dry_run || command -v timeout >/dev/null 2>&1; }; then
    prefix=(timeout "$SSH_TIMEOUT")
  fi
  run_cmd ${prefix[@]+"${prefix[@]}"} gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GCLOUD_LOC[@]}" \
    --worker="$1" ${SSH_ARGS[@]+"${SSH_ARGS[@]}"} --command="$2"
}

# tpu_scp WORKER LOCAL_PATH REMOTE_PATH: copy a local file to WORKER (a
# number, a list, or "all"); REMOTE_PATH is relative to the remote $HOME.
tpu_scp() {
  run_cmd gcloud compute tpus tpu-vm scp "$2" "$TPU_NAME:$3" "${GCLOUD_LOC[@]}" \
    --worker="$1" ${SSH_ARGS[@]+"${SSH_ARGS[@]}"}
}

# remote_vars NAME...: print "NAME=<quoted value>" lines for the remote script.
remote_vars() {
  local v
  for v in "$@"; do
    printf '%s=%s\n' "$v" "$(shquote "${!v}")"
  done
}

# remote_array NAME VALUES...: print "NAME=( <quoted values> )".
remote_array() {
  local name="$1"
  shift
  printf '%s=(%s)\n' "$name" "$(quote_cmd "$@")"
}

# The preamble of every remote script. Expects REMOTE_DIR, VENV_DIR, LOG_DIR
# and TRAIN_SCRIPT to be assigned before it. Provides WID (this worker's
# index), say, and trainer_pids.
remote_preamble() {
  cat <<'EOF'
set -euo pipefail
cd "$HOME"
abs_path() { case "$1" in /*) printf "%s\n" "$1" ;; *) printf "%s\n" "$HOME/$1" ;; esac; }
REMOTE_DIR="$(abs_path "$REMOTE_DIR")"
VENV_DIR="$(abs_path "$VENV_DIR")"
LOG_DIR="$(abs_path "$LOG_DIR")"
worker_id() {
  local id=""
  id="$(curl -sf -m 5 -H "Metadata-Flavor: Google" \
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number" 2>/dev/null)" || id=""
  if [[ ! "$id" =~ ^[0-9]+$ ]]; then
    id="$(hostname | sed -n "s/.*-w-\([0-9][0-9]*\)$/\1/p")"
  fi
  printf "%s\n" "${id:-0}"
}
WID="$(worker_id)"
say() { printf "[worker %s] %s\n" "$WID" "$*"; }
# Training processes of this user: "<...>python[3[.x]] [flags] [dir/]train.py ...".
trainer_pids() {
  pgrep -u "$(id -u)" -f "^[^ ]*python[0-9.]*( -[^ ]+)* ([^ ]*/)?${TRAIN_SCRIPT}( |\$)" || true
}
mkdir -p "$LOG_DIR"
EOF
}

# Build the remote script: variable assignments, the preamble, then BODY.
# remote_script BODY VAR...
remote_script() {
  local body="$1"
  shift
  remote_vars REMOTE_DIR VENV_DIR LOG_DIR TRAIN_SCRIPT "$@"
  remote_preamble
  printf '%s\n' "$body"
}

# ----------------------------------------------------------------------------
# Source tarball of the local working tree
# ----------------------------------------------------------------------------

# make_source_tarball OUT: pack the project's working tree (tracked files plus
# untracked files that git does not ignore; everything when not a git
# checkout) into OUT (.tar.gz).
make_source_tarball() {
  local out="$1"
  # shellcheck disable=SC2016  # expanded by the inner bash, not here
  local script='set -euo pipefail
cd "$1"
list_files() {
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard
  else
    find . -type f ! -path "./.git/*" ! -path "*/__pycache__/*" -print0
  fi
}
list_files | while IFS= read -r -d "" f; do
  if [ -e "$f" ] || [ -L "$f" ]; then printf "%s\0" "$f"; fi
done | tar -czf "$2" --null -T -'
  run_cmd bash -c "$script" make-source-tarball "$PROJECT_ROOT" "$out"
}

# ----------------------------------------------------------------------------
# Training status (run.sh --status and babysit.sh)
# ----------------------------------------------------------------------------

# status_script RUN_NAME TAIL_LINES LOG_SYNC_URI: a remote script printing, on
# each worker, one line
#   diffjax-status worker=<N> alive=<0|1> log_age=<seconds|-1> pids=<...>
# then the last TAIL_LINES lines of that worker's log; when LOG_SYNC_URI (a
# gs:// prefix) is set, it also copies the worker's log there.
status_script() {
  # shellcheck disable=SC2034  # read through remote_vars
  local RUN_NAME="$1" STATUS_TAIL="$2" LOG_SYNC_URI="$3"
  # shellcheck disable=SC2016  # expanded on the worker
  local body='LOG="$LOG_DIR/$RUN_NAME-host$WID.log"
PIDS="$(trainer_pids | tr "\n" " ")"
ALIVE=0
if [[ -n "${PIDS// /}" ]]; then ALIVE=1; fi
AGE=-1
if [[ -f "$LOG" ]]; then AGE=$(($(date +%s) - $(stat -c %Y "$LOG"))); fi
printf "diffjax-status worker=%s alive=%s log_age=%s pids=%s\n" "$WID" "$ALIVE" "$AGE" "${PIDS% }"
if [[ "$STATUS_TAIL" -gt 0 && -f "$LOG" ]]; then
  tail -n "$STATUS_TAIL" "$LOG" | sed "s/^/[worker $WID] /"
fi
if [[ -n "$LOG_SYNC_URI" && -f "$LOG" ]]; then
  if command -v gcloud >/dev/null 2>&1; then
    gcloud storage cp "$LOG" "$LOG_SYNC_URI/" >/dev/null 2>&1 || say "log upload to $LOG_SYNC_URI failed"
  elif command -v gsutil >/dev/null 2>&1; then
    gsutil -q cp "$LOG" "$LOG_SYNC_URI/" >/dev/null 2>&1 || say "log upload to $LOG_SYNC_URI failed"
  fi
fi'
  remote_script "$body" RUN_NAME STATUS_TAIL LOG_SYNC_URI
}

# default_run_name WORKDIR: the last path component, made filename-safe.
default_run_name() {
  local w="${1%/}"
  w="${w##*/}"
  w="$(printf '%s' "$w" | tr -c 'A-Za-z0-9._-' '_')"
  printf '%s\n' "${w:-run}"
}
