"""Turn per-rank graphs into readable Python files, their manifest and their weight shards."""

from fxshard.codegen.emit import emit_rank, rank_file_name

__all__ = ["emit_rank", "rank_file_name"]
