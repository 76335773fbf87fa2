"""Speculative decoding: SD vs vanilla, its verification, the tuner and the pass costs."""
