"""A fault-injecting HTTP/1.1 proxy on 127.0.0.1, in front of the S3 test server.

Each request is forwarded on a fresh upstream connection; with probability ``rate`` its reply is
replaced by a fault, chosen at random from ``kinds``: ``"503"`` (an S3 SlowDown reply, or the status
and error code ``throttle`` names: a 429, MinIO's 503 SlowDownRead, a load balancer's 502), ``"reset"``
(the client connection is aborted before any reply), ``"truncate"`` (the real headers, half the body,
then the connection closes) or ``"delay"`` (the real reply after ``delay_s``); not among the
default kinds, ``"stall"`` (the real headers, half the body, then silence until the proxy closes,
as a stuck connection) and ``"drip"`` (the real headers, then the body 64 bytes every ``drip_s``: never
silent for long, never done). Replies go out with
``Connection: close`` so a fault never leaks into a reused connection. Counts are in ``faults``.

Hostile remotes, on top: with probability ``flip_rate`` a successful object GET (a request with no
query string: listings are left alone, TLS would guard them) has one random bit of its body flipped
(counted as ``"flip"``); :meth:`FaultProxy.rewrite_on_get` has an object rewritten upstream just
before its next GET is forwarded, as a writer racing the reader would (counted as ``"rewrite"``);
``ignore_if_match`` drops ``If-Match`` from requests, as a store without conditional reads would;
``disguise_etags`` gives every object an ETag that looks like an MD5 but is not one (and maps it back
in ``If-Match``), as some S3-compatible stores do; ``etags_apart`` does so in object GET and HEAD replies
only, not listings, and refuses a listing's ETag in ``If-Match``, as a store whose listings and GETs
name versions apart.

Quirky stores: ``range_quirk="ignore"`` drops ``Range`` from object GETs (the store answers 200 with
the whole object); ``range_quirk="shift"`` asks the store for the range one byte off the one requested
(a 206 of the right length whose ``Content-Range`` is not the one asked); ``deny`` holds object paths
(``/<bucket>/<key>``, as sent) whose GETs answer ``deny_status`` (403) with the S3 error code ``deny_code``
(with ``redirect``, and a 3xx status, a ``Location`` naming the object at the upstream store itself);
``listing_etag`` rewrites each ``<ETag>`` value of a listing (its bytes, quotes included, as the XML
holds them), as stores whose listings spell ETags otherwise than their GET replies do;
``listing_body`` rewrites the whole body (XML) of each listing reply, as stores that leave out the
continuation token of a truncated page; ``listing_ignores`` holds query parameters dropped from listing
requests (``continuation-token``, ``start-after``), as a store that answers the first page again;
``reply_etag`` respells the ``ETag`` header of object GET replies (upper case, say); ``reply_headers``
(a function of the body: header name -> value) replaces the ``x-amz-checksum-*`` headers of each
successful object GET reply and adds the others it names, computed before any flip, as a store whose
objects carry only those checksums, or are encrypted (``x-amz-server-side-encryption: aws:kms``: an
ETag that is no MD5); ``refuse_listing``
(a status and an S3 error code) answers every listing so, as a store refusing the region or signature;
``refuse_checksum_mode`` answers 501 NotImplemented to an object GET that asks for checksums
(``x-amz-checksum-mode``), as stores without them do. The head of every object GET forwarded or
refused is kept in ``object_get_heads``, and the head of every object GET reply forwarded in
``object_get_replies``. With ``tls`` (a server context) the proxy is an https endpoint, as S3 is.
With ``silent_close_s``, replies leave out ``Connection: close`` and each connection is closed that
long after its reply, unread requests sent on it meanwhile dropped: a server whose keep-alive ends
sooner than its clients' (they send a request on a connection as it closes).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import ssl
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from urllib.parse import urlparse

_ERROR = b"<?xml version='1.0' encoding='UTF-8'?>\n<Error><Code>%s</Code><Message>%s</Message></Error>"
_RANGE = re.compile(rb"(?im)^range: *bytes=(\d+)-(\d+)\r\n")
KINDS = ("503", "reset", "truncate", "delay")
_ETAG_HEX = re.compile(rb"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")


class FaultProxy:
    """Runs in its own thread and event loop; ``url`` is what to give s3fs as ``endpoint_url``."""

    def __init__(self, upstream: str, rate: float, kinds: Sequence[str] = KINDS, delay_s: float = 3.0,
                 seed: int = 0, flip_rate: float = 0.0, ignore_if_match: bool = False,
                 disguise_etags: bool = False, range_quirk: str | None = None, deny: Sequence[str] = (),
                 deny_code: str = "AccessDenied", listing_etag: Callable[[bytes], bytes] | None = None,
                 drip_s: float = 0.2, deny_status: int = 403, throttle: tuple[int, str] = (503, "SlowDown"),
                 refuse_checksum_mode: bool = False, reply_etag: Callable[[bytes], bytes] | None = None,
                 refuse_listing: tuple[int, str] | None = None, listing_body: Callable[[bytes], bytes] | None = None,
                 listing_ignores: Sequence[str] = (),
                 reply_headers: Callable[[bytes], dict[str, str]] | None = None,
                 tls: ssl.SSLContext | None = None, silent_close_s: float | None = None,
                 etags_apart: bool = False, redirect: bool = False) -> None:
        parsed = urlparse(upstream)
        self._upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.rate, self.kinds, self.delay_s, self.flip_rate = rate, tuple(kinds), delay_s, flip_rate
        self.ignore_if_match, self.disguise_etags = ignore_if_match, disguise_etags
        self.range_quirk, self.deny, self.listing_etag = range_quirk, {p.encode() for p in deny}, listing_etag
        self.drip_s, self.refuse_checksum_mode, self.reply_etag = drip_s, refuse_checksum_mode, reply_etag
        self.listing_body, self.listing_ignores = listing_body, tuple(name.encode() for name in listing_ignores)
        self.reply_headers, self._tls, self.silent_close_s = reply_headers, tls, silent_close_s
        self.etags_apart, self.redirect = etags_apart, redirect
        self._deny_status, self._deny_code = deny_status, deny_code.encode()
        self.object_get_heads: list[bytes] = []
        self.object_get_replies: list[bytes] = []
        self.listings = 0  # listing requests (a GET with a query string)
        self._listing_refused = None if refuse_listing is None else _reply(
            refuse_listing[0], _ERROR % (refuse_listing[1].encode(), b"The request is refused"))
        self._unsupported = _reply(501, _ERROR % (b"NotImplemented", b"A header you provided implies functionality "
                                                                     b"that is not implemented"))
        self._denied = _reply(deny_status, _ERROR % (deny_code.encode(), b"Access Denied"))
        self._throttled = _reply(throttle[0], _ERROR % (throttle[1].encode(), b"Please reduce your request rate."))
        self._disguised: dict[bytes, bytes] = {}  # disguised ETag hex -> the store's
        self._rewrites: dict[str, Callable[[], object]] = {}
        self._random = random.Random(seed)
        self.faults: Counter[str] = Counter()
        self.requests = 0
        self.object_gets = 0  # GETs of an object (not listings), faulted or not
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault proxy did not start")

    def rewrite_on_get(self, path: str, write: Callable[[], object]) -> None:
        """Before the next GET of ``/<bucket>/<key>`` ``path`` is forwarded, call ``write`` (once, in a
        worker thread: it rewrites the object with a signed client of its own)."""
        self._rewrites[path] = write

    def close(self) -> None:
        """Stop serving, end every open connection's task, and the loop."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _shutdown(self) -> None:
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0, ssl=self._tls))
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self._tls else 'http'}://127.0.0.1:{port}"
        self._ready.set()
        self._loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            body = await reader.readexactly(_content_length(head))
            await self._answer(head, body, writer)
            if self.silent_close_s is not None:
                await asyncio.sleep(self.silent_close_s)  # a request sent meanwhile is never read
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away: nothing to answer
        finally:
            writer.close()

    async def _answer(self, head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        self.requests += 1
        fault = self._random.choice(self.kinds) if self._random.random() < self.rate else None
        if fault:
            self.faults[fault] += 1
        if fault == "reset":
            writer.transport.abort()
            return
        if fault == "503":
            writer.write(self._throttled)
            await writer.drain()
            return
        method, target = head.split(b" ", 2)[:2]
        is_object_get = method == b"GET" and b"?" not in target
        is_listing = method == b"GET" and b"?" in target
        self.object_gets += is_object_get
        self.listings += is_listing
        if is_object_get:
            self.object_get_heads.append(head)
        if self._listing_refused is not None and is_listing:
            self.faults["listing-refused"] += 1
            writer.write(self._listing_refused)
            await writer.drain()
            return
        if is_object_get and self.refuse_checksum_mode and b"x-amz-checksum-mode:" in head.lower():
            self.faults["checksum-mode"] += 1
            writer.write(self._unsupported)
            await writer.drain()
            return
        if is_object_get and target in self.deny:
            self.faults["deny"] += 1
            upstream = b"http://%s:%d" % (self._upstream[0].encode(), self._upstream[1])
            writer.write(self._denied if not self.redirect else _reply(
                self._deny_status, _ERROR % (self._deny_code, b"Please re-send this request to the specified "
                                             b"temporary endpoint."), upstream + target))
            await writer.drain()
            return
        if is_object_get and self.range_quirk:
            head = self._range(head)
        rewrite = self._rewrites.pop(target.decode(), None) if is_object_get else None
        if rewrite is not None:
            self.faults["rewrite"] += 1
            await asyncio.get_running_loop().run_in_executor(None, rewrite)
        if is_listing and self.listing_ignores:
            head = self._drop_query(head, target)
        if self.ignore_if_match:
            head = b"\r\n".join(line for line in head.split(b"\r\n") if not line.lower().startswith(b"if-match:"))
        if self.disguise_etags:
            head = _ETAG_HEX.sub(lambda m: self._disguised.get(m.group(0), m.group(0)), head)
        if self.etags_apart:  # If-Match takes the replies' ETags only: a listing's is refused
            head = re.sub(rb"(?im)^if-match:.*$", lambda line: _ETAG_HEX.sub(
                lambda m: self._disguised.get(m.group(0), b"0" * 32), line.group(0)), head)
        reply = await self._forward(head, body)
        if self.disguise_etags:
            reply = self._disguise(reply, listing=not is_object_get)
        elif self.etags_apart and not is_listing:
            reply = self._disguise(reply, listing=False)
        if self.listing_etag is not None and is_listing:
            reply = _with_body(reply, partial(_respell, respell=self.listing_etag))
        if self.listing_body is not None and is_listing:
            reply = _with_body(reply, self.listing_body)
        if is_object_get and self.reply_etag is not None:
            split = reply.index(b"\r\n\r\n") + 4
            respell = self.reply_etag
            reply = re.sub(rb"(?im)^(etag: *)(.*?)(\r?)$", lambda m: m.group(1) + respell(m.group(2)) + m.group(3),
                           reply[:split]) + reply[split:]
        if is_object_get and self.reply_headers is not None and reply.startswith(b"HTTP/1.1 200"):
            split = reply.index(b"\r\n\r\n")
            head = re.sub(rb"(?im)\r\nx-amz-checksum-[a-z0-9]+:[^\r]*", b"", reply[:split])
            head += b"".join(b"\r\n%s: %s" % (name.encode(), value.encode())
                             for name, value in self.reply_headers(reply[split + 4:]).items())
            reply = head + reply[split:]
        if is_object_get:
            self.object_get_replies.append(reply[: reply.index(b"\r\n\r\n")])
        if is_object_get and self.flip_rate and self._random.random() < self.flip_rate:
            reply = self._flip(reply)
        if fault == "delay":
            await asyncio.sleep(self.delay_s)
        split = reply.index(b"\r\n\r\n") + 4
        if fault == "drip":
            writer.write(reply[:split])
            for at in range(split, len(reply), 64):
                writer.write(reply[at: at + 64])
                await writer.drain()
                await asyncio.sleep(self.drip_s)
            return
        if self.silent_close_s is not None:
            reply = _without_close(reply[:split]) + reply[split:]
        if fault in ("truncate", "stall") and len(reply) - split > 1:
            reply = reply[: split + (len(reply) - split) // 2]
        writer.write(reply)
        await writer.drain()
        if fault == "stall":
            await asyncio.Event().wait()  # silence until close() cancels this task
        if fault == "truncate":
            writer.transport.abort()

    def _range(self, head: bytes) -> bytes:
        """``head`` with its ``Range`` dropped (``range_quirk="ignore"``) or moved one byte (``"shift"``:
        one byte later, or earlier where the range starts past 0), counted as ``"range"``."""
        match = _RANGE.search(head)
        if match is None:
            return head
        self.faults["range"] += 1
        if self.range_quirk == "ignore":
            return head[: match.start()] + head[match.end():]
        start, end = int(match.group(1)), int(match.group(2))
        step = -1 if start > 0 else 1
        return head[: match.start()] + b"Range: bytes=%d-%d\r\n" % (start + step, end + step) + head[match.end():]

    def _disguise(self, reply: bytes, listing: bool) -> bytes:
        """``reply`` with every ETag (headers; a listing's body too) replaced by a stable 32-hex value
        that is not the MD5 of the object, as stores whose ETags are not MD5s send them."""
        def disguise(match: re.Match[bytes]) -> bytes:
            fake = hashlib.md5(b"disguised" + match.group(0)).hexdigest().encode()
            self._disguised[fake] = match.group(0)
            return fake

        split = reply.index(b"\r\n\r\n") + 4
        head = re.sub(rb"(?im)^etag:.*$", lambda line: _ETAG_HEX.sub(disguise, line.group(0)), reply[:split])
        body = _ETAG_HEX.sub(disguise, reply[split:]) if listing else reply[split:]
        return head + body

    def _drop_query(self, head: bytes, target: bytes) -> bytes:
        """``head`` with the query parameters named in ``listing_ignores`` taken out of its target."""
        path, _, query = target.partition(b"?")
        kept = [item for item in query.split(b"&") if item.partition(b"=")[0] not in self.listing_ignores]
        if len(kept) < query.count(b"&") + 1:
            self.faults["listing-ignored"] += 1
        return head.replace(target, path + b"?" + b"&".join(kept), 1)

    def _flip(self, reply: bytes) -> bytes:
        """``reply`` with one random bit of its body flipped, if it has a body and succeeded."""
        split = reply.index(b"\r\n\r\n") + 4
        if len(reply) == split or not reply.startswith((b"HTTP/1.1 200", b"HTTP/1.1 206")):
            return reply
        self.faults["flip"] += 1
        position = self._random.randrange(split, len(reply))
        return reply[:position] + bytes([reply[position] ^ (1 << self._random.randrange(8))]) + reply[position + 1:]

    async def _forward(self, head: bytes, body: bytes) -> bytes:
        upstream_reader, upstream_writer = await asyncio.open_connection(*self._upstream)
        upstream_writer.write(_with_close(head) + body)
        await upstream_writer.drain()
        reply = await upstream_reader.read()  # until the server closes: "Connection: close" was asked
        upstream_writer.close()
        split = reply.index(b"\r\n\r\n") + 4
        return _with_close(reply[:split]) + reply[split:]


def _respell(body: bytes, respell: Callable[[bytes], bytes]) -> bytes:
    """A listing's XML ``body`` with each ``<ETag>`` value respelled."""
    return re.sub(rb"(?<=<ETag>)[^<]*(?=</ETag>)", lambda m: respell(m.group(0)), body)


def _with_body(reply: bytes, rewrite: Callable[[bytes], bytes]) -> bytes:
    """``reply`` with its body rewritten, its Content-Length set anew."""
    split = reply.index(b"\r\n\r\n") + 4
    body = rewrite(reply[split:])
    head = re.sub(rb"(?im)^content-length:.*$", b"Content-Length: %d" % len(body), reply[:split])
    return head + body


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


def _with_close(head: bytes) -> bytes:
    """``head`` (request or reply headers, ending in a blank line) with ``Connection: close``."""
    return _without_close(head)[:-2] + b"Connection: close\r\n\r\n"


def _without_close(head: bytes) -> bytes:
    """``head`` (request or reply headers, ending in a blank line) without its ``Connection`` header (a
    reply so is kept alive, as far as the client can tell)."""
    lines = [line for line in head[:-4].split(b"\r\n") if not line.lower().startswith(b"connection:")]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _reply(status: int, body: bytes, location: bytes | None = None) -> bytes:
    """A whole S3 error reply: ``status`` and its XML ``body`` (and a ``Location`` header), on a
    connection closed after it."""
    moved = b"" if location is None else b"Location: %s\r\n" % location
    return (b"HTTP/1.1 %d Error\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n%s"
            b"Connection: close\r\n\r\n" % (status, len(body), moved)) + body
