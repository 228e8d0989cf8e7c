#!/usr/bin/env bash
# Install the project on every worker of the TPU VM: a Python >= 3.11 venv,
# the pinned install (pip install -c constraints.txt -e '.[tpu,gcs]') and the
# project source, from a git ref or from a tarball of the local working tree;
# with --mount, first mount GCS buckets (the training data) read-only with
# gcsfuse. Safe to rerun: mounted directories are left as they are, the venv is
# reused and pip is skipped when pyproject.toml, constraints.txt and the
# extras are unchanged.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

: "${REPO_URL:=}"
: "${REF:=main}"
: "${SOURCE_TARBALL:=}"
: "${EXTRAS:=tpu,gcs}"
: "${PYTHON:=}"
: "${FORCE_INSTALL:=0}"
: "${WORKERS:=all}"
: "${MOUNT:=}"
: "${GCSFUSE_FLAGS:=}"

usage() {
  cat <<EOF
Usage: $SCRIPT_NAME [options]

Bootstrap every worker of TPU_NAME (gcloud compute tpus tpu-vm ssh --worker=all):
  1. with --mount: mount each bucket (or only its DIR) read-only at /LOCAL/DIR
     with gcsfuse --implicit-dirs -o ro (skipped when already mounted); the
     image must have Cloud Storage FUSE (gcsfuse) installed,
  2. find python >= 3.11 (installs python3.11 with apt when the image has none),
  3. create the venv ~/$VENV_DIR if missing,
  4. put the project in ~/$REMOTE_DIR: with --repo-url, git clone/fetch and check
     out REF; otherwise pack the local working tree (tracked + untracked,
     not ignored files), scp it to every worker and unpack it,
  5. pip install -c constraints.txt -e '.[EXTRAS]' (skipped when unchanged),
  6. print the jax / libtpu versions each worker imports.

Options:
  --repo-url URL        clone this git repository on the workers    [REPO_URL]
                        (default: copy the local working tree)
  --ref REF             branch, tag or commit to check out          [REF=$REF]
  --tarball FILE        ship this prebuilt .tar.gz of the project   [SOURCE_TARBALL]
  --extras LIST         pip extras, comma-separated                 [EXTRAS=$EXTRAS]
  --python BIN          interpreter on the workers (>= 3.11)       [PYTHON]
  --force-install       run pip even when nothing changed           [FORCE_INSTALL=0]
  --worker W            only these workers (e.g. 0 or 1,3)           [WORKERS=$WORKERS]
  --mount gs://BUCKET[/DIR]:/LOCAL/DIR
                        mount gs://BUCKET/DIR read-only at /LOCAL/DIR on every
                        worker (training reads its data through the file
                        system); repeatable or comma-separated      [MOUNT]
  (environment only)    extra gcsfuse flags for --mount (caching)   [GCSFUSE_FLAGS]

$COMMON_USAGE

Examples:
  $SCRIPT_NAME --zone=us-west4-a --name=my-v5e
  $SCRIPT_NAME --zone=us-west4-a --name=my-v5e --repo-url=https://github.com/ORG/diffjax.git --ref=v0.1.0
  $SCRIPT_NAME --zone=us-east5-a --name=my-v5p --mount=gs://my-bucket/data:/mnt/data
EOF
}

# bootstrap_flag "$@": this script's own flags (see parse_flags in common.sh).
bootstrap_flag() {
  NSHIFT=1
  case "$1" in
    --repo-url | --repo-url=*) take_value "$@" && REPO_URL="$FLAG_VALUE" ;;
    --ref | --ref=*) take_value "$@" && REF="$FLAG_VALUE" ;;
    --tarball | --tarball=*) take_value "$@" && SOURCE_TARBALL="$FLAG_VALUE" ;;
    --extras | --extras=*) take_value "$@" && EXTRAS="$FLAG_VALUE" ;;
    --python | --python=*) take_value "$@" && PYTHON="$FLAG_VALUE" ;;
    --force-install) FORCE_INSTALL=1 ;;
    --worker | --worker=*) take_value "$@" && WORKERS="$FLAG_VALUE" ;;
    --mount | --mount=*) take_value "$@" && mount_flag "$FLAG_VALUE" ;;
    *) NSHIFT=0 ;;
  esac
}

parse_flags bootstrap_flag "$@"

finalize_common
require_gcloud
[[ "$EXTRAS" =~ ^[A-Za-z0-9_,-]*$ ]] || die_usage "invalid --extras '$EXTRAS'"
parse_mounts

REMOTE_TARBALL="diffjax-src.tar.gz"
if [[ -n "$REPO_URL" ]]; then
  SOURCE_MODE=git
else
  SOURCE_MODE=tarball
fi

# ---------------------------------------------------------------------------
# The script every worker runs. Values are assigned at its top by
# remote_script; everything below is expanded on the worker.
# ---------------------------------------------------------------------------
BODY_HELPERS="$(
  cat <<'EOF'
BOOT_LOG="$LOG_DIR/bootstrap.log"
apt_install() {
  say "apt-get install $*"
  {
    sudo -n env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -qq update &&
      sudo -n env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -qq install -y "$@"
  } >>"$BOOT_LOG" 2>&1
}
py_ok() {
  "$1" -c "import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)" >/dev/null 2>&1
}
pick_python() {
  local c
  for c in $PYTHON python3.13 python3.12 python3.11 python3; do
    if command -v "$c" >/dev/null 2>&1 && py_ok "$c"; then
      command -v "$c"
      return 0
    fi
  done
  return 1
}
EOF
)"

# Step 1 (--mount only): the function, then one call per mount with its values.
MOUNT_STEP=""
if ((${#MOUNT_POINTS[@]})); then
  MOUNT_STEP="$(
    cat <<'EOF'

# 1. Data mounts: gs://BUCKET[/DIR] read-only at a local directory (gcsfuse).
read -r -a GCSFUSE_EXTRA <<<"$GCSFUSE_FLAGS"
mount_gcs() {
  local bucket="$1" dir="$2" mnt="$3" src="gs://$1${2:+/$2}" what
  local -a args=(--implicit-dirs -o ro)
  # A mount whose gcsfuse process died answers "Transport endpoint is not connected".
  if grep -qsF " $mnt fuse" /proc/self/mounts && ! stat "$mnt" >/dev/null 2>&1; then
    say "$mnt: stale mount; unmounting it"
    { fusermount -u "$mnt" || sudo -n umount -l "$mnt"; } >>"$BOOT_LOG" 2>&1 || true
  fi
  if mountpoint -q "$mnt"; then
    what="$(findmnt -n -o SOURCE --mountpoint "$mnt" 2>/dev/null || true)"
    say "$mnt is already mounted${what:+ ($what)}; skipping $src (unmount it to change it)"
    return 0
  fi
  if [[ ! -d "$mnt" ]]; then
    mkdir -p "$mnt" 2>/dev/null || sudo -n mkdir -p "$mnt" || { say "cannot create $mnt"; exit 1; }
  fi
  if [[ ! -O "$mnt" ]]; then
    sudo -n chown "$(id -u):$(id -g)" "$mnt" || { say "cannot make $mnt owned by $(id -un)"; exit 1; }
  fi
  if [[ -n "$dir" ]]; then
    args+=(--only-dir "$dir")
  fi
  say "mounting $src read-only at $mnt (gcsfuse; log: $BOOT_LOG)"
  if ! gcsfuse "${args[@]}" ${GCSFUSE_EXTRA[@]+"${GCSFUSE_EXTRA[@]}"} "$bucket" "$mnt" >>"$BOOT_LOG" 2>&1; then
    say "gcsfuse could not mount $src at $mnt; last lines of $BOOT_LOG:"
    tail -n 20 "$BOOT_LOG"
    exit 1
  fi
}
if ! command -v gcsfuse >/dev/null 2>&1; then
  say "gcsfuse not found: --mount needs Cloud Storage FUSE (gcsfuse) installed in the TPU VM image (or copy the data to each worker's disk instead)"
  exit 1
fi
EOF
  )"$'\n'
  for i in "${!MOUNT_POINTS[@]}"; do
    MOUNT_STEP+="mount_gcs $(quote_cmd "${MOUNT_BUCKETS[i]}" "${MOUNT_DIRS[i]}" "${MOUNT_POINTS[i]}")"$'\n'
  done
fi

BODY_STEPS="$(
  cat <<'EOF'

# 2. Python >= 3.11 (the Ubuntu 22.04 based TPU VM images have python3.10).
if ! PY="$(pick_python)"; then
  apt_install python3.11 python3.11-venv
  PY="$(pick_python)" || { say "no python >= 3.11 available"; exit 1; }
fi
PY_VER="$("$PY" -c "import sys; print(\"%d.%d\" % sys.version_info[:2])")"

# 3. The venv (kept across reruns; rebuilt only when broken or too old).
if [[ -x "$VENV_DIR/bin/python" ]] && py_ok "$VENV_DIR/bin/python"; then
  say "reusing venv $VENV_DIR"
else
  if [[ -e "$VENV_DIR" ]]; then
    if [[ ! -f "$VENV_DIR/pyvenv.cfg" ]]; then
      say "$VENV_DIR exists and is not a venv; refusing to replace it"
      exit 1
    fi
    say "replacing broken or outdated venv $VENV_DIR"
    rm -rf "$VENV_DIR"
  fi
  say "creating venv $VENV_DIR with $PY ($PY_VER)"
  if ! "$PY" -m venv "$VENV_DIR" >>"$BOOT_LOG" 2>&1; then
    rm -rf "$VENV_DIR"
    apt_install "python$PY_VER-venv"
    "$PY" -m venv "$VENV_DIR"
  fi
fi

# 4. The project source.
if [[ "$SOURCE_MODE" == git ]]; then
  command -v git >/dev/null 2>&1 || apt_install git
  if [[ -d "$REMOTE_DIR/.git" ]]; then
    git -C "$REMOTE_DIR" remote set-url origin "$REPO_URL"
    git -C "$REMOTE_DIR" fetch --quiet --tags --force --prune origin
  else
    if [[ -e "$REMOTE_DIR" ]]; then
      say "replacing non-git $REMOTE_DIR with a clone"
      rm -rf "$REMOTE_DIR"
    fi
    rm -rf "$REMOTE_DIR.clone"
    git clone --quiet "$REPO_URL" "$REMOTE_DIR.clone"
    mv "$REMOTE_DIR.clone" "$REMOTE_DIR"
  fi
  if SHA="$(git -C "$REMOTE_DIR" rev-parse -q --verify "origin/$REF^{commit}")"; then
    :
  elif SHA="$(git -C "$REMOTE_DIR" rev-parse -q --verify "$REF^{commit}")"; then
    :
  else
    git -C "$REMOTE_DIR" fetch --quiet origin "$REF"
    SHA="$(git -C "$REMOTE_DIR" rev-parse FETCH_HEAD)"
  fi
  git -C "$REMOTE_DIR" checkout --quiet --force --detach "$SHA"
  say "source: $REPO_URL @ $REF ($SHA)"
else
  TARBALL="$HOME/$REMOTE_TARBALL"
  [[ -f "$TARBALL" ]] || { say "missing $TARBALL (scp failed?)"; exit 1; }
  rm -rf "$REMOTE_DIR.incoming" "$REMOTE_DIR.previous"
  mkdir -p "$REMOTE_DIR.incoming"
  tar -xzf "$TARBALL" -C "$REMOTE_DIR.incoming"
  if [[ -e "$REMOTE_DIR" ]]; then
    mv "$REMOTE_DIR" "$REMOTE_DIR.previous"
  fi
  mv "$REMOTE_DIR.incoming" "$REMOTE_DIR"
  rm -rf "$REMOTE_DIR.previous" "$TARBALL"
  say "source: local working tree, unpacked into $REMOTE_DIR"
fi
if [[ -n "$(trainer_pids)" ]]; then
  say "note: a training process is running; restart it (run.sh) to use the new code"
fi

# 5. The pinned install, skipped when nothing it depends on changed.
cd "$REMOTE_DIR"
[[ -f constraints.txt && -f pyproject.toml ]] || { say "no pyproject.toml/constraints.txt in $REMOTE_DIR"; exit 1; }
STAMP="$VENV_DIR/.diffjax-install-stamp"
WANT="$(cat pyproject.toml constraints.txt | sha256sum | cut -d " " -f 1)-$EXTRAS-$REMOTE_DIR"
if [[ "$FORCE_INSTALL" != 1 && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  say "dependencies unchanged; skipping pip"
else
  SPEC="."
  if [[ -n "$EXTRAS" ]]; then
    SPEC=".[$EXTRAS]"
  fi
  say "pip install -c constraints.txt -e $SPEC (log: $BOOT_LOG)"
  rm -f "$STAMP"
  if ! { "$VENV_DIR/bin/python" -m pip install --quiet --upgrade pip &&
    "$VENV_DIR/bin/python" -m pip install --quiet -c constraints.txt -e "$SPEC"; } >>"$BOOT_LOG" 2>&1; then
    say "pip install failed; last lines of $BOOT_LOG:"
    tail -n 40 "$BOOT_LOG"
    exit 1
  fi
  printf "%s\n" "$WANT" >"$STAMP"
fi

# 6. Sanity check: import only (initialising the TPU here would hold it).
"$VENV_DIR/bin/python" -c "import importlib.metadata as m, jax, diffjax; print(\"jax\", jax.__version__, \"libtpu\", m.version(\"libtpu\"))" |
  sed "s/^/[worker $WID] /"
say "bootstrap done"
EOF
)"
BODY="$BODY_HELPERS"$'\n'"$MOUNT_STEP$BODY_STEPS"

SCRIPT="$(remote_script "$BODY" SOURCE_MODE REPO_URL REF REMOTE_TARBALL EXTRAS PYTHON FORCE_INSTALL GCSFUSE_FLAGS)"

log "bootstrapping workers '$WORKERS' of $TPU_NAME (source: ${REPO_URL:-${SOURCE_TARBALL:-local working tree $PROJECT_ROOT}}${MOUNT:+; mounts: $MOUNT})"
if [[ "$SOURCE_MODE" == tarball ]]; then
  tarball="$SOURCE_TARBALL"
  tmpdir=""
  if [[ -z "$tarball" ]]; then
    if is_dry_run; then
      tmpdir="${TMPDIR:-/tmp}/diffjax-src.XXXXXX"
    else
      tmpdir="$(mktemp -d)"
      trap 'rm -rf "$tmpdir"' EXIT
    fi
    tarball="$tmpdir/diffjax-src.tar.gz"
    make_source_tarball "$tarball"
  elif [[ ! -f "$tarball" ]] && ! is_dry_run; then
    die "tarball not found: $tarball"
  fi
fi

# Copy (tarball mode) and run as one unit, so a retry re-sends the tarball
# that a partly successful previous try already unpacked and removed.
ship_and_bootstrap() {
  if [[ "$SOURCE_MODE" == tarball ]]; then
    tpu_scp "$WORKERS" "$tarball" "$REMOTE_TARBALL" || return
  fi
  tpu_ssh "$WORKERS" "$SCRIPT"
}
retry "$SSH_RETRIES" 20 ship_and_bootstrap
log "bootstrap of $TPU_NAME complete"
