"""RL steps and jobs: whether the default job learns, end-to-end speedups, the update."""
