#!/usr/bin/env bash
# Wheels for a GPU node that cannot reach a package index: the versions pinned for the
# node's Python (constraints.txt, constraints-py312.txt or constraints-py313.txt), as binary
# wheels for Linux x86-64, downloaded here into a folder that travels with the code.
#
#   bash gpu_setup/wheelhouse.sh --python 3.12 --dir wheels                  # every pin
#   bash gpu_setup/wheelhouse.sh --python 3.12 grain array_record portpicker  # only these
#   bash gpu_setup/wheelhouse.sh --dry-run --python 3.12 grain                # print, fetch nothing
#
# Then, on the node, from the project root:
#   pip install --no-index --find-links wheels -c constraints-py312.txt -e .
#
# The folder also gets setuptools, which pip needs there to install the project itself.
# A pin with no wheel comes as its source, which pip builds on the node.
# Name packages to fetch only what the node's image lacks (an image with jax and its CUDA
# plugin often lacks grain, array_record, portpicker, ml_collections and tensorboardX); each
# named package comes with no dependencies, so name the missing ones too. A name that the
# constraints file does not pin is refused, since its version would not match what was tested.
#
# Environment: PYTHON [python3] runs pip.
set -euo pipefail

usage() {
  echo "usage: bash gpu_setup/wheelhouse.sh [--python 3.11|3.12|3.13] [--dir DIR] [--dry-run] [PACKAGE ...]" >&2
  exit 2
}

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python_version=3.12
dir=wheels
dry_run=0
names=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python) [ $# -ge 2 ] || usage; python_version="$2"; shift 2 ;;
    --python=*) python_version="${1#*=}"; shift ;;
    --dir) [ $# -ge 2 ] || usage; dir="$2"; shift 2 ;;
    --dir=*) dir="${1#*=}"; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage ;;
    -*) echo "error: unknown flag $1" >&2; usage ;;
    *) names+=("$1"); shift ;;
  esac
done

case "$python_version" in
  3.11) constraints="$root/constraints.txt" ;;
  3.12) constraints="$root/constraints-py312.txt" ;;
  3.13) constraints="$root/constraints-py313.txt" ;;
  *) echo "error: --python $python_version: the tested sets are 3.11, 3.12 and 3.13." >&2; exit 2 ;;
esac

# A package name as pip compares them: lower case, runs of '-', '_' and '.' as one '-'.
normal() { tr '[:upper:]' '[:lower:]' <<<"$1" | sed -E 's/[-_.]+/-/g'; }

pins=()
while IFS= read -r line; do
  case "$line" in ''|'#'*) continue ;; esac
  pins+=("$line")
done <"$constraints"

wanted=()
if [ ${#names[@]} -eq 0 ]; then
  wanted=("${pins[@]}")
else
  for name in "${names[@]}"; do
    found=""
    for pin in "${pins[@]}"; do
      if [ "$(normal "${pin%%==*}")" = "$(normal "$name")" ]; then
        found="$pin"
        break
      fi
    done
    if [ -z "$found" ]; then
      echo "error: $name is not pinned in $(basename "$constraints"); name a package it pins." >&2
      exit 2
    fi
    wanted+=("$found")
  done
fi

# Linux x86-64 wheels, the oldest glibc a package offers first (the most nodes take them).
platforms=()
for glibc in 1 2014 _2_17 _2_24 _2_27 _2_28 _2_31 _2_34 _2_35; do
  platforms+=(--platform "manylinux${glibc}_x86_64")
done
command=("${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: \
  --python-version "$python_version" --implementation cp "${platforms[@]}" -d "$dir")
build="$(grep -oE 'setuptools[^"]*' "$root/pyproject.toml" | head -n 1)"

echo "${#wanted[@]} wheel(s) for Python $python_version (pins of $(basename "$constraints")) into $dir"
if [ "$dry_run" = 1 ]; then
  echo "would run: ${command[*]} ${wanted[*]}"
  echo "and: ${command[*]} $build (the build requirement of pyproject.toml)"
  exit 0
fi
mkdir -p "$dir"
sources=()
failed=()
for pin in "${wanted[@]}" "$build"; do  # one at a time: a pin without a wheel stops no other
  if "${command[@]}" "$pin" 2>/dev/null; then
    continue
  fi
  # Without a wheel, the source (pure-Python packages build on the node with setuptools).
  if "${PYTHON:-python3}" -m pip download -q --no-deps --no-binary=:all: -d "$dir" "$pin"; then
    sources+=("$pin")
  else
    failed+=("$pin")
  fi
done
if [ ${#sources[@]} -gt 0 ]; then
  # Building a source package without a pyproject.toml takes setuptools and wheel.
  "${command[@]}" wheel || failed+=(wheel)
  echo "as source (no wheel; pip builds them on the node): ${sources[*]}"
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "error: neither a wheel nor the source of ${failed[*]}; the rest is in $dir." >&2
  exit 1
fi
echo "on the node: pip install --no-index --find-links $dir -c $(basename "$constraints") -e ."
