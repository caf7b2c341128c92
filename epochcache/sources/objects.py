"""One object per sample (an image or blob per key, the ImageFolder habit) over any fsspec URL.

Flow: ``list_objects`` lists every file under the URL (but the sidecar table); each object is one
unit of one row, so the daemon's fetch pool reads ``sampler.concurrency`` objects at once and the
sampler's groups interleave them like any other units. ``read`` GETs the object and returns a row
``{"data": bytes, "__key__": "<object path>:0"}`` plus its labels:

- ``labels: folder``: the ImageFolder rule. The classes are the folders directly under the URL,
  sorted (:meth:`ObjectSource.classes`, listed once per source); a sample gets an int32 ``label``,
  the index of its top folder in that list (``cat/1.jpg`` -> 0 of ``[cat, dog]``), and a
  ``label_name`` string column (``cat``). The class list travels in the ``label`` field's metadata
  (``classes``, a JSON list), so shards labelled by different lists have different schemas. An
  object outside any class folder, or in one that appeared after the list was taken, is refused
  (:class:`CorruptObjectError`: skipped) rather than given a number of another class;
- ``labels: <URL of a .csv, .jsonl or .parquet table>``: its ``key`` column names objects by their
  path relative to ``source.url``; its other columns are added to the sample (null where an object
  has no row). The table is read once, whole, when the source opens.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from epochcache.arrays import binaries, numbers, texts
from epochcache.errors import CorruptObjectError, SourceError
from epochcache.sources.base import KEY_COLUMN, RemoteObject, Unit
from epochcache.sources.digests import DigestMemory
from epochcache.sources.files import FileSource

LABELS_FROM_FOLDER = "folder"
_READERS = {".csv": pacsv.read_csv, ".jsonl": pajson.read_json, ".parquet": pq.read_table}


class ObjectSource(FileSource):
    """A folder of objects, one sample each, at ``url``; see the module docstring."""

    suffixes = ("",)
    kind = "sample"

    def __init__(
        self,
        url: str,
        columns: Sequence[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        labels: str | None = None,
        max_sample_bytes: int = 256 * 2**20,
        digests: DigestMemory | None = None,
    ) -> None:
        super().__init__(url, columns, storage_options, digests=digests)
        self.max_sample_bytes = max_sample_bytes
        self._labels_from = labels
        self._sidecar_path: str | None = None
        self._sidecar: pa.Table | None = None
        self._rows: dict[str, int] = {}
        self._classes: list[str] | None = None
        if labels is not None and labels != LABELS_FROM_FOLDER:
            self._load_sidecar(labels, storage_options or {})
        self._check_columns()

    def scan_objects(self) -> Iterator[list[RemoteObject]]:
        for page in super().scan_objects():
            kept = [obj for obj in page if obj.path != self._sidecar_path]
            if kept:
                yield kept

    def units(self, obj: RemoteObject) -> list[Unit]:
        return [Unit(obj, 0, 1, 0, obj.size)]

    def read(self, unit: Unit) -> pa.Table:
        """The object as one sample; one over ``max_sample_bytes`` raises :class:`CorruptObjectError`
        before any byte is fetched."""
        if unit.obj.size > self.max_sample_bytes:
            raise CorruptObjectError(f"{unit.obj.path} is {unit.obj.size} bytes, over sampler.max_sample_bytes="
                                     f"{self.max_sample_bytes}: raise it if such samples are wanted")
        data = self._remote.fetch_whole(unit.obj)
        table = pa.table({"data": binaries([data])})
        if self._labels_from == LABELS_FROM_FOLDER:
            name = self._class_of(unit.obj)
            classes = self.classes()
            field = pa.field("label", pa.int32(), metadata={"classes": json.dumps(classes)})
            table = table.append_column(field, numbers(np.array([classes.index(name)], np.int32)))
            table = table.append_column("label_name", texts([name]))
        elif self._sidecar is not None:
            row = self._rows.get(posixpath.relpath(unit.obj.path, self._remote.root))
            labels = self._sidecar.slice(row, 1) if row is not None else _nulls(self._sidecar.schema)
            for name in labels.column_names:
                table = table.append_column(name, labels.column(name))
        if self.columns is not None:
            table = table.select(self.columns)
        return table.append_column(KEY_COLUMN, texts([f"{unit.obj.path}:0"]))

    def classes(self) -> list[str]:
        """The sorted names of the folders directly under the URL (``labels: folder``): ``label``
        ``i`` is ``classes()[i]``. Listed once (one request), then fixed for the source's life. Only
        folders under the URL count: a store that ignores a listing's prefix lists its bucket's."""
        if self._classes is None:
            root = self._remote.root.rstrip("/")
            entries = self._remote.fs.ls(root, detail=True)
            self._classes = sorted(posixpath.basename(name) for name in (e["name"].rstrip("/") for e in entries
                                                                          if e.get("type") == "directory")
                                   if posixpath.dirname(name) == root)
        return self._classes

    def _class_of(self, obj: RemoteObject) -> str:
        relative = posixpath.relpath(obj.path, self._remote.root.rstrip("/"))
        name, slash, _ = relative.partition("/")
        if not slash or name not in self.classes():
            raise CorruptObjectError(f"{obj.path} lies in no class folder of {self.url} (classes: "
                                     f"{self.classes()}): labels: folder needs <url>/<class>/<object>")
        return name

    def _check_columns(self) -> None:
        present = ["data"]
        if self._labels_from == LABELS_FROM_FOLDER:
            present.extend(["label", "label_name"])
        elif self._sidecar is not None:
            present.extend(self._sidecar.column_names)
        missing = [c for c in self.columns or () if c not in present]
        if missing:
            raise SourceError(f"source.columns names {missing} that samples of {self.url} lack: they have {present}")

    def _load_sidecar(self, url: str, storage_options: dict[str, Any]) -> None:
        suffix = next((s for s in _READERS if url.endswith(s)), None)
        if suffix is None:
            raise SourceError(f"source.labels={url!r} is neither 'folder' nor a .csv, .jsonl or .parquet table")
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
        try:
            with fs.open(path, "rb") as f:
                table = _READERS[suffix](f)
        except FileNotFoundError as exc:
            raise SourceError(f"source.labels: cannot read {url}: it does not exist") from exc
        except (pa.ArrowInvalid, OSError) as exc:
            raise SourceError(f"source.labels: cannot read {url}: {exc}") from exc
        if "key" not in table.column_names:
            raise SourceError(f"source.labels table {url} has no 'key' column: present are {table.column_names}")
        keys = table.column("key").cast(pa.string()).to_pylist()
        self._rows = {key: row for row, key in enumerate(keys)}
        self._sidecar, self._sidecar_path = table.drop_columns(["key"]), path


def _nulls(schema: pa.Schema) -> pa.Table:
    """One row of nulls in ``schema``: the labels of an object the sidecar table has no row for."""
    return pa.Table.from_arrays([pa.nulls(1, field.type) for field in schema], schema=schema)
