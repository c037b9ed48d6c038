"""Run kvprop's benchmarks and print the tables (same as `kvprop bench`).

python bench/run.py [--quick] [--json] [throughput] [scaling] [time_to_find] [vllm] [targets]
"""

import sys

from kvprop import bench

if __name__ == "__main__":
    args = sys.argv[1:]
    parts = [a for a in args if not a.startswith("--")] or bench.DEFAULT_PARTS
    sys.exit(bench.main(quick="--quick" in args, as_json="--json" in args, parts=parts))
