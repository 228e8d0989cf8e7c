#!/usr/bin/env bash
# Keep a training run alive on preemptible (Spot) TPU capacity: poll the TPU
# and the training processes; recreate + bootstrap + relaunch after a
# preemption, relaunch after a crash; stop when the run writes its completion
# marker (WORKDIR/DONE) or after MAX_RESTARTS recoveries. train.py's exit
# status (appended to each worker's log by run.sh) tells a preemption (75: it
# saved a checkpoint, relaunch to resume) from a mistake no rerun fixes (2).
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
trainer_settings

: "${REPO_URL:=}"
: "${REF:=main}"
: "${SOURCE_TARBALL:=}"
: "${CHECK_INTERVAL:=300}"
: "${MAX_RESTARTS:=20}"
: "${MAX_HOURS:=0}"
: "${MAX_ITERATIONS:=}"
: "${HANG_TIMEOUT:=0}"
: "${DEAD_CHECKS:=2}"
: "${SSH_FAILURE_LIMIT:=3}"
: "${STATUS_TIMEOUT:=300}"
: "${DONE_MARKER:=}"
: "${TEARDOWN_ON_DONE:=1}"
: "${TEARDOWN_ON_GIVEUP:=1}"
: "${SYNC_LOGS:=1}"
: "${MOUNT:=}"
: "${GCSFUSE_FLAGS:=}"

usage() {
  cat <<EOF
Usage: $SCRIPT_NAME --config=configs/NAME.py --workdir=gs://BUCKET/PATH [options] [--config.KEY=VALUE ...] [-- TRAIN_ARGS...]

Every CHECK_INTERVAL seconds:
  - if the completion marker exists (default WORKDIR/DONE, written by the
    trainer when the run is finished): tear the TPU down (unless --keep-tpu)
    and exit 0;
  - if the TPU VM / queued resource is PREEMPTED, SUSPENDED, FAILED, TERMINATED
    or missing: teardown.sh, create.sh, bootstrap.sh, run.sh (training resumes
    from the latest checkpoint in WORKDIR);
  - if it is READY but train.py is not running on every worker (or, with
    --hang-timeout, its logs stopped growing): bootstrap.sh + run.sh; at once
    when train.py exited with status 75 (stopped by SIGTERM after saving a
    checkpoint); but if it exited with status 2 (a mistake in the config,
    flags or data, or a non-finite loss: a rerun fails the same way) it gives
    up as below;
  - while it is being created or waits in the queue: nothing.
Each recovery counts as a restart; after MAX_RESTARTS (or MAX_HOURS) it
gives up, tears the TPU down (unless --keep-tpu) and exits 1.
Worker logs are copied to WORKDIR/logs/ at each check (unless --no-log-sync).
Run it where it can live for days (tmux/screen or nohup on a small VM), e.g.
  nohup tpu_setup/babysit.sh ... >babysit.log 2>&1 &

Options (run.sh / bootstrap.sh options are passed through):
  --config FILE, --workdir gs://..., --config.KEY=VALUE, -- ARGS   as for run.sh
  --run-name NAME, --env KEY=VALUE, --coordinator-env              as for run.sh
  --repo-url URL, --ref REF          as for bootstrap.sh (default: ship the local
                                     tree, packed once at start)   [REPO_URL, REF]
  --mount gs://BUCKET[/DIR]:/LOCAL/DIR
                                     as for bootstrap.sh: mounted read-only with gcsfuse
                                     on every worker, again after each recreate
                                     (repeatable or comma-separated) [MOUNT]
  --interval S                       seconds between checks         [CHECK_INTERVAL=$CHECK_INTERVAL]
  --max-restarts N                   recoveries before giving up    [MAX_RESTARTS=$MAX_RESTARTS]
  --max-hours H                      give up after H hours, 0 = never [MAX_HOURS=$MAX_HOURS]
  --hang-timeout S                   relaunch when no worker log grew for S seconds,
                                     0 = off                        [HANG_TIMEOUT=$HANG_TIMEOUT]
  --done-marker URI                  completion marker              [DONE_MARKER=WORKDIR/DONE]
  --keep-tpu                         never tear down on completion or give-up
                                     [TEARDOWN_ON_DONE=$TEARDOWN_ON_DONE TEARDOWN_ON_GIVEUP=$TEARDOWN_ON_GIVEUP]
  --no-log-sync                      do not copy worker logs to WORKDIR/logs/ [SYNC_LOGS=$SYNC_LOGS]
  --max-iterations N                 stop after N checks (default: unlimited; 1 in dry-run)
Also: DEAD_CHECKS=$DEAD_CHECKS (consecutive "not running" checks before relaunching a run
that was seen running), SSH_FAILURE_LIMIT=$SSH_FAILURE_LIMIT (consecutive failed status
checks before recreating), STATUS_TIMEOUT=$STATUS_TIMEOUT (s, per status check), the
create.sh variables (RESERVED, LABELS, CREATE_EXTRA_ARGS, VALID_UNTIL_DURATION, ...) and
the bootstrap.sh ones (EXTRAS, PYTHON, GCSFUSE_FLAGS).

$COMMON_USAGE

Example:
  $SCRIPT_NAME --zone=us-east5-a --name=my-v5p --accelerator-type=v5p-64 --queued --spot \\
      --config=configs/paper_3b.py --config.model.arm=diff_v1 --workdir=gs://my-bucket/diffjax/3b_diff_v1 \\
      --mount=gs://my-bucket/data:/mnt/data --config.data.paths="('/mnt/data/prepared',)"
EOF
}

# babysit_flag "$@": this script's own flags (see parse_flags in common.sh).
babysit_flag() {
  NSHIFT=1
  case "$1" in
    --repo-url | --repo-url=*) take_value "$@" && REPO_URL="$FLAG_VALUE" ;;
    --ref | --ref=*) take_value "$@" && REF="$FLAG_VALUE" ;;
    --mount | --mount=*) take_value "$@" && mount_flag "$FLAG_VALUE" ;;
    --interval | --interval=*) take_value "$@" && CHECK_INTERVAL="$FLAG_VALUE" ;;
    --max-restarts | --max-restarts=*) take_value "$@" && MAX_RESTARTS="$FLAG_VALUE" ;;
    --max-hours | --max-hours=*) take_value "$@" && MAX_HOURS="$FLAG_VALUE" ;;
    --hang-timeout | --hang-timeout=*) take_value "$@" && HANG_TIMEOUT="$FLAG_VALUE" ;;
    --done-marker | --done-marker=*) take_value "$@" && DONE_MARKER="$FLAG_VALUE" ;;
    --max-iterations | --max-iterations=*) take_value "$@" && MAX_ITERATIONS="$FLAG_VALUE" ;;
    --keep-tpu)
      TEARDOWN_ON_DONE=0
      TEARDOWN_ON_GIVEUP=0
      ;;
    --no-log-sync) SYNC_LOGS=0 ;;
    --coordinator-env) COORDINATOR_ENV=1 ;;
    *) NSHIFT=0 ;;
  esac
}

parse_flags babysit_flag "$@"

finalize_common
require_gcloud
[[ -n "$CONFIG" ]] || die_usage "--config is required"
[[ -n "$WORKDIR" ]] || die_usage "--workdir is required"
[[ "$WORKDIR" == gs://* ]] ||
  die_usage "--workdir must be on GCS (gs://...): a recreated TPU VM starts with an empty disk"
WORKDIR="${WORKDIR%/}"
: "${DONE_MARKER:=$WORKDIR/DONE}"
if [[ -z "$RUN_NAME" ]]; then
  RUN_NAME="$(default_run_name "$WORKDIR")"
fi
if [[ -z "$MAX_ITERATIONS" ]]; then
  if is_dry_run; then MAX_ITERATIONS=1; else MAX_ITERATIONS=0; fi
fi
for n in CHECK_INTERVAL MAX_RESTARTS MAX_HOURS MAX_ITERATIONS HANG_TIMEOUT DEAD_CHECKS SSH_FAILURE_LIMIT STATUS_TIMEOUT; do
  [[ "${!n}" =~ ^[0-9]+$ ]] || die_usage "$n must be a non-negative integer, got '${!n}'"
done
parse_mounts

# Children (create/bootstrap/run/teardown.sh) read their settings from the
# environment.
export_common
export REPO_URL REF MOUNT GCSFUSE_FLAGS GRACE_SECONDS COORDINATOR_ENV COORDINATOR_PORT
export CREATE_RETRIES CREATE_RETRY_DELAY WAIT_TIMEOUT RESERVED LABELS \
  VALID_UNTIL_DURATION CREATE_EXTRA_ARGS EXTRAS PYTHON

# Only one babysitter per TPU.
if ! is_dry_run && command -v flock >/dev/null 2>&1; then
  lock_file="${XDG_RUNTIME_DIR:-/tmp}/diffjax-babysit-${PROJECT:-default}-$ZONE-$TPU_NAME.lock"
  exec 9>"$lock_file"
  flock -n 9 || die "another babysit.sh already watches $TPU_NAME ($lock_file)"
fi

# Pack the local tree once, so every recovery ships the same code.
tmpdir=""
cleanup() {
  if [[ -n "$tmpdir" ]]; then rm -rf "$tmpdir"; fi
}
trap cleanup EXIT
trap 'log "interrupted: the TPU VM and the training run are left as they are (teardown.sh deletes them)"; exit 130' INT TERM
if [[ -z "$REPO_URL" && -z "$SOURCE_TARBALL" ]]; then
  if is_dry_run; then
    SOURCE_TARBALL="${TMPDIR:-/tmp}/diffjax-babysit.XXXXXX/diffjax-src.tar.gz"
  else
    tmpdir="$(mktemp -d)"
    SOURCE_TARBALL="$tmpdir/diffjax-src.tar.gz"
  fi
  log "packing the local working tree once: $SOURCE_TARBALL"
  make_source_tarball "$SOURCE_TARBALL"
fi
export SOURCE_TARBALL

RUN_ARGS=(--config="$CONFIG" --workdir="$WORKDIR" --run-name="$RUN_NAME")
for kv in ${ENV_PAIRS[@]+"${ENV_PAIRS[@]}"}; do
  RUN_ARGS+=(--env="$kv")
done
RUN_ARGS+=(--)
RUN_ARGS+=(${OVERRIDES[@]+"${OVERRIDES[@]}"})

START_TIME="$(date +%s)"
START_STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
restarts=0
iteration=0
dead_count=0
ssh_failures=0
seen_alive=0
EXITS=""

# Run a child script. Dry-run state simulation is for this script only.
child() {
  DRY_RUN_STATE="" DRY_RUN_QR_STATE="" "$TPU_SETUP_DIR/$1" "${@:2}"
}

is_done() {
  if is_dry_run; then
    run_cmd gcloud storage ls "$DONE_MARKER"
    is_true "${DRY_RUN_DONE:-0}"
    return
  fi
  run_cmd gcloud storage ls "$DONE_MARKER" >/dev/null 2>&1
}

# resource_health: set HEALTH (HEALTHY | WAITING | BROKEN | UNKNOWN) and
# STATE_DESC from the node / queued resource state.
resource_health() {
  local qs="" ns
  if is_true "$QUEUED"; then
    qs="$(describe_state qr SUSPENDED)"
    case "$qs" in
      ACTIVE) ;;
      CREATING | ACCEPTED | PROVISIONING | WAITING_FOR_RESOURCES | DELETING)
        HEALTH=WAITING STATE_DESC="queued resource $qs"
        return
        ;;
      UNKNOWN)
        HEALTH=UNKNOWN STATE_DESC="queued resource state unknown"
        return
        ;;
      *)
        HEALTH=BROKEN STATE_DESC="queued resource $qs"
        return
        ;;
    esac
  fi
  ns="$(describe_state node PREEMPTED)"
  STATE_DESC="${qs:+queued resource $qs, }node $ns"
  case "$ns" in
    READY) HEALTH=HEALTHY ;;
    CREATING | STARTING | RESTARTING | REPAIRING | REIMAGING | UNHIDING | DELETING) HEALTH=WAITING ;;
    UNKNOWN) HEALTH=UNKNOWN ;;
    *) HEALTH=BROKEN ;; # NOT_FOUND, PREEMPTED, TERMINATED, STOPPED, ...
  esac
}

# training_status: set TRAINING (ALL | NONE | PARTIAL | HUNG | UNKNOWN) from
# one ssh round over all workers, and EXITS to the exit statuses of train.py
# that end the workers' logs (run.sh appends "=== <time> exit <status>"; none
# while it runs); also uploads the worker logs.
training_status() {
  local out sync_uri="" total alive min_age
  if is_true "$SYNC_LOGS"; then
    sync_uri="$WORKDIR/logs/$START_STAMP-r$restarts"
  fi
  out="$(SSH_TIMEOUT="$STATUS_TIMEOUT" tpu_ssh all "$(status_script "$RUN_NAME" 1 "$sync_uri")" 2>/dev/null)" || true
  if is_dry_run; then
    TRAINING="${DRY_RUN_TRAINING:-ALL}"
    EXITS="${DRY_RUN_EXITS:-}"
    return
  fi
  EXITS="$(sed -n 's/^\[worker [0-9]*\] === .* exit \([0-9]*\)$/\1/p' <<<"$out" | sort -u | tr '\n' ' ')"
  EXITS="${EXITS% }"
  total="$(grep -c '^diffjax-status ' <<<"$out" || true)"
  alive="$(grep -c '^diffjax-status .* alive=1 ' <<<"$out" || true)"
  min_age="$(sed -n 's/^diffjax-status .* log_age=\([0-9-]*\) .*/\1/p' <<<"$out" | grep -v '^-' | sort -n | head -n 1 || true)"
  if ((total == 0)); then
    TRAINING=UNKNOWN
  elif ((alive == 0)); then
    TRAINING=NONE
  elif ((alive < total)); then
    TRAINING=PARTIAL
  elif ((HANG_TIMEOUT > 0)) && [[ -n "$min_age" ]] && ((min_age > HANG_TIMEOUT)); then
    TRAINING=HUNG
  else
    TRAINING=ALL
  fi
  log "training: $TRAINING ($alive/$total workers running${min_age:+, newest log line ${min_age}s ago}${EXITS:+, train.py exit status $EXITS})"
}

# has_exit STATUS: whether a worker's train.py last exited with STATUS.
has_exit() {
  [[ " $EXITS " == *" $1 "* ]]
}

relaunch() {
  child bootstrap.sh && child run.sh "${RUN_ARGS[@]}"
}

recreate() {
  child teardown.sh --yes && child create.sh && relaunch
}

finish() {
  local code="$1" teardown="$2" why="$3"
  log "$why"
  if is_true "$SYNC_LOGS" && ! is_dry_run; then
    log "final copy of the worker logs to $WORKDIR/logs/"
    training_status || true
  fi
  if is_true "$teardown"; then
    log "tearing the TPU down"
    child teardown.sh --yes || warn "teardown failed: delete $TPU_NAME by hand to stop billing"
  else
    warn "the TPU VM $TPU_NAME is left running (and billing); tpu_setup/teardown.sh deletes it"
  fi
  exit "$code"
}

log "watching $TPU_NAME (zone $ZONE) for run '$RUN_NAME'; done marker $DONE_MARKER; check every ${CHECK_INTERVAL}s${MOUNT:+; mounts $MOUNT}"
while true; do
  iteration=$((iteration + 1))
  if is_done; then
    finish 0 "$TEARDOWN_ON_DONE" "completion marker $DONE_MARKER found: run finished after $restarts restart(s)"
  fi
  if ((MAX_HOURS > 0 && $(date +%s) - START_TIME > MAX_HOURS * 3600)); then
    finish 1 "$TEARDOWN_ON_GIVEUP" "giving up: MAX_HOURS=$MAX_HOURS reached"
  fi

  action=""
  resource_health
  log "check $iteration: $STATE_DESC ($HEALTH), restarts $restarts/$MAX_RESTARTS"
  case "$HEALTH" in
    HEALTHY)
      training_status
      case "$TRAINING" in
        ALL)
          ssh_failures=0 dead_count=0 seen_alive=1
          ;;
        UNKNOWN)
          ssh_failures=$((ssh_failures + 1))
          warn "status check failed ($ssh_failures/$SSH_FAILURE_LIMIT)"
          if ((ssh_failures >= SSH_FAILURE_LIMIT)); then
            action=recreate
          fi
          ;;
        *)
          ssh_failures=0
          dead_count=$((dead_count + 1))
          if [[ "$TRAINING" == NONE ]] && has_exit 2; then
            finish 1 "$TEARDOWN_ON_GIVEUP" "giving up: train.py exited with status 2 (a mistake in the config, flags or data, or a non-finite loss; the error: line in the worker logs says which); a relaunch would fail the same way"
          fi
          if [[ "$TRAINING" == NONE ]] && has_exit 75; then
            log "train.py exited with status 75 (stopped by SIGTERM after saving a checkpoint): relaunching to resume"
            dead_count=$DEAD_CHECKS
          fi
          if ((seen_alive == 0 || dead_count >= DEAD_CHECKS)) || [[ "$TRAINING" == HUNG ]]; then
            # The run may just have finished: look for the marker again.
            if is_done; then
              continue
            fi
            action=relaunch
          fi
          ;;
      esac
      ;;
    BROKEN) action=recreate ;;
    WAITING | UNKNOWN) ;;
  esac

  if [[ -n "$action" ]]; then
    if ((restarts >= MAX_RESTARTS)); then
      finish 1 "$TEARDOWN_ON_GIVEUP" "giving up: MAX_RESTARTS=$MAX_RESTARTS recoveries used"
    fi
    restarts=$((restarts + 1))
    log "recovery $restarts/$MAX_RESTARTS: $action"
    if "$action"; then
      log "recovery $restarts done"
      seen_alive=0 dead_count=0 ssh_failures=0
    else
      warn "recovery $restarts failed; retrying at the next check"
    fi
  fi

  if ((MAX_ITERATIONS > 0 && iteration >= MAX_ITERATIONS)); then
    log "stopping after $iteration check(s) (MAX_ITERATIONS); the TPU is left as it is"
    exit 0
  fi
  sleep_s "$CHECK_INTERVAL"
done
