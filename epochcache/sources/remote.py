"""The two primitives every source builds on: list the objects under a URL, read a byte range.

Errors are translated here, at the boundary: a missing object becomes :class:`ObjectMissingError`,
a refused one :class:`SourceError` naming the URL; transient failures (5xx, resets, timeouts, a body
cut short, detected by length) pass through for :mod:`epochcache.retry` to classify and retry.
Messages carry paths and causes only, never ``storage_options`` (which may hold credentials).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import fsspec

from epochcache.errors import ObjectMissingError, SourceError
from epochcache.retry import TruncatedReadError, describe
from epochcache.sources.base import RemoteObject


class RemoteFiles:
    """An fsspec filesystem rooted at ``url``: a file, or a folder searched recursively."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        if hasattr(self.fs, "retries"):  # s3fs's own retry loop: attempts are counted in epochcache.retry
            self.fs.retries = 1

    def __repr__(self) -> str:  # never show storage_options: they may hold credentials
        return f"RemoteFiles({self.url!r})"

    def list(self, suffixes: Sequence[str], kind: str) -> list[RemoteObject]:
        """Objects whose names end with one of ``suffixes``, sorted by path; ``kind`` names them in the
        error raised when there are none."""
        try:
            if self.fs.isfile(self.root):
                found = {self.root: self.fs.info(self.root)}
            else:
                found = self.fs.find(self.root, detail=True)
        except (FileNotFoundError, PermissionError) as exc:
            raise SourceError(f"cannot list {self.url}: {describe(exc)}") from exc
        objects = [
            RemoteObject(path=path, size=int(info["size"]))
            for path, info in found.items()
            if path.endswith(tuple(suffixes)) and info.get("type", "file") == "file"
        ]
        if not objects:
            raise SourceError(f"no {kind} files ({', '.join('*' + s for s in suffixes)}) under {self.url}: "
                              "check source.url")
        return sorted(objects, key=lambda o: o.path)

    def fetch(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``path`` in one ranged read; exactly that many or an error."""
        try:
            data = self.fs.cat_file(path, start=start, end=end)
        except FileNotFoundError as exc:
            raise ObjectMissingError(f"{self._url(path)} is gone (deleted since it was listed?): "
                                     f"{describe(exc)}") from exc
        except PermissionError as exc:
            raise SourceError(f"cannot read {self._url(path)}: {describe(exc)}: check the credentials and "
                              "the bucket policy") from exc
        if len(data) != end - start:
            raise TruncatedReadError(f"{self._url(path)} bytes {start}-{end}: got {len(data)} bytes")
        return data

    def _url(self, path: str) -> str:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return path if protocol in ("file", "local") else f"{protocol}://{path}"
