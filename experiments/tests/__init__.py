"""The tests of the experiments: the scripts, the modules they share (``harness``, the step-time
model, ``reproduce``) and the docs' figures they make. The package's own tests, in tests/, never
import anything of experiments/ (tests/test_test_imports.py)."""
