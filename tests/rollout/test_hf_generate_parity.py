"""Greedy ``generate`` reproduces transformers' greedy ``generate`` token for token."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests import hf_fixtures  # pylint: disable=wrong-import-position
from tlt_jax.models import hf  # pylint: disable=wrong-import-position
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine  # pylint: disable=wrong-import-position
from tlt_jax.rollout.decode.sampling import SamplingParams  # pylint: disable=wrong-import-position

NEW_TOKENS = 32


@pytest.mark.parametrize("make", [hf_fixtures.make_qwen2_checkpoint,
                                  hf_fixtures.make_llama_checkpoint], ids=["qwen2", "llama"])
def test_greedy_generate_matches_transformers(tmp_path, make):
  torch_model = make(tmp_path, seed=3)
  model, config = hf.from_pretrained(tmp_path)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(4, config.vocab_size, n).tolist() for n in (3, 17, 8, 30, 1)]
  engine = RolloutEngine(model, config=EngineConfig(max_batch=4, max_prompt_len=32,
                                                    max_new_tokens=NEW_TOKENS))
  # The model's EOS ids stop rows, in both implementations.
  ours = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0))
  for prompt, tokens in zip(prompts, ours.tokens):
    with torch.no_grad():
      out = torch_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    assert tokens == expected
  assert any(len(t) == NEW_TOKENS for t in ours.tokens)
