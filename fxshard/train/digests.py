"""Content digests: what a checkpoint proves of its tensors, and what identifies a token file on resume.

A checkpoint's shard records, in its safetensors header's metadata, the digest of every tensor's bytes as saved
(``fxshard.digests``: ``{key: hex}``, ``fxshard.digest``: the hash); the index records each shard file's size and
the digest of its header, which holds those digests.  Every tensor read back (resume, export) is hashed and compared:
a flipped bit anywhere in a checkpoint is named with its tensor and file, where safetensors and
``torch.distributed.checkpoint`` would load it.  The hash is xxHash's XXH3 (128 bits): a checksum against damage
(disks, copies, bit flips), not a signature against an attacker, who could rewrite the digests too; measured on
this project's CPU machine at about 5x sha256's rate (``hashlib.sha256``), so a save or a resume spends a small part
of its time on it (docs/checkpoints.md has the figures)::

    digests = tensor_digests(tensors)                # {key: hex}, at save
    check_tensor(t, digests[key], "ckpt/step-5/shard-pp0-tp0.safetensors", key)   # at load
    file_digest(Path("data/corpus.bin"))             # a token file's digest, once per process
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
import xxhash

from fxshard.errors import FxshardError

HASH = "xxh3-128"
META_HASH, META_DIGESTS = "fxshard.digest", "fxshard.digests"  # keys of the shard's safetensors metadata
CHUNK = 16 << 20


class DigestError(FxshardError):
    """Bytes read back differ from the digest recorded when they were written: the file is damaged."""


def tensor_digest(t: torch.Tensor) -> str:
    """The digest of ``t``'s bytes (as stored: contiguous, its own dtype)."""
    t = t.detach().cpu().contiguous()
    return xxhash.xxh3_128_hexdigest(t.reshape(-1).view(torch.uint8).numpy())


def tensor_digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: tensor_digest(v) for k, v in tensors.items()}


def shard_metadata(digests: dict[str, str]) -> dict[str, str]:
    """The safetensors metadata that carries a shard's tensor digests."""
    return {META_HASH: HASH, META_DIGESTS: json.dumps(digests, sort_keys=True)}


def digests_of(metadata: dict | None, where: str) -> dict[str, str] | None:
    """The tensor digests a shard's metadata records (None: saved before fxshard recorded them)."""
    if not metadata or META_DIGESTS not in metadata:
        return None
    if metadata.get(META_HASH) != HASH:
        raise DigestError(f"{where}: its digests are {metadata.get(META_HASH)!r}, a hash this fxshard does not "
                          f"compute (it knows {HASH}); read it with the fxshard that saved it")
    try:
        digests = json.loads(metadata[META_DIGESTS])
    except ValueError:
        digests = None
    if not isinstance(digests, dict):
        raise DigestError(f"{where}: its header's {META_DIGESTS} is not a JSON object of digests; the file is "
                          "damaged")
    return digests


def check_tensor(t: torch.Tensor, digest: str | None, where: str, key: str) -> torch.Tensor:
    """``t`` when its bytes have ``digest``; a :class:`DigestError` naming the file and the tensor otherwise."""
    if digest is None:
        raise DigestError(f"{where}: tensor {key!r} has no digest in the file's header, where every tensor saved "
                          "has one; the file is damaged")
    found = tensor_digest(t)
    if found != digest:
        raise DigestError(f"{where}: tensor {key!r} differs from what was saved (its bytes hash to {found[:16]}, the "
                          f"save recorded {digest[:16]}); the file is damaged (a flipped bit, a bad copy): resume "
                          "from an earlier step, or copy the checkpoint again from its source")
    return t


def header(path: Path) -> bytes:
    """A safetensors file's JSON header (its 8-byte length first), as bytes."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > os.fstat(f.fileno()).st_size:
            raise ValueError(f"header of {length} bytes in a file of {os.fstat(f.fileno()).st_size}")
        return f.read(length)


def header_digest(path: Path) -> str:
    return xxhash.xxh3_128_hexdigest(header(path))


def file_digest(path: Path) -> dict:
    """``{"size", "digest"}`` of the whole file ``path``, read once per process and file version."""
    st = os.stat(path)
    return _file_digest(str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=16)
def _file_digest(path: str, size: int, mtime_ns: int, ino: int) -> dict:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return {"size": size, "digest": f"{HASH}:{h.hexdigest()}"}
