#!/usr/bin/env bash
# Offline self-test of tpu_setup/ (needs no gcloud, no cloud project, no TPU):
#   1. bash -n on every script, and shellcheck when installed
#      (SELFTEST_REQUIRE_SHELLCHECK=1 makes a missing shellcheck a failure);
#   2. --help of every script;
#   3. every script's dry run, asserting the printed commands (gcloud verbs and
#      flags) and that gcloud is never executed; bad arguments must fail;
#   4. bash -n (and shellcheck) on every remote script the dry runs produce;
#   5. the remote scripts of run.sh (launch, status, relaunch, stop) executed
#      in a local sandbox HOME with a fake trainer;
#   6. babysit.sh run for real against a fake gcloud (preemption, recreate,
#      bootstrap with a --mount (fake gcsfuse), launch, log sync, DONE marker,
#      teardown);
#   7. with SELFTEST_BOOTSTRAP=1, bootstrap.sh's remote script executed in a
#      sandbox HOME (creates a venv and runs the real pinned pip install:
#      slow, needs network access to the package index).
# Exits non-zero when any check fails.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SCRIPTS=(common.sh create.sh bootstrap.sh run.sh babysit.sh teardown.sh selftest.sh)
EXECUTABLES=(create.sh bootstrap.sh run.sh babysit.sh teardown.sh)

failures=0
checks=0
pass() {
  checks=$((checks + 1))
  printf 'ok   %s\n' "$*"
}
fail() {
  checks=$((checks + 1))
  failures=$((failures + 1))
  printf 'FAIL %s\n' "$*"
}

TMP="$(mktemp -d)"
SANDBOX_PIDFILE=""
cleanup() {
  if [[ -n "$SANDBOX_PIDFILE" && -f "$SANDBOX_PIDFILE" ]]; then
    kill "$(cat "$SANDBOX_PIDFILE")" 2>/dev/null || true
  fi
  rm -rf "$TMP"
}
trap cleanup EXIT

# A fake gcloud that records any call: dry runs must never execute it.
FAKEBIN="$TMP/fakebin"
mkdir -p "$FAKEBIN"
cat >"$FAKEBIN/gcloud" <<EOF
#!/bin/sh
echo "\$*" >>"$TMP/gcloud-called"
exit 97
EOF
chmod +x "$FAKEBIN/gcloud"

# Common arguments for the dry runs.
Z=(--zone=us-west4-a)

# ---------------------------------------------------------------------------
# 1. Syntax and lint
# ---------------------------------------------------------------------------
for s in "${SCRIPTS[@]}"; do
  if bash -n "$HERE/$s"; then pass "bash -n $s"; else fail "bash -n $s"; fi
done
for s in "${EXECUTABLES[@]}" selftest.sh; do
  if [[ -x "$HERE/$s" ]]; then pass "$s is executable"; else fail "$s is not executable"; fi
done
HAVE_SHELLCHECK=0
if command -v shellcheck >/dev/null 2>&1; then
  HAVE_SHELLCHECK=1
  if (cd "$HERE" && shellcheck "${SCRIPTS[@]}"); then
    pass "shellcheck ${SCRIPTS[*]}"
  else
    fail "shellcheck reported problems"
  fi
elif [[ "${SELFTEST_REQUIRE_SHELLCHECK:-0}" == 1 ]]; then
  fail "shellcheck not installed (apt-get install shellcheck)"
else
  printf 'skip shellcheck (not installed)\n'
fi

# ---------------------------------------------------------------------------
# 2. --help
# ---------------------------------------------------------------------------
for s in "${EXECUTABLES[@]}"; do
  if out="$(PATH="$FAKEBIN:$PATH" "$HERE/$s" --help 2>&1)" && [[ "$out" == *Usage:* && "$out" == *--dry-run* ]]; then
    pass "$s --help"
  else
    fail "$s --help"
  fi
done

# ---------------------------------------------------------------------------
# 3. Dry runs
# ---------------------------------------------------------------------------
n_dry=0
LAST_OUT=""
LAST_REC=""
# dry NAME SCRIPT ARGS... --- EXPECTED...: run SCRIPT ARGS in dry-run mode
# (environment from the caller) and check that its output holds every EXPECTED
# string; an EXPECTED string starting with "!" must be absent.
dry() {
  local name="$1" script="$2" rc=0 ok=1 e
  shift 2
  local -a args=()
  while (($#)) && [[ "$1" != --- ]]; do
    args+=("$1")
    shift
  done
  shift
  n_dry=$((n_dry + 1))
  LAST_REC="$TMP/rec/$n_dry"
  mkdir -p "$LAST_REC"
  rm -f "$TMP/gcloud-called"
  # NO_DRY_FLAG=1: rely on DRY_RUN=1 from the environment instead of --dry-run.
  if [[ "${NO_DRY_FLAG:-0}" != 1 ]]; then
    args=(--dry-run ${args[@]+"${args[@]}"})
  fi
  LAST_OUT="$(PATH="$FAKEBIN:$PATH" DRY_RUN_RECORD_DIR="$LAST_REC" \
    "$HERE/$script" ${args[@]+"${args[@]}"} 2>&1)" || rc=$?
  if ((rc != 0)); then
    fail "$name: exit $rc"
    printf '%s\n' "$LAST_OUT" | tail -n 20 | sed 's/^/     | /'
    return 0
  fi
  if [[ -f "$TMP/gcloud-called" ]]; then
    fail "$name: gcloud was executed in dry-run mode: $(cat "$TMP/gcloud-called")"
    ok=0
  fi
  for e in "$@"; do
    if [[ "$e" == !* ]]; then
      if [[ "$LAST_OUT" == *"${e#!}"* ]]; then
        fail "$name: output unexpectedly contains '${e#!}'"
        ok=0
      fi
    elif [[ "$LAST_OUT" != *"$e"* ]]; then
      fail "$name: output lacks '$e'"
      ok=0
    fi
  done
  if ((ok)); then pass "dry run: $name"; fi
}

# must_fail NAME SCRIPT ARGS...: the script must exit non-zero.
must_fail() {
  local name="$1" script="$2"
  shift 2
  rm -f "$TMP/gcloud-called"
  if PATH="$FAKEBIN:$PATH" "$HERE/$script" --dry-run "$@" >/dev/null 2>&1; then
    fail "$name: expected a non-zero exit"
  elif [[ -f "$TMP/gcloud-called" ]]; then
    fail "$name: gcloud was executed"
  else
    pass "rejects: $name"
  fi
}

# find_record DIR SUBSTRING: print the path of a recorded command in DIR whose
# arguments contain SUBSTRING.
find_record() {
  local f
  for f in "$1"/cmd.*; do
    [[ -e "$f" ]] || continue
    # grep reads the file itself: "tr | grep -q" under pipefail failed when
    # grep quit at the first match and tr, still writing, got SIGPIPE.
    if grep -qaF -- "$2" "$f"; then
      printf '%s\n' "$f"
      return 0
    fi
  done
  return 1
}

# remote_command RECORD: print the --command= payload of a recorded command.
remote_command() {
  local -a argv
  local a
  mapfile -d '' -t argv <"$1"
  for a in "${argv[@]}"; do
    if [[ "$a" == --command=* ]]; then
      printf '%s\n' "${a#--command=}"
      return 0
    fi
  done
  return 1
}

# script_has NAME SCRIPT EXPECTED...: SCRIPT (a recorded remote script) holds
# every EXPECTED string; one starting with "!" must be absent.
script_has() {
  local name="$1" script="$2" ok=1 e
  shift 2
  if [[ -z "$script" ]]; then
    fail "$name: no remote script recorded"
    return 0
  fi
  for e in "$@"; do
    if [[ "$e" == !* ]]; then
      if [[ "$script" == *"${e#!}"* ]]; then
        fail "$name: remote script unexpectedly contains '${e#!}'"
        ok=0
      fi
    elif [[ "$script" != *"$e"* ]]; then
      fail "$name: remote script lacks '$e'"
      ok=0
    fi
  done
  if ((ok)); then pass "remote script: $name"; fi
}

# in_order NAME TEXT A B...: A, B, ... occur in TEXT in this order.
in_order() {
  local name="$1" rest="$2" e
  shift 2
  for e in "$@"; do
    if [[ "$rest" != *"$e"* ]]; then
      fail "$name: '$e' missing or out of order"
      return 0
    fi
    rest="${rest#*"$e"}"
  done
  pass "$name"
}

dry "create v5e (direct)" create.sh "${Z[@]}" --name=my-v5e --- \
  "+ gcloud compute tpus tpu-vm describe my-v5e --zone=us-west4-a" \
  "+ gcloud compute tpus tpu-vm create my-v5e --zone=us-west4-a --accelerator-type=v5litepod-16 --version=v2-alpha-tpuv5-lite" \
  "!--spot" "!queued-resources"
dry "create v5e spot with project" create.sh "${Z[@]}" --name=my-v5e --spot --project=my-proj --- \
  "gcloud compute tpus tpu-vm create my-v5e --zone=us-west4-a --project=my-proj" "--spot"
dry "create v5e preemptible" create.sh "${Z[@]}" --name=my-v5e --preemptible --- \
  "gcloud compute tpus tpu-vm create my-v5e" "--preemptible"
dry "create v5p queued spot" create.sh --zone=us-east5-a --name=my-v5p --accelerator-type=v5p-64 --queued --spot --- \
  "+ gcloud compute tpus queued-resources describe my-v5p-qr --zone=us-east5-a" \
  "+ gcloud compute tpus queued-resources create my-v5p-qr --node-id=my-v5p --zone=us-east5-a --accelerator-type=v5p-64 --runtime-version=v2-alpha-tpuv5" \
  "--spot" "!tpu-vm create"
ZONE=us-central1-a TPU_NAME=env-tpu ACCELERATOR_TYPE=v5p-32 \
  dry "create from environment variables" create.sh --- \
  "gcloud compute tpus tpu-vm create env-tpu --zone=us-central1-a --accelerator-type=v5p-32 --version=v2-alpha-tpuv5"
DRY_RUN_STATE=PREEMPTED dry "create --recreate over a preempted VM" create.sh "${Z[@]}" --name=my-v5e --recreate --- \
  "gcloud compute tpus tpu-vm delete my-v5e" "gcloud compute tpus tpu-vm create my-v5e"
DRY_RUN_STATE=READY dry "create is a no-op when READY" create.sh "${Z[@]}" --name=my-v5e --- \
  "tpu-vm describe" "!tpu-vm create" "already exists"

dry "bootstrap (local tree)" bootstrap.sh "${Z[@]}" --name=my-v5e --- \
  "git ls-files" "tar -czf" \
  "+ gcloud compute tpus tpu-vm scp" "my-v5e:diffjax-src.tar.gz --zone=us-west4-a --worker=all" \
  "+ gcloud compute tpus tpu-vm ssh my-v5e --zone=us-west4-a --worker=all" \
  "pip install --quiet -c constraints.txt -e" "EXTRAS=tpu,gcs" "python3.11-venv" "!gcsfuse" "!mount_gcs"
BOOT_REC="$LAST_REC"
dry "bootstrap --mount (two, one with a DIR)" bootstrap.sh "${Z[@]}" --name=my-v5e \
  --mount=gs://my-bucket/data/:/mnt/data/ --mount gs://other-bucket:/mnt/other --- \
  "+ gcloud compute tpus tpu-vm ssh my-v5e --zone=us-west4-a --worker=all" \
  "mounts: gs://my-bucket/data:/mnt/data,gs://other-bucket:/mnt/other"
MOUNT_SCRIPT="$(remote_command "$(find_record "$LAST_REC" '--command=')" || true)"
# shellcheck disable=SC2016  # literal text of the remote script
script_has "bootstrap --mount: gcsfuse read-only, only DIR, skipped when mounted, gcsfuse required" "$MOUNT_SCRIPT" \
  "mount_gcs my-bucket data /mnt/data" 'mount_gcs other-bucket "" /mnt/other' \
  'if mountpoint -q "$mnt"; then' "already mounted" \
  "args=(--implicit-dirs -o ro)" 'args+=(--only-dir "$dir")' 'gcsfuse "${args[@]}"' '"$bucket" "$mnt"' \
  'sudo -n mkdir -p "$mnt"' 'sudo -n chown "$(id -u):$(id -g)" "$mnt"' \
  "command -v gcsfuse" "needs Cloud Storage FUSE (gcsfuse) installed in the TPU VM image"
# shellcheck disable=SC2016  # literal text of the remote script
in_order "bootstrap --mount: guard, mkdir, gcsfuse in order; mounts before the install" "$MOUNT_SCRIPT" \
  "mount_gcs() {" 'if mountpoint -q "$mnt"; then' "return 0" 'mkdir -p "$mnt"' 'gcsfuse "${args[@]}"' \
  "command -v gcsfuse" "mount_gcs my-bucket data /mnt/data" "mount_gcs other-bucket" "pick_python)" "pip install"
MOUNT=gs://env-bucket/a/b:/data/ab GCSFUSE_FLAGS="--file-mode=444" dry "bootstrap: MOUNT and GCSFUSE_FLAGS from the environment" \
  bootstrap.sh "${Z[@]}" --name=my-v5e --- "mount_gcs env-bucket a/b /data/ab" "GCSFUSE_FLAGS=--file-mode=444"
dry "bootstrap (git ref)" bootstrap.sh "${Z[@]}" --name=my-v5e --repo-url=https://example.com/org/diffjax.git --ref=v1.2 --- \
  "gcloud compute tpus tpu-vm ssh my-v5e --zone=us-west4-a --worker=all" "git clone" \
  "REPO_URL=https://example.com/org/diffjax.git" "REF=v1.2" "!tpu-vm scp" "!tar -czf"

dry "run (launch)" run.sh "${Z[@]}" --name=my-v5e --config=configs/tiny.py --config.model.arm=diff_v1 \
  --workdir=gs://my-bucket/diffjax/tiny --config.num_steps=20 --env=FOO=bar -- --extra_flag=1 --- \
  "+ gcloud compute tpus tpu-vm ssh my-v5e --zone=us-west4-a --worker=all" \
  "lsof -t" "/dev/vfio/*" "/dev/accel*" "rm -f /tmp/libtpu_lockfile" "setsid nohup" \
  "TRAIN_ARGS=(--config=configs/tiny.py --workdir=gs://my-bucket/diffjax/tiny --config.model.arm=diff_v1 --config.num_steps=20 --extra_flag=1)" \
  "TRAIN_ENV=(FOO=bar)" "RUN_NAME=tiny" "\$LOG_DIR/\$RUN_NAME-host\$WID.log" "!--worker=0"
dry "run --follow" run.sh "${Z[@]}" --name=my-v5e --config=configs/tiny.py --config.model.arm=diff_v1 --workdir=gs://b/r1 --follow --- \
  "--worker=all" "--worker=0" "tail -n 100 -F"
dry "run --status" run.sh "${Z[@]}" --name=my-v5e --workdir=gs://b/r1 --status --- \
  "gcloud compute tpus tpu-vm ssh my-v5e --zone=us-west4-a --worker=all" "diffjax-status" "!setsid"
dry "run --stop" run.sh "${Z[@]}" --name=my-v5e --stop --- "--worker=all" "ACTION=stop" "libtpu_lockfile"
NO_DRY_FLAG=1 DRY_RUN=1 dry "DRY_RUN=1 from the environment" run.sh "${Z[@]}" --name=my-v5e --run-name=r2 --tail --- \
  "--worker=0" "tail -n 100 -F"

dry "teardown (direct)" teardown.sh "${Z[@]}" --name=my-v5e --- \
  "+ gcloud compute tpus tpu-vm delete my-v5e --zone=us-west4-a --quiet" "!queued-resources"
dry "teardown (queued)" teardown.sh --zone=us-east5-a --name=my-v5p --queued --- \
  "+ gcloud compute tpus queued-resources delete my-v5p-qr --zone=us-east5-a --force --quiet"

dry "babysit: preempted queued v5p is recreated" babysit.sh --zone=us-east5-a --name=my-v5p --accelerator-type=v5p-64 \
  --queued --spot --config=configs/paper_3b.py --config.model.arm=diff_v1 --workdir=gs://b/3b -- --config.seed=1 --- \
  "+ gcloud storage ls gs://b/3b/DONE" \
  "gcloud compute tpus queued-resources describe my-v5p-qr" \
  "gcloud compute tpus queued-resources delete my-v5p-qr --zone=us-east5-a --force --quiet" \
  "gcloud compute tpus queued-resources create my-v5p-qr --node-id=my-v5p" "--spot" \
  "gcloud compute tpus tpu-vm scp" "gcloud compute tpus tpu-vm ssh my-v5p" \
  "--config=configs/paper_3b.py --workdir=gs://b/3b --config.model.arm=diff_v1 --config.seed=1" "recovery 1/20: recreate"
DRY_RUN_STATE=PREEMPTED dry "babysit: preempted spot v5e is recreated" babysit.sh "${Z[@]}" --name=my-v5e --spot \
  --config=configs/tiny.py --config.model.arm=diff_v1 --workdir=gs://b/t --- \
  "gcloud compute tpus tpu-vm delete my-v5e" "gcloud compute tpus tpu-vm create my-v5e" "--spot" \
  "gcloud compute tpus tpu-vm ssh my-v5e"
DRY_RUN_STATE=READY DRY_RUN_TRAINING=NONE dry "babysit: dead run is relaunched in place" babysit.sh "${Z[@]}" \
  --name=my-v5e --config=configs/tiny.py --config.model.arm=diff_v1 --workdir=gs://b/t --- \
  "timeout 300 gcloud compute tpus tpu-vm ssh my-v5e" "diffjax-status" "LOG_SYNC_URI=gs://b/t/logs/" \
  "recovery 1/20: relaunch" "setsid nohup" "!tpu-vm create" "!tpu-vm delete"
DRY_RUN_STATE=READY DRY_RUN_TRAINING=ALL dry "babysit: healthy run is left alone" babysit.sh "${Z[@]}" \
  --name=my-v5e --config=configs/tiny.py --config.model.arm=diff_v1 --workdir=gs://b/t --- \
  "diffjax-status" "!recovery" "!setsid nohup"
DRY_RUN_DONE=1 dry "babysit: DONE marker ends the run and tears down" babysit.sh "${Z[@]}" --name=my-v5e \
  --config=configs/tiny.py --config.model.arm=diff_v1 --workdir=gs://b/t --- \
  "+ gcloud storage ls gs://b/t/DONE" "gcloud compute tpus tpu-vm delete my-v5e" "!tpu-vm create"
DRY_RUN_STATE=PREEMPTED dry "babysit --mount: the recreated VM is mounted again" babysit.sh "${Z[@]}" --name=my-v5e --spot \
  --mount=gs://my-bucket/data:/mnt/data --config=configs/tiny.py --config.model.arm=diff_v1 --workdir=gs://b/t \
  "--config.data.paths=('/mnt/data/prepared',)" --- \
  "mounts gs://my-bucket/data:/mnt/data" "gcloud compute tpus tpu-vm create my-v5e" "mount_gcs my-bucket data /mnt/data"
in_order "babysit --mount: create, then bootstrap with the mount, then launch" "$LAST_OUT" \
  "gcloud compute tpus tpu-vm create my-v5e" "mount_gcs my-bucket data /mnt/data" "/mnt/data/prepared" "setsid nohup"
DRY_RUN_DONE=1 dry "babysit --keep-tpu keeps the TPU" babysit.sh "${Z[@]}" --name=my-v5e --keep-tpu \
  --config=configs/tiny.py --config.model.arm=diff_v1 --workdir=gs://b/t --done-marker=gs://b/t/FINISHED --- \
  "gcloud storage ls gs://b/t/FINISHED" "!tpu-vm delete"

must_fail "missing --zone" create.sh --name=x
must_fail "unknown flag" create.sh "${Z[@]}" --bogus
must_fail "bad TPU name" create.sh "${Z[@]}" --name=Bad_Name
must_fail "unknown accelerator without --runtime-version" create.sh "${Z[@]}" --accelerator-type=v9x-8
must_fail "run without --workdir" run.sh "${Z[@]}" --config=configs/default.py
must_fail "run without --config" run.sh "${Z[@]}" --workdir=gs://b/x
must_fail "babysit with a local workdir" babysit.sh "${Z[@]}" --config=configs/default.py --workdir=/tmp/w
must_fail "babysit with a bad interval" babysit.sh "${Z[@]}" --config=configs/default.py --workdir=gs://b/w --interval=soon
must_fail "bootstrap --mount without gs://" bootstrap.sh "${Z[@]}" --mount=my-bucket/data:/mnt/data
must_fail "bootstrap --mount with a relative local path" bootstrap.sh "${Z[@]}" --mount=gs://my-bucket/data:mnt/data
must_fail "bootstrap --mount without a local path" bootstrap.sh "${Z[@]}" --mount=gs://my-bucket/data
must_fail "bootstrap --mount with a bad bucket name" bootstrap.sh "${Z[@]}" --mount=gs://My_Bucket:/mnt/data
must_fail "bootstrap --mount twice at one path" bootstrap.sh "${Z[@]}" --mount=gs://my-bucket/a:/mnt/d,gs://my-bucket/b:/mnt/d
must_fail "babysit with a bad --mount" babysit.sh "${Z[@]}" --config=configs/default.py --workdir=gs://b/w --mount=gs://my-bucket:data

# ---------------------------------------------------------------------------
# 4. Remote scripts: syntax (and lint)
# ---------------------------------------------------------------------------
n_remote=0
remote_bad=0
for f in "$TMP"/rec/*/cmd.*; do
  [[ -e "$f" ]] || continue
  if script="$(remote_command "$f")"; then
    n_remote=$((n_remote + 1))
    if ! bash -n <<<"$script"; then
      fail "remote script has a syntax error ($f)"
      remote_bad=$((remote_bad + 1))
      continue
    fi
    if ((HAVE_SHELLCHECK)) &&
      ! shellcheck -s bash -S warning -e SC2034,SC2086 - <<<"$script" >"$TMP/sc.out" 2>&1; then
      fail "shellcheck of a remote script: $(head -n 20 "$TMP/sc.out")"
      remote_bad=$((remote_bad + 1))
      continue
    fi
  fi
done
if ((n_remote >= 10 && remote_bad == 0)); then
  pass "$n_remote remote scripts parse$( ((HAVE_SHELLCHECK)) && echo " and are shellcheck-clean")"
else
  fail "only $n_remote remote scripts recorded"
fi

# ---------------------------------------------------------------------------
# 5. run.sh's remote scripts, executed in a sandbox
# ---------------------------------------------------------------------------
SB="$TMP/sandbox"
SBBIN="$TMP/sandboxbin"
TRAINER=diffjax_selftest_trainer.py # unique, so no real run can match
mkdir -p "$SB/diffjax" "$SB/diffjax-venv/bin" "$SBBIN"
# Workers' tools that differ here: sudo runs the command, curl plays the
# metadata server, lsof finds no TPU device holders.
cat >"$SBBIN/sudo" <<'EOF'
#!/bin/sh
[ "$1" = -n ] && shift
exec "$@"
EOF
# A fake metadata server: worker 1 of a two-host slice.
cat >"$SBBIN/curl" <<'EOF'
#!/bin/sh
for a in "$@"; do last="$a"; done
case "$last" in
  */agent-worker-number) echo 1 ;;
  */worker-network-endpoints) echo "unknown:unknown:10.0.0.11,unknown:unknown:10.0.0.12" ;;
  *) exit 22 ;;
esac
EOF
printf '#!/bin/sh\nexit 1\n' >"$SBBIN/lsof"
chmod +x "$SBBIN"/*
PYBIN="$(python3 -c 'import os, sys; print(os.path.realpath(sys.executable))' 2>/dev/null || true)"
if [[ -z "$PYBIN" ]]; then
  fail "sandbox: python3 not found"
else
  ln -sf "$PYBIN" "$SB/diffjax-venv/bin/python"
  cat >"$SB/diffjax/$TRAINER" <<'EOF'
import json, os, sys, time
with open(os.path.expanduser("~/trainer-args.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "run": os.environ.get("DIFFJAX_RUN_NAME"),
               "foo": os.environ.get("FOO"), "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
               "coord": [os.environ.get(k) for k in ("DIFFJAX_COORDINATOR", "DIFFJAX_NUM_PROCESSES",
                                                     "DIFFJAX_PROCESS_ID", "DIFFJAX_WORKER_ID")]}, f)
print("selftest trainer running", flush=True)
time.sleep(300)
EOF
  # Regenerate the launch/status/stop scripts with the sandbox trainer.
  dry "run (launch, sandbox trainer)" run.sh "${Z[@]}" --train-script="$TRAINER" --config=configs/tiny.py --config.model.arm=diff_v1 \
    --workdir=gs://b/sandbox --grace-seconds=5 --config.num_steps=3 \
    "--config.data.paths=('gs://b/d/prepared',)" --env=FOO=bar --coordinator-env --- \
    "--worker=all" "COORDINATOR_ENV=1" "worker-network-endpoints"
  LAUNCH="$(remote_command "$(find_record "$LAST_REC" '--command=')")"
  dry "run --status (sandbox trainer)" run.sh "${Z[@]}" --train-script="$TRAINER" --workdir=gs://b/sandbox --status --- "--worker=all"
  STATUS="$(remote_command "$(find_record "$LAST_REC" '--command=')")"
  dry "run --stop (sandbox trainer)" run.sh "${Z[@]}" --train-script="$TRAINER" --grace-seconds=5 --stop --- "--worker=all"
  STOP="$(remote_command "$(find_record "$LAST_REC" '--command=')")"
  SANDBOX_PIDFILE="$SB/diffjax-logs/sandbox.pid"
  sandbox() { HOME="$SB" PATH="$SBBIN:$PATH" bash -c "$1" 2>&1; }

  if out="$(sandbox "$LAUNCH")" && [[ "$out" == *"started $TRAINER"* ]]; then
    pass "sandbox: launch starts the trainer"
  else
    fail "sandbox: launch: $out"
  fi
  pid1="$(cat "$SANDBOX_PIDFILE" 2>/dev/null || true)"
  sleep 1
  got="$(cat "$SB/trainer-args.json" 2>/dev/null || true)"
  if [[ "$got" == *'"--config=configs/tiny.py", "--workdir=gs://b/sandbox", "--config.model.arm=diff_v1", "--config.num_steps=3", "--config.data.paths=('"'gs://b/d/prepared',)"'"'* &&
    "$got" == *'"run": "sandbox"'* && "$got" == *'"foo": "bar"'* && "$got" == *'"unbuffered": "1"'* &&
    "$got" == *'"coord": ["10.0.0.11:8476", "2", "1", "1"]'* ]]; then
    pass "sandbox: trainer got the config, workdir, overrides, environment and coordinator"
  else
    fail "sandbox: trainer arguments: $got"
  fi
  log_file=""
  for f in "$SB"/diffjax-logs/sandbox-host*.log; do
    if [[ -f "$f" ]]; then log_file="$f"; fi
  done
  if [[ "$log_file" == */sandbox-host1.log ]] && grep -q "selftest trainer running" "$log_file"; then
    pass "sandbox: per-host log $(basename "$log_file") (worker id from the metadata)"
  else
    fail "sandbox: no per-host log with trainer output"
  fi
  if out="$(sandbox "$STATUS")" && [[ "$out" == *"diffjax-status worker=1 alive=1 "* ]]; then
    pass "sandbox: status reports the run alive"
  else
    fail "sandbox: status while running: $out"
  fi
  touch "$SB/libtpu_lockfile_marker"
  if out="$(sandbox "$LAUNCH")" && [[ "$out" == *"stopping processes"* && "$out" == *"started $TRAINER"* ]]; then
    pid2="$(cat "$SANDBOX_PIDFILE")"
    if [[ -n "$pid1" && "$pid1" != "$pid2" && ! -d "/proc/$pid1" ]]; then
      pass "sandbox: relaunch stops the old trainer first"
    else
      fail "sandbox: relaunch left the old trainer ($pid1 -> $pid2)"
    fi
  else
    fail "sandbox: relaunch: $out"
  fi
  if out="$(sandbox "$STOP")" && [[ "$out" == *"training stopped"* ]] && sleep 1 &&
    [[ "$(sandbox "$STATUS")" == *" alive=0 "* ]]; then
    pass "sandbox: stop ends the run"
  else
    fail "sandbox: stop: $out"
  fi
fi

# ---------------------------------------------------------------------------
# 6. babysit.sh for real (not dry-run) against a fake gcloud: a preempted TPU
#    is deleted and recreated, the workers are bootstrapped (with a --mount,
#    by a fake gcsfuse) and the run is launched, logs are synced, and the DONE
#    marker ends it with a teardown.
# ---------------------------------------------------------------------------
if [[ -n "$PYBIN" ]]; then
  MNTBIN="$TMP/mountbin"
  export FAKE_DIR="$TMP/fakecloud" FAKE_HOME="$TMP/sandbox2" FAKE_GCS="$TMP/gcs" FAKE_BIN="$MNTBIN:$SBBIN"
  mkdir -p "$FAKE_DIR/bin" "$FAKE_HOME/src" "$FAKE_HOME/diffjax-venv/bin" "$FAKE_GCS/b/babysit" "$MNTBIN"
  echo PREEMPTED >"$FAKE_DIR/state"
  # The workers' gcsfuse and mountpoint: gcsfuse logs its arguments to the
  # gcloud call log and records the mount point (its last argument) in
  # FAKE_DIR/mounted, which mountpoint reads and a VM deletion clears.
  cat >"$MNTBIN/gcsfuse" <<'EOF'
#!/bin/sh
echo "gcsfuse $*" >>"$FAKE_DIR/calls"
for a in "$@"; do last="$a"; done
echo "$last" >>"$FAKE_DIR/mounted"
EOF
  cat >"$MNTBIN/mountpoint" <<'EOF'
#!/bin/sh
[ "$1" = -q ] && shift
grep -qxF -- "$1" "$FAKE_DIR/mounted" 2>/dev/null
EOF
  chmod +x "$MNTBIN"/*
  MNT="$TMP/mnt/data" # absent: bootstrap creates it
  # One TPU VM whose state lives in FAKE_DIR/state; gs://X is FAKE_GCS/X; ssh
  # runs the remote script here with HOME=FAKE_HOME; scp copies there.
  cat >"$FAKE_DIR/bin/gcloud" <<'FAKE_GCLOUD'
#!/usr/bin/env bash
printf '%s\n' "${*:1:5}" >>"$FAKE_DIR/calls"
gs() { printf '%s\n' "$FAKE_GCS/${1#gs://}"; }
case "$1 $2 $3 $4" in
  "compute tpus tpu-vm describe")
    state="$(cat "$FAKE_DIR/state")"
    if [[ "$state" == NOT_FOUND ]]; then
      echo "ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: node not found" >&2
      exit 1
    fi
    echo "$state"
    ;;
  "compute tpus tpu-vm delete")
    echo NOT_FOUND >"$FAKE_DIR/state"
    rm -f "$FAKE_DIR/mounted"
    ;;
  "compute tpus tpu-vm create") echo READY >"$FAKE_DIR/state" ;;
  "compute tpus tpu-vm scp") cp "$5" "$FAKE_HOME/${6#*:}" ;;
  "compute tpus tpu-vm ssh")
    for a in "$@"; do
      if [[ "$a" == --command=* ]]; then
        HOME="$FAKE_HOME" PATH="$FAKE_BIN:$PATH" bash -c "${a#--command=}"
        exit
      fi
    done
    exit 2
    ;;
  *)
    case "$1 $2" in
      "storage ls") [[ -e "$(gs "$3")" ]] ;;
      "storage cp") mkdir -p "$(gs "$4")" && cp "$3" "$(gs "$4")" ;;
      *)
        echo "fake gcloud: unexpected: $*" >&2
        exit 3
        ;;
    esac
    ;;
esac
FAKE_GCLOUD
  chmod +x "$FAKE_DIR/bin/gcloud"
  # The project shipped to the workers: a stub with a fake trainer that
  # writes the DONE marker (its GCS path, mapped to disk) after a few seconds.
  printf '[project]\nname = "stub"\n' >"$FAKE_HOME/src/pyproject.toml"
  printf 'jax==0.0.0\n' >"$FAKE_HOME/src/constraints.txt"
  cat >"$FAKE_HOME/src/$TRAINER" <<'FAKE_TRAINER'
import os, sys, time
print("selftest trainer", sys.argv[1:], flush=True)
if os.environ.get("SELFTEST_CRASH"):
    sys.exit("error: simulated crash")
time.sleep(8)
with open(os.path.join(os.environ["FAKE_GCS"], "b", "babysit", "DONE"), "w") as f:
    f.write("done\n")
FAKE_TRAINER
  tar -czf "$TMP/stub.tar.gz" -C "$FAKE_HOME/src" .
  # An installed venv whose stamp matches the stub, so bootstrap skips pip; its
  # python answers the post-install import check itself.
  {
    printf '#!/bin/sh\n'
    # shellcheck disable=SC2016  # expanded by the stub's shell
    printf 'case "$2" in *importlib.metadata*) echo "jax (stub) libtpu (stub)"; exit 0 ;; esac\n'
    printf 'exec %s "$@"\n' "$PYBIN"
  } >"$FAKE_HOME/diffjax-venv/bin/python"
  chmod +x "$FAKE_HOME/diffjax-venv/bin/python"
  # (EXTRAS is bootstrap.sh's default, read from it.)
  # shellcheck disable=SC2016  # a sed script
  BOOT_EXTRAS="$(sed -n 's/^: "\${EXTRAS:=\(.*\)}"$/\1/p' "$HERE/bootstrap.sh")"
  printf '%s-%s-%s\n' "$(cat "$FAKE_HOME/src/pyproject.toml" "$FAKE_HOME/src/constraints.txt" | sha256sum | cut -d ' ' -f 1)" \
    "$BOOT_EXTRAS" "$FAKE_HOME/diffjax" >"$FAKE_HOME/diffjax-venv/.diffjax-install-stamp"

  rc=0
  out="$(PATH="$FAKE_DIR/bin:$PATH" XDG_RUNTIME_DIR="$TMP" SOURCE_TARBALL="$TMP/stub.tar.gz" POLL_INTERVAL=1 \
    TRAIN_SCRIPT="$TRAINER" GRACE_SECONDS=5 timeout 180 "$HERE/babysit.sh" --zone=us-west4-a \
    --name=selftest-tpu --spot --config=configs/tiny.py --config.model.arm=diff_v1 --workdir=gs://b/babysit --interval=2 \
    --mount="gs://my-data/prepared-v1:$MNT" --max-iterations=15 2>&1)" || rc=$?
  calls="$(cat "$FAKE_DIR/calls" 2>/dev/null || true)"
  if ((rc == 0)) &&
    [[ "$out" == *"node PREEMPTED (BROKEN)"* && "$out" == *"recovery 1/20: recreate"* &&
      "$out" == *"training: ALL"* && "$out" == *"completion marker gs://b/babysit/DONE found"* &&
      "$out" == *"teardown complete"* ]] &&
    grep -q "compute tpus tpu-vm delete" <<<"$calls" && grep -q "compute tpus tpu-vm create" <<<"$calls" &&
    [[ "$(cat "$FAKE_DIR/state")" == NOT_FOUND ]]; then
    pass "babysit (fake gcloud): preempted -> recreate -> bootstrap -> run -> DONE -> teardown"
  else
    fail "babysit (fake gcloud): exit $rc"
    printf '%s\n' "$out" | tail -n 40 | sed 's/^/     | /'
  fi
  if compgen -G "$FAKE_GCS/b/babysit/logs/*/babysit-host1.log" >/dev/null; then
    pass "babysit (fake gcloud): worker logs synced to WORKDIR/logs/"
  else
    fail "babysit (fake gcloud): no worker log under WORKDIR/logs: $(find "$FAKE_GCS" -type f | head)"
  fi
  if [[ "$(grep '^gcsfuse ' <<<"$calls" || true)" == "gcsfuse --implicit-dirs -o ro --only-dir prepared-v1 my-data $MNT" &&
    -d "$MNT" && "$out" == *"mounting gs://my-data/prepared-v1 read-only at $MNT"* ]] &&
    awk '/compute tpus tpu-vm create/ { c = NR } /^gcsfuse / { g = NR } END { exit !(c && g > c) }' <<<"$calls"; then
    pass "babysit (fake gcloud): --mount reaches the bootstrap of the recreated VM (gcsfuse -o ro --only-dir, mkdir)"
  else
    fail "babysit (fake gcloud): --mount: gcsfuse calls: $(grep '^gcsfuse ' <<<"$calls" || echo none)"
  fi

  # A run that crashes at once on a READY TPU: relaunched in place until
  # MAX_RESTARTS, then babysit gives up (exit 1) and tears the TPU down.
  echo READY >"$FAKE_DIR/state"
  : >"$FAKE_DIR/calls"
  rm -f "$FAKE_GCS/b/babysit/DONE"
  rc=0
  out="$(PATH="$FAKE_DIR/bin:$PATH" XDG_RUNTIME_DIR="$TMP" SOURCE_TARBALL="$TMP/stub.tar.gz" POLL_INTERVAL=1 \
    TRAIN_SCRIPT="$TRAINER" GRACE_SECONDS=5 timeout 180 "$HERE/babysit.sh" --zone=us-west4-a \
    --name=selftest-tpu --config=configs/tiny.py --config.model.arm=diff_v1 --workdir=gs://b/babysit --interval=1 \
    --max-restarts=2 --max-iterations=10 --env=SELFTEST_CRASH=1 --mount="gs://my-data/prepared-v1:$MNT" 2>&1)" || rc=$?
  calls="$(cat "$FAKE_DIR/calls")"
  if ((rc == 1)) &&
    [[ "$out" == *"recovery 1/2: relaunch"* && "$out" == *"recovery 2/2: relaunch"* &&
      "$out" == *"exited at once"* && "$out" == *"giving up: MAX_RESTARTS=2"* &&
      "$out" == *"teardown complete"* ]] &&
    ! grep -q "compute tpus tpu-vm create" <<<"$calls" && [[ "$(cat "$FAKE_DIR/state")" == NOT_FOUND ]]; then
    pass "babysit (fake gcloud): crashing run -> relaunch x2 -> give up -> teardown"
  else
    fail "babysit (fake gcloud): crash loop: exit $rc"
    printf '%s\n' "$out" | tail -n 30 | sed 's/^/     | /'
  fi
  # The same VM bootstrapped twice: mounted by the first, left alone by the second.
  if [[ "$(grep -c '^gcsfuse ' <<<"$calls" || true)" == 1 && "$out" == *"$MNT is already mounted; skipping"* ]]; then
    pass "babysit (fake gcloud): a rerun of bootstrap skips the mounted directory"
  else
    fail "babysit (fake gcloud): rerun with --mount: gcsfuse calls: $(grep '^gcsfuse ' <<<"$calls" || echo none)"
  fi
  # Without gcsfuse on the worker, bootstrap --mount stops at once with one line.
  if command -v gcsfuse >/dev/null 2>&1; then
    printf 'skip bootstrap --mount without gcsfuse (gcsfuse is installed here)\n'
  else
    rc=0
    mkdir -p "$TMP/nofuse-home"
    out="$(HOME="$TMP/nofuse-home" PATH="$SBBIN:$PATH" bash -c "$MOUNT_SCRIPT" 2>&1)" || rc=$?
    if ((rc == 1)) && [[ "$(grep -c . <<<"$out")" == 1 &&
      "$out" == *"gcsfuse not found: --mount needs Cloud Storage FUSE (gcsfuse) installed in the TPU VM image"* ]] &&
      [[ ! -e "$TMP/nofuse-home/diffjax-venv" ]]; then
      pass "bootstrap --mount without gcsfuse: one-line error, nothing installed"
    else
      fail "bootstrap --mount without gcsfuse: exit $rc: $out"
    fi
  fi
fi

# ---------------------------------------------------------------------------
# 7. Optional: bootstrap's remote script in a sandbox (real pip install)
# ---------------------------------------------------------------------------
if [[ "${SELFTEST_BOOTSTRAP:-0}" == 1 ]]; then
  BS="$TMP/bootstrap-home"
  mkdir -p "$BS"
  # shellcheck source=common.sh
  (source "$HERE/common.sh" && DRY_RUN=0 make_source_tarball "$BS/diffjax-src.tar.gz") 2>/dev/null
  BOOT="$(remote_command "$(find_record "$BOOT_REC" '--command=')")"
  for round in 1 2; do
    if out="$(HOME="$BS" PATH="$SBBIN:$PATH" bash -c "$BOOT" 2>&1)" && [[ "$out" == *"bootstrap done"* ]]; then
      pass "sandbox bootstrap round $round: $(grep -E '\] (jax|dependencies|reusing)' <<<"$out" | tr '\n' ' ')"
    else
      fail "sandbox bootstrap round $round: $(tail -n 30 <<<"$out")"
    fi
    # Round 2 reruns it on the installed tree: needs the tarball again.
    (source "$HERE/common.sh" && DRY_RUN=0 make_source_tarball "$BS/diffjax-src.tar.gz") 2>/dev/null
  done
fi

printf '\n%d checks, %d failed\n' "$checks" "$failures"
((failures == 0))
