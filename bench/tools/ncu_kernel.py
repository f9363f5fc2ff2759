"""Run one tuning shape's kernel a few times, for a profiler to catch one launch:
    ncu --clock-control none --section SpeedOfLight -k regex:_eva_fwd --launch-skip 2 --launch-count 1 \\
        python3 bench/tools/ncu_kernel.py eva_attention 0 [triton]
(op, index into autotune/space.py TUNE_SHAPES or the problem's keyword arguments as JSON, e.g.
'{"B": 8, "H": 9, "Hkv": 3, "Nk": 2048, "D": 64, "C": 32, "W": 256, "window": "sliding"}', backend;
the tuned or default config, bf16)."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # this tree's package, installed or not
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from flashswitch import registry  # noqa: E402
from flashswitch.autotune import space  # noqa: E402


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    op, shape = sys.argv[1], sys.argv[2]
    kwargs = json.loads(shape) if shape.lstrip().startswith("{") else space.TUNE_SHAPES[op][int(shape)]
    backend = sys.argv[3] if len(sys.argv) > 3 else "triton"
    spec = registry.get(op)
    problem = spec.random_problem(**kwargs, dtype="bf16", device="cuda", seed=0)
    fn = spec.kernel_callable(backend, None, problem)
    for _ in range(4):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
