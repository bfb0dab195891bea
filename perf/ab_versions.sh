#!/usr/bin/env bash
# A/B of two versions of flash4's code on one GPU, each version timed in its own processes,
# in an interleaved order (new old old new ...), so that both see the same machine, clocks
# and peers. The device machine gets a copy of the working tree without git, so both
# versions travel as files:
#
#   here:        bash perf/ab_versions.sh stage OLD_REF NEW_REF
#                    every file under flash4/ kernels/ pipelines/ that differs between the
#                    two refs, as each has it, into .ab/old/ and .ab/new/ (git-ignored; pass
#                    .ab in the device call's carry)
#   on the GPU:  bash perf/ab_versions.sh run "COMMAND" new-1 old-1 old-2 new-2
#                    for each label, the files of its version (the part before the dash)
#                    copied into place, then COMMAND in a fresh shell with $AB_LABEL set;
#                    its output goes to $OUT/ab-LABEL.log, and its lines that start with
#                    "fp8 ", "fwd ", "bwd " or "flash4" are echoed under the label.
#                    The new version's files are put back at the end.
#
# COMMAND example: 'python -m flash4 bench --pass fp8 --seqlen 512 --rounds 2 --out $OUT/bench-$AB_LABEL.json'
# A file one version lacks is removed while the other runs (a module the other adds).
set -u
here=".ab"
roots=(flash4 kernels pipelines)

stage() {
  local old=$1 new=$2
  rm -rf "$here/old" "$here/new"
  mkdir -p "$here/old" "$here/new"
  git diff --name-only "$old" "$new" -- "${roots[@]}" > "$here/files"
  while read -r path; do
    for side in old new; do
      local ref=$old
      [ "$side" = new ] && ref=$new
      if git cat-file -e "$ref:$path" 2>/dev/null; then
        mkdir -p "$here/$side/$(dirname "$path")"
        git show "$ref:$path" > "$here/$side/$path"
      fi
    done
  done < "$here/files"
  echo "$(wc -l < "$here/files") files differ between $old and $new: $(tr '\n' ' ' < "$here/files")"
}

use() {
  local side=$1
  while read -r path; do
    if [ -f "$here/$side/$path" ]; then
      cp "$here/$side/$path" "$path"
    else
      rm -f "$path"
    fi
  done < "$here/files"
}

run() {
  local command=$1
  shift
  local out="${OUT:-ab-logs}"
  mkdir -p "$out"
  for label in "$@"; do
    use "${label%%-*}"
    AB_LABEL=$label bash -c "$command" > "$out/ab-$label.log" 2>&1
    echo "$label rc=$? ${SECONDS}s"
    grep -E "^(fp8|fwd|bwd|flash4)" "$out/ab-$label.log"
  done
  use new
}

case "${1:-}" in
  stage) stage "$2" "$3" ;;
  run) shift; run "$@" ;;
  *) echo "usage: bash perf/ab_versions.sh stage OLD_REF NEW_REF | run COMMAND LABEL..." >&2; exit 2 ;;
esac
