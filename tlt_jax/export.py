"""Exports of what the job trains, in formats other tools serve.

  python -m tlt_jax.export speculators DRAFTER_DIR OUT_DIR --verifier MODEL_DIR

writes the EAGLE-3 drafter in DRAFTER_DIR (saved by ``save_drafter``, e.g. a job's
``final_drafter/``) as a ``speculators`` ``eagle3`` checkpoint in OUT_DIR, for the HF-format
model in MODEL_DIR (the verifier it drafts for, e.g. the job's ``final_model/``), which vLLM
serves as a pair:

  vllm serve MODEL_DIR --speculative-config \\
      '{"model": "OUT_DIR", "method": "eagle3", "num_speculative_tokens": 3}'

(a job with ``drafter=eagle3`` writes that directory itself: ``final_drafter_speculators/``).
OUT_DIR is written atomically; an existing OUT_DIR is replaced only when it is a speculators
checkpoint. A drafter saved for another policy than MODEL_DIR's is exported after a warning; an
EAGLE-1 drafter (``drafter=eagle``), a verifier the drafter does not fit, a missing directory
or a damaged file are one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from tlt_jax.models import hf
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.drafter_io import drafter_policy_mismatch, load_drafter
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.speculators_format import export_speculators, is_speculators_dir
from tlt_jax.models.weights import WeightsError, hf_tensor_names

USAGE = "python -m tlt_jax.export speculators DRAFTER_DIR OUT_DIR --verifier MODEL_DIR"


class ExportError(ValueError):
  """A mistake in what the command was given (a path, a directory's contents)."""


def verifier_config(model_dir: Path) -> ModelConfig:
  """The ``ModelConfig`` of the HF-format model directory ``model_dir``."""
  raw = hf.read_hf_config(model_dir)
  try:
    return hf.config_from_hf(raw)
  except KeyError as e:
    raise ExportError(f"{model_dir / hf.CONFIG_FILE} lacks the required key {e.args[0]!r}: "
                      "--verifier takes an HF-format model directory") from None
  except (TypeError, ValueError) as e:
    raise ExportError(f"{model_dir / hf.CONFIG_FILE}: {e}") from None


def fingerprint_params(model_dir: Path, config: ModelConfig) -> dict:
  """The params of the model in ``model_dir`` that ``policy_fingerprint`` hashes (the token
  embedding and every norm weight), as a nested dict, read from its safetensors files alone (the
  rest of a large model is never loaded)."""
  wanted = {hf_name: path for path, (hf_name, _) in hf_tensor_names(config).items()
            if path == ("embed_tokens", "embedding")
            or ".".join(map(str, path)).endswith("norm.weight")}
  found = {wanted[name]: value for name, value in hf.read_tensors(model_dir, wanted).items()}
  missing = sorted(name for name, path in wanted.items() if path not in found)
  if missing:
    raise WeightsError(f"the safetensors files of {model_dir} lack {missing[0]!r} "
                       f"({len(missing)} tensors missing): not a complete HF-format model")
  nested: dict = {}
  for path, value in found.items():
    node = nested
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return nested


def speculators(drafter_dir: Path, out_dir: Path, model_dir: Path,
                warn: Callable[[str], None] = print) -> tuple[Path, Drafter]:
  """Writes the drafter saved in ``drafter_dir`` as a speculators ``eagle3`` checkpoint at
  ``out_dir`` for the verifier ``model_dir``; ``warn`` gets a line when the drafter was trained
  for another policy. Returns ``out_dir`` and the drafter; mistakes raise a one-line
  ``ValueError`` or ``OSError``."""
  for flag, path in (("DRAFTER_DIR", drafter_dir), ("--verifier", model_dir)):
    if not path.is_dir():
      raise ExportError(f"{flag} {path} is not a directory")
  if out_dir.exists() and not is_speculators_dir(out_dir):
    raise ExportError(f"OUT_DIR {out_dir} exists and is not a speculators checkpoint: choose a "
                      "new directory (an existing speculators checkpoint is replaced)")
  config = verifier_config(model_dir)
  drafter = load_drafter(drafter_dir, config)  # a drafter made for another shape: one line
  if not is_speculators_dir(drafter_dir):  # our format records the policy it was trained for
    warning = drafter_policy_mismatch(drafter_dir, fingerprint_params(model_dir, config))
    if warning:
      warn(f"{warning} (exported anyway)")
  return export_speculators(drafter, model_dir, out_dir), drafter


def serve_command(model_dir: Path, out_dir: Path, tokens: int) -> str:
  """The ``vllm serve`` line that serves the verifier with the exported drafter."""
  spec = json.dumps({"model": str(out_dir), "method": "eagle3", "num_speculative_tokens": tokens})
  return f"vllm serve {model_dir} --speculative-config '{spec}'"


class _Parser(argparse.ArgumentParser):
  """argparse whose mistakes are one line on stderr (exit status 2), as every other error."""

  def error(self, message):
    self.exit(2, f"error: {message} (usage: {USAGE})\n")


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="python -m tlt_jax.export", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
  formats = parser.add_subparsers(dest="format", required=True, metavar="FORMAT",
                                  parser_class=_Parser)
  spec = formats.add_parser("speculators", help="a speculators eagle3 checkpoint (vLLM serves it)",
                            description="Writes an EAGLE-3 drafter saved by save_drafter as a "
                                        "speculators eagle3 checkpoint for its verifier.")
  spec.add_argument("drafter_dir", metavar="DRAFTER_DIR", type=Path,
                    help="a drafter saved by save_drafter (e.g. a job's final_drafter/)")
  spec.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="where to write the checkpoint")
  spec.add_argument("--verifier", metavar="MODEL_DIR", type=Path, required=True,
                    help="the HF-format model it drafts for (e.g. a job's final_model/)")
  return parser


def _one_line(error: Exception) -> str:
  return " ".join(str(error).split()) or type(error).__name__


def main(argv: list[str] | None = None) -> int:
  """The command line; returns its exit status (0, or 2 after a one-line error on stderr)."""
  try:
    args = _parser().parse_args(argv)
  except SystemExit as e:  # --help (0) or a usage mistake (2, its line already printed)
    return int(e.code or 0)
  warn = lambda line: print(f"warning: {line}", file=sys.stderr, flush=True)
  try:
    out, drafter = speculators(args.drafter_dir, args.out_dir, args.verifier, warn)
  except (ValueError, OSError, TypeError, KeyError) as e:
    print(f"error: {_one_line(e)}", file=sys.stderr)
    return 2
  print(f"wrote {out} (a speculators eagle3 checkpoint for {args.verifier}); serve the pair "
        f"with: {serve_command(args.verifier, out, drafter.ttt_steps)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
