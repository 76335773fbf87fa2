"""The RL side of TLT: tasks and verifiable rewards (``tasks.py``, ``rewards.py``,
``external_tasks.py``), the GRPO maths (``grpo.py``), the update's row packing (``packing.py``) and
jitted policy update (``update.py``), the SFT warm start (``sft.py``) and the trainer that runs one
RL step (``trainer.py``)."""

from tlt_jax.rl.tasks import ArithmeticTask, Problem, Task, extract_answer

__all__ = ["ArithmeticTask", "Problem", "Task", "extract_answer"]
