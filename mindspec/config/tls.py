"""HTTPS for the service ports from MindIE's ``ServerConfig`` TLS keys.

With ``httpsEnabled`` true every port serves HTTPS (with it false MindIE ignores every TLS key,
and so does mindspec):

- ``tlsCert`` / ``tlsPk``: the certificate (chain) and its private key, PEM. Relative paths are
  taken from the config file's folder (MindIE takes them from its install folder); absolute paths
  are kept. Absent: MindIE's defaults ``security/certs/server.pem`` / ``security/keys/server.key.pem``.
- ``tlsPkPwd``: a file holding the private key's password as plain text (one trailing newline is
  dropped). Absent or "": the key is not encrypted.
- ``tlsCaFile`` (names in ``tlsCaPath``, default ``security/ca/``): client certificates must be
  signed by one of these CAs (mutual TLS, ``ssl.CERT_REQUIRED``). Absent: no client certificates.
- ``managementTls*`` / ``metricsTls*`` (Cert, Pk, PkPwd, CaFile): the management and metrics ports'
  own files. MindIE uses them only when ``managementIpAddress`` differs from ``ipAddress``; so does
  mindspec, and an absent one falls back key by key (metrics -> management -> business). A port
  merged with the business port uses the business files.

KMC: MindIE can keep the key password encrypted with its KMC keystores (``kmcKsfMaster`` /
``kmcKsfStandby``). mindspec does not read KMC. The rule is that the password file must hold the
plain password. If the file is not printable UTF-8 text (for example binary KMC ciphertext), or if
the password it holds does not decrypt the key (for example KMC ciphertext written as text), you
get one ConfigError. It names the ``*PkPwd`` key and says to store the plain password there.

Every file is checked when the config is read: a missing one, a certificate that does not match
its key, or a wrong password is one ConfigError naming the key and the path.
"""
from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

FIELDS = ("Cert", "Pk", "PkPwd", "CaFile")
PLANES = ("tls", "managementTls", "metricsTls")  # key prefixes: business, management, metrics port
DEFAULTS = {"tlsCert": "security/certs/server.pem", "tlsPk": "security/keys/server.key.pem"}
DEFAULT_CA_PATH = "security/ca/"
MAX_CA_FILES = 3  # MindIE: 1 to 3 CA files per list
KMC_HINT = ("a KMC-encrypted password needs MindIE's kmcKsfMaster/kmcKsfStandby keystores, which mindspec "
            "does not read: write the plain password in this file, readable by the server's user only")


def _config_error(message: str) -> Exception:
    from mindspec.config.mindie_config import ConfigError  # late: mindie_config imports this module

    return ConfigError(message)


@dataclass(frozen=True)
class ServerTls:
    """One port's HTTPS settings, files resolved and checked."""

    cert_file: str
    key_file: str
    key_password: Optional[str] = field(default=None, repr=False)
    ca_files: tuple[str, ...] = ()  # non-empty: clients must present a certificate signed by one

    def uvicorn_kwargs(self) -> dict:
        """uvicorn.Config keywords. uvicorn takes one CA file; load_extra_cas adds the others."""
        kwargs = dict(ssl_certfile=self.cert_file, ssl_keyfile=self.key_file, ssl_keyfile_password=self.key_password)
        if self.ca_files:
            kwargs.update(ssl_ca_certs=self.ca_files[0], ssl_cert_reqs=ssl.CERT_REQUIRED)
        return kwargs

    def load_extra_cas(self, context: ssl.SSLContext) -> None:
        for ca in self.ca_files[1:]:
            context.load_verify_locations(ca)


@dataclass(frozen=True)
class PortsTls:
    business: ServerTls
    management: ServerTls
    metrics: ServerTls


def parse_tls(data: dict, where: Callable[[str], str], base_dir: Path, separate_management: bool) -> PortsTls:
    """``data``: the ServerConfig object; ``where(key)`` its JSON path; ``separate_management``:
    managementIpAddress differs from ipAddress (only then are managementTls*/metricsTls* used)."""
    business = {f: f"tls{f}" for f in FIELDS}
    management = _plane_keys(data, "managementTls", business, separate_management)
    metrics = _plane_keys(data, "metricsTls", management, separate_management)
    reader = _TlsReader(data, where, base_dir)
    built: dict[tuple, ServerTls] = {}  # planes with the same keys share one ServerTls

    def plane(keys: dict) -> ServerTls:
        ident = tuple(keys[f] for f in FIELDS)
        if ident not in built:
            built[ident] = reader.read(keys)
        return built[ident]

    return PortsTls(plane(business), plane(management), plane(metrics))


def _plane_keys(data: dict, prefix: str, fallback: dict, separate: bool) -> dict:
    return {f: f"{prefix}{f}" if separate and f"{prefix}{f}" in data else fallback[f] for f in FIELDS}


class _TlsReader:
    def __init__(self, data: dict, where: Callable[[str], str], base_dir: Path):
        self.data, self.where, self.base_dir = data, where, base_dir

    def read(self, keys: dict) -> ServerTls:
        cert = self._file(keys["Cert"], self._string(keys["Cert"], DEFAULTS.get(keys["Cert"])))
        key = self._file(keys["Pk"], self._string(keys["Pk"], DEFAULTS.get(keys["Pk"])))
        pwd_name = self._string(keys["PkPwd"], None)
        password = _read_password(self._file(keys["PkPwd"], pwd_name), self.where(keys["PkPwd"])) if pwd_name else None
        tls = ServerTls(str(cert), str(key), password, self._ca_files(keys["CaFile"]))
        self._check_loads(tls, keys)
        return tls

    def _string(self, key: str, default: Optional[str]) -> Optional[str]:
        value = self.data.get(key, default)
        if value is not None and not isinstance(value, str):
            raise _config_error(f"{self.where(key)}: must be a file path string, got {value!r}")
        return value

    def _file(self, key: str, name: Optional[str], folder: Optional[Path] = None) -> Path:
        if not name:
            raise _config_error(f"{self.where(key)}: must name a file (httpsEnabled is true)")
        path = (folder or self.base_dir) / name
        if not path.is_file():
            raise _config_error(f"{self.where(key)}: {path} does not exist "
                                "(relative paths are taken from the config file's folder)")
        return path.resolve()

    def _ca_files(self, key: str) -> tuple[str, ...]:
        names = self.data.get(key)
        if names is None:
            return ()
        if not isinstance(names, list) or not 1 <= len(names) <= MAX_CA_FILES or not all(isinstance(n, str) for n in names):
            raise _config_error(f"{self.where(key)}: must be a list of 1 to {MAX_CA_FILES} file names, got {names!r}")
        folder = self.base_dir / (self._string("tlsCaPath", DEFAULT_CA_PATH) or "")
        return tuple(str(self._file(key, n, folder)) for n in names)

    def _check_loads(self, tls: ServerTls, keys: dict) -> None:
        """Loads the files as the server will, so a bad one fails here with its key named."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        asked = []

        def password() -> str:  # a callback: OpenSSL would otherwise prompt on the terminal
            asked.append(True)
            return tls.key_password or ""

        try:
            context.load_cert_chain(tls.cert_file, tls.key_file, password)
        except ssl.SSLError as exc:
            raise self._key_error(tls, keys, bool(asked), exc) from None
        for ca in tls.ca_files:
            try:
                context.load_verify_locations(ca)
            except ssl.SSLError:
                raise _config_error(f"{self.where(keys['CaFile'])}: {ca} is not a PEM CA certificate") from None

    def _key_error(self, tls: ServerTls, keys: dict, asked: bool, exc: ssl.SSLError) -> Exception:
        if asked and tls.key_password is None:
            return _config_error(f"{self.where(keys['Pk'])}: {tls.key_file} is encrypted: name a plain-text file "
                                 f"holding its password in {self.where(keys['PkPwd'])}")
        if asked:
            return _config_error(f"{self.where(keys['PkPwd'])}: the password in that file does not decrypt "
                                 f"{self.where(keys['Pk'])} ({tls.key_file}); {KMC_HINT}")
        return _config_error(f"{self.where(keys['Cert'])} / {self.where(keys['Pk'])}: cannot use certificate "
                             f"{tls.cert_file} with key {tls.key_file} ({exc.reason or exc})")


def _read_password(path: Path, where: str) -> str:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _config_error(f"{where}: {path} is not a plain-text password; {KMC_HINT}") from None
    text = text[:-1] if text.endswith("\n") else text
    text = text[:-1] if text.endswith("\r") else text
    if not text or not text.isprintable():
        raise _config_error(f"{where}: {path} is not a plain-text password (empty, or holds control characters); "
                            f"{KMC_HINT}")
    return text
