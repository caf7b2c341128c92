"""Checking and repairing a cache directory's files against its ledger.

The ledger is the truth; files disagreeing with it are the debris of a crash: temp files of a shard
that was being written, whole shards published to disk but not yet to the ledger, files whose record
was removed just before they were deleted, and records whose file is gone. ``check`` finds them (and
with ``checksums`` also shards whose bytes changed); with ``fix`` it repairs them: temp files and
unknown files removed, unknown files that are whole shards (their checksum matches the one in
their name, their units are not cached elsewhere) adopted back into the ledger, missing records
dropped, corrupt shards quarantined. ``reconcile`` is the fix the daemon runs at every start.

Cost is proportional to what changed: the shard folder's listing is joined against the ledger's file
names (:meth:`Ledger.filenames`), and records or files are read only for the names that disagree.

Flow: (layout, ledger) -> :class:`Repairs` (counts of what was found, and fixed if ``fix``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import astuple, dataclass

from epochcache.cache.layout import SHARD_SUFFIX, TMP_SUFFIX, CacheLayout
from epochcache.cache.ledger import Ledger, ShardRecord
from epochcache.cache.progress import progress_bar
from epochcache.cache.quarantine import quarantine_shard
from epochcache.cache.shard_files import whole_shard
from epochcache.cache.shards import verify_shard
from epochcache.errors import ShardCorruptError

log = logging.getLogger(__name__)

# With a live daemon, a file and its record change apart (publish renames then records, a few ms;
# eviction unrecords a batch then deletes its files, one by one: 16-24 s for 10,000-32,000 shards): a
# disagreement counts only if it outlasts this with none of them going away meanwhile, or the longest
# wait (a daemon that deletes ever more files past it, but not all, leaves those counted).
_SETTLE_S = 1.0
_SETTLE_POLL_S = 0.05
_SETTLE_MOST_S = 300.0


@dataclass(frozen=True)
class Repairs:
    """What a check found (and fixed, if asked): counts per kind of problem."""

    temp_files: int = 0
    unknown_files: int = 0  # removed when fixing
    adopted: int = 0  # unknown files that are whole shards: recorded when fixing
    missing_records: int = 0
    corrupt: int = 0  # quarantined when fixing
    quarantine_debris: int = 0  # quarantine files without a ledger entry, or entries without a file

    @property
    def problems(self) -> int:
        return sum(astuple(self))


@dataclass(frozen=True)
class _Findings:
    temp: frozenset[str]
    unknown: frozenset[str]
    missing: frozenset[str]
    stray_quarantine: frozenset[str]
    lost_quarantine: frozenset[str]

    def __and__(self, other: _Findings) -> _Findings:
        return _Findings(*(a & b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __bool__(self) -> bool:
        return any(astuple(self))


def reconcile(layout: CacheLayout, ledger: Ledger, checksums: bool = False, progress: bool | None = False) -> Repairs:
    """Make disk and ledger agree (at daemon start, ``verify --fix``); only the lock's holder may call it.

    Also forgets the reservation and the retiring set, which only a running daemon can own.
    """
    repairs = check(layout, ledger, fix=True, checksums=checksums, progress=progress)
    ledger.clear_reservation()
    ledger.clear_retiring()
    if repairs.problems:
        log.warning("reconciled %s: %s", layout.root, repairs)
    return repairs


def check(
    layout: CacheLayout, ledger: Ledger, *, fix: bool = False, checksums: bool = False, live: bool = False,
    progress: bool | None = False,
) -> Repairs:
    """Compare disk with the ledger; with ``fix`` repair what disagrees (hold the lock to fix).

    ``checksums``: also hash every shard (reads every byte, a page of records at a time). ``progress``
    shows bars of the passes that read files (:mod:`epochcache.cache.progress`). ``live``: a daemon
    is running, so one temp file is the shard in progress and disagreements must persist for a
    moment to count.
    """
    findings = _scan(layout, ledger)
    if live:
        findings = _settled(layout, ledger, findings)
    temp = len(findings.temp) - (1 if live and findings.temp else 0)
    adoptable = _adoptable(layout, ledger, findings.unknown, progress)
    corrupt = _corrupt(layout, ledger, progress) if checksums else []
    if fix:
        _apply(layout, ledger, findings, adoptable, corrupt)
    return Repairs(
        temp_files=temp,
        unknown_files=len(findings.unknown) - len(adoptable),
        adopted=len(adoptable),
        missing_records=len(findings.missing),
        corrupt=len(corrupt),
        quarantine_debris=len(findings.stray_quarantine) + len(findings.lost_quarantine),
    )


def _settled(layout: CacheLayout, ledger: Ledger, findings: _Findings) -> _Findings:
    """Of ``findings``, those that persist while a daemon runs: scanned again until none has gone
    for :data:`_SETTLE_S` (a daemon still deleting an evicted batch's files makes some go at each
    scan), or for at most :data:`_SETTLE_MOST_S`."""
    started = changed = time.monotonic()
    said = False
    while findings and time.monotonic() - changed < _SETTLE_S and time.monotonic() - started < _SETTLE_MOST_S:
        time.sleep(_SETTLE_POLL_S)
        again = findings & _scan(layout, ledger)
        if again != findings:
            changed = time.monotonic()
            if not said and changed - started > _SETTLE_S:
                said = True
                log.info("the running daemon is still deleting evicted shards (%d files to go): waiting for it",
                         len(again.unknown))
        findings = again
    return findings


def _scan(layout: CacheLayout, ledger: Ledger) -> _Findings:
    recorded = ledger.filenames()
    quarantined = {entry.record.filename: entry.record.id for entry in ledger.quarantine.entries()}
    names = {path.name for path in layout.shards.iterdir()}
    in_quarantine = {path.name for path in layout.quarantine.iterdir()}
    gone = recorded - names
    return _Findings(
        temp=frozenset(n for n in names if n.endswith(TMP_SUFFIX)),
        unknown=frozenset(n for n in names if n.endswith(SHARD_SUFFIX) and n not in recorded),
        # Records are read only when some file is gone (something is wrong), to name their ids.
        missing=frozenset(r.id for page in ledger.pages() for r in page if r.filename in gone) if gone else frozenset(),
        stray_quarantine=frozenset(in_quarantine - quarantined.keys()),
        lost_quarantine=frozenset(sid for name, sid in quarantined.items() if name not in in_quarantine),
    )


def _adoptable(
    layout: CacheLayout, ledger: Ledger, unknown: frozenset[str], progress: bool | None
) -> list[ShardRecord]:
    """Records for the unknown files that are whole shards holding no unit cached elsewhere (each
    file read whole: a bar when asked, as a lost ledger makes every file unknown)."""
    taken: set[str] = set()
    out = []
    with progress_bar("reading unknown shard files", len(unknown), progress, unit=" shards") as bar:
        for name in sorted(unknown):
            record = whole_shard(layout.shards / name)
            if record is not None and taken.isdisjoint(record.units) and not ledger.cached_units(record.units):
                taken.update(record.units)
                out.append(record)
            bar.update()
    return out


def _corrupt(layout: CacheLayout, ledger: Ledger, progress: bool | None) -> list[tuple[ShardRecord, str]]:
    """Published shards whose file fails its checksum, with the reason."""
    out = []
    folder = layout.shards
    with progress_bar("verifying checksums", ledger.usage().shard_bytes, progress, unit="B", unit_scale=True,
                      unit_divisor=1024) as bar:
        for page in ledger.pages():
            for record in page:
                try:
                    verify_shard(folder / record.filename, record.checksum)
                except ShardCorruptError as exc:
                    out.append((record, str(exc)))
                except FileNotFoundError:
                    pass  # evicted while we looked, or a missing record: counted by the scan
                bar.update(record.nbytes)
    return out


def _apply(
    layout: CacheLayout, ledger: Ledger, findings: _Findings, adoptable: list[ShardRecord],
    corrupt: list[tuple[ShardRecord, str]],
) -> None:
    adopted = {record.filename for record in adoptable}
    for name in findings.temp | (findings.unknown - adopted):
        (layout.shards / name).unlink(missing_ok=True)
    if adoptable:
        ledger.adopt(adoptable)
    ledger.drop(sorted(findings.missing))
    for name in findings.stray_quarantine:
        (layout.quarantine / name).unlink(missing_ok=True)
    ledger.quarantine.forget(sorted(findings.lost_quarantine))
    for record, reason in corrupt:
        quarantine_shard(layout, ledger, record, reason)
