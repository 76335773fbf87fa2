"""Plants known, plausible one-line bugs ("mutants") in a temporary copy of the repository and
checks that the tests meant to catch each one fail. Not collected by pytest; run it by hand:

  python tests/mutation_check.py               # every mutant
  python tests/mutation_check.py --list        # names, tiers, files, the tests that catch them
  python tests/mutation_check.py resume_skips_optimizer_state checksums_not_verified

Each mutant is an exact text replacement that must apply exactly once (so a refactor that moves
the code makes the script fail loudly rather than test nothing), caught in its tier: a fast-tier
mutant's tests run with ``-m "not slow"`` (the README's command), a full-tier one's with
``-m ""``. The mutants of one call share one compile cache (``$TLT_TEST_COMPILE_CACHE``, made
fresh unless set). Exit status 1 if any mutant survives (its tests pass) or no longer applies.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  file: str  # relative to the repository root
  old: str
  new: str
  tests: tuple[str, ...]  # pytest node ids / -k expressions as argv pieces
  why: str
  tier: str = "fast"  # the tier whose tests catch it: "fast" (README's command) or "full"


MUTANTS = [
    Mutant("resume_skips_optimizer_state", "tlt_jax/rl/update.py",
           'self.opt_state = jax.device_put(jax.tree.unflatten(treedef, state["opt_state"]),\n'
           '                                    layout.opt_state)',
           "self.opt_state = self.opt_state",
           ("tests/rl/test_trainer.py::test_save_and_restore_continue_exactly",),
           "restore() keeps the freshly initialised optimizer state"),
    Mutant("resume_skips_kl_reference", "tlt_jax/rl/update.py",
           'ckpt.pure_dict_to_state(state["ref_params"], self.ref_params)',
           "self.ref_params",
           ("tests/rl/test_trainer.py::test_save_and_restore_continue_exactly",),
           "restore() keeps the reference policy it was built with"),
    Mutant("engine_keeps_old_weights", "tlt_jax/rollout/engine.py",
           "    self.params = params\n    if drafter_params is not None:",
           "    if drafter_params is not None:",
           ("tests/rl/test_trainer.py::test_rl_steps_learn_a_dense_reward",),
           "update_params() ignores the new policy weights"),
    Mutant("nonfinite_update_applied", "tlt_jax/rl/update.py",
           "keep = lambda new, old: jnp.where(finite, new, old)",
           "keep = lambda new, old: new",
           ("tests/rl/test_trainer.py", "-k", "nonfinite"),
           "a NaN update is applied to the params"),
    Mutant("update_ignores_sampling_temperature", "tlt_jax/rl/update.py",
           "grpo.token_logprobs(logits / temperature, ids[:, 1:])",
           "grpo.token_logprobs(logits, ids[:, 1:])",
           ("tests/rl/test_trainer.py", "-k", "ratio_one"),
           "the update scores tokens at T=1 while the rollout sampled at another temperature"),
    Mutant("warmup_zero_starts_at_half_rate", "tlt_jax/rl/update.py",
           "  if config.warmup_steps == 0:\n    return optax.constant_schedule(config.learning_rate)",
           "  if config.warmup_steps == 0:\n    return optax.linear_schedule(config.learning_rate / 2,"
           " config.learning_rate, 1)",
           ("tests/rl/test_trainer.py", "-k", "warmup"),
           "warmup_steps=0 still runs the first update at half the rate"),
    Mutant("unknown_config_keys_dropped", "tlt_jax/job/typed_config.py",
           "  check_keys(section_, (fields - set(extra)) | set(ignore), where)\n", "",
           ("tests/test_train_job.py", "tests/test_generate.py", "-k", "unknown_keys"),
           "to_dataclass silently drops misspelled fields"),
    Mutant("resume_ignores_saved_config", "tlt_jax/job/run_dir.py",
           "      set_dotted(merged, name, value)", "      pass",
           ("tests/test_train_job.py", "-k", "saved_config or named_overrides"),
           "--config.resume=True trains with the defaults instead of the run's config"),
    Mutant("leftovers_mixed_into_a_new_run", "tlt_jax/job/runner.py",
           "if (aside := set_aside_leftovers(logdir)) is not None:",
           "if (aside := None) is not None:",
           ("tests/test_restart_path.py", "-k", "double_ctrl_c or sets_an_earlier"),
           "a run started over in a logdir with an earlier attempt's files appends to them"),
    Mutant("save_cut_by_a_second_signal", "tlt_jax/job/signals.py",
           "    if self._deferred:\n", "    if False:\n",
           ("tests/test_restart_path.py", "-k", "during_a_save"),
           "a second Ctrl-C while a checkpoint is written leaves half of it (and orbax tracebacks)"),
    Mutant("resume_override_changes_shapes", "tlt_jax/job/run_dir.py",
           "  check_resume_overrides(saved, cfg)\n", "",
           ("tests/test_restart_path.py", "-k", "changes_the_models_shape"),
           "a resume with --config.model.hidden_size changed fails deep in orbax with Python-API "
           "advice"),
    Mutant("damaged_config_json_ends_a_resume", "tlt_jax/job/run_dir.py",
           "    saved = checkpoint_config(checkpoint_dir, latest)\n", "    raise\n",
           ("tests/test_restart_path.py", "-k", "damaged_config"),
           "a damaged config.json in a run with good checkpoints refuses the resume"),
    Mutant("generate_prompt_error_names_python_fields", "tlt_jax/generate.py",
           "  check_lengths(ids, engine_config, sampling, given=bool(prompts),",
           "  (lambda *a, **k: None)(ids, engine_config, sampling, given=bool(prompts),",
           ("tests/test_generate.py", "-k", "long_prompt"),
           "a too-long --prompt is reported as EngineConfig.max_prompt_len, not the flag"),
    Mutant("resume_misses_the_compile_cache", "tlt_jax/rollout/interface.py",
           "          return jax.device_put(shard.data, device)", "          return shard.data",
           ("tests/rollout/test_engine.py", "-k", "on_device"),
           "the rollout decodes with the replicated arrays' one-device views as they are, not "
           "as single-device arrays"),
    Mutant("new_run_overwrites_checkpoints", "tlt_jax/job/run_dir.py",
           "  if not cfg.resume:\n    if latest is not None:",
           "  if not cfg.resume:\n    if False:",
           ("tests/test_train_job.py", "-k", "logdir_with_checkpoints_is_refused"),
           "a new run in a logdir that holds checkpoints starts over on top of them"),
    Mutant("default_verify_rejection", "tlt_jax/configs/tiny_grpo.py",
           'max_prompt_len=32, verify="coupled")', 'max_prompt_len=32, verify="rejection")',
           ("tests/test_same_seed.py", "-k", "choice_of_arm"),
           "the default job verifies by rejection sampling: the tuner's timed choice of arm "
           "changes the tokens"),
    Mutant("old_logprobs_from_rollout", "tlt_jax/rl/update.py",
           'self.recompute = config.old_logprobs == "policy"',
           "self.recompute = False",
           ("tests/test_same_seed.py", "-k", "choice_of_arm"),
           "the loss's old log-probs are the rollout's, whose last bits follow the arm"),
    Mutant("own_pass_old_logprobs_zero", "tlt_jax/rl/update.py",
           "old = jnp.where(jnp.isnan(old), jax.lax.stop_gradient(logprobs), old)",
           "old = jnp.where(jnp.isnan(old), 0.0, old)",
           ("tests/rl/test_update_buckets.py", "-k", "policys_old_logprobs"),
           "the first update's rows take old log-probs of 0 instead of its own pass's"),
    Mutant("unpacked_logprobs_shifted", "tlt_jax/rl/packing.py",
           "    out[i, :n - 1] = values[r, at:at + n - 1]\n",
           "    out[i, :n - 1] = values[r, at + 1:at + n]\n",
           ("tests/rl/test_update_buckets.py", "-k", "policys_old_logprobs"),
           "the recomputed old log-probs are read back one packed position late"),
    Mutant("rerun_metric_rows_repeated", "tlt_jax/job/run_dir.py",
           'row.get("step", 0) <= resume_step', "True",
           ("tests/test_train_job.py", "-k", "replaces_rerun"),
           "metrics.jsonl keeps the rows of steps a resumed run does again"),
    Mutant("checksums_not_verified", "tlt_jax/checkpoint/checkpointer.py",
           "      if got != want:", "      if False:",
           ("tests/test_checkpoint_integrity.py", "-k", "garbled_data"),
           "garbled array bytes load silently"),
    Mutant("rotation_forgets_the_good_step", "tlt_jax/checkpoint/checkpointer.py",
           "spared = set(steps[-self.keep:]) | ({max(self._good)} if self._good else set())",
           "spared = set(steps[-self.keep:])",
           ("tests/test_checkpoint_integrity.py", "-k", "rotation"),
           "keep-N rotation deletes the newest good checkpoint"),
    Mutant("compaction_slices_the_kv_cache", "tlt_jax/rollout/steps.py",
           "    rows = dataclasses.replace(rows, done=rows.done | pad,",
           "    rows = dataclasses.replace(rows, cache=jax.tree.map(lambda x: x[:index.shape[0]], "
           "state.cache))\n    rows = dataclasses.replace(rows, done=rows.done | pad,",
           ("tests/rollout/test_engine.py", "-k", "uncached_forward"),
           "the live rows move to a smaller bucket but the KV cache keeps the first rows"),
    Mutant("sd_bonus_from_the_root", "tlt_jax/rollout/speculative.py",
           "final_residual = jnp.where(active[:, None], pick_positions(probs, cur), final_residual)",
           "final_residual = jnp.where(active[:, None], pick_positions(probs, jnp.zeros_like(cur)),"
           " final_residual)",
           ("tests/rollout/test_lossless_deep.py", "-k", "chain-plain and target_law"),
           "after a fully accepted draft the bonus token is drawn from the root's distribution"),
    Mutant("sd_levels_reuse_the_first_accept_key", "tlt_jax/rollout/speculative.py",
           "_keys(args, rows, gen_pos + level, _ACCEPT + 8 * j)",
           "_keys(args, rows, gen_pos + min(level, 1), _ACCEPT + 8 * j)",
           ("tests/rollout/test_lossless_deep.py", "-k", "chain-plain and target_law"),
           "draft levels >= 2 reuse level 1's acceptance random numbers"),
    Mutant("math_verify_never_asked", "tlt_jax/rl/rewards.py",
           "  if use_math_verify and _math_verify_says(answer, gold):",
           "  if False:",
           ("tests/rl/test_rewards.py", "-k", "math_verify"),
           "the installed math_verify is never used"),
    Mutant("cache_outgrown_before_growing", "tlt_jax/rollout/steps.py",
           "go &= ~jnp.any(live & (s.cache.lengths + need > kv_len))",
           "go &= ~jnp.any(live & (s.cache.lengths > kv_len))",
           ("tests/rollout/test_kv_buckets.py", "-k", "change_nothing and vanilla"),
           "a segment keeps decoding until a row has already run past its length bucket"),
    Mutant("compaction_off_still_compacts", "tlt_jax/rollout/scheduler.py",
           "    if self.config.compaction and smaller < run.batch:",
           "    if smaller < run.batch:",
           ("tests/rollout/test_kv_buckets.py", "-k", "without_compaction"),
           "compaction=False compacts a chunk that stopped to grow its cache"),
    Mutant("packed_sequences_see_each_other", "tlt_jax/rl/update.py",
           "return (segments[:, :, None] == segments[:, None, :]) & causal[None]",
           "return jnp.broadcast_to(causal[None], segments.shape + (t,))",
           ("tests/rl/test_update_buckets.py", "-k", "packed_logprobs_equal or sum_to_the_full"),
           "packed sequences attend across their boundaries"),
    Mutant("reduced_vocab_draft_index_not_mapped", "tlt_jax/rollout/speculative.py",
           "      return drafter.to_target_ids(index), jnp.exp(logq)",
           "      return index.astype(jnp.int32), jnp.exp(logq)",
           ("tests/rollout/test_lossless_deep.py", "-k", "chain-reduced"),
           "a sampled draft from a reduced vocabulary is used as a target id without mapping",
           tier="full"),
    Mutant("reduced_vocab_loss_on_the_first_k_logits", "tlt_jax/drafter/objective.py",
           "    target_next_logits = jnp.take(target_next_logits, jnp.asarray(drafter.vocab_ids), "
           "axis=-1)",
           "    target_next_logits = target_next_logits[..., :len(drafter.vocab_ids)]",
           ("tests/drafter/test_reduced_vocab.py", "-k", "renormalised"),
           "the reduced drafter learns the target's first K logits instead of its subset's"),
    Mutant("catch_up_consumes_the_last_pending_pair", "tlt_jax/rollout/steps.py",
           "take = jnp.where(~s.done & (pend > limit), jnp.minimum(pend - 1, width), 0)",
           "take = jnp.where(~s.done & (pend > limit), jnp.minimum(pend, width), 0)",
           ("tests/rollout/test_adaptive.py", "-k", "catch_up"),
           "the catch-up leaves nothing pending, so the next SD step drafts from a stale pair"),
    Mutant("vanilla_feature_one_slot_late", "tlt_jax/rollout/steps.py",
           'extra["feats"] = state.feats.at[rows, state.num_generated].set(',
           'extra["feats"] = state.feats.at[rows, state.num_generated + 1].set(',
           ("tests/rollout/test_adaptive.py", "-k", "catch_up"),
           "vanilla steps store each token's feature one slot off"),
    Mutant("switch_without_catch_up", "tlt_jax/rollout/scheduler.py",
           "lagging |= not strategy.learned and self.learned",
           "lagging = False",
           ("tests/rollout/test_adaptive.py", "-k", "greedy_with_switching and mirror"),
           "vanilla -> SD switches skip the drafter's catch-up (drafts from a stale drafter)",
           tier="full"),
    Mutant("coupled_noise_of_the_next_position", "tlt_jax/rollout/speculative.py",
           "logp = logp + jnp.take_along_axis(noise, draft.depth[:, :, None], axis=1)",
           "logp = logp + jnp.take_along_axis(noise, jnp.minimum(draft.depth + 1, spec.depth)"
           "[:, :, None], axis=1)",
           ("tests/rollout/test_adaptive.py", "-k", "coupled and (adaptive-plain or chain-topk)"),
           "coupled verification perturbs a node with the noise of the following position"),
    Mutant("coupled_tree_ranked_by_perturbed_score", "tlt_jax/rollout/speculative.py",
           "    _, index = lax.top_k(shaken, k)\n    return jnp.take_along_axis(lp, index, -1), index",
           "    return lax.top_k(shaken, k)",
           ("tests/rollout/test_adaptive.py", "-k", "coupled and tree-plain"),
           "coupled trees rank candidates by perturbed score, so kept nodes need not form a tree"),
    Mutant("checkpoint_forgets_the_tuner", "tlt_jax/rollout/interface.py",
           "    tuner.load_state_dict(saved)",
           "    pass",
           ("tests/rl/test_adaptive_trainer.py", "-k", "through_a_checkpoint"),
           "a resumed run's tuner starts fresh instead of keeping what it learned"),
    # the adaptive drafter (issue 8)
    Mutant("hidden_states_one_position_late", "tlt_jax/rollout/scheduler.py",
           "feats[keep.index(s), :n]])",
           "feats[keep.index(s), 1:n + 1]])",
           ("tests/rollout/test_hidden.py", "-k", "own_pass and chain"),  # greedy chain
           "a row's completion hidden states are taken one position late"),
    Mutant("shard_samples_with_its_local_row_keys", "tlt_jax/rollout/parallel.py",
           "              row_offset=row_offset + rows.start,",
           "              row_offset=row_offset,",
           ("tests/rollout/test_parallel.py", "-k", "two_devices"),
           "each device's shard samples with row keys counted from 0, so tokens depend on the split",
           tier="full"),
    Mutant("interrupt_leaves_device_threads_running", "tlt_jax/rollout/parallel.py",
           "      while any(t in threading.enumerate() for t in threads):\n"
           "        time.sleep(0.005)\n",
           "",
           ("tests/rollout/test_parallel.py", "-k", "two_devices"),
           "Ctrl-C during a data-parallel rollout exits while device threads are inside XLA: the "
           "process aborts (exit -6) instead of saving and exiting 130",
           tier="full"),
    Mutant("buffer_positions_run_on_across_a_row", "tlt_jax/drafter/buffer.py",
           "        positions[r, at:at + n] = t\n",
           "        positions[r, at:at + n] = at + np.arange(n)\n",
           ("tests/drafter/test_buffer.py",),
           "packed samples get the row's running positions instead of their own"),
    Mutant("buffer_evicts_the_newest", "tlt_jax/drafter/buffer.py",
           "sample = self._samples.popleft()",
           "sample = self._samples.pop()",
           ("tests/drafter/test_buffer.py",),
           "over its byte bound the buffer drops the newest sample instead of the oldest"),
    Mutant("spot_step_not_counted", "tlt_jax/drafter/spot.py",
           "        self.steps += 1\n      metrics = jax.device_get(metrics)",
           "        pass\n      metrics = jax.device_get(metrics)",
           ("tests/drafter/test_spot.py",),
           "an applied drafter update is not counted (lost from the step count at preemption)"),
    Mutant("resume_leaves_the_drafter_buffer_empty", "tlt_jax/drafter/online.py",
           "    self.buffer.load_state_dict(state)",
           "    pass",
           ("tests/rl/test_online_drafter.py", "-k", "resume"),
           "a resumed run's drafter trains on other batches than the uninterrupted run"),
    # what ran, and switch costs (issue 19)
    Mutant("tuner_reward_leaves_out_the_catch_up", "tlt_jax/rollout/scheduler.py",
           'self.tuner.update(run.batch, strategy.name, delta["tokens"], end.seconds + switch_s,',
           'self.tuner.update(run.batch, strategy.name, delta["tokens"], end.seconds,',
           ("tests/rollout/test_adaptive.py", "-k", "charged_the_catch_up"),
           "an SD segment's reward leaves out the drafter catch-up before it, so the tuner "
           "overrates switching from vanilla"),
    Mutant("switches_count_only_catch_ups", "tlt_jax/rollout/scheduler.py",
           "    if run.previous is not None and strategy.name != run.previous:",
           '    if run.previous == "vanilla" and strategy.spec is not None and self.learned:',
           ("tests/rollout/test_adaptive.py", "-k", "ngram_drafter_too"),
           "sd_switches counts only vanilla -> learned-drafter switches (none with n-gram)",
           tier="full"),
    Mutant("serial_drafter_budget_ignored", "tlt_jax/drafter/online.py",
           "max_seconds=c.serial_seconds or None",
           "max_seconds=None",
           ("tests/rl/test_online_drafter.py", "-k", "time_budget"),
           "serial drafter training runs all serial_steps however long they take"),
    # every idle device trains the drafter: spot rounds (issue 21)
    Mutant("spot_round_sums_instead_of_averaging", "tlt_jax/drafter/spot.py",
           "weights[:len(team)] = 1.0 / len(team)", "weights[:len(team)] = 1.0",
           ("tests/drafter/test_spot_rounds.py", "-k", "four_devices"),
           "a round applies the sum of its members' gradients, not their mean"),
    Mutant("spot_round_counts_its_empty_slots", "tlt_jax/drafter/spot.py",
           "weights = np.zeros(slots, np.float32)",
           "weights = np.full(slots, 1.0 / len(team), np.float32)",
           ("tests/drafter/test_spot_rounds.py", "-k", "four_devices"),
           "the slots a round leaves empty (padded with the first member's gradient) get weight"),
    Mutant("spot_round_not_counted", "tlt_jax/drafter/spot.py",
           "      self.steps += 1\n      return out\n",
           "      return out\n",
           ("tests/drafter/test_spot_rounds.py", "-k", "four_devices"),
           "a round of several devices updates the params but not the step count"),
    Mutant("spot_idle_devices_never_join_a_round", "tlt_jax/drafter/online.py",
           "team = [idle_now[leader[0]]] + [idle_now[j] for j in sorted(idle_now) "
           "if j != leader[0]]",
           "team = [idle_now[leader[0]]]",
           ("tests/drafter/test_spot_rounds.py", "-k", "four_devices"),
           "only the first idle device trains; the others' hooks wait (one device at a time)"),
    Mutant("spot_rounds_not_precompiled", "tlt_jax/drafter/online.py",
           "slots=len(engine.devices) if spot else None)",
           "slots=None)",
           ("tests/drafter/test_spot_rounds.py", "-k", "four_devices"),
           "precompile_on compiles no gradient/apply step: the first round compiles in the tail"),
    Mutant("spot_full_rounds_keep_devices_waiting", "tlt_jax/drafter/online.py",
           "          return None  # the rounds are full: this device can never take part",
           "          pass",
           ("tests/drafter/test_spot_rounds.py", "-k", "four_devices"),
           "with spot_devices reached, a device going idle still waits in its hook (its idle "
           "time counted as used)"),
    # the first hour of a user: resume, signals, checks before work, loading (issue 19)
    Mutant("drafter_saves_kept_on_resume", "tlt_jax/job/runner.py",
           "dropped = drafter_ckpt.delete_after(trainer.step_count)", "dropped = []",
           ("tests/test_train_job.py", "-k", "eagle_drafter_trains_online"),
           "the drafter's selective saves of the steps a resumed run redoes collide with them",
           tier="full"),
    Mutant("config_written_before_restore", "tlt_jax/job/runner.py",
           "    save_run_config(cfg, logdir)\n  mesh =",
           "  if hosts.is_primary():\n    save_run_config(cfg, logdir)\n  mesh =",
           ("tests/test_train_job.py", "-k", "refused_resume_writes_nothing"),
           "a refused resume rewrites config.json with its failed overrides"),
    Mutant("stop_signal_step_not_saved", "tlt_jax/job/runner.py",
           "if stopped and steps.saved_step != trainer.step_count:",
           "if False:",
           ("tests/test_train_job.py", "-k", "signal_during_rl"),
           "a stop on SIGTERM/SIGINT loses the steps since the last checkpoint"),
    Mutant("sigterm_not_handled", "tlt_jax/job/signals.py",
           "      for sig in (signal.SIGINT, signal.SIGTERM):",
           "      for sig in (signal.SIGINT,):",
           ("tests/test_train_job.py", "-k", "signal_during_rl"),
           "SIGTERM (a preemption) kills the job without a checkpoint or a message"),
    Mutant("prompt_lengths_unchecked", "tlt_jax/job/build.py",
           "  if lengths[worst] > max_prompt_len:", "  if False:",
           ("tests/test_train_job.py", "-k", "bad_values_are_rejected and max_prompt_len"),
           "a too short rollout.max_prompt_len fails only after the warm start and compile"),
    Mutant("fixed_tuner_unchecked", "tlt_jax/rollout/engine_config.py",
           "        fixed_arm(self.tuner.fixed, b, names)", "        pass",
           ("tests/test_train_job.py", "-k", "fixed_tuner_naming"),
           "a fixed tuner naming an arm that is not offered fails only mid-rollout"),
    Mutant("infinite_learning_rate_accepted", "tlt_jax/rl/trainer.py",
           "0 < self.learning_rate < math.inf", "0 < self.learning_rate",
           ("tests/test_train_job.py", "-k", "bad_values_are_rejected and learning_rate"),
           "learning_rate=inf is accepted and fails after the warm start"),
    Mutant("drafter_fingerprint_ignores_weights", "tlt_jax/models/drafter.py",
           "    digest.update(np.ascontiguousarray(value).tobytes())",
           "    digest.update(str(value.dtype).encode())",
           ("tests/models/test_drafter_provenance.py",),
           "the policy fingerprint hashes only names and shapes: every same-shape policy matches"),
    Mutant("nonfinite_weights_load", "tlt_jax/models/hf.py",
           "        check_finite(array, file, hf_name)\n", "",
           ("tests/models/test_hf.py", "-k", "nonfinite"),
           "from_pretrained loads NaN/Inf weights without a word"),
    Mutant("hf_reader_dispatches_to_gguf", "tlt_jax/models/hf.py",
           "  path = Path(path)\n  hf_config = read_hf_config(path)",
           "  path = Path(path)\n  if path.suffix.lower() == \".gguf\" and not path.is_dir():\n"
           "    from tlt_jax.models.gguf import load_gguf  # pylint: disable=import-outside-toplevel"
           "\n    return load_gguf(path, dtype=dtype, strict=strict)\n"
           "  hf_config = read_hf_config(path)",
           ("tests/test_import_graph.py",),
           "the HF reader dispatches to the GGUF one again: gguf <-> hf is an import circle"),
    Mutant("update_ignores_advantages", "tlt_jax/rl/trainer.py",
           "batch = self.make_batch(prompts, result.tokens, result.logprobs, advantages)",
           "batch = self.make_batch(prompts, result.tokens, result.logprobs, "
           "np.ones_like(advantages))",
           ("tests/rl/test_trainer.py::test_rl_steps_learn_a_dense_reward",),
           "every sample is pushed up alike: the policy moves but does not learn the reward"),
    Mutant("policy_gradient_sign_flipped", "tlt_jax/rl/grpo.py",
           "  pg = -jnp.minimum(unclipped, clipped)", "  pg = jnp.minimum(unclipped, clipped)",
           ("tests/rl/test_trainer.py::test_rl_steps_learn_a_dense_reward",),
           "GRPO descends the reward"),
    Mutant("cache_skips_quick_compiles", "tlt_jax/compile_cache.py",
           '    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)',
           "    pass  # JAX default: only compiles over a second are cached",
           ("tests/test_compile_cache.py::test_second_run_loads_what_the_first_compiled",),
           "the compile cache keeps only programs that took over a second: most of ours recompile"),
    Mutant("generate_precompiles_every_bucket", "tlt_jax/configs/tiny_generate.py",
           "compaction=True, precompile=False))", "compaction=True, precompile=True))",
           ("tests/test_compile_cache.py::test_generate_compiles_only_what_its_request_uses",),
           "generate compiles every bucket to answer one prompt"),
    Mutant("cache_not_reset_on_enable", "tlt_jax/compile_cache.py",
           "  compilation_cache.reset_cache()  # JAX decides on its cache at the first compile, once",
           "  pass",
           ("tests/test_compile_cache.py::test_enable_takes_effect_after_compiles",),
           "a cache enabled after a first compile is never used"),
    # the cost-model tuner and the ledger (issue 21)
    Mutant("cost_model_probes_every_time", "tlt_jax/rollout/tuner/cost.py",
           "return drafter is not None and any(v == drafter.version for _, v in "
           "drafter.accept.get(arm, ()))",
           "return False",
           ("tests/rollout/test_tuner.py", "-k", "good_drafter_is_used"),
           "an arm measured under the current drafter is probed again at every decision"),
    Mutant("acceptance_not_pooled_over_arms", "tlt_jax/rollout/tuner/cost.py",
           "samples = [x for window in drafter.accept.values() for x in window]",
           "samples = []",
           ("tests/rollout/test_tuner.py", "-k", "useless_drafter_costs_one_probe"),
           "what one arm measured of the drafter is not used for the arms never run, so each "
           "of them costs a probe"),
    Mutant("drafter_quality_shift_ignored", "tlt_jax/rollout/tuner/cost.py",
           "shifted.append(a + (drafter.quality - then if then is not None else 0.0))",
           "shifted.append(a)",
           ("tests/rollout/test_tuner.py", "-k", "improved_drafter"),
           "a drafter whose held-out top-1 rose is judged by its old acceptance: never re-tried"),
    Mutant("calibration_trusted_over_segments", "tlt_jax/rollout/tuner/base.py",
           "             (mine_long, self._costs.get((bucket, vanilla))),\n",
           "",
           ("tests/rollout/test_tuner.py", "-k", "calibration_flattered"),
           "an arm's measured long segments do not correct a flattering calibration"),
    Mutant("settled_vanilla_still_cut_into_segments", "tlt_jax/rollout/tuner/cost.py",
           "settled = not self._meta[greedy].speculative and not close",
           "settled = False",
           ("tests/rollout/test_tuner.py", "-k", "useless_drafter_costs_one_probe"),
           "a bucket settled on vanilla still stops every segment_steps steps"),
    Mutant("probes_run_full_segments", "tlt_jax/rollout/tuner/cost.py",
           "                      self.config.probe_steps, probe=True)",
           "                      None, probe=True)",
           ("tests/rollout/test_tuner.py", "-k", "cost or useless or calibration or drafter"),
           "a probe of an unsure arm runs a whole segment_steps segment"),
    Mutant("close_calls_never_measured_at_their_bucket", "tlt_jax/rollout/tuner/cost.py",
           "    if unmeasured:  # (its acceptance first, in a short probe, if the drafter is new to it)",
           "    if False:",
           ("tests/rollout/test_tuner.py", "-k", "close_call_the_calibration"),
           "an arm the calibration puts just below vanilla is never measured where it runs, so "
           "a calibration error keeps a faster arm out"),
    Mutant("stale_predictions_after_an_update", "tlt_jax/rollout/tuner/cost.py",
           "  def update(self, *args, **kwargs) -> None:\n    self._speeds.clear()\n",
           "  def update(self, *args, **kwargs) -> None:\n",
           ("tests/rollout/test_tuner.py", "-k", "useless_drafter_costs_one_probe"),
           "the cached predictions outlive a measurement: the tuner decides on what it knew "
           "before the segment"),
    Mutant("advantages_dispatched_to_the_device", "tlt_jax/rl/trainer.py",
           "advantages = grpo.group_advantages(rewards, g, self.grpo_config.normalize_std,",
           "advantages = grpo.group_advantages(jax.numpy.asarray(rewards), g, "
           "self.grpo_config.normalize_std,",
           ("tests/rl/test_ledger_trainer.py", "-k", "no_compiles"),
           "the step's advantages are eager jax ops: the first RL step compiles them"),
    Mutant("ledger_bootstrap_unbounded", "tlt_jax/drafter/ledger.py",
           "self.bootstrap_left -= bootstrap",
           "self.bootstrap_left -= 0",
           ("tests/drafter/test_ledger.py", "-k", "bootstrap_is_granted"),
           "the bootstrap grant never runs out: the drafter trains every step whether SD pays"),
    Mutant("ledger_losses_not_debited", "tlt_jax/drafter/ledger.py",
           "self.balance_s += self.savings_share * float(saved_s)",
           "self.balance_s += self.savings_share * max(float(saved_s), 0.0)",
           ("tests/drafter/test_ledger.py", "-k", "losses_are_debited"),
           "time SD lost (probes) is not charged against the drafter's budget"),
    Mutant("sd_saving_forgets_the_sd_time", "tlt_jax/rollout/stats.py",
           "total += tally.critical_tokens * step_s - tally.seconds",
           "total += tally.critical_tokens * step_s",
           ("tests/rollout/test_stats.py",),
           "the SD saving counts the vanilla time avoided but not what the SD segments took"),
    Mutant("unchanged_drafter_scored_again", "tlt_jax/drafter/online.py",
           "    if not self.evaluated:  # the engines' weights were not scored yet",
           "    if True:",
           ("tests/rl/test_ledger_trainer.py", "-k", "unchanged_weights"),
           "an unchanged drafter is evaluated again every step (critical-path time for nothing)"),
    # ---- issue 22: drafts from the rollout's own history ----
    Mutant("suffix_support_ignored", "tlt_jax/rollout/suffix.py",
           "order = jnp.lexsort((-firsts, -supports, -matched), axis=-1)",
           "order = jnp.lexsort((-firsts, supports, -matched), axis=-1)",
           ("tests/rollout/test_suffix.py", "-k", "documented_rules or hedges"),
           "the least supported continuation is drafted first, not the most frequent"),
    Mutant("suffix_budget_counts_the_bonus", "tlt_jax/rollout/suffix.py",
           "budget = jnp.clip(remaining.astype(jnp.int32) - 1, 0, depth)",
           "budget = jnp.clip(remaining.astype(jnp.int32), 0, depth)",
           ("tests/rollout/test_suffix.py", "-k", "documented_rules"),
           "a row near its length limit drafts a token it can never emit (its slot is lost to "
           "the hedges)"),
    Mutant("suffix_sibling_prompts_searched", "tlt_jax/rollout/suffix.py",
           "ctx_ok = same[:, :, None] & followed & (is_self[:, :, None] | ~in_prompt)",
           "ctx_ok = same[:, :, None] & followed",
           ("tests/rollout/test_suffix.py", "-k", "documented_rules"),
           "the siblings' prompts (the row's own) are searched again as 'group' occurrences"),
    Mutant("history_not_packed", "tlt_jax/rollout/scheduler.py",
           "history[slot] = pack_history(request.history[i], history.shape[1])",
           "pass",
           ("tests/rollout/test_suffix.py", "-k", "greedy_with_history"),
           "generate(history=...) is accepted but never reaches the decode state"),
    Mutant("bounded_segments_ignore_the_measured_length", "tlt_jax/rollout/scheduler.py",
           "bounded = self.segment_lengths.get(batch, self.config.segment_steps)",
           "bounded = self.config.segment_steps",
           ("tests/rollout/test_adaptive.py", "-k", "measured_length"),
           "segments stay configured-short where a boundary costs many decode steps (an "
           "accelerator): the calibration's boundary is paid every 32 steps"),
    Mutant("history_check_lets_out_of_vocab_ids_through", "tlt_jax/rollout/engine.py",
           "if ids.size and (ids.min() < 0 or ids.max() >= vocab):",
           "if False:",
           ("tests/rollout/test_suffix.py", "-k", "history"),
           "an out-of-vocabulary id in the history reaches the suffix drafter's gather"),
    Mutant("bootstrap_ignores_its_time_budget", "tlt_jax/drafter/ledger.py",
           "        bootstrap = int(min(bootstrap, affordable))",
           "        bootstrap = int(bootstrap)",
           ("tests/drafter/test_ledger.py", "-k", "bootstrap_in_time"),
           "the drafter's bootstrap runs max_steps every RL step whatever its time budget: the "
           "default job pays it on the critical path"),
    Mutant("point_chain_accepts_every_draft", "tlt_jax/rollout/speculative.py",
           "    passed = u < p_tok\n", "    passed = u < 1.0\n",
           ("tests/rollout/test_suffix.py", "-k", "sampled and chain-stop"),
           "point-mass chains (n-gram, suffix) accept every draft: the output law is the "
           "history's, not the target's"),
    Mutant("point_chain_bonus_keeps_the_rejected_token", "tlt_jax/rollout/speculative.py",
           "final = jnp.where(stopped[:, None], removed, here)", "final = here",
           ("tests/rollout/test_suffix.py", "-k", "sampled and chain-stop"),
           "after a rejected point-mass draft the bonus may be that token again: it is "
           "over-sampled"),
    Mutant("learned_drafter_not_caught_up_after_suffix", "tlt_jax/rollout/scheduler.py",
           "lagging |= not strategy.learned and self.learned",
           "lagging |= strategy.spec is None and self.learned",
           ("tests/rollout/test_suffix.py", "-k", "share_one_engine"),
           "after suffix segments the learned drafter drafts from a stale cache (no catch-up)"),
    Mutant("history_share_not_forgotten", "tlt_jax/rollout/tuner/cost.py",
           "    if forget:\n      drafter.accept.clear()\n", "",
           ("tests/rollout/test_tuner.py", "-k", "forgotten"),
           "a suffix drafter judged hopeless without history is never re-tried once the prompts "
           "have history"),
    Mutant("suffix_acceptance_pooled_with_learned", "tlt_jax/rollout/tuner/cost.py",
           "samples = [x for window in drafter.accept.values() for x in window]",
           "samples = [x for d in self._drafters.values() for window in d.accept.values() "
           "for x in window]",
           ("tests/rollout/test_tuner.py", "-k", "borrows_acceptance_only"),
           "a suffix arm never run borrows the learned drafter's acceptance (and vice versa)"),
    Mutant("observe_bumps_every_drafter", "tlt_jax/rollout/tuner/cost.py",
           "    drafter.version += 1\n",
           "    for d in self._drafters.values():\n      d.version += 1\n",
           ("tests/rollout/test_tuner.py", "-k", "re_probes_only_its_arms"),
           "observing one drafter re-probes the other's arms too"),
    Mutant("history_lookup_refreshes_eviction", "tlt_jax/rl/history.py",
           "kept = (new + old)[:self.config.per_prompt]",
           "kept = (old + new)[:self.config.per_prompt]",
           ("tests/rl/test_history.py", "-k", "newest_first"),
           "the store keeps the oldest completions and drafts from stale ones"),
    Mutant("history_kept_for_a_vanilla_engine", "tlt_jax/rl/trainer.py",
           "    if history is not None and self.engine.uses_history:",
           "    if history is not None:",
           ("tests/rl/test_trainer.py", "-k", "vanilla_engine_gets_no_history"),
           "a rollout that cannot draft from history pays for keeping and saving it"),
    Mutant("history_not_saved", "tlt_jax/rl/trainer.py",
           "      metadata[HISTORY_KEY] = self.history.state_dict()\n", "",
           ("tests/rl/test_trainer.py", "-k", "store_is_saved"),
           "a resumed run drafts from an empty store: its metrics differ from the "
           "uninterrupted run's"),
    Mutant("history_hit_rate_after_the_add", "tlt_jax/rl/trainer.py",
           "      had.setdefault(prompt_key(prompts[first]), bool(earlier[i]))\n"
           "    for first in range(0, len(prompts), g):\n"
           "      self.history.add(prompts[first], completions[first:first + g])\n",
           "      pass\n"
           "    for first in range(0, len(prompts), g):\n"
           "      self.history.add(prompts[first], completions[first:first + g])\n"
           "    for first in range(0, len(prompts), g):\n"
           "      had.setdefault(prompt_key(prompts[first]), self.history.has(prompts[first]))\n",
           ("tests/rl/test_trainer.py", "-k", "earlier_completions"),
           "history_hit_rate counts the step's own completions as history"),
    Mutant("job_drops_the_suffix_drafter", "tlt_jax/job/runner.py",
           "drafter_training=job.drafter_training, suffix=job.suffix,",
           "drafter_training=job.drafter_training, suffix=None,",
           ("tests/test_train_job.py", "-k", "hands_the_trainer"),
           "config.drafter=suffix builds a trainer without the suffix drafter"),
    # several processes and FSDP (issue 23)
    Mutant("process_takes_the_wrong_shards", "tlt_jax/rollout/processes.py",
           "mine = shards[index * local_devices:(index + 1) * local_devices]",
           "mine = shards[index:index + local_devices]",
           ("tests/test_hosts.py", "-k", "shards_of_the_one_process_split"),
           "a process with several devices takes another process's rows"),
    Mutant("process_rows_sampled_with_local_keys", "tlt_jax/rollout/processes.py",
           "prompts[rows.start:rows.stop], params, row_offset=rows.start,",
           "prompts[rows.start:rows.stop], params, row_offset=0,",
           ("tests/rollout/test_processes.py",),
           "a process samples its rows with the keys of rows 0.., so tokens follow the process count"),
    Mutant("process_loads_process_0s_tuner", "tlt_jax/rollout/processes.py",
           "self.local.load_tuner_state(states[me], report)",
           "self.local.load_tuner_state(states[0], report)",
           ("tests/rollout/test_processes.py", "-k", "tuner"),
           "every process resumes with process 0's tuner"),
    Mutant("allgather_puts_itself_first", "tlt_jax/hosts.py",
           "    if peer == me:\n      out.append(value)",
           "    if peer == 0:\n      out.append(value)",
           ("tests/test_hosts.py", "-k", "exchange_in_rounds"),
           "an exchange puts this process's value in process 0's slot"),
    Mutant("launcher_leaves_the_survivors", "tlt_jax/launch.py",
           "        _stop(children, grace_s)\n        break",
           "        break",
           ("tests/test_hosts.py", "-k", "launcher_stops_the_others"),
           "the launcher waits for the survivors of a dead process instead of stopping them"),
    Mutant("launched_processes_keep_their_own_pool", "tlt_jax/launch.py",
           '    env["PJRT_NPROC"] = str(cpu_pool_size(base, count * devices))',
           '    env["PJRT_NPROC"] = str(cpu_pool_size(base, devices))',
           ("tests/test_hosts.py", "-k", "rounds_as_one_process"),
           "each launched process gets the XLA:CPU pool of its own devices: long products round "
           "otherwise than in one process with every device (tokens drift from the 1-process run)"),
    Mutant("no_wait_for_the_coordinator", "tlt_jax/hosts.py",
           "    wait_for_coordinator(address, index, connect_timeout_s)\n",
           "    pass\n",
           ("tests/test_hosts.py", "-k", "cannot_reach_the_coordinator"),
           "a process whose coordinator never comes is aborted by JAX with only 'deadline "
           "exceeded'"),
    Mutant("fsdp_optimizer_state_replicated", "tlt_jax/rl/mesh.py",
           "    self.opt_state = self.of(opt_state) if opt_state is not None else self.replicated",
           "    self.opt_state = self.replicated",
           ("tests/rl/test_fsdp.py",),
           "FSDP shards the params but keeps a whole optimizer state on every device"),
    Mutant("fsdp_engines_get_shards", "tlt_jax/rl/update.py",
           '    return self._compiled(("gather",))(self.params)',
           "    return self.params",
           ("tests/rl/test_fsdp.py",),
           "the rollout engines are handed FSDP shards instead of gathered params"),
    Mutant("drafter_buffers_share_one_file", "tlt_jax/drafter/online.py",
           "  if hosts.process_count() == 1:\n    return BUFFER_FILE",
           "  if True:\n    return BUFFER_FILE",
           ("tests/test_multiprocess.py", "-k", "online_drafter"),
           "every process writes its drafter buffer to the same checkpoint file",
           tier="full"),
    # issue 34: behaviours and assertions no test checked
    Mutant("notebook_glob_misses_one", "tests/test_notebooks.py",
           'NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))',
           'NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*_*_*.ipynb"))',
           ("tests/test_notebooks.py", "-k", "there_are_notebooks"),
           "a narrower glob finds 3 of the 4 notebooks: one is never executed"),
    Mutant("dead_peer_takes_others_with_it", "tests/hosts_worker.py",
           'if mode == "die" and me == 1:', 'if mode == "die" and me != 0:',
           ("tests/test_hosts.py", "-k", "dead_peer"),
           "more processes die than the one named: JAX names processes 1 and 2, and process 2 "
           "exits by itself instead of being ended"),
    Mutant("tail_idle_is_the_least_idle_device", "tlt_jax/drafter/online.py",
           '"tail_idle_device_s": float(sum(d.idle_s for d in devices)),',
           '"tail_idle_device_s": float(min((d.idle_s for d in devices), default=0.0)),',
           ("tests/test_train_job.py", "-k", "four_devices"),
           "the tail's idle device-seconds are the least idle device's (the slowest one's 0 s)",
           tier="full"),
    Mutant("first_segment_counts_as_a_switch", "tlt_jax/rollout/scheduler.py",
           "if run.previous is not None and strategy.name != run.previous:",
           "if strategy.name != run.previous:",
           ("tests/rl/test_adaptive_trainer.py", "-k", "reports_switches"),
           "sd_switches counts a chunk's first segment as a change of arm"),
    Mutant("bench_update_speedup_inverted", "experiments/rl/bench_update.py",
           'out["speedup"] = out["padded"]["update_s"] / out["packed"]["update_s"]',
           'out["speedup"] = out["packed"]["update_s"] / out["padded"]["update_s"]',
           ("tests/test_experiments.py", "-k", "cheapest_benchmarks"),
           "the packed update's speedup is reported as packed / padded seconds",
           tier="full"),
    Mutant("every_step_samples_with_one_seed", "tlt_jax/rl/trainer.py",
           "seed=(cfg.seed * 1_000_003 + self.step_count) % 2**32)",
           "seed=(cfg.seed * 1_000_003) % 2**32)",
           ("tests/rl/test_trainer.py", "-k", "seed_of_its_own"),
           "every RL step's rollout samples with the same seed: the same noise per row and "
           "position each step"),
    Mutant("history_stores_the_next_groups_row", "tlt_jax/rl/trainer.py",
           "self.history.add(prompts[first], completions[first:first + g])",
           "self.history.add(prompts[first], completions[first + 1:first + g + 1])",
           ("tests/rl/test_trainer.py", "-k", "its_own_prompts_history"),
           "a prompt's history gets the next prompt's first completion (decoding stays lossless)"),
    Mutant("history_rows_paired_r_mod_p", "tlt_jax/rl/trainer.py",
           "history=[h for h in earlier for _ in range(g)])",
           "history=[earlier[r % len(earlier)] for r in range(len(prompts))])",
           ("tests/rl/test_trainer.py", "-k", "its_own_prompts_history"),
           "row r drafts from prompt r % P's history instead of its own (r // g)"),
    Mutant("config_json_written_in_place", "tlt_jax/job/typed_config.py",
           'tmp = path.with_name(path.name + ".tmp")', "tmp = path",
           ("tests/test_train_job.py", "-k", "replaced_atomically"),
           "config.json is truncated and rewritten in place: a crash leaves a partial config"),
    Mutant("drafter_buffer_written_in_place", "tlt_jax/drafter/online.py",
           '    tmp = path + ".tmp"\n', "    tmp = path\n",
           ("tests/rl/test_online_drafter.py", "-k", "replaced_atomically"),
           "the drafter buffer file is rewritten in place: a crash leaves a partial buffer"),
    Mutant("ledger_no_debit_without_training", "tlt_jax/drafter/ledger.py",
           "    else:\n      self.balance_s -= other_s\n", "",
           ("tests/drafter/test_ledger.py", "-k", "without_training"),
           "a step that trained no drafter step does not pay for its evaluation and copy"),
    Mutant("llama3_rope_blend_inverted", "tlt_jax/models/transformer.py",
           "blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled",
           "blended = smooth * scaled / scaling.factor + (1 - smooth) * scaled",
           ("tests/models/test_transformer.py", "-k", "published_llama31"),
           "Llama-3 RoPE scaling blends the mid band the wrong way round"),
    Mutant("pool_lowers_from_the_arrays", "tlt_jax/rollout/pool.py",
           "      return jax.jit(fn, donate_argnums=1).lower(self.weights_spec(),\n",
           "      return jax.jit(fn, donate_argnums=1).lower(self.weights(),\n",
           ("tests/test_compile_cache.py", "-k", "resumed_run"),
           "the decode segments are lowered from the weight arrays, whose type names the mesh a "
           "replicated array came from: a resumed run (restored arrays) misses 4 of 45", "full"),
    Mutant("locked_tuner_reads_unlocked", "tlt_jax/rollout/parallel.py",
           '  summary = _locked("summary")\n',
           "  summary = lambda self, *args: self.tuner.summary(*args)\n",
           ("tests/rollout/test_parallel.py", "-k", "lock"),
           "the shared tuner's summary reads beside another thread's plan (CI met a half-built "
           "prediction: KeyError 'chain d3')"),
    Mutant("saving_prices_the_shortest_row", "tlt_jax/rollout/scheduler.py",
           "longest = int(np.argmax(self.emitted))",
           "longest = int(np.argmin(self.emitted))",
           ("tests/rollout/test_adaptive.py", "-k", "critical_tokens"),
           "SD's saving follows the chunk's shortest row, not the one vanilla's time waits on"),
    Mutant("saving_prices_the_mean_row", "tlt_jax/rollout/stats.py",
           "total += tally.critical_tokens * step_s - tally.seconds",
           "total += tally.tokens / tally.row_steps * tally.steps * step_s - tally.seconds",
           ("tests/rollout/test_stats.py",),
           "the saving counts the mean row's accepted length, overstating it where short rows "
           "accept more than the long one (on the H200's long-tail job: 29.6 ms a step claimed, "
           "5.0 ms measured)"),
    Mutant("control_updates_anyway", "tlt_jax/rl/trainer.py",
           'out = {"control": True} if cfg.control else self.policy_update(batch)',
           'out = dict(self.policy_update(batch), control=True) if cfg.control else '
           'self.policy_update(batch)',
           ("tests/rl/test_trainer.py", "-k", "no_update_control"),
           "the no-update control still updates the policy (its curve would not be a control)"),
    Mutant("periodic_eval_after_the_save", "tlt_jax/job/runner.py",
           "    if _evaluation_due(self.job.trainer, trainer.step_count):  # before the save",
           "    if False:  # before the save",
           ("tests/test_train_job.py", "-k", "periodic or eval_every"),
           "no periodic held-out evaluation: the curve has its two ends only"),
    # ---- the EAGLE-3 drafter (issue 40)
    Mutant("eagle3_residual_normed", "tlt_jax/models/eagle3.py",
           "    x = hidden + attn\n",
           "    x = self.hidden_norm(hidden) + attn\n",
           ("tests/models/test_eagle3_speculators.py",),
           "the first layer's residual is the normed hidden (speculators' norm_before_residual)"),
    Mutant("eagle3_export_unsorted_vocab", "tlt_jax/models/speculators_format.py",
           "    order = np.argsort(np.asarray(drafter.vocab_ids))",
           "    order = np.arange(len(drafter.vocab_ids))",
           ("tests/models/test_eagle3_speculators.py",),
           "the export writes head rows and d2t in the drafter's own order, not by target id"),
    Mutant("feature_tap_after_the_layer", "tlt_jax/models/transformer.py",
           "      if i in wanted:\n        taps[i] = x\n      kv =",
           "      kv =",
           ("tests/models/test_eagle3.py",),
           "a feature layer id taps nothing but the final stream (KeyError) or the wrong layer"),
    Mutant("ttt_mask_crosses_sequences", "tlt_jax/drafter/objective.py",
           "    step_mask = mask * _shift(mask, k) * (_shift(segments, k) == segments)",
           "    step_mask = mask * _shift(mask, k)",
           ("tests/models/test_eagle3.py",),
           "a chained step is scored against the next packed sequence's token"),
    Mutant("ttt_positions_not_advanced", "tlt_jax/models/eagle3.py",
           "    out = drafter.forward(target, step_tokens, hidden, positions + k,",
           "    out = drafter.forward(target, step_tokens, hidden, positions,",
           ("tests/models/test_eagle3.py", "tests/models/test_eagle3_speculators.py"),
           "chained training steps sit at the root's position, not one further each"),
    Mutant("spot_compiles_for_the_hidden_width", "tlt_jax/drafter/spot.py",
           "    feats = spec((rows, length, self.feature_size), self.buffer.dtype)",
           "    feats = spec((rows, length, 32), self.buffer.dtype)",
           ("tests/drafter/test_spot.py",),
           "ahead-of-time spot steps are compiled for H-wide features (an eagle3 drafter's are "
           "(n+1)H)"),

]


def copy_repo(dest: pathlib.Path) -> None:
  """The package, tests and build files (no .git, no outputs) into ``dest``."""
  for name in ("tlt_jax", "tests", "notebooks", "experiments"):
    shutil.copytree(ROOT / name, dest / name, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
  for name in ("pyproject.toml", "README.md"):
    shutil.copy2(ROOT / name, dest / name)
  os.symlink("tlt_jax/configs", dest / "configs")


def run_mutant(mutant: Mutant, timeout: int) -> tuple[str, float, str]:
  """Returns (verdict, seconds, detail): 'caught', 'SURVIVED' or 'NOT APPLIED'."""
  with tempfile.TemporaryDirectory(prefix=f"mutant_{mutant.name}_") as tmp:
    dest = pathlib.Path(tmp)
    copy_repo(dest)
    path = dest / mutant.file
    text = path.read_text()
    if text.count(mutant.old) != 1:
      return "NOT APPLIED", 0.0, f"the text to replace occurs {text.count(mutant.old)} times"
    path.write_text(text.replace(mutant.old, mutant.new))
    env = dict(os.environ, PYTHONPATH=str(dest), JAX_PLATFORMS="cpu")
    # the fast tier's tests only (a fast-tier mutant whose tests are all slow matches no test)
    tier = ["-m", "not slow"] if mutant.tier == "fast" else ["-m", ""]
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p",
                           "no:cacheprovider", *tier, *mutant.tests], cwd=dest, env=env,
                          capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - t0
    tail = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode == 5:  # pytest: no tests collected
      return "NOT APPLIED", seconds, "no test matched"
    return ("caught" if done.returncode != 0 else "SURVIVED"), seconds, tail


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
  parser.add_argument("--list", action="store_true", help="list the mutants and exit")
  parser.add_argument("--timeout", type=int, default=900, help="seconds per mutant")
  args = parser.parse_args()
  chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
  unknown = set(args.names) - {m.name for m in MUTANTS}
  if unknown:
    parser.error(f"unknown mutants {sorted(unknown)}")
  if args.list:
    for m in chosen:
      print(f"{m.name:36s} {m.tier:4s} {m.file:28s} {' '.join(m.tests)}\n{'':36s} {m.why}")
    return 0
  failures, caught = 0, {"fast": 0, "full": 0}
  with tempfile.TemporaryDirectory(prefix="mutants_xla_") as cache:
    os.environ.setdefault("TLT_TEST_COMPILE_CACHE", cache)
    for m in chosen:
      verdict, seconds, detail = run_mutant(m, args.timeout)
      failures += verdict != "caught"
      caught[m.tier] += verdict == "caught"
      print(f"{verdict:12s} {m.tier:4s} {m.name:36s} {seconds:6.0f}s  {detail}", flush=True)
  print(f"{len(chosen) - failures} of {len(chosen)} mutants caught "
        f"({caught['fast']} in the fast tier, {caught['full']} in the full tier)")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
