"""Run a launch plan given as JSON through launcher.running.supervise, as `train` would."""

import json
import os
import sys

from launcher.planning.plan import Plan
from launcher.running.supervise import run

data = json.loads(sys.argv[1])
data["argv"] = tuple(data["argv"])
data["nnodes"] = tuple(data.get("nnodes", (1, 1)))
data["world_sizes"] = tuple(data.get("world_sizes", (1,)))
plan = Plan(**data)
sys.exit(run(plan, dict(os.environ),
             lambda m: print(f"entrypoint: {m}", file=sys.stderr)).code)
