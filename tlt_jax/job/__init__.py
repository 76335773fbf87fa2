"""The main job (``python -m tlt_jax.train``), a room per part of it.

- ``typed_config``: ml_collections configs (files, sections, JSON) into validated dataclasses;
  every mistake a ``ConfigError`` naming ``config.<section>.<key>``.
- ``build``: the job's config translated once into a ``Job``, with every check that needs no
  model (``build_job``, ``job_devices``, ``check_prompt_lengths``).
- ``rollout_config``: the drafter (``config.drafter`` parsed once into a ``DrafterSpec``), the
  rollout engine's config and the drafter's online training.
- ``run_dir``: the logdir: the saved config and resume, the metrics log, the final exports.
- ``signals``: a clean stop on SIGINT/SIGTERM.
- ``runner``: running it: warm start, the compile before the first step (``precompile``), GRPO
  steps, checkpoints, evaluation, console lines.
"""
