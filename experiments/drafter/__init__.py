"""The drafter: the bench target and its offline drafters, drift, spot training, saves."""
