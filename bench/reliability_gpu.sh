#!/usr/bin/env bash
# The GPU reliability run: the fuzzer (>= 10,000 cases) against ddtree serve on cuda:0, the
# 60 s load (16 clients, inline and CUDA IPC), then a real sticky CUDA error (last: it poisons
# the CUDA context of a server process of its own). Logs and JSON go to $OUT (default
# ./reliability-out). Needs the project installed (pip install -e .) with pytest, hypothesis,
# grpcio-health-checking, grpcio-reflection and googleapis-common-protos, and one GPU.
#
#   OUT=/tmp/out bash bench/reliability_gpu.sh               # fuzz, load, sticky
#   OUT=/tmp/out bash bench/reliability_gpu.sh fuzz sticky   # some of them
set -u
OUT=${OUT:-reliability-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DDTREE_REQUIRE_GPU=1
export DDTREE_CACHE_DIR=${DDTREE_CACHE_DIR:-/tmp/ddtree-kernels}
steps=${*:-fuzz load sticky}
log="$OUT/reliability.log"
echo "# $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)," \
    "$(python3 -c 'import torch, grpc, hypothesis; print(f"torch {torch.__version__}, grpcio {grpc.__version__}, hypothesis {hypothesis.__version__}")')," \
    "$(nproc) CPUs, $(date -u +%FT%TZ), commit ${DDTREE_COMMIT:-unknown}" | tee -a "$log"
for step in $steps; do
    start=$SECONDS
    case $step in
    fuzz)
        {
            echo "## fuzz: python3 -m pytest tests/reliability/test_fuzz_gpu.py"
            DDTREE_FUZZ_PROGRESS=1 DDTREE_FUZZ_REPORT="$OUT/fuzz.json" timeout 240 \
                python3 -m pytest -v -s -p no:cacheprovider --durations=12 \
                tests/reliability/test_fuzz_gpu.py
            echo "## fuzz exit $? after $((SECONDS - start)) s"
            [ -f "$OUT/fuzz.json" ] && python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print('cases', r['total'], r['cases']); print('numeric_mismatches', len(r['numeric_mismatches']), r['numeric_mismatches'][:10]); [print(f'  {v:6d}  {k}') for k, v in r['outcomes'].items()]" "$OUT/fuzz.json"
        } 2>&1 | tee -a "$log"
        ;;
    load)
        {
            echo "## load: python3 bench/load.py --clients 16 --duration-s 60 --device cuda:0"
            timeout 120 python3 bench/load.py --clients 16 --duration-s 60 --warm-up-s 10 \
                --device cuda:0 --out "$OUT/load.json"
            echo "## load exit $? after $((SECONDS - start)) s"
        } 2>&1 | tee -a "$OUT/load.log"
        ;;
    sticky)
        {
            echo "## sticky: python3 -m pytest tests/reliability/test_sticky.py"
            timeout 150 python3 -m pytest -v -s -p no:cacheprovider tests/reliability/test_sticky.py
            echo "## sticky exit $? after $((SECONDS - start)) s"
        } 2>&1 | tee -a "$log"
        ;;
    *) echo "unknown step $step (fuzz, load, sticky)" >&2 ;;
    esac
done
