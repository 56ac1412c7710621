"""Compiler passes, one per file, run in order by ``fxshard.compiler``."""
