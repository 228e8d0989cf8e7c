#!/usr/bin/env bash
# Start train.py on every worker of the TPU VM (after stopping anything that
# still holds the TPU), one log file per worker; or stop / inspect / follow it.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
trainer_settings

: "${FOLLOW:=0}"
: "${FOLLOW_WORKER:=0}"
: "${GRACE_SECONDS:=120}"
: "${COORDINATOR_ENV:=0}"
: "${COORDINATOR_PORT:=8476}"
: "${STATUS_TAIL:=5}"

ACTION=launch

usage() {
  cat <<EOF
Usage: $SCRIPT_NAME --config=configs/NAME.py --workdir=gs://BUCKET/PATH [options] [--config.KEY=VALUE ...] [-- TRAIN_ARGS...]

On every worker (gcloud compute tpus tpu-vm ssh --worker=all):
  1. stop stale training processes and anything holding the TPU
     (python ... $TRAIN_SCRIPT of this user, and 'sudo lsof -t /dev/vfio/* /dev/accel*'),
     SIGTERM then SIGKILL after GRACE_SECONDS; remove /tmp/libtpu_lockfile;
  2. start, under setsid + nohup, in ~/$REMOTE_DIR:
       ~/$VENV_DIR/bin/python $TRAIN_SCRIPT --config=CONFIG --workdir=WORKDIR [overrides]
     appending to ~/$LOG_DIR/RUN_NAME-host<worker>.log (pid in ~/$LOG_DIR/RUN_NAME.pid);
     when it ends, a last line "=== <time> exit <status>" is appended (train.py:
     0 finished, 2 a config/flag/data mistake, 75 stopped by SIGTERM after saving).
The trainer initialises jax.distributed itself and resumes from the latest
checkpoint in WORKDIR, so rerunning this script restarts the job in place.

Options:
  --config FILE          config file, relative to the project root   [CONFIG]
  --workdir DIR          checkpoints/logs; gs://... for multi-host    [WORKDIR]
  --config.KEY=VALUE     config override, passed through (repeatable)
  -- ARGS...             everything after -- is passed to $TRAIN_SCRIPT
  --run-name NAME        log file prefix (default: last part of WORKDIR) [RUN_NAME]
  --env KEY=VALUE        environment variable for the trainer (repeatable)
                                                                   [TRAIN_ENV="K=V K2=V2"]
  --follow               after starting, stream worker FOLLOW_WORKER's log
                         (Ctrl-C stops streaming, not training)    [FOLLOW=0]
  --follow-worker N      worker whose log --follow/--tail streams   [FOLLOW_WORKER=0]
  --tail                 only stream the log (start nothing)
  --status               only report, per worker, whether training runs,
                         the log age and its last STATUS_TAIL lines [STATUS_TAIL=$STATUS_TAIL]
  --stop                 only stop training (and free the TPU)
  --grace-seconds S      wait after SIGTERM before SIGKILL (the trainer saves
                         a checkpoint on SIGTERM)                   [GRACE_SECONDS=$GRACE_SECONDS]
  --coordinator-env      also export DIFFJAX_COORDINATOR=<worker 0 IP>:COORDINATOR_PORT,
                         DIFFJAX_NUM_PROCESSES and DIFFJAX_PROCESS_ID, read from the TPU
                         metadata, on multi-host slices; only for trainers whose own
                         pod detection does not fire on TPU VMs     [COORDINATOR_ENV=0]
  --train-script FILE    entry point in the project root            [TRAIN_SCRIPT=$TRAIN_SCRIPT]

$COMMON_USAGE

Environment set for the trainer: PYTHONUNBUFFERED=1, DIFFJAX_RUN_NAME,
DIFFJAX_WORKER_ID (informational), plus --env / TRAIN_ENV.

Examples:
  $SCRIPT_NAME --zone=us-west4-a --name=my-v5e --config=configs/tiny.py --config.model.arm=diff_v1 \\
      --workdir=gs://my-bucket/diffjax/tiny_diff_v1 --config.num_steps=2000 --follow
  $SCRIPT_NAME --zone=us-west4-a --name=my-v5e --workdir=gs://my-bucket/diffjax/tiny_diff_v1 --status
EOF
}

# run_flag "$@": this script's own flags (see parse_flags in common.sh).
run_flag() {
  NSHIFT=1
  case "$1" in
    --follow) FOLLOW=1 ;;
    --follow-worker | --follow-worker=*) take_value "$@" && FOLLOW_WORKER="$FLAG_VALUE" ;;
    --tail) ACTION="tail" ;;
    --status) ACTION=status ;;
    --stop) ACTION=stop ;;
    --grace-seconds | --grace-seconds=*) take_value "$@" && GRACE_SECONDS="$FLAG_VALUE" ;;
    --coordinator-env) COORDINATOR_ENV=1 ;;
    --train-script | --train-script=*) take_value "$@" && TRAIN_SCRIPT="$FLAG_VALUE" ;;
    *) NSHIFT=0 ;;
  esac
}

parse_flags run_flag "$@"

finalize_common
require_gcloud
[[ "$GRACE_SECONDS" =~ ^[0-9]+$ ]] || die_usage "--grace-seconds must be a number"
if [[ -z "$RUN_NAME" && -n "$WORKDIR" ]]; then
  RUN_NAME="$(default_run_name "$WORKDIR")"
fi
[[ -z "$RUN_NAME" || "$RUN_NAME" =~ ^[A-Za-z0-9._-]+$ ]] ||
  die_usage "invalid run name '$RUN_NAME' (letters, digits, . _ -)"

case "$ACTION" in
  launch)
    [[ -n "$CONFIG" ]] || die_usage "--config is required"
    [[ -n "$WORKDIR" ]] || die_usage "--workdir is required"
    if [[ ! -f "$PROJECT_ROOT/$CONFIG" ]]; then
      warn "$CONFIG not found in the local tree ($PROJECT_ROOT); the workers may still have it"
    fi
    if [[ "$WORKDIR" != gs://* ]]; then
      warn "WORKDIR is not on GCS: every worker writes to its own disk, and it is lost with the VM"
    fi
    ;;
  status | tail)
    [[ -n "$RUN_NAME" ]] || die_usage "--$ACTION needs --workdir or --run-name"
    ;;
esac

TRAIN_ARGS=()
if [[ -n "$CONFIG" ]]; then TRAIN_ARGS+=("--config=$CONFIG"); fi
if [[ -n "$WORKDIR" ]]; then TRAIN_ARGS+=("--workdir=$WORKDIR"); fi
TRAIN_ARGS+=(${OVERRIDES[@]+"${OVERRIDES[@]}"})

# ---------------------------------------------------------------------------
# Remote part: stop, then (launch only) start.
# ---------------------------------------------------------------------------
# shellcheck disable=SC2016  # expanded on the worker
LAUNCH_BODY='stop_training() {
  local devs=() holders="" all pid left i
  shopt -s nullglob
  devs=(/dev/vfio/* /dev/accel*)
  shopt -u nullglob
  if ((${#devs[@]})) && command -v lsof >/dev/null 2>&1; then
    holders="$(sudo -n lsof -t "${devs[@]}" 2>/dev/null || true)"
  fi
  all="$({ trainer_pids; printf "%s\n" "$holders"; } | sed "/^$/d" | sort -u | tr "\n" " ")"
  if [[ -n "${all// /}" ]]; then
    say "stopping processes using the TPU or running $TRAIN_SCRIPT: $all"
    sudo -n kill -TERM $all 2>/dev/null || true
    for ((i = 0; i < GRACE_SECONDS; i++)); do
      left=""
      for pid in $all; do
        if [[ -d "/proc/$pid" ]]; then left="$left $pid"; fi
      done
      [[ -z "$left" ]] && break
      sleep 1
    done
    if [[ -n "$left" ]]; then
      say "still running after ${GRACE_SECONDS}s, sending SIGKILL:$left"
      sudo -n kill -KILL $left 2>/dev/null || true
      sleep 2
    fi
  fi
  sudo -n rm -f /tmp/libtpu_lockfile
}

stop_training
if [[ "$ACTION" == stop ]]; then
  say "training stopped, TPU released"
  exit 0
fi
[[ -f "$REMOTE_DIR/$TRAIN_SCRIPT" ]] || { say "missing $REMOTE_DIR/$TRAIN_SCRIPT: run bootstrap.sh first"; exit 1; }
[[ -x "$VENV_DIR/bin/python" ]] || { say "missing venv $VENV_DIR: run bootstrap.sh first"; exit 1; }
LOG="$LOG_DIR/$RUN_NAME-host$WID.log"
if [[ "$COORDINATOR_ENV" == 1 ]]; then
  ENDPOINTS="$(curl -sf -m 5 -H "Metadata-Flavor: Google" \
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/worker-network-endpoints" 2>/dev/null || true)"
  mapfile -t IPS < <(printf "%s\n" "$ENDPOINTS" | tr "," "\n" | cut -s -d: -f3 | sed "/^$/d")
  if ((${#IPS[@]} > 1)); then
    export DIFFJAX_COORDINATOR="${IPS[0]}:$COORDINATOR_PORT" DIFFJAX_NUM_PROCESSES="${#IPS[@]}" DIFFJAX_PROCESS_ID="$WID"
    say "coordinator $DIFFJAX_COORDINATOR, process $WID of ${#IPS[@]}"
  fi
fi
cd "$REMOTE_DIR"
{
  printf "=== %s launch run=%s worker=%s host=%s\n" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$RUN_NAME" "$WID" "$(hostname)"
  printf "=== %s" "$TRAIN_SCRIPT"
  printf " %q" "${TRAIN_ARGS[@]}"
  printf "\n"
} >>"$LOG"
# A small wrapper appends the exit status of the trainer to the log when it ends,
# "=== <time> exit <status>": babysit.sh reads it (75: stopped after saving, rerun
# to resume; 2: a mistake in the config, flags or data, a rerun fails the same way).
read -r -d "" EXIT_WRAPPER <<"EOW" || true
"${@:2}"
rc=$?
printf "=== %s exit %s\n" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$rc" >>"$1"
EOW
PYTHONUNBUFFERED=1 DIFFJAX_RUN_NAME="$RUN_NAME" DIFFJAX_WORKER_ID="$WID" \
  setsid nohup bash -c "$EXIT_WRAPPER" diffjax-run "$LOG" \
  env "${TRAIN_ENV[@]}" "$VENV_DIR/bin/python" "$TRAIN_SCRIPT" "${TRAIN_ARGS[@]}" \
  >>"$LOG" 2>&1 </dev/null &
PID=$!
printf "%s\n" "$PID" >"$LOG_DIR/$RUN_NAME.pid"
sleep 3
if [[ ! -d "/proc/$PID" ]]; then
  say "$TRAIN_SCRIPT exited at once; last lines of $LOG:"
  tail -n 30 "$LOG"
  exit 42
fi
say "started $TRAIN_SCRIPT (pid $PID), log $LOG"'

case "$ACTION" in
  launch | stop)
    SCRIPT="$(
      remote_vars REMOTE_DIR VENV_DIR LOG_DIR TRAIN_SCRIPT ACTION RUN_NAME GRACE_SECONDS \
        COORDINATOR_ENV COORDINATOR_PORT
      remote_array TRAIN_ARGS ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"}
      remote_array TRAIN_ENV ${ENV_PAIRS[@]+"${ENV_PAIRS[@]}"}
      remote_preamble
      printf '%s\n' "$LAUNCH_BODY"
    )"
    if [[ "$ACTION" == stop ]]; then
      log "stopping training on all workers of $TPU_NAME"
    else
      log "starting run '$RUN_NAME' on all workers of $TPU_NAME: $TRAIN_SCRIPT $(quote_cmd "${TRAIN_ARGS[@]}")"
    fi
    # Safe to retry: every try first stops what a previous try started. Not
    # retried: the trainer itself failing at start (exit 42 from the worker).
    RETRY_FATAL_RC=42 retry "$SSH_RETRIES" 20 tpu_ssh all "$SCRIPT"
    if [[ "$ACTION" == launch ]]; then
      log "started; logs: ~/$LOG_DIR/$RUN_NAME-host<worker>.log on each worker"
      if is_true "$FOLLOW"; then
        ACTION="tail"
      fi
    fi
    ;;
esac

case "$ACTION" in
  status)
    tpu_ssh all "$(status_script "$RUN_NAME" "$STATUS_TAIL" "")"
    ;;
  tail)
    # shellcheck disable=SC2016  # expanded on the worker
    TAIL_BODY='LOG="$LOG_DIR/$RUN_NAME-host$WID.log"
say "streaming $LOG (Ctrl-C stops streaming; training keeps running)"
exec tail -n 100 -F "$LOG"'
    tpu_ssh "$FOLLOW_WORKER" "$(remote_script "$TAIL_BODY" RUN_NAME)"
    ;;
esac
