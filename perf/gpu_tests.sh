#!/usr/bin/env bash
# The GPU tests in segments, each under its own time limit, for device calls of at most ten
# minutes: a hang in one segment (a kernel waiting on a barrier or a turn that never comes)
# costs that segment's limit, not the call, and every segment leaves its log. On the GPU
# machine, from the project's root, after `source .gpu/activate.sh`:
#
#     bash perf/gpu_tests.sh [-j] [segment ...]      (default: all, in the order below)
#
# -j runs the segments side by side, each in its own pytest process, and waits for all:
# the tests' time is mostly compilation, one core a process, so on the GPU machine's 16
# cores the five FP8 segments took 267 s together against about 1000 one after another
# (H100, 2026-12-05). Each keeps its own limit.
#
# Logs go to $OUT (the device tool's output folder) or ./gpu-logs; one summary line per
# segment goes to stdout: its name, pytest's exit status (124: the limit ran out), seconds
# since the start, and pytest's last line.
set -u
out="${OUT:-gpu-logs}"
mkdir -p "$out"
start=$SECONDS

# name, limit in seconds, pytest arguments
segments=(
  "fwd|450|tests/test_fwd_gpu.py -k not candidate and not multicast and not head_cluster and not lazy_rescale and not other_ and not no_bit"
  "fwdvariants|300|tests/test_fwd_gpu.py -k (other_ or no_bit) and not candidate and not multicast and not head_cluster and not lazy_rescale"
  "fwdlazy|200|tests/test_fwd_gpu.py -k lazy_rescale and not candidate"
  "fwdclusters|330|tests/test_fwd_gpu.py -k (multicast or head_cluster) and not candidate"
  "bwd|200|tests/test_bwd_gpu.py -k matches_reference and not 256 and not candidate"
  "bwd256|120|tests/test_bwd_gpu.py -k matches_reference and 256 and not candidate"
  "deterministic|120|tests/test_bwd_gpu.py -k deterministic"
  "bwdvariants|300|tests/test_bwd_gpu.py -k variants and not transposed"
  "bwdtransposed|240|tests/test_bwd_gpu.py -k transposed and not postprocess"
  "autograd|240|tests/test_autograd_gpu.py -k not training"
  "training|150|tests/test_autograd_gpu.py -k training -s"
  "fp8|330|tests/test_fp8_gpu.py -k not quantiz and not v_layout and not int8 and not no_bit and not per_tensor_v and not four_warpgroups"
  "fp8variants|300|tests/test_fp8_gpu.py -k (no_bit or per_tensor_v) and not quantiz and not v_layout and not int8"
  "fp8quantize|300|tests/test_fp8_gpu.py -k (quantiz or v_layout) and not int8"
  "fp8int8|420|tests/test_fp8_gpu.py -k int8 -s"
  "bwdparts|120|tests/test_bwd_gpu.py tests/test_bwd_preprocess.py -k preprocess or postprocess"
  "fwdcandidates|200|tests/test_fwd_gpu.py tests/test_fp8_gpu.py -k candidate and not int8 and not four_warpgroups"
  "fourwarpgroups|300|tests/test_fp8_gpu.py -k four_warpgroups"
  "bwdcandidates|300|tests/test_bwd_gpu.py -k candidate"
)

side_by_side=0
if [ "${1:-}" = "-j" ]; then
  side_by_side=1
  shift
fi
wanted=("$@")

run_segment() {
  local name=$1 limit=$2 args=$3
  # The -k expression is one argument; the rest split on spaces.
  local files="${args%% -k *}"
  local extra=()
  if [[ "$args" == *" -k "* ]]; then
    local rest="${args#* -k }"
    extra=(-k "${rest% -s}")
    [[ "$rest" == *" -s" ]] && extra+=(-s)
  fi
  # shellcheck disable=SC2086
  timeout "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider $files "${extra[@]}" > "$out/$name.log" 2>&1
  local status=$?
  echo "$name rc=$status $((SECONDS - start))s: $(tail -1 "$out/$name.log")"
}

for segment in "${segments[@]}"; do
  IFS='|' read -r name limit args <<< "$segment"
  if [ ${#wanted[@]} -gt 0 ] && [[ ! " ${wanted[*]} " == *" $name "* ]]; then
    continue
  fi
  if [ "$side_by_side" = 1 ]; then
    run_segment "$name" "$limit" "$args" &
  else
    run_segment "$name" "$limit" "$args"
  fi
done
wait
