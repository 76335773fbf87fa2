"""The ``--devices`` flag of the multi-device benchmarks, read before JAX is imported (it must see
``XLA_FLAGS`` first; harness.py imports it). A shared module, not a script."""

import argparse
import os


def simulated_devices(default: int = 4) -> tuple[argparse.ArgumentParser, int]:
  """A parent parser with ``--devices`` and its value, already added to ``XLA_FLAGS`` (simulated
  CPU devices) with ``JAX_PLATFORMS=cpu`` unless set."""
  parser = argparse.ArgumentParser(add_help=False)
  parser.add_argument("--devices", type=int, default=default, help="simulated CPU devices")
  n = parser.parse_known_args()[0].devices
  flag = f"--xla_force_host_platform_device_count={n}"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  return parser, n
