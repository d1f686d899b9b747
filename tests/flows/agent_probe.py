"""A blueprint agent for the job tests: records what it was given, then sleeps, exits or runs forever.

usage: agent_probe.py OUT_DIR [--until FILE] [--sleep S] [--exit CODE] [--forever]

--until FILE: wait until FILE exists (a barrier the test opens) before the rest.
"""

import json
import os
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
args = sys.argv[2:]
name = f"{os.environ.get('MN_AGENT_ID', 'unknown')}.{os.environ.get('MN_AGENT_ATTEMPT', '0')}"
record = {"pid": os.getpid(), "start": time.time(), "env": dict(os.environ), "cwd": os.getcwd()}
(out / f"{name}.json").write_text(json.dumps(record))
print(f"agent {name} started", flush=True)
print(f"agent {name} says hello on stderr", file=sys.stderr, flush=True)
while "--until" in args and not Path(args[args.index("--until") + 1]).exists():
    time.sleep(0.1)
if "--sleep" in args:
    time.sleep(float(args[args.index("--sleep") + 1]))
if "--forever" in args:
    while True:
        time.sleep(1)
sys.exit(int(args[args.index("--exit") + 1]) if "--exit" in args else 0)
