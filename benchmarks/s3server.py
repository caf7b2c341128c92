"""A moto S3 server on loopback in a child process (so it does not share the benchmark's GIL), for
the benchmarks that read through S3; over plain HTTP, or over TLS (https, as S3 serves) with a
certificate made for 127.0.0.1 (:func:`self_signed_certificate`, which tests use as well)."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
from collections.abc import Iterator, Set
from contextlib import contextmanager
from pathlib import Path

# argv: the CPUs to run on ("" for any, else comma-separated), then, for https, the certificate and key files
_SERVER = (
    "import os, ssl, sys; cpus, tls = sys.argv[1], sys.argv[2:]\n"
    "if cpus: os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split(',')})  # before any thread starts\n"
    "import logging\n"
    "from moto.moto_server.threaded_moto_server import MotoRequestHandler\n"
    "from moto.server import DomainDispatcherApplication, create_backend_app\n"
    "from werkzeug.serving import make_server\n"
    "logging.getLogger('werkzeug').setLevel(logging.ERROR)\n"
    "context = None\n"
    "if tls: context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); context.load_cert_chain(*tls)\n"
    "app = DomainDispatcherApplication(create_backend_app)  # (as moto's ThreadedMotoServer serves it)\n"
    "server = make_server('127.0.0.1', 0, app, True, request_handler=MotoRequestHandler, ssl_context=context)\n"
    "print('PORT', server.server_address[1], flush=True); server.serve_forever()\n"
)


@contextmanager
def moto_server(cpus: Set[int] = frozenset(), tls: tuple[Path, Path] | None = None) -> Iterator[str]:
    """Yields the server's endpoint URL (``http://127.0.0.1:<port>``, or ``https://`` with ``tls``: the
    certificate and key files to serve, see :func:`self_signed_certificate`); the server ends on exit.
    ``cpus``: the CPUs the server runs on (Linux), none for any."""
    argv = [",".join(map(str, sorted(cpus))), *(map(str, tls) if tls else ())]
    server = subprocess.Popen([sys.executable, "-c", _SERVER, *argv], stdout=subprocess.PIPE, text=True)
    try:
        lines = iter(server.stdout.readline, "")  # type: ignore[union-attr]
        port = next(line.split()[1] for line in lines if line.startswith("PORT "))
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, self-signed (an hour long), and its key, as ``cert.pem`` and
    ``key.pem`` in ``folder``: an https server on loopback serves them, and its clients trust the
    certificate (botocore's ``verify``, in s3fs's ``client_kwargs``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path
