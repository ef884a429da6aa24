"""Herald vs vanilla across hosts with shaped links (see herald/bench/network.py);
same as `herald bench network`. Needs root, `ip` and `tc` (docs/testbed.md).

    sudo -E python bench/bench_network.py [--rate 1gbit] [--dim 128 512] [--rows 200000] [--out FILE.json]
    sudo -E python bench/bench_network.py --rate 100mbit --dim 512 --rows 30000 --cache-ratio 0.3 \
        --schedules vanilla herald costaware     # the network-bound regime (docs/testbed.md)
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

from herald.bench.network import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
