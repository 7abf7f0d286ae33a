cd "$(dirname "$0")"
# the budget headlines again after the one-pass loss (its forward now holds a block's graph
# and the gradient maps): 8192 px under 8 GiB (levels=3 set) and 4352 px under 4 GiB
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" MEMSTUDY_CACHE=/tmp/memstudy-cache PYTHONUNBUFFERED=1
RES=$OUT/results; mkdir -p $RES
nvidia-smi > $RES/nvidia-smi.txt 2>&1
S3="amp:bf16,checkpoint,offload:which=boundaries,tile:32:levels=3:keep=conv1,allocator:expandable_segments=true"
S2="amp:bf16,checkpoint,offload:which=boundaries,tile:16:keep=all,allocator:expandable_segments=true"
common="--device cuda --set train.warmup_steps=2 --set train.measure_steps=2 --set data.val_images=2"
timeout 300 python3 -m memstudy --db $RES/budgets.sqlite run --size 8192 -t $S3 --steps 6 --budget 8GiB $common --set data.train_images=6 --label "8192 under 8GiB" 2>&1 | tee $RES/budget-8192.log
timeout 200 python3 -m memstudy --db $RES/budgets.sqlite run --size 4352 -t $S2 --steps 8 --budget 4GiB $common --set data.train_images=8 --label "4352 under 4GiB" 2>&1 | tee $RES/budget-4352.log
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$RES"
