#!/bin/sh
# Prepare .devcarry/ (ignored by git) for bench/gpu_check.py on a device machine that has no network.
# Run here, on a machine with network, from anywhere:  sh bench/gpu_carry.sh
#
# It holds: the gguf wheel (the device image lacks gguf), llama.cpp's reference outputs (they live in
# ../shared, which does not travel), and the default model cut in two (94 MiB: one call carries at most
# 64 MiB). Two calls then bring it over (the machine must still be warm for the second, i.e. call it
# within ~30 s of the first returning):
#   1. carry .devcarry/wheels .devcarry/smollm2_q41_llamacpp_greedy.json .devcarry/model.part0
#      run   python3 bench/gpu_check.py --phases setup,build,nvcc,stash
#   2. carry .devcarry/wheels .devcarry/smollm2_q41_llamacpp_greedy.json .devcarry/model.part1
#      run   python3 bench/gpu_check.py
# If the machine went cold in between, call 2 still runs everything, with a synthetic model of the
# default model's shape for the timings, and the default model's parity tests skip.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-python3}
EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.devcarry/' "$EXCLUDE" 2>/dev/null || echo '/.devcarry/' >> "$EXCLUDE"
mkdir -p .devcarry/wheels
[ -n "$(ls .devcarry/wheels/gguf-*.whl 2>/dev/null)" ] || "$PY" -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation py --platform any -d .devcarry/wheels 'gguf==0.19.0'
cp ../shared/reference/smollm2_q41_llamacpp_greedy.json .devcarry/
MODEL=$("$PY" -c 'import fastserve; print(fastserve.default_model_path())')
if [ ! -f .devcarry/model.part1 ]; then
    split -n 2 -d -a 1 "$MODEL" .devcarry/model.part
fi
ls -l .devcarry .devcarry/wheels
du -ch .devcarry/wheels .devcarry/smollm2_q41_llamacpp_greedy.json .devcarry/model.part0 | tail -1
