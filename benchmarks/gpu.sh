#!/usr/bin/env bash
# Everything that needs a GPU, in one run: GPU tests, then the benchmarks named in $1
# (default: all single-GPU ones). Logs and result files go to $OUT/results (default ./gpu-out),
# packed into one archive, $OUT/results.tgz, after every step (so a run stopped from outside
# keeps the steps it finished), the folder removed at the end.
#
#   benchmarks/gpu.sh [tests] [foundation] [techniques] [techniques-loss] [maxres] [maxres-compile] [triaccel] [kernels] [bnlag] [distributed] [overhead] [compile] [compile-4160] [allocator] [allocator-4160] [lowrank] [accumulate] [tune-triaccel] [triaccel-tuned] [native] [daso] [tile] [tile-4188] [tile-sweeps] [ladder] [tile-native] [tile-targets] [tile-stream] [tile-stream-ahead] [tile-stream-layer1] [tile-stream-2gib] [tile-auto-calibrate] [tile-auto] [tile-auto-2gib] [tile-auto-sizes] [tile-auto-large] [networks] [tile-selective] [tile-selective-strips] [tile-partial] [tile-strips-4gib] [tile-hold-4gib] [tile-hold-pairs] [host-profile] [host-steps] [stream-timeline] [link] [context] [validation-passes] [norm-kernels] [tile-norm] [tile-norm-8192] [compress] [compress-breakdown] [compress-4160] [compress-kernels] [compress-offload] [compress-quality] [loss] [paper] [paper-2gpu] [paper-2gpu-timing]
#
# A step may take a time limit in seconds ("maxres:240"); results are packed even when one runs out.
# TESTS_K narrows the GPU tests (pytest -k), BNLAG_ARGS / DIST_ARGS / MAXRES_ARGS / MAXRESCOMPILE_ARGS / TRIACCEL_ARGS / ACCUMULATE_ARGS /
# OVERHEAD_ARGS / COMPILE_ARGS / COMPILE4160_ARGS / ALLOCATOR_ARGS / ALLOCATOR4160_ARGS / LOWRANK_ARGS / TILE_ARGS / TILE4188_ARGS / TILESWEEPS_ARGS / LADDER_ARGS / TILENATIVE_ARGS / COMPRESS_ARGS / COMPRESSBREAKDOWN_ARGS / COMPRESS4160_ARGS / COMPRESSOFFLOAD_ARGS / COMPRESSQUALITY_ARGS / LOSS_ARGS / HOSTPROFILE_ARGS / HOST_STEPS_ARGS / LINK_ARGS / NETWORKS_ARGS / VALPASSES_ARGS / CONTEXT_ARGS / PAPER_ARGS / PAPER2_ARGS (e.g. "--sizes 2048")
# replace a benchmark's arguments.
#
# RESUME=folder   resume earlier results: its *.sqlite are copied into the results folder and
#                 its subfolders' *.sqlite into the results subfolder of the same name
#                 (e.g. RESUME/compile/compile.sqlite for the compile steps), so the cells they
#                 hold are skipped.
# WHEELS=folder   offline install (default .whl when present): where the project's
#                 dependencies do not import, the wheels in this folder are installed without
#                 an index, into $WHEELS_SITE (default $TMPDIR/memstudy-wheels), put first on
#                 PYTHONPATH, so the Python environment itself is left as it is. WHEELS/tune
#                 holds Propulate and MPI for `memstudy tune` (benchmarks/tune_env.sh). How to
#                 fill them: benchmarks/BENCHMARKS.md, "Reproduce".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
RES="$OUT/results"
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 MEMSTUDY_CACHE="${MEMSTUDY_CACHE:-/tmp/memstudy-cache}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -z "${WHEELS:-}" ] || [ -d "$WHEELS" ] || { echo "WHEELS=$WHEELS is not a folder"; exit 1; }
export WHEELS="${WHEELS:-.whl}"
if [ -d "$WHEELS" ] && ! python3 -c "import segmentation_models_pytorch, pytorch_msssim, momentumnet, xdist" 2>/dev/null; then
    WHEELS_SITE="${WHEELS_SITE:-${TMPDIR:-/tmp}/memstudy-wheels}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WHEELS_SITE" "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="$WHEELS_SITE:$PYTHONPATH"
fi
PY=python3
nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
$PY -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count(), torch.cuda.get_device_name(0))" | tee "$RES/env.txt"

if [ -n "${RESUME:-}" ]; then  # earlier databases: their recorded cells are skipped
    [ -d "$RESUME" ] || { echo "RESUME=$RESUME is not a folder"; exit 1; }
    cp "$RESUME"/*.sqlite "$RES/" 2>/dev/null
    for dir in "$RESUME"/*/; do
        [ -d "$dir" ] || continue  # no subfolder: the pattern itself
        name=$(basename "$dir")
        mkdir -p "$RES/$name" && cp "$dir"*.sqlite "$RES/$name/" 2>/dev/null
    done
fi
STEPS="${*:-tests foundation techniques techniques-loss maxres triaccel kernels}"
DB="$RES/gpu.sqlite"
for item in $STEPS; do
    step="${item%%:*}"           # "maxres:240" runs maxres for at most 240 s
    limit="${item#*:}"; [ "$limit" = "$item" ] && limit=3600
    echo "=== $step $(date +%T) (limit ${limit}s)"
    PY="timeout --signal=INT --kill-after=20 $limit python3"
    case "$step" in
        # side by side on the GPU, then the `alone` and two-GPU tests one at a time (dev/gpu-tests)
        tests) MEMSTUDY_GPU_MARKS="(gpu or multigpu) and not large" PYTHON="$PY" dev/gpu-tests --durations=60 ${TESTS_K:+-k "$TESTS_K"} -p no:cacheprovider 2>&1 | tee "$RES/gpu-tests.log" ;;
        foundation) $PY benchmarks/bench_foundation.py --db "$DB" --md "$RES/foundation.md" 2>&1 | tee "$RES/foundation.log" ;;
        techniques) $PY benchmarks/bench_techniques.py --skip loss --db "$RES/techniques.sqlite" --loss-db "$RES/techniques-loss.sqlite" --md "$RES/techniques.md" 2>&1 | tee "$RES/techniques.log" ;;
        techniques-loss) $PY benchmarks/bench_techniques.py --skip memory --db "$RES/techniques.sqlite" --loss-db "$RES/techniques-loss.sqlite" --md "$RES/techniques-loss.md" 2>&1 | tee "$RES/techniques-loss.log" ;;
        maxres) $PY benchmarks/bench_maxres.py --out "$RES/maxres" ${MAXRES_ARGS:-} 2>&1 | tee "$RES/maxres.log" ;;
        # maxres under 8 GiB with the best compile set only (each probe compiles its size;
        # fit sizes where activations dominate: at 256-512 px the prediction was noise, docs/report.md)
        maxres-compile) $PY -m memstudy --db "$RES/maxres-compile.sqlite" maxres --device cuda --budget 8GiB --step 256 --max-size 8192 ${MAXRESCOMPILE_ARGS:---sets amp:bf16,compile:memory_budget=0.5,allocator:expandable_segments=true --fit-sizes 2048,3072} 2>&1 | tee "$RES/maxres-compile.log" ;;
        accumulate) $PY benchmarks/bench_accumulate.py --out "$RES/accumulate" ${ACCUMULATE_ARGS:-} 2>&1 | tee "$RES/accumulate.log" ;;
        # Propulate + MPI, installed or from $WHEELS/tune (benchmarks/tune_env.sh); the ranking is written even when the limit cuts the search
        tune-triaccel) . benchmarks/tune_env.sh; $PY -m memstudy --db "$RES/tune-triaccel.sqlite" tune benchmarks/specs/tune-triaccel.toml 2>&1 | tee "$RES/tune-triaccel.log"
            python3 -m memstudy --db "$RES/tune-triaccel.sqlite" tune benchmarks/specs/tune-triaccel.toml --best 10 2>&1 | tee "$RES/tune-triaccel.md" ;;
        triaccel) $PY benchmarks/bench_triaccel.py --out "$RES/triaccel" ${TRIACCEL_ARGS:-} 2>&1 | tee "$RES/triaccel.log" ;;
        # the ablation again with the best trial of tune-triaccel (run that step first, in the same run or resumed with RESUME)
        triaccel-tuned) $PY benchmarks/bench_triaccel.py --out "$RES/triaccel-tuned" --parts ablation --tuned "$RES/tune-triaccel.sqlite" ${TRIACCELTUNED_ARGS:-} 2>&1 | tee "$RES/triaccel-tuned.log" ;;
        kernels) $PY benchmarks/bench_kernels.py --out "$RES/kernels" 2>&1 | tee "$RES/kernels.log" ;;
        bnlag) $PY benchmarks/bench_bn_lag.py --out "$RES/bnlag" ${BNLAG_ARGS:---size 2048 --steps 24 --precisions fp32,fp16} 2>&1 | tee "$RES/bnlag.log" ;;
        distributed) $PY benchmarks/bench_distributed.py --out "$RES/distributed" ${DIST_ARGS:-} 2>&1 | tee "$RES/distributed.log" ;;
        overhead) $PY benchmarks/bench_overhead.py --out "$RES/overhead" ${OVERHEAD_ARGS:-} 2>&1 | tee "$RES/overhead.log" ;;
        compile) $PY benchmarks/bench_compile.py --out "$RES/compile" --part compile ${COMPILE_ARGS:---sizes 2048} 2>&1 | tee -a "$RES/compile.log" ;;
        compile-4160) $PY benchmarks/bench_compile.py --out "$RES/compile" --part compile ${COMPILE4160_ARGS:---sizes 4160} 2>&1 | tee -a "$RES/compile.log" ;;
        allocator) $PY benchmarks/bench_compile.py --out "$RES/compile" --part allocator ${ALLOCATOR_ARGS:---sizes 2048} 2>&1 | tee -a "$RES/allocator.log" ;;
        allocator-4160) $PY benchmarks/bench_compile.py --out "$RES/compile" --part allocator ${ALLOCATOR4160_ARGS:---sizes 4160} 2>&1 | tee -a "$RES/allocator.log" ;;
        native) $PY benchmarks/bench_native.py --out "$RES/native" 2>&1 | tee "$RES/native.log" ;;
        lowrank) $PY benchmarks/bench_lowrank.py --out "$RES/lowrank" ${LOWRANK_ARGS:-} 2>&1 | tee "$RES/lowrank.log" ;;
        daso) $PY benchmarks/bench_daso_ab.py --out "$RES/daso" ${DASO_ARGS:-} 2>&1 | tee "$RES/daso.log" ;;  # needs 2 GPUs
        # tile / ladder databases sit in the results folder itself, so RESUME's *.sqlite resumes them
        tile) $PY benchmarks/bench_tile.py --out "$RES" ${TILE_ARGS:---sizes 2048 --tiles 4,8} 2>&1 | tee -a "$RES/tile.log" ;;
        tile-4188) $PY benchmarks/bench_tile.py --out "$RES" ${TILE4188_ARGS:---sizes 4188 --tiles 8,16} 2>&1 | tee -a "$RES/tile.log" ;;
        ladder) $PY benchmarks/bench_ladder.py --part ladder --out "$RES" ${LADDER_ARGS:---budgets 4GiB --step 256} 2>&1 | tee -a "$RES/ladder.log" ;;
        tile-sweeps) $PY benchmarks/bench_tile_sweeps.py --out "$RES" ${TILESWEEPS_ARGS:---size 4188 --tiles 8,16 --profile} 2>&1 | tee -a "$RES/tile-sweeps.log" ;;
        tile-native) $PY benchmarks/bench_ladder.py --part native --out "$RES" ${TILENATIVE_ARGS:-} 2>&1 | tee -a "$RES/ladder.log" ;;
        # both step-time targets in one step: the 4 GiB set at 4188 px beside the tuned step, and the
        # 8 GiB set at 8192 px, each run twice (their step times spread between runs: BENCHMARKS.md),
        # with the kernel attribution of each profiled step (docs/metrics.md, "Step profile") and, at
        # 4188 px, where the allocator released its cache to make room (MEMSTUDY_ALLOC_TRACE)
        tile-targets) mkdir -p "$RES/targets-4188" "$RES/targets-8192"
            four=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.NATIVE_SET)")
            eight=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.BEST_LEVELS3)")
            MEMSTUDY_PROFILE_TABLE="$RES/targets-4188/kernels.txt" MEMSTUDY_ALLOC_TRACE="$RES/targets-4188/releases.md" $PY benchmarks/bench_ladder.py --part native --out "$RES/targets-4188" --size 4188 --budget 4GiB --steps 8 --no-float32 --tiled-set "$four;$four" 2>&1 | tee -a "$RES/targets.log"
            MEMSTUDY_PROFILE_TABLE="$RES/targets-8192/kernels.txt" $PY benchmarks/bench_ladder.py --part native --out "$RES/targets-8192" --size 8192 --budget 8GiB --steps 6 --no-float32 --no-references --tiled-set "$eight;$eight" 2>&1 | tee -a "$RES/targets.log" ;;
        # tile:stream (docs/techniques/tile.md): its GPU tests, then STREAM_SET under 8 GiB at
        # 8192 px and STREAM_SIZES (default 12288 16384), each a few steps, no untiled reference
        tile-stream) $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_tile_stream_gpu.py 2>&1 | tee "$RES/tile-stream-tests.log"
            stream=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.STREAM_SET)")
            for size in 8192 ${STREAM_SIZES:-12288 16384}; do
                $PY benchmarks/bench_ladder.py --part native --out "$RES/stream-$size" --size "$size" --budget 8GiB --steps 4 --no-float32 --no-references --tiled-set "$stream" 2>&1 | tee -a "$RES/tile-stream.log"
            done ;;
        # the streamed copies on the compute stream (STREAM_SET with tile:ahead=false) against a
        # tile ahead on side streams (STREAM_SET, tile:ahead's default), alternating twice in one
        # run under 8 GiB at AHEAD_SIZE (default 8192); the run takes about 5 minutes (give
        # the step 360 s or more), then the streaming GPU tests
        tile-stream-ahead) size=${AHEAD_SIZE:-8192}
            stream=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.STREAM_SET)")
            plain=${stream/stream=true/stream=true:ahead=false}
            $PY benchmarks/bench_ladder.py --part native --out "$RES/stream-ahead-$size" --size "$size" --budget 8GiB --steps 6 --no-float32 --no-references --tiled-set "$plain;$stream;$plain;$stream" 2>&1 | tee -a "$RES/tile-stream-ahead.log"
            $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_streaming.py tests/test_tile_stream_gpu.py -k "not 16384" 2>&1 | tee "$RES/stream-ahead-tests.log" ;;
        # how the streamed levels' residual stages are cut (tile:layer1): STREAM_SET with each of
        # LAYER1_CUTS (default "convs blocks whole"; STREAM_SET's own is convs) in turn in one run
        # under 8 GiB at LAYER1_SIZE (default 8192), its 16 strips or LAYER1_ROWS-row ones (e.g.
        # 752, tile:auto's at 16384 px); LAYER1_PROFILE=1 attributes each profiled step's kernels
        # and copies (kernels.txt; about 100 s more a run at 8192 px)
        tile-stream-layer1) size=${LAYER1_SIZE:-8192}; mkdir -p "$RES/stream-layer1-$size"
            stream=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.STREAM_SET)")
            [ -n "${LAYER1_ROWS:-}" ] && stream=${stream/tile:16:/tile:rows=$LAYER1_ROWS:}
            sets=""; for cut in ${LAYER1_CUTS:-convs blocks whole}; do sets="$sets${sets:+;}${stream/layer1=convs/layer1=$cut}"; done
            [ "${LAYER1_PROFILE:-0}" = 1 ] && export MEMSTUDY_PROFILE_TABLE="$RES/stream-layer1-$size/kernels.txt"
            $PY benchmarks/bench_ladder.py --part native --out "$RES/stream-layer1-$size" --size "$size" --budget 8GiB --steps 4 --no-float32 --no-references --tiled-set "$sets" 2>&1 | tee -a "$RES/tile-stream-layer1.log"
            unset MEMSTUDY_PROFILE_TABLE ;;
        # 4188 px under 2 GiB with the streaming set, tile:16 and tile:32 (bench_ladder.STREAM_2GIB_SETS)
        tile-stream-2gib) sets=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.STREAM_2GIB_SETS)")
            MEMSTUDY_ALLOC_TRACE="$RES/stream-4188-2gib/releases.md" $PY benchmarks/bench_ladder.py --part native --out "$RES/stream-4188-2gib" --size 4188 --budget 2GiB --steps 6 --no-float32 --no-references --tiled-set "$sets" 2>&1 | tee -a "$RES/tile-stream.log" ;;
        # tile:auto's calibration points (bench_ladder.calibration_sets), unconstrained, of the
        # plans AUTO_CALIBRATION_PLANS names (default: all of bench_ladder.AUTO_PLANS)
        tile-auto-calibrate) sets=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.calibration_sets(*[p.split() for p in ['${AUTO_CALIBRATION_PLANS:-}'] if p]))") || continue
            for size in ${CALIBRATION_SIZES:-2048 4096}; do
                $PY benchmarks/bench_ladder.py --part native --out "$RES/auto-calibration-$size" --size "$size" --budget 100GiB --steps 4 --no-float32 --no-references --tiled-set "$sets" 2>&1 | tee -a "$RES/tile-auto-calibrate.log"
            done ;;
        # tile:auto (bench_ladder.AUTO_SET): the stream GPU tests but the 16384 px one, then 4188 px
        # under 4 GiB beside the tuned step, 4188 px under 2 GiB (with offload_optim), and
        # AUTO_SIZES under 8 GiB; tile-auto-2gib: only the 2 GiB row; tile-auto-large: the
        # 16384 px GPU test, AUTO_LARGE_SIZES
        tile-auto|tile-auto-2gib) set=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.AUTO_SET)")
            if [ "$step" = tile-auto ]; then
                $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_tile_stream_gpu.py -k "not 16384" 2>&1 | tee "$RES/tile-stream-tests.log"
                $PY benchmarks/bench_ladder.py --part native --out "$RES/auto-4188-4gib" --size 4188 --budget 4GiB --steps 6 --no-float32 --tiled-set "$set" 2>&1 | tee -a "$RES/tile-auto.log"
            fi
            $PY benchmarks/bench_ladder.py --part native --out "$RES/auto-4188-2gib" --size 4188 --budget 2GiB --steps 4 --no-float32 --no-references --tiled-set "$set,offload_optim" 2>&1 | tee -a "$RES/tile-auto.log"
            [ "$step" = tile-auto ] && for size in ${AUTO_SIZES:-4188 8192}; do
                $PY benchmarks/bench_ladder.py --part native --out "$RES/auto-$size" --size "$size" --budget 8GiB --steps 4 --no-float32 --no-references --tiled-set "$set" 2>&1 | tee -a "$RES/tile-auto.log"
            done ;;
        # only AUTO_SIZES (default 8192) under 8 GiB, no tests, no 4188 px rows; AUTO_SET_NAME
        # (a bench_ladder name, default AUTO_SET; e.g. AUTO_HOLD_SET) picks the set, and names
        # the folders after it when it is another
        tile-auto-sizes) name=${AUTO_SET_NAME:-AUTO_SET}
            set=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.$name)") || exit 1
            suffix=""; [ "$name" = AUTO_SET ] || suffix="-$(echo "$name" | tr 'A-Z_' 'a-z-')"
            for size in ${AUTO_SIZES:-8192}; do
                $PY benchmarks/bench_ladder.py --part native --out "$RES/auto-$size$suffix" --size "$size" --budget 8GiB --steps 4 --no-float32 --no-references --tiled-set "$set" 2>&1 | tee -a "$RES/tile-auto$suffix.log"
            done ;;
        tile-auto-large) $PY -m pytest -q -rP -m large -p no:cacheprovider tests/test_tile_stream_gpu.py 2>&1 | tee "$RES/tile-auto-16384-test.log"
            set=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.AUTO_SET)")
            for size in ${AUTO_LARGE_SIZES:-12288 16384}; do
                $PY benchmarks/bench_ladder.py --part native --out "$RES/auto-$size" --size "$size" --budget 8GiB --steps 4 --no-float32 --no-references --tiled-set "$set" 2>&1 | tee -a "$RES/tile-auto.log"
            done ;;
        # other networks and the segmentation task (docs/network.md): native 4188 px per network,
        # task and budget with the best tiled set(s) ('+'-joined names in bench_ladder), beside
        # that network's own tuned bf16 step
        # the 4 GiB target with no convolution recomputed (bench_ladder.SELECTIVE_SET) against
        # tile:auto, alternating, beside the tuned step, each step's kernels attributed
        tile-selective) mkdir -p "$RES/selective-4188"
            sel=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.SELECTIVE_SET)")
            auto=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.AUTO_SET)")
            MEMSTUDY_PROFILE_TABLE="$RES/selective-4188/kernels.txt" $PY benchmarks/bench_ladder.py --part native --out "$RES/selective-4188" --size 4188 --budget 4GiB --steps 8 --no-float32 --tuned-only --tiled-set "$sel;$auto;$sel;$auto" 2>&1 | tee -a "$RES/tile-selective.log" ;;
        # no convolution recomputed with narrower strips than the 4 strips that ran out of memory
        # in the first forward (6 and 8), each against tile:auto with hold=1, alternating
        tile-selective-strips) mkdir -p "$RES/selective-strips-4188"
            sel=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.SELECTIVE_SET)")
            hold=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.AUTO_HOLD_SET)")
            $PY benchmarks/bench_ladder.py --part native --out "$RES/selective-strips-4188" --size 4188 --budget 4GiB --steps 8 --no-float32 --tuned-only --tiled-set "${sel/tile:4:/tile:6:};$hold;${sel/tile:4:/tile:8:};$hold" 2>&1 | tee -a "$RES/tile-selective-strips.log" ;;
        # recomputing fewer untiled blocks (bench_ladder.PARTIAL_SET) against tile:auto, alternating
        tile-partial) mkdir -p "$RES/partial-4188"
            part=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.PARTIAL_SET)")
            auto=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.AUTO_SET)")
            $PY benchmarks/bench_ladder.py --part native --out "$RES/partial-4188" --size 4188 --budget 4GiB --steps 8 --no-float32 --tuned-only --tiled-set "$part;$auto;$part;$auto" 2>&1 | tee -a "$RES/tile-partial.log" ;;
        # tile:auto's strips at 4188 px under 4 GiB against more, shorter ones (fewer allocator
        # retries near the cap?), alternating, beside the tuned step
        tile-strips-4gib) mkdir -p "$RES/strips-4188-4gib"
            auto=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.AUTO_SET)")
            sets=""; for k in 6 8; do sets="$sets;${auto/tile:auto/tile:$k:keep=all}"; done
            $PY benchmarks/bench_ladder.py --part native --out "$RES/strips-4188-4gib" --size 4188 --budget 4GiB --steps 8 --no-float32 --tuned-only --tiled-set "$auto$sets;$auto$sets" 2>&1 | tee -a "$RES/tile-strips-4gib.log" ;;
        # tile:auto against the fixed 4 GiB set, which holds the top region's input on the device
        # (offload:hold=1: no round trip over PCIe for the tensor backward needs first), with 4
        # and with 3 strips, alternating (the first two twice), beside the tuned step, each step's kernels
        # attributed; about 5 minutes on an H200 (230 s ended it before the tuned step)
        tile-hold-4gib) mkdir -p "$RES/hold-4188-4gib"
            auto=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.AUTO_SET)")
            native=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.NATIVE_SET)")
            sets="$auto;$native;${native/tile:4:/tile:3:};$auto;$native"
            MEMSTUDY_PROFILE_TABLE="$RES/hold-4188-4gib/kernels.txt" $PY benchmarks/bench_ladder.py --part native --out "$RES/hold-4188-4gib" --size 4188 --budget 4GiB --steps 8 --no-float32 --tuned-only --tiled-set "$sets" 2>&1 | tee -a "$RES/tile-hold-4gib.log" ;;
        # the 4 GiB target's ratio at 4188 px: PAIRS (default 3) pairs, each the set
        # (HOLD_PAIR_SET, default bench_ladder.AUTO_HOLD_SET) then the tuned step, one file each;
        # the median of the pairs' ratios is the figure (about 70 s a pair on an H200); each
        # run's step is the median of its plain steps: PAIR_STEPS (default 14) - 4 of them
        tile-hold-pairs) name=${HOLD_PAIR_SET:-AUTO_HOLD_SET}
            set=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.$name)") || exit 1
            for pair in $(seq 1 "${PAIRS:-3}"); do
                $PY benchmarks/bench_ladder.py --part native --out "$RES/hold-pairs-4188/pair-$pair" --size 4188 --budget 4GiB --steps ${PAIR_STEPS:-14} --no-float32 --tuned-only --tiled-set "$set" 2>&1 | tee -a "$RES/tile-hold-pairs.log"
            done ;;
        # which Python launches the 4 GiB step's kernels: cProfile around its timed steps
        # (benchmarks/bench_host_profile.py; HOST_PROFILE_SET, default bench_ladder.AUTO_HOLD_SET)
        host-profile) name=${HOST_PROFILE_SET:-AUTO_HOLD_SET}
            set=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.$name)") || exit 1
            $PY benchmarks/bench_host_profile.py --out "$RES/host-profile-4188-4gib" --size 4188 --budget 4GiB -t "$set" --steps 8 --skip 3 ${HOSTPROFILE_ARGS:-} 2>&1 | tee "$RES/host-profile.log" ;;
        # the same set's steps one by one without a profiler, with the garbage collector's
        # pauses (HOST_STEPS_ARGS: e.g. --gc-freeze), then again with each step's GPU timeline
        # (busy, copies alone, idle: whether a slow step's GPU worked longer or waited);
        # about 50 s each on an H200
        host-steps) name=${HOST_PROFILE_SET:-AUTO_HOLD_SET}
            set=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.$name)") || exit 1
            for timeline in "" --gpu-timeline; do
                $PY benchmarks/bench_host_profile.py --out "$RES/host-steps-4188-4gib${timeline:+-timeline}" --size 4188 --budget 4GiB -t "$set" --steps 14 --skip 3 --no-profile $timeline ${HOST_STEPS_ARGS:-} 2>&1 | tee -a "$RES/host-steps.log"
            done ;;
        # tile:auto under 8 GiB at TIMELINE_SIZE (default 16384) px, two steps timed on their own
        # with the GPU's timeline, no validation: kernels, copies each way, idle (link-bound?);
        # TIMELINE_ARGS replaces "--no-profile --gpu-timeline" (e.g. "--gpu-timeline": Python's
        # profiler too), TIMELINE_SUFFIX is appended to the folder's name, TIMELINE_TECHNIQUES
        # replaces the set (default bench_ladder.AUTO_SET), TIMELINE_BUDGET the budget
        stream-timeline) size=${TIMELINE_SIZE:-16384}; budget=${TIMELINE_BUDGET:-8GiB}
            set=${TIMELINE_TECHNIQUES:-$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.AUTO_SET)")} || exit 1
            $PY benchmarks/bench_host_profile.py --out "$RES/timeline-$size-$(echo "$budget" | tr 'A-Z' 'a-z')${TIMELINE_SUFFIX:-}" --size "$size" --budget "$budget" -t "$set" --steps 5 --skip 3 --set train.validate=false ${TIMELINE_ARGS:---no-profile --gpu-timeline} 2>&1 | tee -a "$RES/stream-timeline.log" ;;
        # the host-device link: pinned copies each way alone and both at once
        link) $PY benchmarks/bench_link.py --out "$RES/link" ${LINK_ARGS:-} 2>&1 | tee "$RES/link.log" ;;
        # what the CUDA context holds after each first use, and under which settings it shrinks
        context) $PY benchmarks/bench_context.py --out "$RES/context" ${CONTEXT_ARGS:-} 2>&1 | tee "$RES/context.log" ;;
        # the tiled validation forward three times per process: what its first pass pays once
        validation-passes) $PY benchmarks/bench_validation_passes.py --out "$RES/validation-passes" ${VALPASSES_ARGS:---sizes 16384,8192} 2>&1 | tee "$RES/validation-passes.log" ;;
        networks) for entry in ${NETWORKS:-resnet50,segment,8GiB,BEST_LEVELS3 resnet18,enhance,4GiB,NATIVE_SET resnet34,segment,4GiB,NATIVE_SET resnet50,enhance,8GiB,BEST_LEVELS3}; do
                IFS=, read -r net task budget set <<< "$entry"
                tiled=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(';'.join(getattr(b, n) for n in '$set'.split('+')))")
                $PY benchmarks/bench_ladder.py --part native --out "$RES/networks/$net-$task-$budget" --size ${NETWORKS_SIZE:-4188} --budget "$budget" --steps 8 --no-float32 --network "model.encoder=$net;train.task=$task" --tiled-set "$tiled" ${NETWORKS_ARGS:-} 2>&1 | tee -a "$RES/networks.log"
            done ;;
        # the tiled BatchNorm's kernels: Triton against PyTorch's primitives, per strip
        # (bench_norm_kernels) and in both targets' steps, tile:norm=torch and the default (triton)
        # alternating at 4188 px beside the tuned step (tile-norm), once each at 8192 px (tile-norm-8192)
        norm-kernels) $PY benchmarks/bench_norm_kernels.py --out "$RES/norm-kernels" 2>&1 | tee "$RES/norm-kernels.log" ;;
        tile-norm) mkdir -p "$RES/norm-4188"
            four=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.NATIVE_SET)")
            MEMSTUDY_PROFILE_TABLE="$RES/norm-4188/kernels.txt" $PY benchmarks/bench_ladder.py --part native --out "$RES/norm-4188" --size 4188 --budget 4GiB --steps 8 --no-float32 --tiled-set "${four/keep=all/keep=all:norm=torch};$four;${four/keep=all/keep=all:norm=torch};$four" 2>&1 | tee -a "$RES/tile-norm.log" ;;
        tile-norm-8192) mkdir -p "$RES/norm-8192"
            eight=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ladder as b; print(b.BEST_LEVELS3)")
            MEMSTUDY_PROFILE_TABLE="$RES/norm-8192/kernels.txt" $PY benchmarks/bench_ladder.py --part native --out "$RES/norm-8192" --size 8192 --budget 8GiB --steps 6 --no-float32 --no-references --tiled-set "${eight/layer1=convs/layer1=convs:norm=torch};$eight" 2>&1 | tee -a "$RES/tile-norm.log" ;;
        compress) $PY benchmarks/bench_compress.py --part memory --out "$RES/compress" ${COMPRESS_ARGS:---sizes 2048 --bases original,amp:bf16+checkpoint} 2>&1 | tee -a "$RES/compress.log" ;;
        compress-breakdown) $PY benchmarks/bench_compress.py --part breakdown --out "$RES/compress" ${COMPRESSBREAKDOWN_ARGS:---sizes 2048} 2>&1 | tee -a "$RES/compress.log" ;;
        compress-4160) $PY benchmarks/bench_compress.py --part memory --out "$RES/compress" ${COMPRESS4160_ARGS:---sizes 4160 --bases amp:bf16+checkpoint,amp:bf16+tile} 2>&1 | tee -a "$RES/compress.log" ;;
        compress-kernels) $PY benchmarks/bench_compress.py --part kernels --out "$RES/compress" 2>&1 | tee -a "$RES/compress.log" ;;
        compress-offload) $PY benchmarks/bench_compress.py --part offload --out "$RES/compress" ${COMPRESSOFFLOAD_ARGS:---sizes 4160} 2>&1 | tee -a "$RES/compress.log" ;;
        # the MS-SSIM loss: pytorch-msssim vs the chunked default, alone and in memstudy's step
        loss) $PY benchmarks/bench_loss.py --out "$RES/loss" ${LOSS_ARGS:-} 2>&1 | tee "$RES/loss.log" ;;
        # the study's protocol (docs/paper.md), resuming a copy of PAPER_DB (default: the H100
        # database; on another GPU name its own); PAPER_ARGS e.g. "--cells-per-gpu 4" for seeds
        # whose answer is loss and memory. An interrupted grid keeps every recorded cell.
        paper) mkdir -p "$RES/paper"
            cp "${PAPER_DB:-benchmarks/results/h100/paper/paper-protocol-512px.sqlite}" "$RES/paper/paper-protocol-512px.sqlite" || continue
            $PY -m memstudy --db "$RES/paper/paper-protocol-512px.sqlite" grid benchmarks/specs/paper-protocol.toml ${PAPER_ARGS:-} 2>&1 | tee "$RES/paper/grid.log"
            python3 benchmarks/bench_paper.py "$RES/paper/paper-protocol-512px.sqlite" --format md --figure "$RES/paper/figure2.png" > "$RES/paper/tables.md" 2>&1 ;;
        # Tables 3-6 (two GPUs, docs/paper.md): both two-GPU specs resumed on a copy of PAPER2_DB
        # (default: start empty); on a host of 4 GPUs two lanes, GPUs 0,1 and 2,3, one cell each
        # at a time (the grid's claims keep them apart). No cell starts in the last
        # PAPER2_CELL_S seconds (default 280, a 50-epoch cell) of the step's limit, so the limit
        # kills none. PAPER2_ARGS e.g. "--seeds 0". paper-2gpu-timing: the short timing specs,
        # one cell at a time (Tables 4 and 6 take epoch times only from runs with no neighbour).
        paper-2gpu|paper-2gpu-timing) mkdir -p "$RES/paper-2gpu"; db="$RES/paper-2gpu/paper-protocol-2gpu.sqlite"
            [ -n "${PAPER2_DB:-}" ] && [ ! -f "$db" ] && { cp "$PAPER2_DB" "$db" || continue; }
            start=$SECONDS
            lane() {  # GPUS SPEC...: the specs in turn on one GPU pair, within the step's limit
                local gpus=$1 spec left; shift
                for spec in "$@"; do
                    left=$((limit - (SECONDS - start)))
                    [ "$left" -gt "${PAPER2_CELL_S:-280}" ] || break
                    timeout --signal=INT --kill-after=20 "$left" python3 -m memstudy --db "$db" grid "benchmarks/specs/$spec.toml" --gpus "$gpus" --start-within $((left - ${PAPER2_CELL_S:-280})) ${PAPER2_ARGS:-} 2>&1 | sed "s/^/[$gpus] /" | tee -a "$RES/paper-2gpu/grid.log"
                done
            }
            if [ "$step" = paper-2gpu-timing ]; then
                lane 0,1 paper-protocol-2gpu-timing paper-protocol-2gpu-mp-timing
            elif [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then
                lane 0,1 paper-protocol-2gpu paper-protocol-2gpu-mp & lane 2,3 paper-protocol-2gpu-mp paper-protocol-2gpu & wait
            else
                lane 0,1 paper-protocol-2gpu paper-protocol-2gpu-mp
            fi
            python3 benchmarks/bench_paper.py "$db" --format md --original benchmarks/results/h100/paper/paper-protocol-512px.sqlite > "$RES/paper-2gpu/tables.md" 2>&1 ;;
        compress-quality) $PY benchmarks/bench_compress.py --part quality --out "$RES/compress" ${COMPRESSQUALITY_ARGS:-} 2>&1 | tee -a "$RES/compress.log" ;;
        *) echo "unknown step $step" ;;
    esac
    tar czf "$OUT/results.tgz.part" -C "$OUT" results && mv "$OUT/results.tgz.part" "$OUT/results.tgz"
done
[ -f "$OUT/results.tgz" ] && rm -rf "$RES"
echo "=== done $(date +%T)"
