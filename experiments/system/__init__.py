"""The system: accelerator check, loader parity, start times, processes, FSDP, scaling model."""
