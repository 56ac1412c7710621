"""Defaults read on both sides of the compiler: the rank files' text states them, the trainer runs with them.

A leaf without torch (the command line reads ``fxshard run``'s options before torch loads).
"""

ZERO_BUCKET_MB = 160.0  # ZeRO 1's flat buckets (fxshard.runtime.distributed_optimizer): --zero-bucket-mb's default
