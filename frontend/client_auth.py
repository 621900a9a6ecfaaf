"""How a client reaches a server started with TLS and an API key (the server side is
frontend/auth.py): one `ClientAuth` and one set of flags for every client tool —
`JaxserveClient`, `jaxserve generate`, `jaxserve bench`, `jaxserve profile` and
`jaxserve diagnose` (whose metrics port speaks HTTPS when the server has --tls-cert).

    auth = ClientAuth(tls_ca_cert="ca.pem", api_key=key)
    channel = auth.channel("host:50051")           # grpc.Channel (TLS when asked)
    urllib.request.urlopen(auth.url("host:9090", "/metrics"), context=auth.ssl_context())

Flags (`add_flags`, read back by `from_args`): --tls, --tls-ca-cert, --tls-cert,
--tls-key, and, where the port checks a key, --api-key / --api-key-file (or the
JAXSERVE_API_KEY variable, `auth.resolve_api_key`).
"""

from __future__ import annotations

import argparse
import re
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Collection

    import grpc

# grpc is imported where a channel is made: the CLI builds these flags for every command.


def _read_pem(option: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{option}: cannot read {path} ({e.strerror})") from None


def check_certificates(option: str, path: str) -> bytes:
    """The bytes of `path`, a PEM file of X.509 certificates (a certificate chain or a
    CA). Raises ValueError("OPTION: ...") naming the cause when it cannot be read or holds
    no certificate: found here, gRPC would only log C-core lines when it connects or binds.
    """
    data = _read_pem(option, path)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(
            f"{option}: {path} is not a PEM file (binary; a DER certificate converts with "
            "'openssl x509 -inform der -in FILE -out FILE.pem')"
        ) from None
    if not text.strip():
        raise ValueError(f"{option}: {path} is empty (expected PEM certificates)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=text)
    except (ssl.SSLError, ValueError) as e:
        # OpenSSL's words, less its source line; "no start line" says no more than ours.
        detail = re.sub(r"\s*\(_ssl\.c:\d+\)", "", str(e.args[-1]))
        detail = "" if "no start line" in detail else f": {detail}"
        raise ValueError(
            f"{option}: {path} holds no PEM certificate ('-----BEGIN CERTIFICATE-----'){detail}"
        ) from None
    return data


def check_key_pair(cert_option: str, cert: str, key_option: str, key: str) -> tuple[bytes, bytes]:
    """(certificate chain, key) bytes of two PEM files that belong together. Raises
    ValueError naming the option of the file at fault: one `check_certificates` refuses,
    a key that cannot be read, is encrypted or is not a PEM private key, or a key that is
    not the certificate's."""
    chain = check_certificates(cert_option, cert)
    data = _read_pem(key_option, key)
    if b"ENCRYPTED" in data:
        raise ValueError(
            f"{key_option}: {key} is encrypted; give the key unencrypted "
            "('openssl pkey -in KEY -out PLAIN.key')"
        )
    try:
        # password: an encrypted key the check above missed fails, never prompts.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=b"")
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(
                f"{key_option}: {key} is not the private key of the certificate in {cert}"
            ) from None
        raise ValueError(
            f"{key_option}: {key} holds no PEM private key ('-----BEGIN PRIVATE KEY-----')"
        ) from None
    except OSError as e:  # gone since it was read
        raise ValueError(f"{key_option}: cannot read {key} ({e.strerror})") from None
    return chain, data


@dataclass(frozen=True, slots=True)
class ClientAuth:
    """TLS and API key of a client.

    tls: use TLS, verifying the server against the system's root certificates (implied
        by tls_ca_cert or tls_cert).
    tls_ca_cert: PEM file of the CA that signed the server's certificate.
    tls_cert / tls_key: PEM files of this client's certificate and key, for a server
        that requires client certificates (`serve --tls-client-ca`); both or neither.
    api_key: the server's `--api-key`, sent as `authorization: Bearer KEY` (None: none).

    Raises ValueError naming the field: tls_cert without tls_key or the reverse; the
    methods that read the files raise it for a file that cannot be read.
    """

    tls: bool = False
    tls_ca_cert: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    api_key: str | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert: give both tls_cert and tls_key (mutual TLS), or neither")

    def client_kwargs(self) -> dict:
        """The keyword arguments of `JaxserveClient` (its names are these fields')."""
        return {
            f: getattr(self, f) for f in ("tls", "tls_ca_cert", "tls_cert", "tls_key", "api_key")
        }

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls or self.tls_ca_cert or self.tls_cert)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """gRPC call metadata carrying the key, or None."""
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else None

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers carrying the key (empty without one)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _credentials(self) -> grpc.ChannelCredentials:
        import grpc

        self.check_files()
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem("tls_ca_cert", self.tls_ca_cert),
            private_key=_read_pem("tls_key", self.tls_key),
            certificate_chain=_read_pem("tls_cert", self.tls_cert),
        )

    def check_files(self) -> None:
        """Raise ValueError naming the field of a PEM file that cannot be read, is not
        PEM, or (tls_key) is not the key of tls_cert."""
        if self.tls_ca_cert is not None:
            check_certificates("tls_ca_cert", self.tls_ca_cert)
        if self.tls_cert is not None:
            check_key_pair("tls_cert", self.tls_cert, "tls_key", self.tls_key)

    def channel(self, target: str) -> grpc.Channel:
        """A blocking channel to HOST:PORT."""
        import grpc

        if self.uses_tls:
            return grpc.secure_channel(target, self._credentials())
        return grpc.insecure_channel(target)

    def aio_channel(self, target: str) -> grpc.aio.Channel:
        """An asyncio channel to HOST:PORT."""
        import grpc

        if self.uses_tls:
            return grpc.aio.secure_channel(target, self._credentials())
        return grpc.aio.insecure_channel(target)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The context of an HTTPS client (metrics port, OpenAI HTTP port), None
        without TLS."""
        if not self.uses_tls:
            return None
        self.check_files()  # name the option of a bad file
        ctx = ssl.create_default_context(cafile=self.tls_ca_cert)
        if self.tls_cert is not None:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    def url(self, address: str, path: str = "") -> str:
        """`address` (HOST:PORT or a URL) as a URL ending in `path`: https:// with TLS,
        http:// without, unless the address names its scheme."""
        if "://" in address:
            return address if not path or address.endswith(path) else address.rstrip("/") + path
        return f"{'https' if self.uses_tls else 'http'}://{address}{path}"


def add_flags(parser: argparse.ArgumentParser, api_key: bool = True) -> None:
    """The client TLS (and API key) flags, in their own group of `parser`."""
    g = parser.add_argument_group("TLS and API key (as the server's --tls-cert / --api-key)")
    g.add_argument(
        "--tls",
        action="store_true",
        help="connect with TLS, checking the server against the system's root "
        "certificates (default: off; on with --tls-ca-cert or --tls-cert)",
    )
    g.add_argument(
        "--tls-ca-cert",
        help="PEM file of the CA that signed the server's certificate (default: none)",
    )
    g.add_argument(
        "--tls-cert",
        help="PEM file of this client's certificate, for a server with --tls-client-ca "
        "(with --tls-key) (default: none)",
    )
    g.add_argument("--tls-key", help="PEM file of this client's key (default: none)")
    if api_key:
        g.add_argument(
            "--api-key",
            help="the server's API key (also --api-key-file, or the JAXSERVE_API_KEY "
            "variable) (default: none)",
        )
        g.add_argument(
            "--api-key-file", help="file whose first line is the API key (default: none)"
        )


def from_args(args: argparse.Namespace) -> ClientAuth:
    """The `ClientAuth` of flags added by `add_flags`. Raises ValueError naming the flag
    (with dashes) of a bad combination or an unreadable key file; PEM files are read
    when a channel or context is made (`flag_error` words those errors as flags)."""
    from jaxserve.frontend.auth import resolve_api_key

    key = None
    if hasattr(args, "api_key"):
        key = resolve_api_key(args.api_key, getattr(args, "api_key_file", None))
    if (args.tls_cert is None) != (args.tls_key is None):  # ClientAuth's words are fields'
        raise ValueError("tls-cert: give both --tls-cert and --tls-key (mutual TLS), or neither")
    try:
        return ClientAuth(args.tls, args.tls_ca_cert, args.tls_cert, args.tls_key, key)
    except ValueError as e:
        raise ValueError(flag_error(e)) from None


def flag_error(
    e: Exception, flags: dict[str, str] | None = None, known: Collection[str] | None = None
) -> str:
    """A ValueError naming a field ("tls_ca_cert: ...", "from: ...") in the words of the
    flag the user typed ("--tls-ca-cert: ..."), as every command says its usage errors;
    `flags` maps a field whose flag has another name ({"out_dir": "--out"}); `known`: the
    command's flags, when a field may be no flag (serve's settings name config fields):
    a field whose --flag is not among them keeps its name. A message that names a flag
    already, or no field, is left as it is."""
    option, sep, rest = str(e).partition(":")
    if flags and option in flags:
        return f"{flags[option]}{sep}{rest}"
    # An item of a list field ("stop[0]: ...") is its repeatable flag's ("--stop: ...").
    field = re.fullmatch(r"([a-z][a-z0-9_-]*)(?:\[\d+\])?", option) if sep else None
    if field is None:
        return str(e)
    flag = f"--{field[1].replace('_', '-')}"
    return str(e) if known is not None and flag not in known else f"{flag}{sep}{rest}"
