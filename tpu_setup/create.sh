#!/usr/bin/env bash
# Create a Cloud TPU VM (directly, or through a queued resource) and wait
# until it is READY. Retries with exponential backoff on failure (stockouts).
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

: "${CREATE_RETRIES:=6}"
: "${CREATE_RETRY_DELAY:=60}"
: "${WAIT_TIMEOUT:=}"
: "${RESERVED:=0}"
: "${LABELS:=app=diffjax}"
: "${VALID_UNTIL_DURATION:=}"
: "${CREATE_EXTRA_ARGS:=}"
: "${RECREATE:=0}"

usage() {
  cat <<EOF
Usage: $SCRIPT_NAME [options]

Create the TPU VM TPU_NAME (gcloud compute tpus tpu-vm create) or, with
--queued, the queued resource QR_ID whose node is TPU_NAME
(gcloud compute tpus queued-resources create), then wait until it is READY.
Does nothing when it already exists and is READY.

Options:
  --retries N              create attempts                       [CREATE_RETRIES=$CREATE_RETRIES]
  --retry-delay S          first backoff delay, doubles each time [CREATE_RETRY_DELAY=$CREATE_RETRY_DELAY]
  --wait-timeout S         give up waiting for READY after S seconds, per attempt
                           (default 1800, or 86400 with --queued) [WAIT_TIMEOUT]
  --reserved               use reserved capacity                  [RESERVED=0]
  --labels K=V,...         resource labels                        [LABELS=$LABELS]
  --valid-until-duration D queued only: drop the request if not provisioned
                           within D (e.g. 6h)                     [VALID_UNTIL_DURATION]
  --extra-args "ARGS"      more flags for the create command, e.g.
                           "--network=N --subnetwork=S --internal-ips"
                                                                  [CREATE_EXTRA_ARGS]
  --recreate               delete an existing PREEMPTED/FAILED/... resource
                           first instead of failing               [RECREATE=0]

$COMMON_USAGE

Examples:
  $SCRIPT_NAME --zone=us-west4-a --accelerator-type=v5litepod-16 --name=my-v5e
  $SCRIPT_NAME --zone=us-east5-a --accelerator-type=v5p-64 --name=my-v5p --queued --spot
EOF
}

# create_flag "$@": this script's own flags (see parse_flags in common.sh).
create_flag() {
  NSHIFT=1
  case "$1" in
    --retries | --retries=*) take_value "$@" && CREATE_RETRIES="$FLAG_VALUE" ;;
    --retry-delay | --retry-delay=*) take_value "$@" && CREATE_RETRY_DELAY="$FLAG_VALUE" ;;
    --wait-timeout | --wait-timeout=*) take_value "$@" && WAIT_TIMEOUT="$FLAG_VALUE" ;;
    --reserved) RESERVED=1 ;;
    --labels | --labels=*) take_value "$@" && LABELS="$FLAG_VALUE" ;;
    --valid-until-duration | --valid-until-duration=*) take_value "$@" && VALID_UNTIL_DURATION="$FLAG_VALUE" ;;
    --extra-args | --extra-args=*) take_value "$@" && CREATE_EXTRA_ARGS="$FLAG_VALUE" ;;
    --recreate) RECREATE=1 ;;
    *) NSHIFT=0 ;;
  esac
}

parse_flags create_flag "$@"

finalize_common
export_common
require_gcloud
if [[ -z "$WAIT_TIMEOUT" ]]; then
  if is_true "$QUEUED"; then WAIT_TIMEOUT=86400; else WAIT_TIMEOUT=1800; fi
fi

# Classify a node state: ready | pending | broken | absent | unknown.
classify_node() {
  case "$1" in
    READY) echo ready ;;
    CREATING | STARTING | RESTARTING | REPAIRING | REIMAGING | UNHIDING) echo pending ;;
    NOT_FOUND) echo absent ;;
    UNKNOWN) echo unknown ;;
    *) echo broken ;; # PREEMPTED, TERMINATED, STOPPED, STOPPING, DELETING, HIDDEN, ...
  esac
}

# Classify a queued resource state.
classify_qr() {
  case "$1" in
    ACTIVE) echo ready ;;
    CREATING | ACCEPTED | PROVISIONING | WAITING_FOR_RESOURCES) echo pending ;;
    NOT_FOUND) echo absent ;;
    UNKNOWN) echo unknown ;;
    *) echo broken ;; # FAILED, SUSPENDING, SUSPENDED, DELETING
  esac
}

# Current overall state: ready | pending | broken | absent | unknown.
current_state() {
  local s
  if is_true "$QUEUED"; then
    s="$(describe_state qr NOT_FOUND)"
    case "$(classify_qr "$s")" in
      ready)
        # The queued resource is ACTIVE; its node should be READY.
        classify_node "$(describe_state node READY)"
        ;;
      *) classify_qr "$s" ;;
    esac
  else
    classify_node "$(describe_state node NOT_FOUND)"
  fi
}

delete_resource() {
  DRY_RUN_STATE="" DRY_RUN_QR_STATE="" "$TPU_SETUP_DIR/teardown.sh" --yes
}

create_once() {
  local -a cmd extra=()
  if [[ -n "$CREATE_EXTRA_ARGS" ]]; then
    read -r -a extra <<<"$CREATE_EXTRA_ARGS"
  fi
  if is_true "$QUEUED"; then
    cmd=(gcloud compute tpus queued-resources create "$QR_ID" "--node-id=$TPU_NAME"
      "${GCLOUD_LOC[@]}" "--accelerator-type=$ACCELERATOR_TYPE"
      "--runtime-version=$RUNTIME_VERSION")
    if [[ -n "$VALID_UNTIL_DURATION" ]]; then
      cmd+=("--valid-until-duration=$VALID_UNTIL_DURATION")
    fi
  else
    cmd=(gcloud compute tpus tpu-vm create "$TPU_NAME" "${GCLOUD_LOC[@]}"
      "--accelerator-type=$ACCELERATOR_TYPE" "--version=$RUNTIME_VERSION")
    if is_true "$PREEMPTIBLE"; then
      cmd+=(--preemptible)
    fi
  fi
  if is_true "$SPOT"; then
    cmd+=(--spot)
  fi
  if is_true "$RESERVED"; then
    cmd+=(--reserved)
  fi
  if [[ -n "$LABELS" ]]; then
    cmd+=("--labels=$LABELS")
  fi
  run_cmd "${cmd[@]}" ${extra[@]+"${extra[@]}"}
}

# wait_ready: poll until ready; returns 1 on broken state or timeout.
wait_ready() {
  local start state
  start="$(date +%s)"
  while true; do
    state="$(current_state)"
    case "$state" in
      ready) return 0 ;;
      broken)
        warn "resource entered a failed state"
        return 1
        ;;
    esac
    if is_dry_run; then
      return 0
    fi
    if (($(date +%s) - start > WAIT_TIMEOUT)); then
      warn "not READY after ${WAIT_TIMEOUT}s (last: $state)"
      return 1
    fi
    log "waiting for $TPU_NAME to become READY (now: $state)"
    sleep_s "$POLL_INTERVAL"
  done
}

what="TPU VM $TPU_NAME ($ACCELERATOR_TYPE, $RUNTIME_VERSION, zone $ZONE)"
if is_true "$QUEUED"; then
  what="queued resource $QR_ID for $what"
fi

state="$(current_state)"
case "$state" in
  ready)
    log "$what already exists and is READY"
    exit 0
    ;;
  pending)
    log "$what is being created; waiting"
    wait_ready && exit 0
    warn "it did not become READY; deleting it and creating it again"
    delete_resource
    ;;
  broken)
    is_true "$RECREATE" ||
      die "$what exists in a failed/preempted state; run teardown.sh first or pass --recreate"
    log "$what exists in a failed/preempted state; deleting it first (--recreate)"
    delete_resource
    ;;
  unknown)
    die "could not query $what (check gcloud auth, project and zone)"
    ;;
esac

# A dry run simulates the existing resource's state only for the check above.
unset DRY_RUN_STATE DRY_RUN_QR_STATE

attempt=1
delay="$CREATE_RETRY_DELAY"
while true; do
  log "creating $what (attempt $attempt/$CREATE_RETRIES)"
  if create_once && wait_ready; then
    log "$what is READY"
    exit 0
  fi
  if ((attempt >= CREATE_RETRIES)); then
    die "could not create $what after $attempt attempts"
  fi
  # Clean up whatever a failed attempt left behind (a FAILED queued resource,
  # a node stuck in CREATING) so the next create does not collide with it.
  if [[ "$(current_state)" != absent ]]; then
    delete_resource || warn "cleanup after the failed attempt failed"
  fi
  wait_s=$((delay + RANDOM % (delay / 4 + 1)))
  warn "attempt $attempt failed; retrying in ${wait_s}s"
  sleep_s "$wait_s"
  attempt=$((attempt + 1))
  delay=$((delay * 2))
  if ((delay > RETRY_MAX_DELAY)); then delay=$RETRY_MAX_DELAY; fi
done
