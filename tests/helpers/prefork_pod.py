"""A pod for tests/test_prefork.py: says what it was given, then ends as its argument says."""

from __future__ import annotations

import atexit
import json
import os
import random
import sys
import threading
import time

how = sys.argv[1]
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(),
                  "sid": os.getsid(0), "pod": os.environ.get("CEASELESS_POD"),
                  "set_by_import": os.environ.get("SET_BY_IMPORT"),
                  "main": __name__, "path0": sys.path[0],
                  "netns": os.readlink("/proc/self/ns/net"),
                  "gloo": os.environ.get("CEASELESS_GLOO_HOSTNAME"),
                  "zygote_globals": "Zygote" in globals(),
                  # a fresh process draws fresh random numbers: so must a fork (random and numpy reseed
                  # themselves after a fork)
                  "random": random.getrandbits(60),
                  "np_random": int(sys.modules["numpy"].random.randint(1 << 60))
                  if "numpy" in sys.modules else None}))
atexit.register(lambda: print("atexit ran"))
if how == "late-thread":  # a non-daemon thread outlives the main module: waited for
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
elif how == "exit":
    sys.exit(int(sys.argv[2]))
elif how == "raise":
    raise RuntimeError("the script failed")
elif how == "hook-raise":  # an uncaught exception goes through sys.excepthook
    sys.excepthook = lambda t, v, tb: print(f"hook saw {t.__name__}: {v}")
    raise RuntimeError("the script failed")
elif how == "sleep":
    print("sleeping")  # unflushed: PYTHONUNBUFFERED must hold in a fork too
    time.sleep(60)
