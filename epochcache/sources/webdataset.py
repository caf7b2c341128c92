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

from epochcache.errors import SourceError
from epochcache.sources.base import KEY_COLUMN, RemoteObject, Unit
from epochcache.sources.remote import FileSource

_SUFFIXES = (".tar",)


class WebDatasetSource(FileSource):
    """A folder (or a single file) of WebDataset tar shards at ``url``; see the module docstring."""
    suffixes = _SUFFIXES
    kind = 'WebDataset tar'
    column_word = 'field'

    def __init__(
        self, url: str, columns: Sequence[str] | None = None, storage_options: dict[str, Any] | None = None,
        max_sample_bytes: int = 256 * 2**20,
    ) -> None:
        super().__init__(url, columns, storage_options)
        self.max_sample_bytes = max_sample_bytes

    def units(self, obj: RemoteObject) -> list[Unit]:
        return [Unit(obj, 0, None, 0, obj.size)]

    def read(self, unit: Unit) -> pa.Table:
        data = self._remote.fetch(unit.obj.path, 0, unit.obj.size)
        samples = _samples(unit.obj.path, data)
        fields = self.columns or sorted({name for sample in samples.values() for name in sample})
        table = pa.table({name: pa.array([s.get(name) for s in samples.values()], pa.binary()) for name in fields})
        keys = pa.array([f"{unit.obj.path}:{key}" for key in samples], pa.string())
        return table.append_column(KEY_COLUMN, keys)


def _samples(path: str, data: bytes) -> dict[str, dict[str, bytes]]:
    """Members of the tar ``data`` grouped by sample key, in order of first appearance."""
    samples: dict[str, dict[str, bytes]] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                folder, name = posixpath.split(member.name)
                stem, dot, field = name.partition(".")
                if not dot or not stem:  # no field name: not part of a sample (WebDataset skips these too)
                    continue
                extracted = tar.extractfile(member)
                if extracted is not None:
                    samples.setdefault(posixpath.join(folder, stem), {})[field] = extracted.read()
    except tarfile.TarError as exc:
        raise SourceError(f"{path} is not a readable tar file: {exc}") from exc
    return samples
