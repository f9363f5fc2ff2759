"""Measure this GPU's ceilings: copy bandwidth (a large device-to-device copy, bytes read + written)
and bf16 matmul throughput (8192^3, random inputs), both with `triton.testing.do_bench` (median).

    python bench/tools/ceilings.py [--out bench/results/<device>]

writes <out>/ceilings.json, which bench/tools/plot.py uses for the "% of ceiling" column and the plot line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: `import common`

import torch  # noqa: E402

from common import bench_ms, env_info, provenance, results_dir  # noqa: E402

COPY_BYTES = 2 << 30  # 2 GiB source buffer: far beyond L2
MATMUL_N = 8192


def measure() -> dict:
    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src), warmup=25, rep=200)
    moved = 2 * src.numel() * src.element_size()  # read + write
    del src, dst
    a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device="cuda")
    mm_ms = bench_ms(lambda: torch.mm(a, b), warmup=25, rep=200)
    return {**env_info(), **provenance(),
            "copy_bytes": moved, "copy_ms": copy_ms, "copy_GBps": moved / (copy_ms * 1e-3) / 1e9,
            "matmul_n": MATMUL_N, "matmul_ms": mm_ms,
            "bf16_matmul_TFLOPs": 2 * MATMUL_N ** 3 / (mm_ms * 1e-3) / 1e12}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="folder (default bench/results/<device>)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("ceilings.py measures a CUDA GPU; none is visible")
        return 2
    data = measure()
    out = args.out or results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "ceilings.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"{data['device']}: copy {data['copy_GBps']:.0f} GB/s, bf16 matmul {data['bf16_matmul_TFLOPs']:.0f} "
          f"TFLOP/s -> {out / 'ceilings.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
