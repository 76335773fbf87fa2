"""RL side of TLT: tasks and rewards (GRPO losses and the trainer loop follow)."""

from tlt_jax.rl.tasks import ArithmeticTask, Problem, Task, extract_answer

__all__ = ["ArithmeticTask", "Problem", "Task", "extract_answer"]
