#!/bin/sh
# Prepare .devcarry/ (ignored by git) for bench/gpu_check.py on a device machine that has no network.
# Run here, on a machine with network, from anywhere:  sh bench/gpu_carry.sh
#
# It holds: the gguf wheel (the device image lacks gguf) and the default model cut in two (94 MiB: one call carries at most
# 64 MiB). Call 1 does all the work without the real model; call 2 only adds its parity tests, so a
# machine gone cold in between (it waits ~30 s) costs those tests and nothing else:
# (llama.cpp's reference outputs travel with the working tree: tests/golden/data.)
#   1. carry .devcarry/wheels .devcarry/model.part0
#      run   PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --budget-s 420      (timeout_s 480)
#      (everything: build, nvcc, GPU tests, bandwidth, timings on a synthetic model of the default
#      model's shape and on a 1.1B, engine, pools, then families and gemma3 if the budget still allows;
#      it also stashes model.part0 on the device)
#      If the table says families or gemma3 "skipped" (the budget ran out), the same machine, same carry:
#      run   PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --phases setup,build,bandwidth,families,gemma3 \
#            --budget-s 420      (timeout_s 480)
#      (the synthetic families' parity, gpt-oss and its MXFP4 experts included, then the 30B-A3B- and
#      gpt-oss-20b-shaped mixtures of experts timed, each written to the device's disk first: ~4 GB)
#   2. carry .devcarry/wheels .devcarry/model.part1
#      run   PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --phases setup,build,stash,model,tests --tests-k default
#      (assembles the default model from both parts, sha256 checked, and runs its GPU parity tests)
# Check it first without a GPU: python3 bench/gpu_check.py --dry-run (the kernels run on the CPU).
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-python3}
EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.devcarry/' "$EXCLUDE" 2>/dev/null || echo '/.devcarry/' >> "$EXCLUDE"
mkdir -p .devcarry/wheels
[ -n "$(ls .devcarry/wheels/gguf-*.whl 2>/dev/null)" ] || "$PY" -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation py --platform any -d .devcarry/wheels 'gguf==0.19.0'
MODEL=$("$PY" -c 'import fastserve; print(fastserve.default_model_path())')
if [ ! -f .devcarry/model.part1 ]; then
    split -n 2 -d -a 1 "$MODEL" .devcarry/model.part
fi
ls -l .devcarry .devcarry/wheels
du -ch .devcarry/wheels .devcarry/model.part0 | tail -1
