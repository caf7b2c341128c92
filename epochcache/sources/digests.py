"""What an S3 store's digests of a whole object say of the bytes read: :class:`WholeDigests`.

A GetObject reply may carry three digests of the object epochcache can check itself:

- a plain ETag, ``"<hex>"``: the body's MD5 (a single-part upload; not under SSE-KMS or SSE-C, whose
  ETags are no MD5);
- a multipart upload's ETag, ``"<hex>-<parts>"``: the MD5 of its parts' MD5s, one after the other;
- a multipart upload's composite checksum, ``x-amz-checksum-<name>: <base64>-<parts>``: the checksum
  of its parts' checksums (CRC32, SHA1, SHA256; CRC32C with awscrt installed).

botocore checks a whole object's full-object ``x-amz-checksum-*`` itself, but neither multipart
digest: before this module, a multipart object (most objects over 8 MiB: a WebDataset tar) read over
plain HTTP was taken as sent. A reply names its parts' count, not their size; uploaders cut every
part but the last to one size (8 MiB: the AWS CLI and boto3; 50 MiB: s3fs; 5 MiB, S3's least:
rclone, the Go SDK), so the size is found by trying, in turn, the one that last matched under the
source, the common sizes, whole MiBs and the even split that give the reply's count,
:data:`MAX_TRIES` hash passes at most. None matching means damage in transit or parts of sizes not
tried: the caller tells them apart by a second read (damage does not repeat itself bit for bit)
and, if the two agree, tells damage at rest from a store whose digests are not what they look like
(:meth:`WholeDigests.agreed`): once another object of the source matched a digest of that kind, the
object is damaged at rest (corrupt; checks go on); with none matched, only :data:`NOT_THEIRS_AFTER`
objects disagreeing so give that kind up for the source (a store whose plain ETags are no MD5s, or
parts of sizes not guessed), and until then each is corrupt too (skipped, it is read again at the
pass end). What matched is remembered across runs where a :class:`DigestMemory` is given (the daemon keeps it
in its ledger): a restarted daemon whose first whole reads are of objects damaged at rest still
knows the store's digests to be what they look like. A whole object whose full-object
``x-amz-checksum-*`` botocore checked is not checked again (:func:`store_checked`).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
import re
import zlib
from collections.abc import Callable, Collection, Iterator
from typing import Any, NamedTuple, Protocol

log = logging.getLogger(__name__)

MiB = 2**20
# Part sizes uploaders use, most common first: the AWS CLI and boto3, S3's least (rclone, the Go
# SDK), MinIO's mc, s3fs, then round sizes others are set to.
COMMON_PART_SIZES = (8 * MiB, 5 * MiB, 16 * MiB, 50 * MiB, 64 * MiB, 100 * MiB, 128 * MiB, 256 * MiB)
# Part sizes tried for one multipart digest: each costs a hash pass over the object.
MAX_TRIES = 4
# Objects whose two reads agree, not with a kind of digest none has matched, that give the kind up.
NOT_THEIRS_AFTER = 3

# (spelled in either case, and weak or not, by some S3-compatible stores)
_ETAG = re.compile(r'^(?:W/)?"?([0-9a-f]{32})(?:-([0-9]+))?"?$', re.IGNORECASE)
_COMPOSITE = re.compile(r"^([A-Za-z0-9+/=]+)-([0-9]+)$")
# Server-side encryption under which an S3 ETag is not the MD5 of the body.
_ETAG_NOT_MD5 = {"aws:kms", "aws:kms:dsse"}
# The checksums a GetObject reply may carry (botocore's parsed ``Checksum<name>``), and those botocore
# computes only through awscrt (it leaves them unchecked without it).
STORE_CHECKSUMS = ("CRC64NVME", "CRC32C", "CRC32", "SHA1", "SHA256")
CRT_ONLY_CHECKSUMS = {"CRC64NVME", "CRC32C"}


def _crc32c(data: memoryview) -> bytes:
    from awscrt import checksums  # (only where botocore has it: see _part_hashes)
    return int(checksums.crc32c(data)).to_bytes(4, "big")


@functools.cache
def _part_hashes() -> dict[str, Callable[[memoryview], bytes]]:
    """The digest of one part (raw bytes, as a composite concatenates them) per checksum name."""
    from botocore.compat import HAS_CRT

    hashes: dict[str, Callable[[memoryview], bytes]] = {
        "CRC32": lambda data: zlib.crc32(data).to_bytes(4, "big"),
        "SHA1": lambda data: hashlib.sha1(data).digest(),
        "SHA256": lambda data: hashlib.sha256(data).digest(),
    }
    if HAS_CRT:
        hashes["CRC32C"] = _crc32c
    return hashes


class Claim(NamedTuple):
    """A digest a reply offers of the whole object: ``kind`` ("ETag", "multipart ETag" or a composite
    checksum's name), its value as sent, its parts' count (0: a digest of the body itself) and the
    digest it spells (lower-case hex for an ETag's MD5, base64 for a checksum)."""

    kind: str
    value: str
    parts: int
    digest: str

    def __str__(self) -> str:
        if self.kind == "ETag":
            return f"ETag (MD5) {self.value}"
        if self.kind == "multipart ETag":
            return f"multipart ETag {self.value} (the MD5 of its {self.parts} parts' MD5s)"
        return f"composite {self.kind} {self.value} (of its {self.parts} parts' {self.kind}s)"


def claims(reply: dict[str, Any]) -> list[Claim]:
    """The digests ``reply`` (botocore's parsed GetObject) offers that epochcache can check, cheapest
    first: its ETag unless encrypted (SSE-KMS, SSE-C), then composite checksums it can compute."""
    found = []
    encrypted = reply.get("ServerSideEncryption") in _ETAG_NOT_MD5 or reply.get("SSECustomerAlgorithm")
    etag = _ETAG.match(str(reply.get("ETag", "")).strip())
    if etag and not encrypted:
        parts = int(etag.group(2) or 0)
        found.append(Claim("multipart ETag" if parts else "ETag", etag.group(0), parts, etag.group(1).lower()))
    computable = _part_hashes()
    for name in STORE_CHECKSUMS:
        composite = _COMPOSITE.match(str(reply.get(f"Checksum{name}") or ""))
        if composite and name in computable:
            found.append(Claim(name, composite.group(0), int(composite.group(2)), composite.group(1)))
    return found


def part_sizes(size: int, parts: int, hint: int | None = None) -> list[int]:
    """The part sizes to try for an object of ``size`` bytes uploaded in ``parts`` parts, all but the
    last of one size: ``hint`` (the size that last matched), :data:`COMMON_PART_SIZES`, whole MiBs
    from the even split up (s3fs cuts a part at the first write past its block size), then the even
    split itself: those that cut ``size`` into exactly ``parts`` parts, at most :data:`MAX_TRIES`."""
    if parts <= 1:
        return [size] if parts == 1 else []
    even = -(-size // parts)
    mibs = range(-(-even // MiB) * MiB, even + MAX_TRIES * MiB, MiB)
    candidates = [hint, *COMMON_PART_SIZES, *mibs, even]
    tried: list[int] = []
    for part in candidates:
        # (parts - 1) whole parts fall short of the size, ``parts`` reach it
        if part and part not in tried and (parts - 1) * part < size <= parts * part:
            tried.append(part)
    return tried[:MAX_TRIES]


def _pieces(data: memoryview, part: int) -> Iterator[memoryview]:
    return (data[at:at + part] for at in range(0, len(data), part))


def _matches(claim: Claim, data: memoryview, part: int, hashes: dict[str, Callable[[memoryview], bytes]]) -> bool:
    """Whether ``data`` cut into parts of ``part`` bytes gives ``claim`` (a multipart digest)."""
    if claim.kind == "multipart ETag":
        joined = b"".join(hashlib.md5(piece).digest() for piece in _pieces(data, part))
        return hashlib.md5(joined).hexdigest() == claim.digest
    part_hash = hashes[claim.kind]
    joined = b"".join(part_hash(piece) for piece in _pieces(data, part))
    return base64.b64encode(part_hash(memoryview(joined))).decode() == claim.digest


class Verdict(NamedTuple):
    """What :meth:`WholeDigests.check` found: ``checked``, the bytes match a digest offered; else
    ``failed``, the digest they do not match (None: none offered, or none still trusted)."""

    checked: bool
    failed: Claim | None


class DigestMemory(Protocol):
    """Where a source's kinds of digest that matched an object are kept across runs."""

    def matched(self) -> Collection[str]:
        """The kinds that matched an object of the source before (in any run)."""

    def remember(self, kind: str) -> None:
        """Keep that ``kind`` matched an object of the source (called once per kind and process)."""


class WholeDigests:
    """One source's checks of whole objects against their digests, and what it has learnt of its
    store: the part size that last matched a multipart digest, the kinds of digest that matched an
    object (from ``memory`` too, and kept there), the objects whose reads agreed against a kind none
    matched, and the kinds given up."""

    def __init__(self, memory: DigestMemory | None = None) -> None:
        self._memory = memory
        self._part_size: int | None = None
        self._matched: set[str] = set(memory.matched()) if memory is not None else set()
        self._disagreed: dict[str, set[str]] = {}
        self._given_up: set[str] = set()

    def check(self, data: bytes, reply: dict[str, Any]) -> Verdict:
        """Check ``data`` (the whole body of ``reply``) against the first digest offered that this
        source still trusts: checked, failed (see :class:`Verdict`) or neither."""
        view = memoryview(data)
        for claim in claims(reply):
            if claim.kind in self._given_up:
                continue
            if claim.parts == 0:
                matched = hashlib.md5(view).hexdigest() == claim.digest
            else:
                hashes = _part_hashes()
                part = next((part for part in part_sizes(len(data), claim.parts, self._part_size)
                             if _matches(claim, view, part, hashes)), None)
                if part is not None:
                    self._part_size = part
                matched = part is not None
            if matched and claim.kind not in self._matched:
                self._matched.add(claim.kind)
                if self._memory is not None:
                    self._memory.remember(claim.kind)
            return Verdict(matched, None if matched else claim)
        return Verdict(False, None)

    def agreed(self, claim: Claim, url: str, under: str) -> str | None:
        """Two reads of ``url`` agreed with each other but not with ``claim``: why its bytes are corrupt,
        or None where ``claim``'s kind is given up for this source (said once, as a warning naming the
        source ``under``) and the bytes are taken. See the module docstring."""
        if claim.kind in self._given_up:
            return None
        sizes = "" if claim.parts == 0 else ", or uploaded in parts of sizes epochcache does not guess"
        if claim.kind in self._matched:
            return (f"two reads agree, not with its {claim}, which other objects under {under} match: damaged at "
                    f"rest{sizes}")
        disagreed = self._disagreed.setdefault(claim.kind, set())
        disagreed.add(url)
        if len(disagreed) < NOT_THEIRS_AFTER:
            return (f"two reads agree, not with its {claim}: damaged at rest{sizes}, or the store's "
                    f"{claim.kind}s are not what they look like (told once another object matches its "
                    f"{claim.kind}, or {NOT_THEIRS_AFTER} disagree so with none matched)")
        self._given_up.add(claim.kind)
        why = "this store's ETags are not MD5s" if claim.parts == 0 else \
            "its parts are of sizes epochcache does not guess (not one size but the last, or none of the common sizes)"
        log.warning("%s: two reads agree but not with its %s, as for %d objects and none matched: %s, so whole "
                    "objects under %s are not checked by their %s from now on", url, claim, len(disagreed), why,
                    under, claim.kind)
        return None


def store_checked(reply: dict[str, Any]) -> str | None:
    """The name of a full-object ``x-amz-checksum-*`` in ``reply`` that botocore checks (asked for with
    ``ChecksumMode``: a mismatch raises), if any: a composite one (``<base64>-<parts>``) it never
    checks, CRC32C only with awscrt, CRC64NVME only with awscrt 0.23.4 or later."""
    return next((name for name in STORE_CHECKSUMS if (value := str(reply.get(f"Checksum{name}") or ""))
                 and "-" not in value and _botocore_checks(name)), None)


def _botocore_checks(name: str) -> bool:
    """Whether botocore computes checksum ``name`` (as botocore.httpchecksum decides at its import)."""
    from botocore import compat  # (botocore is loaded by then: the reply came through it)

    if name == "CRC64NVME":
        minimum = getattr(compat, "has_minimum_crt_version", None)
        return bool(compat.HAS_CRT and minimum is not None and minimum((0, 23, 4)))
    return compat.HAS_CRT or name not in CRT_ONLY_CHECKSUMS


def unchecked_checksum(reply: dict[str, Any]) -> str | None:
    """The checksum a GetObject reply carries and why neither botocore nor epochcache could check it,
    if it carries none botocore checked (:func:`store_checked`); else None. epochcache checks the
    composite ones but CRC32C's without awscrt."""
    sent = {name: str(reply[f"Checksum{name}"]) for name in STORE_CHECKSUMS if reply.get(f"Checksum{name}")}
    if not sent or store_checked(reply) is not None:
        return None
    name, value = next(iter(sent.items()))
    if "-" in value:
        return (f"{name} of its parts (a multipart upload's composite checksum), which botocore does not check, "
                "nor epochcache for the part sizes it tried or without awscrt (pip install 'epochcache[crt]')")
    return f"{name}, which botocore checks only with awscrt installed (pip install 'epochcache[crt]')"
