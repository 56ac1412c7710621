"""The spawn harness the multi-process tests use (it lives in the library, shared with the benchmarks)."""

from fxshard.testing import spawn

__all__ = ["spawn"]
