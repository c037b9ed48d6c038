"""Run kvprop's benchmarks and print the tables (same as `kvprop bench`).

python bench/run.py [--quick] [--json] [throughput] [scaling] [time_to_find] [vllm] [targets]
"""

import sys

from kvprop.front import cli

if __name__ == "__main__":
    sys.exit(cli.main(["bench", *sys.argv[1:]]))
