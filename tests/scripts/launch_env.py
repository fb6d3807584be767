"""Rank program for tests/test_launch.py: report the environment the launcher gave this rank.

Prints one ``ENV {json}`` line to stdout, one ``ERR rank R`` line to stderr and a last stdout
line with no newline. Also runs as a module (``-m launch_env``).
"""

import json
import os
import sys

NAMES = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
         "MASTER_PORT", "GPUCOLL_AUTH_TOKEN", "GPUCOLL_LAUNCHER_STORE", "PYTHONUNBUFFERED",
         "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"]

report = {name: os.environ.get(name) for name in NAMES}
report["argv"] = sys.argv[1:]
report["name"] = __name__
report["file"] = os.path.basename(__file__)
report["pid"] = os.getpid()
print("ENV " + json.dumps(report, sort_keys=True))
sys.stderr.write(f"ERR rank {report['RANK']}\n")
sys.stdout.write(f"partial line of rank {report['RANK']}")
