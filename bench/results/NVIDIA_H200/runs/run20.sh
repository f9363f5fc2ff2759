#!/usr/bin/env bash
# H200 run 20 (one device call): build; the op-2 test files in full (cuda file, then the kernels file:
# triton, cuda and cupy kernels, bf16/fp16/fp32, gpu hypothesis profile); then decode: a read-only
# bandwidth figure (sum of 2 GiB), an A/B of decode configs (per call, read flush, graph) and the
# host time per call with a profile. Everything packed into $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" a c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
OUT="$OUT_ROOT/a" STAGES=build bench/run_gpu.sh
timeout 70 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 --durations=5 tests/test_eva_attention_cuda.py \
  > "$C/test_eva_attention_cuda.log" 2>&1; tail -n 1 "$C/test_eva_attention_cuda.log"; pack
timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 --durations=15 tests/test_eva_attention_kernels.py \
  > "$C/test_eva_attention_kernels.log" 2>&1; tail -n 1 "$C/test_eva_attention_kernels.log"; pack
python3 - > "$C/read_ceiling.log" 2>&1 <<'PY'
import torch
from triton.testing import do_bench, do_bench_cudagraph
x = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda"); s = torch.empty((), dtype=torch.float32, device="cuda")
f = lambda: torch.sum(x, dtype=torch.float32, out=s)
for name, ms in (("do_bench", do_bench(f, rep=200, return_mode="median")),
                 ("graph", do_bench_cudagraph(f, rep=200, return_mode="median"))):
    print(f"read-only sum of 2 GiB bf16, {name}: {ms:.4f} ms = {x.numel() * 2 / ms / 1e6:.0f} GB/s")
PY
cat "$C/read_ceiling.log"; pack
cd bench
timeout 150 python3 config_ab.py eva_attention 3 '{}' '{"FUSE": false, "TMA": true}' \
  '{"FUSE": false, "TMA": true, "BLOCK_N": 128, "num_stages": 2}' '{"FUSE": false, "TMA": true, "num_stages": 4}' \
  '{"NUM_SPLITS": 2}' '{"BLOCK_N": 128, "num_stages": 2}' '{"num_warps": 8}' --rounds 3 > "$C/ab_decode.log" 2>&1
cat "$C/ab_decode.log"; pack
timeout 60 python3 host_time.py --ops eva_attention --backends triton --profile > "$C/host_time_eva.log" 2>&1
cd ..; pack; rm -rf "$OUT_ROOT"/a "$OUT_ROOT"/c
