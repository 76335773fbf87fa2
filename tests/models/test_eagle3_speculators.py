"""EAGLE-3 drafter vs the real ``speculators`` package: exported checkpoints compute our logits.

Each test writes a random HF target (transformers), loads it with tlt_jax, makes an
``Eagle3Drafter`` whose every parameter (norms included) is random, exports it with
``export_speculators`` and loads the directory with ``speculators``' own ``Eagle3DraftModel``
(eager attention, the verifier's embedding loaded by the package). Both sides get the same token
ids and the same auxiliary hidden states (from our target's forward); the package's draft logits
(its ``lm_head`` outputs, one per test-time-training step) must match ours to 2e-5 relative error
with the same argmax everywhere, for 1 step and for 3 chained steps.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
speculators_eagle3 = pytest.importorskip("speculators.models.eagle3")

from tests import hf_fixtures  # noqa: E402  pylint: disable=wrong-import-position
from tlt_jax.models import hf  # noqa: E402
from tlt_jax.models.drafter import Drafter  # noqa: E402
from tlt_jax.models.drafter_io import (drafter_policy_mismatch, load_drafter,  # noqa: E402
                                       save_drafter)
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine  # noqa: E402
from tlt_jax.rollout.decode.sampling import SamplingParams  # noqa: E402
from tlt_jax.rollout.decode.speculative import SpecConfig  # noqa: E402
from tlt_jax.models.eagle3 import Eagle3Drafter, ttt_logits  # noqa: E402
from tlt_jax.models.speculators_format import (SpeculatorsFormatError,  # noqa: E402
                                               export_speculators, load_speculators)

NUM_LAYERS = 6
SEQ = 12
REL_TOL = 2e-5


def randomize(drafter: nnx.Module, seed: int) -> None:
  """Redraws every param: norms ~ 1 + N(0, 0.1), matrices ~ N(0, 0.08)."""
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
    noise = rng.standard_normal(var.shape).astype(np.float32)
    value = 1.0 + 0.1 * noise if "norm" in str(path[-2]) else 0.08 * noise
    var.set_value(jnp.asarray(value, var.dtype))


# a Llama verifier in the full tier (the export is the same but for the architecture's name)
@pytest.fixture(scope="module", params=["qwen2", pytest.param("llama", marks=pytest.mark.slow)])
def verifier(request, tmp_path_factory):
  """(HF directory, our target) of a random 6-layer Qwen2 or Llama."""
  path = tmp_path_factory.mktemp(request.param)
  make = hf_fixtures.make_qwen2_checkpoint if request.param == "qwen2" else \
      hf_fixtures.make_llama_checkpoint
  make(path, seed=3, num_layers=NUM_LAYERS)
  return path, hf.from_pretrained(path)[0]


def their_logits(out_dir, features: np.ndarray, ids: np.ndarray, positions: np.ndarray,
                 steps: int, n_aux: int, hidden: int) -> list[np.ndarray]:
  """The package's per-step draft logits for one row (B = 1), eager attention."""
  config = speculators_eagle3.Eagle3SpeculatorConfig.from_pretrained(str(out_dir))
  layer = config.transformer_layer_config  # the same config, with eager attention
  config.transformer_layer_config = type(layer).from_dict(layer.to_dict(),
                                                          attn_implementation="eager")
  model = speculators_eagle3.Eagle3DraftModel.from_pretrained(str(out_dir), config=config)
  model.load_verifier_weights()
  model.eval()
  seen = []
  model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach().numpy()))
  with torch.no_grad():
    model(hidden_states=torch.from_numpy(features[:, :, :n_aux * hidden].copy()),
          input_ids=torch.from_numpy(ids.astype(np.int64)),
          document_ids=torch.zeros_like(torch.from_numpy(ids.astype(np.int64))),
          position_ids=torch.from_numpy(positions.astype(np.int64)), ttt_steps=steps)
  return [s[0] for s in seen]


def assert_close(theirs: list[np.ndarray], ours: list[jax.Array], vocab_ids=None) -> float:
  """Per step: relative max error and argmax; ours reordered to the format's increasing ids.
  Returns the largest relative error."""
  order = slice(None) if vocab_ids is None else np.argsort(vocab_ids)
  assert len(theirs) == len(ours)
  worst = 0.0
  for step, (a, b) in enumerate(zip(theirs, ours)):
    b = np.asarray(b[0])[:, order]
    rel = float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
    assert rel < REL_TOL, f"step {step}: relative error {rel:.2e}"
    assert np.array_equal(a.argmax(-1), b.argmax(-1)), f"step {step}: argmax differs"
    worst = max(worst, rel)
  return worst


def export_and_compare(drafter: Eagle3Drafter, target, verifier_dir, out_dir, seed=0) -> None:
  export_speculators(drafter, verifier_dir, out_dir)
  compare_with_package(drafter, target, out_dir, seed)


def compare_with_package(drafter: Eagle3Drafter, target, out_dir, seed=0) -> float:
  """Our logits vs the package's on the exported ``out_dir``, 1 and 3 chained steps, random
  token ids; returns the largest relative error seen."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, target.config.vocab_size, (1, SEQ)).astype(np.int32)
  positions = (np.arange(SEQ)[None] + 1).astype(np.int32)
  features = np.asarray(target.forward(jnp.asarray(ids), return_hidden=drafter.target_features
                                       ).hidden)
  n_aux, h = len(drafter.feature_layers), target.config.hidden_size
  worst = 0.0
  for steps in (1, 3):
    ours = ttt_logits(drafter, target, jnp.asarray(ids), jnp.asarray(features),
                      jnp.asarray(positions), steps=steps)
    worst = max(worst, assert_close(their_logits(out_dir, features, ids, positions, steps,
                                                 n_aux, h), ours, drafter.vocab_ids))
  return worst


@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_exported_drafter_matches_the_speculators_package(verifier, tmp_path, draft_vocab):
  verifier_dir, target = verifier
  drafter = Eagle3Drafter.create(target.config, seed=1)
  if draft_vocab is not None:  # an unsorted subset: the export sorts it, rows permuted along
    ids = np.random.default_rng(5).permutation(target.config.vocab_size)[:draft_vocab]
    drafter.set_draft_vocab(target, ids)
  randomize(drafter, seed=2)
  assert drafter.feature_layers == (2, 3)
  export_and_compare(drafter, target, verifier_dir, tmp_path / "spec")
  if draft_vocab is not None:
    assert_the_package_reads_our_vocabulary_maps(tmp_path / "spec", drafter, target)


def assert_the_package_reads_our_vocabulary_maps(out_dir, drafter, target) -> None:
  """The exported ``d2t`` / ``t2d`` as the package loads them equal what the package's own
  ``build_vocab_mappings_from_distribution`` makes for the drafter's vocabulary (offsets:
  target id = draft index + d2t[index]), and map each draft index to the drafter's token."""
  vocab_mapping = pytest.importorskip("speculators.train.vocab_mapping")
  config = speculators_eagle3.Eagle3SpeculatorConfig.from_pretrained(str(out_dir))
  model = speculators_eagle3.Eagle3DraftModel.from_pretrained(str(out_dir), config=config)
  ids = [int(t) for t in drafter.vocab_ids]
  d2t, t2d = vocab_mapping.build_vocab_mappings_from_distribution(
      {t: 1 for t in ids}, len(ids), target.config.vocab_size)
  assert np.array_equal(model.d2t.numpy(), d2t.numpy())
  assert np.array_equal(model.t2d.numpy(), t2d.numpy())
  draft_index = np.arange(len(ids))
  assert np.array_equal(draft_index + model.d2t.numpy()[draft_index], sorted(ids))


def test_three_feature_layers_and_a_round_trip(verifier, tmp_path):
  """Explicit low/middle/last layers (the last: after the final layer), then ours -> speculators
  -> ours gives the same weights and the same logits."""
  verifier_dir, target = verifier
  drafter = Eagle3Drafter.create(target.config, seed=4, feature_layers=(1, 3, NUM_LAYERS))
  drafter.set_draft_vocab(target, np.arange(0, target.config.vocab_size, 3))
  randomize(drafter, seed=6)
  export_and_compare(drafter, target, verifier_dir, tmp_path / "spec")
  back = load_drafter(tmp_path / "spec", target.config)
  assert isinstance(back, Eagle3Drafter) and back.feature_layers == drafter.feature_layers
  assert back.vocab_ids == drafter.vocab_ids
  for (p, a), (q, b) in zip(nnx.to_flat_state(nnx.state(drafter, nnx.Param)),
                            nnx.to_flat_state(nnx.state(back, nnx.Param))):
    assert p == q and np.array_equal(np.asarray(a.get_value()), np.asarray(b.get_value())), p
  assert drafter_policy_mismatch(tmp_path / "spec", target) is None  # it names a verifier only
  # the same drafts in our engine: identical acceptance, step by step (one engine, the
  # reloaded drafter's params swapped in)
  engine = RolloutEngine(target, drafter=drafter, config=EngineConfig(
      max_batch=4, max_prompt_len=8, max_new_tokens=16, prefill_buckets=(8,),
      spec=SpecConfig(3, 1, 4)))
  accepted = []
  for params in (nnx.split(drafter)[1], nnx.split(back)[1]):
    engine.update_params(engine.params, params)
    result = engine.generate([[5, 9, 1], [7, 7, 2, 30], [3], [11, 4]],
                             SamplingParams(max_new_tokens=16, temperature=1.0, seed=2))
    accepted.append((result.tokens, list(result.stats.accept_hist)))
  assert accepted[0] == accepted[1] and sum(accepted[0][1][1:]) > 0
  # and through our own format too
  save_drafter(back, tmp_path / "ours")
  again = load_drafter(tmp_path / "ours", target.config)
  assert isinstance(again, Eagle3Drafter) and again.ttt_steps == drafter.ttt_steps
  assert again.feature_layers == drafter.feature_layers


def test_an_eagle1_drafter_is_refused_in_one_line(verifier, tmp_path):
  verifier_dir, target = verifier
  with pytest.raises(SpeculatorsFormatError, match=r"drafter=eagle3") as err:
    export_speculators(Drafter.create(target.config), verifier_dir, tmp_path / "out")
  assert "\n" not in str(err.value)
  assert not (tmp_path / "out").exists()


def test_mismatched_and_malformed_checkpoints_give_one_line(verifier, tmp_path):
  verifier_dir, target = verifier
  drafter = Eagle3Drafter.create(target.config, seed=1)
  out = export_speculators(drafter, verifier_dir, tmp_path / "spec")
  config = json.loads((out / "config.json").read_text())

  def check(pattern, target_config=target.config):
    with pytest.raises(ValueError, match=pattern) as err:
      load_speculators(out, target_config)
    assert "\n" not in str(err.value)

  check(r"hidden_size=64 but the target has hidden_size=32",
        target.config.replace(hidden_size=32, head_dim=target.config.head_dim))
  check(r"vocab_size=128 but the target has vocab_size=256",
        target.config.replace(vocab_size=256))
  check(r"reads target layers \[2, 3\].*\(2 layers\)", target.config.replace(num_layers=2))
  for key, value, pattern in [("norm_before_residual", True, "norm_before_residual=True"),
                              ("speculators_model_type", "dflash", "only 'eagle3'"),
                              ("eagle_aux_hidden_state_layer_ids", None, "set them explicitly")]:
    (out / "config.json").write_text(json.dumps(dict(config, **{key: value})))
    check(pattern)
  (out / "config.json").write_text("{not json")
  check(r"config.json")
  (out / "config.json").write_text(json.dumps(config))
  (out / "model.safetensors").write_bytes(b"garbage")
  check(r"model.safetensors")


@pytest.fixture
def one_torch_thread():
  """Torch on one thread: its tiny forwards are many times slower when two threads share CPUs."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(threads)


def test_a_qwen3_verifier(tmp_path, one_torch_thread):  # pylint: disable=unused-argument
  """A Qwen3 target (q/k norms, untied, head_dim 24 != hidden / heads): the drafter's layer is
  still a Llama layer, the package loads the export, names the verifier and computes our
  logits; the checkpoint reads back as the same drafter."""
  verifier_dir = tmp_path / "qwen3"
  hf_fixtures.make_qwen3_checkpoint(verifier_dir, seed=5, num_layers=NUM_LAYERS, head_dim=24,
                                    tie=False)
  target, target_config = hf.from_pretrained(verifier_dir)
  assert (target_config.architecture, target_config.head_dim) == ("qwen3", 24)
  drafter = Eagle3Drafter.create(target_config, seed=1)
  drafter.set_draft_vocab(target, np.random.default_rng(7).permutation(128)[:40])
  randomize(drafter, seed=3)
  assert not hasattr(drafter.layer.self_attn, "q_norm")
  out = export_speculators(drafter, verifier_dir, tmp_path / "spec")
  config = json.loads((out / "config.json").read_text())
  assert config["speculators_config"]["verifier"]["architectures"] == ["Qwen3ForCausalLM"]
  layer = config["transformer_layer_config"]
  assert (layer["model_type"], layer["head_dim"]) == ("llama", 24)
  assert compare_with_package(drafter, target, out, seed=1) < REL_TOL
  back = load_speculators(out, target_config)
  assert back.vocab_ids == tuple(sorted(drafter.vocab_ids))
  ours = dict(nnx.to_flat_state(nnx.state(drafter, nnx.Param)))
  order = np.argsort(drafter.vocab_ids)  # the head comes back in increasing target-id order
  for path, var in nnx.to_flat_state(nnx.state(back, nnx.Param)):
    expected = np.asarray(ours[path].get_value())
    if path[0] == "head":
      expected = expected[:, order]
    assert np.array_equal(np.asarray(var.get_value()), expected), path
