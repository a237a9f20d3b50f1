#!/usr/bin/env bash
# The GPU kit in one command: every test and benchmark that needs a CUDA machine, for a machine
# that has PyTorch with CUDA but no package registry (an air-gapped cluster node, a lent box).
#
#   bench/gpu_kit.sh wheels [PYTHON_VERSION]   where PyPI is reachable: the wheels such a machine
#                                              lacks, at constraints.txt's pins, into .whl/ (3.12),
#                                              in place of any there (one Python's wheels at a time)
#   bench/gpu_kit.sh run OUT [STEP...]          on the CUDA machine, from the checkout: installs .whl/
#                                              (if there) into a private folder, stops at once if the
#                                              project's packages still do not import, then runs each
#                                              STEP, its output into OUT/STEP.txt; STEP_TIMEOUT (s)
#                                              each, 540 by default, and KIT_BUDGET (s) for them all,
#                                              570 by default: inside a 10-minute limit on a call, a
#                                              step that hangs leaves the next ones what is left, and
#                                              a step with under 30 s left is skipped
#   KIT_WHEELS: another folder than .whl/ for both; KIT_SITE: where `run` installs (/tmp/hetpipe-kit-site)
#
# Steps, in this order by default:
#   env        nvidia-smi, the Python and package versions the steps run with
#   tests      pytest -m cuda over every test file that marks one: pinned minibatches, the device
#              per thread, CUDA IPC, links, the oracles on the GPU (tests/e2e/test_cuda.py)
#   transport  bench/transport.py --cuda: CUDA IPC and pinned shared memory vs a device-to-device copy
#   copies     bench/host_copies.py: a push's and a pull's copies through pageable, pinned and shared
#              host memory, and the push log's write and fsync of the same bytes
#   gpu        bench/gpu.py: the 117.8M GPT in bf16, HetPipe layouts vs a plain loop, ddp, torch-pipeline
#              (GPU_STEPS steps each, 100 by default: on an H100 the runs took 17-42 s each at 100
#              steps, ddp left out on one GPU; each run's result is in OUT/gpu.json as soon as it is done)
#   profile    bench/gpu.py --profile: torch.profiler over 5 minibatches of the plain loop and of each
#              stage of 1x1 and 2x2 (what a step costs: wall, kernels, launches; the tables in
#              OUT/profile/); its samples/s are not the benchmark's (the profiler slows its window)
#   peers      bench/peers.py: the CPU job's peers on this machine's GPUs
#   trace      bench/gpu.py --trace over the 2x2 at GPU_STEPS: where its pushes and pulls spent their time,
#              phase by phase, from the run's sync and shard traces (bench/sync_latency.py). Not in the
#              default steps: name it.
#   waves      bench/gpu.py over the 2x2 at Nm 4, 8, 16 and the planner's (auto), side by side with a plain
#              loop at GPU_STEPS: each VW moves the whole model through the shards once a wave, so a
#              longer wave spreads those passes over more minibatches. Not in the default steps: name it.
#   spy        py-spy (its wheel carried like the rest) over bench/gpu.py's 2x2 at GPU_STEPS, every
#              process and thread, waits included; bench/spy_summary.py prints where each kind of
#              process spent its samples, and the raw profile is kept gzipped (OUT/spy.raw.gz).
#              Not in the default steps: name it.
# On an H100 (2026-11-27) env took 8 s, tests 40-68, transport 34, copies about 10 (its probe),
# gpu about 135 and peers 96; on an H200 (2026-11-28) env 5 s, tests 48-60, transport 31, profile
# 61, gpu at GPU_STEPS=200 154 s. All together are close to one 10-minute call, so give the steps a
# call in two parts where device time allows; a machine's start takes about a minute more.
# A sampling profile of another step: `py-spy record --subprocesses --idle --threads -f raw` around
# it (py-spy lands in KIT_SITE/bin), and gzip the output: files over 16 MiB do not come back from
# the lent machines.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
WHEELS="${KIT_WHEELS:-$ROOT/.whl}"   # where `wheels` puts them and `run` installs them from
# What a CUDA machine with PyTorch, numpy and pytest lacks: pyproject's dependencies, the test
# runner's timeout plugin, hypothesis (test_data.py, which the cuda step collects, imports it) and
# scikit-learn (data.name: digits reads the data file its wheel ships, without importing it, so
# none of its own dependencies is needed); versions from constraints.txt.
KIT="grpcio grpcio-health-checking grpcio-reflection protobuf cryptography cffi pycparser safetensors
     setproctitle psutil tqdm prometheus-client PyYAML pytest-timeout hypothesis sortedcontainers
     scikit-learn py-spy"
STEPS="env tests transport copies gpu profile peers"

die() { echo "gpu_kit: $*" >&2; exit 2; }

pin() {  # name==version from constraints.txt
    grep -iE "^$1==" "$ROOT/constraints.txt" || die "$1 has no pin in constraints.txt"
}

wheels() {
    local version=${1:-3.12}
    local pins=()
    for name in $KIT; do pins+=("$(pin "$name")") || exit 2; done
    mkdir -p "$WHEELS"
    rm -f "$WHEELS"/*.whl   # another Python's wheels would make the install there refuse them all
    # Every manylinux tag a CPython wheel of these may carry: pip matches each tag exactly.
    local platforms=()
    for tag in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux_2_12 \
               manylinux2010 manylinux_2_5 manylinux1; do
        platforms+=(--platform "${tag}_x86_64")
    done
    python3 -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
        --python-version "$version" "${platforms[@]}" -d "$WHEELS" "${pins[@]}" || die "pip download failed"
    echo "$(ls "$WHEELS"/*.whl | wc -l) wheels for CPython $version in $WHEELS ($(du -sh "$WHEELS" | cut -f1))"
}

step() {  # step NAME OUT: one step, its output into OUT/NAME.txt and on the terminal
    local name=$1 out=$2 status limit left=$((DEADLINE - SECONDS))
    local -a cmd
    case $name in
        env)       cmd=(bash -c 'nvidia-smi; env | grep -E "^(CUDA_|PYTORCH_|NCCL_)" | sort; python3 -c "import sys, torch, grpc, google.protobuf as pb, safetensors
print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available())
print(\"grpcio\", grpc.__version__, \"protobuf\", pb.__version__, \"safetensors\", safetensors.__version__)"') ;;
        tests)     mapfile -t files < <(grep -rlE --include='test_*.py' 'pytest\.mark\.cuda\b' tests | sort)
                   cmd=(python3 -m pytest -q -p no:cacheprovider -m cuda "${files[@]}") ;;
        transport) cmd=(python3 bench/transport.py --cuda) ;;
        copies)    cmd=(python3 bench/host_copies.py) ;;
        gpu)       cmd=(python3 bench/gpu.py --steps "${GPU_STEPS:-100}" --json "$out/gpu.json") ;;
        profile)   cmd=(python3 bench/gpu.py --steps 60 --runs plain h11 h22 --profile 30 5 --tables "$out/profile") ;;
        peers)     cmd=(python3 bench/peers.py --json "$out/peers.json") ;;
        trace)     cmd=(python3 bench/gpu.py --steps "${GPU_STEPS:-100}" --runs h22 --trace) ;;
        waves)     cmd=(python3 bench/gpu.py --steps "${GPU_STEPS:-100}" --runs plain h22 --nm 4 8 16 auto
                        --json "$out/waves.json") ;;
        spy)       cmd=(bash "$SELF" _spy "$out") ;;
        *)         die "no step '$name' (steps: $STEPS trace waves spy)" ;;
    esac
    if ((left < 30)); then
        echo "=== $name: skipped: $left s left of KIT_BUDGET ${KIT_BUDGET:-570}" | tee "$out/$name.txt"
        return 124
    fi
    limit=$((${STEP_TIMEOUT:-540} < left - 10 ? ${STEP_TIMEOUT:-540} : left - 10))
    echo "=== $name (up to $limit s): ${cmd[*]}"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "${cmd[@]}" 2>&1 | tee "$out/$name.txt"
    status=${PIPESTATUS[0]}
    echo "=== $name: exit $status after $((SECONDS - start)) s" | tee -a "$out/$name.txt"
    return "$status"
}

spy() {  # the spy step: py-spy over bench/gpu.py's 2x2, its summary, the raw profile gzipped
    local out=$1 spy
    spy=$(command -v py-spy || echo "${KIT_SITE:-/tmp/hetpipe-kit-site}/bin/py-spy")
    [[ -x $spy ]] || die "no py-spy: carry its wheel (bench/gpu_kit.sh wheels)"
    # py-spy exits 0 whatever its child did: the run's own status is kept apart, and returned.
    rm -f "$out/spy.status"
    # 100 a second: at 200 it fell behind over the 2x2's nine processes (docs/benchmarks.md).
    "$spy" record --subprocesses --idle --threads -r 100 -f raw -o "$out/spy.raw" -- \
        bash -c 'python3 bench/gpu.py --steps "$0" --runs h22; echo $? > "$1/spy.status"' "${GPU_STEPS:-100}" "$out" \
        || return
    python3 bench/spy_summary.py "$out/spy.raw" && gzip -f "$out/spy.raw" || return
    return "$(cat "$out/spy.status" 2> /dev/null || echo 2)"
}

run() {
    local out=${1:?usage: bench/gpu_kit.sh run OUT [STEP...]}
    shift
    DEADLINE=$((SECONDS + ${KIT_BUDGET:-570}))   # the install counts too: one call holds it all
    mkdir -p "$out"
    out=$(cd "$out" && pwd)
    if compgen -G "$WHEELS/*.whl" > /dev/null; then
        local site=${KIT_SITE:-/tmp/hetpipe-kit-site}
        python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "$WHEELS"/*.whl || die "installing $WHEELS failed"
        export PYTHONPATH="$ROOT:$site${PYTHONPATH:+:$PYTHONPATH}"
    else
        export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    fi
    export PYTHONUNBUFFERED=1
    # What an image with torch alone lacks: without it every service fails at its start, each
    # step after its own start-up, and the call is spent.
    local missing
    missing=$(python3 -c 'import setproctitle, grpc_health.v1.health, grpc_reflection.v1alpha.reflection, cryptography
import safetensors, yaml, psutil, prometheus_client, pytest_timeout' 2>&1 | tail -1) \
        || die "$missing: run \`bench/gpu_kit.sh wheels\` where PyPI is reachable and bring $WHEELS along (the device tool: carry [\".whl\"])"
    cd "$ROOT" || exit 2
    local failed=()
    for name in ${*:-$STEPS}; do
        step "$name" "$out" || failed+=("$name")
    done
    if ((${#failed[@]})); then
        echo "gpu_kit: failed: ${failed[*]} (outputs in $out)"
        return 1
    fi
    echo "gpu_kit: every step passed (outputs in $out)"
}

case ${1:-} in
    wheels) shift; wheels "$@" ;;
    run)    shift; run "$@" ;;
    _spy)   shift; spy "$@" ;;
    *)      awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2 ;;
esac
