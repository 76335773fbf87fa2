"""A process of the tests of ``tlt_jax.hosts`` / ``tlt_jax.launch`` (tests/test_hosts.py):
``python -m tests.hosts_worker MODE`` joins the job its environment describes and then
gather: exchanges two rounds and prints what it got; silent: process 1 skips the second round
(it sleeps); die: process 1 exits at once after the first round (os._exit(3), no goodbye)."""

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tlt_jax import hosts  # pylint: disable=wrong-import-position

mode = sys.argv[1]
hosts.initialize(timeout_s=float(os.environ.get("TEST_TIMEOUT_S", "60")),
                 heartbeat_s=int(os.environ.get("TEST_HEARTBEAT_S", "30")),
                 connect_timeout_s=int(os.environ.get("TEST_CONNECT_S", "120")))
me = hosts.process_index()
print(f"round 1: {hosts.allgather({'from': me}, 'test')}", flush=True)
if mode == "die" and me == 1:
  os._exit(3)
if mode == "silent" and me == 1:
  time.sleep(30)
  sys.exit(0)
try:
  print(f"round 2: {hosts.allgather(me * 10, 'test')}", flush=True)
except hosts.PeerLostError as e:
  print(f"error: {e}", flush=True)
  sys.exit(1)
hosts.shutdown()
