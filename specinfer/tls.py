"""TLS for the services: ``--tls-cert``/``--tls-key`` make a service's listeners serve TLS;
``--tls-ca`` adds mutual TLS between services: a speculator or verifier given a CA accepts
only clients holding a certificate that CA signed, and the router presents its own
certificate and checks theirs against the CA. The router's public listeners (gRPC and the
OpenAI HTTP API) serve TLS without asking clients for certificates (API keys authenticate
them). ``throwaway_pki`` makes a CA and one certificate for a local trial (``up --tls``).
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from specinfer.config import Flags, flag


class TlsError(ValueError):
    """A TLS flag that cannot work (exit 2, naming it)."""


@dataclass(frozen=True)
class TlsFlags(Flags):
    """The TLS flags every service takes: PEM file paths (read by ``from_flags``)."""

    tls_cert: str | None = flag(None, "this service's certificate (chain): its listeners "
                                "serve TLS", metavar="PEM")
    tls_key: str | None = flag(None, "its private key", metavar="PEM")
    tls_ca: str | None = flag(None, "mutual TLS between services: the CA whose certificates "
                              "a speculator or verifier accepts from callers, and the router "
                              "checks theirs against (needs --tls-cert/--tls-key)",
                              metavar="PEM")
    tls_server_name: str | None = flag(None, "the name the router expects in the speculators' "
                                       "and verifiers' certificates (default: the host of "
                                       "each address)", metavar="NAME")


@dataclass(frozen=True)
class TlsConfig:
    cert: bytes
    key: bytes
    ca: bytes | None = None
    server_name: str | None = None
    cert_path: str = ""
    key_path: str = ""

    @property
    def mutual(self) -> bool:
        return self.ca is not None

    def server_credentials(self, *, mutual: bool) -> grpc.ServerCredentials:
        """``mutual``: require a client certificate signed by the CA."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca if mutual else None,
            require_client_auth=mutual)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """For calls to another service: check its certificate against the CA, and
        present ours."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name \
            else []

    def ssl_context(self) -> ssl.SSLContext:
        """The OpenAI HTTP API's server context (TLS 1.2 and later)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_path, self.key_path)
        return context


def _read(path: str, flag: str) -> bytes:
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise TlsError(f"{flag} {path!r}: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise TlsError(f"{flag} {path!r}: not a PEM file")
    return data


def from_flags(flags: TlsFlags) -> TlsConfig | None:
    """The TLS settings the flags give, or None for plaintext."""
    cert, key, ca = flags.tls_cert, flags.tls_key, flags.tls_ca
    if not (cert or key or ca):
        return None
    if not (cert and key):
        raise TlsError("--tls-cert and --tls-key go together (and --tls-ca needs both)")
    config = TlsConfig(_read(cert, "--tls-cert"), _read(key, "--tls-key"),
                       _read(ca, "--tls-ca") if ca else None,
                       flags.tls_server_name,
                       str(Path(cert).expanduser()), str(Path(key).expanduser()))
    try:  # a key that does not match its certificate fails here, not at the first call
        config.ssl_context()
    except ssl.SSLError as exc:
        raise TlsError(f"--tls-cert/--tls-key: {exc.reason or exc}") from None
    return config


def server_credentials_from(config: TlsConfig | None) -> grpc.ServerCredentials | None:
    """A speculator's or verifier's listener: plaintext without TLS flags, TLS with a
    certificate, and with a CA callers must hold a certificate it signed (mutual TLS)."""
    if config is None:
        return None
    return config.server_credentials(mutual=config.mutual)


def throwaway_pki(directory: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1")
                  ) -> dict[str, Path]:
    """A CA and one certificate for ``hosts`` signed by it, for a local trial (valid a
    week); returns the PEM paths: ``ca``, ``cert``, ``key``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specinfer throw-away CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=7))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                       crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False,
                                       decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"ca": directory / "ca.pem", "cert": directory / "cert.pem",
             "key": directory / "key.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    paths["key"].chmod(0o600)
    return paths
