#!/usr/bin/env bash
# Delete the TPU VM (and its queued resource). Never touches the workdir.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

: "${ASSUME_YES:=0}"
: "${DELETE_TIMEOUT:=1800}"

usage() {
  cat <<EOF
Usage: $SCRIPT_NAME [options]

Delete the TPU VM TPU_NAME and, with --queued, the queued resource QR_ID
(with --force, which deletes its node too), then wait until they are gone.
Succeeds when nothing exists. Checkpoints and logs in the workdir (GCS) are
left alone; the VM's local disk (including ~/$LOG_DIR) is lost.

Options:
  -y, --yes               do not ask for confirmation on a terminal [ASSUME_YES=0]
  --delete-timeout S      wait at most S seconds for the deletion  [DELETE_TIMEOUT=$DELETE_TIMEOUT]

$COMMON_USAGE

Example:
  $SCRIPT_NAME --zone=us-east5-a --name=my-v5p --queued
EOF
}

# teardown_flag "$@": this script's own flags (see parse_flags in common.sh).
teardown_flag() {
  NSHIFT=1
  case "$1" in
    -y | --yes) ASSUME_YES=1 ;;
    --delete-timeout | --delete-timeout=*) take_value "$@" && DELETE_TIMEOUT="$FLAG_VALUE" ;;
    *) NSHIFT=0 ;;
  esac
}

parse_flags teardown_flag "$@"

finalize_common
require_gcloud

confirm() {
  if is_true "$ASSUME_YES" || is_dry_run || [[ ! -t 0 ]]; then
    return 0
  fi
  local answer
  read -r -p "Delete $1? [y/N] " answer
  [[ "$answer" == y || "$answer" == Y || "$answer" == yes ]] || die "aborted"
}

# wait_gone node|qr: poll until the resource no longer exists.
wait_gone() {
  local kind="$1" start state
  start="$(date +%s)"
  while true; do
    state="$(describe_state "$kind" NOT_FOUND)"
    if [[ "$state" == NOT_FOUND ]] || is_dry_run; then
      return 0
    fi
    if (($(date +%s) - start > DELETE_TIMEOUT)); then
      warn "$kind still present after ${DELETE_TIMEOUT}s (state $state)"
      return 1
    fi
    log "waiting for the $kind deletion (state $state)"
    sleep_s "$POLL_INTERVAL"
  done
}

rc=0
if is_true "$QUEUED"; then
  qr_state="$(describe_state qr ACTIVE)"
  if [[ "$qr_state" == NOT_FOUND ]]; then
    log "queued resource $QR_ID does not exist"
  else
    confirm "queued resource $QR_ID and its TPU VM $TPU_NAME"
    log "deleting queued resource $QR_ID (state $qr_state) and its node"
    retry 3 30 run_cmd gcloud compute tpus queued-resources delete "$QR_ID" "${GCLOUD_LOC[@]}" \
      --force --quiet || rc=1
    wait_gone qr || rc=1
  fi
fi

# After a queued resource delete --force the node is gone too; a dry run
# assumes so.
node_dry_default=READY
if is_true "$QUEUED"; then
  node_dry_default=NOT_FOUND
fi
node_state="$(describe_state node "$node_dry_default")"
if [[ "$node_state" == NOT_FOUND ]]; then
  log "TPU VM $TPU_NAME does not exist (any more)"
else
  confirm "TPU VM $TPU_NAME"
  log "deleting TPU VM $TPU_NAME (state $node_state)"
  retry 3 30 run_cmd gcloud compute tpus tpu-vm delete "$TPU_NAME" "${GCLOUD_LOC[@]}" --quiet || rc=1
  wait_gone node || rc=1
fi

if ((rc)); then
  die "teardown incomplete; check 'gcloud compute tpus tpu-vm list --zone=$ZONE' and 'gcloud compute tpus queued-resources list --zone=$ZONE'"
fi
log "teardown complete"
