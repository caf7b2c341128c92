"""WebDataset tar shards over any fsspec URL: units are whole tar objects, samples are member groups.

Flow: ``list_objects`` lists ``*.tar`` under the URL; ``units`` is one unit per tar (no request: a
tar has no index to read first); ``read`` fetches the tar in one GET and groups its members the
WebDataset way: ``dir/name.cls`` and ``dir/name.jpg`` are fields ``cls`` and ``jpg`` of the sample
``dir/name`` (the key is the member path up to the first dot of its file name). Each field becomes
a binary column of the member's bytes (null where a sample lacks it); the row's key is
``<object path>:<sample key>``. Give ``columns`` (field names) so every shard has the same schema.
"""

from __future__ import annotations

import io
import posixpath
import tarfile
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from epochcache.arrays import binaries, texts
from epochcache.errors import CorruptObjectError
from epochcache.sources.base import KEY_COLUMN, RemoteObject, Unit
from epochcache.sources.digests import DigestMemory
from epochcache.sources.files import FileSource

_SUFFIXES = (".tar",)
_END_BLOCKS = 2 * tarfile.BLOCKSIZE  # the end-of-archive marker: two zero blocks


class WebDatasetSource(FileSource):
    """A folder (or a single file) of WebDataset tar shards at ``url``; see the module docstring."""
    suffixes = _SUFFIXES
    kind = 'WebDataset tar'
    column_word = 'field'

    def __init__(
        self, url: str, columns: Sequence[str] | None = None, storage_options: dict[str, Any] | None = None,
        max_sample_bytes: int = 256 * 2**20, digests: DigestMemory | None = None,
    ) -> None:
        super().__init__(url, columns, storage_options, digests=digests)
        self.max_sample_bytes = max_sample_bytes

    def units(self, obj: RemoteObject) -> list[Unit]:
        return [Unit(obj, 0, None, 0, obj.size)]

    def read(self, unit: Unit) -> pa.Table:
        """The tar's samples; a malformed, truncated or sparse tar, a bad header checksum, a member
        over ``max_sample_bytes`` or running past the object's end raise :class:`CorruptObjectError`."""
        data = self._remote.fetch_whole(unit.obj)
        samples = _samples(unit.key, data, self.max_sample_bytes)
        fields = self.columns or sorted({name for sample in samples.values() for name in sample})
        table = pa.table({name: binaries([s.get(name) for s in samples.values()]) for name in fields})
        keys = texts([f"{unit.obj.path}:{key}" for key in samples])
        return table.append_column(KEY_COLUMN, keys)


def _samples(where: str, data: bytes, max_member: int) -> dict[str, dict[str, bytes]]:
    """Members of the tar ``data`` grouped by sample key, in order of first appearance.

    Every member's bytes are a slice of ``data`` (never generated: sparse members are refused), so
    memory stays bounded by the object's size however large a header claims a member is.
    """
    samples: dict[str, dict[str, bytes]] = {}
    view = memoryview(data)
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:")
        for member in tar:
            if member.issparse():
                raise CorruptObjectError(f"{where}: tar member {member.name!r} is sparse (declares "
                                         f"{member.size} bytes): WebDataset shards hold plain files")
            if not member.isfile():
                continue
            if member.size > max_member:
                raise CorruptObjectError(f"{where}: tar member {member.name!r} is {member.size} bytes, over "
                                         f"sampler.max_sample_bytes={max_member}")
            if member.offset_data + member.size > len(data):
                raise CorruptObjectError(f"{where}: tar member {member.name!r} runs past the end of the object "
                                         f"({member.offset_data}+{member.size} > {len(data)} bytes): truncated")
            folder, name = posixpath.split(member.name)
            stem, dot, field = name.partition(".")
            if not dot or not stem:  # no field name: not part of a sample (WebDataset skips these too)
                continue
            payload = bytes(view[member.offset_data : member.offset_data + member.size])
            samples.setdefault(posixpath.join(folder, stem), {})[field] = payload
        end = tar.offset
    except tarfile.TarError as exc:
        raise CorruptObjectError(f"{where} is not a readable tar file: {exc}") from exc
    # tarfile ends its walk quietly at a damaged header (bad checksum) after the first; a whole tar
    # ends in zero blocks, so anything else past the last member means members were lost
    if end + _END_BLOCKS > len(data) or data.count(0, end) != len(data) - end:
        raise CorruptObjectError(f"{where}: the tar does not end in its end-of-archive zero blocks after "
                                 f"byte {end}: a header is damaged or the object is truncated")
    return samples
