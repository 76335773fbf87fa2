"""The rollout engine without SD: bucketing, capacity, a decode step, against tunix."""
