"""httpsEnabled: certificates made here (a CA, a server certificate for 127.0.0.1/127.0.0.2, an
encrypted key with a password file, client certificates), a real `mindspec serve`, and the
official openai client over HTTPS."""
import datetime
import ipaddress
import json
import logging
import re
import shutil
import ssl
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mindspec.config.mindie_config import ConfigError, load_config
from tests.service.conftest import free_port, start_serve, stop_serve, write_config

DOCUMENTED = Path(__file__).resolve().parents[1] / "config" / "data" / "mindie_documented_config.json"
PASSWORD = "s3cret pass"


# ---- certificates ------------------------------------------------------------------------------


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


class Ca:
    def __init__(self, folder: Path, name: str):
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = _name(name)
        cert = (_builder(name, self.name, self.key.public_key())
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))
        self.path = folder / f"{name}.pem"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, cert_path: Path, key_path: Path, *, client=False, password=None) -> None:
        """A leaf certificate: a server one for 127.0.0.1 and 127.0.0.2, or a client one."""
        key = ec.generate_private_key(ec.SECP256R1())
        builder = _builder("mindspec-client" if client else "127.0.0.1", self.name, key.public_key())
        if client:
            builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        else:
            sans = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", "127.0.0.2")]
            builder = (builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
                       .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
        cert = builder.sign(self.key, hashes.SHA256())
        encryption = (serialization.BestAvailableEncryption(password.encode()) if password
                      else serialization.NoEncryption())
        for path, data in ((cert_path, cert.public_bytes(serialization.Encoding.PEM)),
                           (key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        encryption))):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """server CA + server cert (plain key and encrypted key), management CA + cert, client CA + cert."""
    d = tmp_path_factory.mktemp("pki")
    server_ca, mgmt_ca, client_ca = Ca(d, "server_ca"), Ca(d, "management_ca"), Ca(d, "client_ca")
    server_ca.issue(d / "server.pem", d / "server.key.pem")
    server_ca.issue(d / "enc_server.pem", d / "enc_server.key.pem", password=PASSWORD)
    (d / "key_pwd.txt").write_text(PASSWORD + "\n")
    mgmt_ca.issue(d / "mgmt_server.pem", d / "mgmt_server.key.pem")
    client_ca.issue(d / "client.pem", d / "client.key.pem", client=True)
    other_ca = Ca(d / "other", "client_ca")  # same name, different key: not trusted by the server
    other_ca.issue(d / "rogue_client.pem", d / "rogue_client.key.pem", client=True)
    return d


# ---- reading the TLS keys ----------------------------------------------------------------------


def _server_cfg(tmp_path: Path, **server) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"ServerConfig": {"httpsEnabled": True, **server},
                                "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelWeightPath": "/m"}]}}}))
    return path


def test_relative_paths_are_taken_from_the_config_folder(pki, tmp_path):
    shutil.copytree(pki, tmp_path / "certs")
    tls = load_config(_server_cfg(tmp_path, tlsCert="certs/server.pem", tlsPk=str(pki / "server.key.pem"),
                                  tlsCaPath="certs", tlsCaFile=["client_ca.pem"])).server.tls.business
    assert tls.cert_file == str(tmp_path / "certs" / "server.pem")
    assert tls.key_file == str(pki / "server.key.pem")  # absolute: kept
    assert tls.ca_files == (str(tmp_path / "certs" / "client_ca.pem"),) and tls.key_password is None
    kwargs = tls.uvicorn_kwargs()
    assert kwargs["ssl_cert_reqs"] == ssl.CERT_REQUIRED and kwargs["ssl_ca_certs"] == tls.ca_files[0]


def test_password_file_is_read(pki, tmp_path):
    tls = load_config(_server_cfg(tmp_path, tlsCert=str(pki / "enc_server.pem"), tlsPk=str(pki / "enc_server.key.pem"),
                                  tlsPkPwd=str(pki / "key_pwd.txt"))).server.tls.business
    assert tls.key_password == PASSWORD and tls.ca_files == ()


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("case, message", [
    ("missing cert", r"ServerConfig.tlsCert: .*/nope.pem does not exist \(relative paths are taken from the config file's folder\)"),
    ("missing key", r"ServerConfig.tlsPk: .*/nope.key does not exist"),
    ("missing password file", r"ServerConfig.tlsPkPwd: .*/nope.txt does not exist"),
    ("missing ca", r"ServerConfig.tlsCaFile: .*/nope_ca.pem does not exist"),
    ("encrypted key without password", r"ServerConfig.tlsPk: .*enc_server.key.pem is encrypted: name a plain-text "
                                       r"file holding its password in ServerConfig.tlsPkPwd"),
    ("wrong password", r"ServerConfig.tlsPkPwd: the password in that file does not decrypt ServerConfig.tlsPk .*kmcKsfMaster"),
    ("binary password file", r"ServerConfig.tlsPkPwd: .*kmc.bin is not a plain-text password; .*kmcKsfMaster"),
    ("cert and key do not match", r"ServerConfig.tlsCert / ServerConfig.tlsPk: cannot use certificate .*server.pem "
                                  r"with key .*mgmt_server.key.pem"),
    ("ca list is a string", r"ServerConfig.tlsCaFile: must be a list of 1 to 3 file names, got 'ca.pem'"),
    ("ca is not a certificate", r"ServerConfig.tlsCaFile: .*key_pwd.txt is not a PEM CA certificate"),
])
def test_bad_tls_files_are_one_clear_error(pki, tmp_path, case, message):
    keys = {"tlsCert": str(pki / "server.pem"), "tlsPk": str(pki / "server.key.pem")}
    enc = {"tlsCert": str(pki / "enc_server.pem"), "tlsPk": str(pki / "enc_server.key.pem")}
    keys = {
        "missing cert": {**keys, "tlsCert": "nope.pem"},
        "missing key": {**keys, "tlsPk": "nope.key"},
        "missing password file": {**keys, "tlsPkPwd": "nope.txt"},
        "missing ca": {**keys, "tlsCaPath": str(pki), "tlsCaFile": ["client_ca.pem", "nope_ca.pem"]},
        "encrypted key without password": enc,
        "wrong password": {**enc, "tlsPkPwd": _write(tmp_path / "pwd.txt", b"not it\n")},
        "binary password file": {**enc, "tlsPkPwd": _write(tmp_path / "kmc.bin", bytes(range(256)))},
        "cert and key do not match": {**keys, "tlsPk": str(pki / "mgmt_server.key.pem")},
        "ca list is a string": {**keys, "tlsCaFile": "ca.pem"},
        "ca is not a certificate": {**keys, "tlsCaPath": str(pki), "tlsCaFile": ["key_pwd.txt"]},
    }[case]
    with pytest.raises(ConfigError, match=message):
        load_config(_server_cfg(tmp_path, **keys))


def test_https_disabled_ignores_tls_keys(tmp_path):
    cfg = load_config(_server_cfg(tmp_path, httpsEnabled=False, tlsCert="nope.pem", tlsCaFile="x"))
    assert cfg.server.tls is None


def test_documented_config_without_its_certificates_names_tlsCert(tmp_path):
    shutil.copy(DOCUMENTED, tmp_path / "config.json")
    with pytest.raises(ConfigError, match=re.escape(
            f"ServerConfig.tlsCert: {tmp_path / 'security/certs/server.pem'} does not exist")):
        load_config(tmp_path / "config.json")


def test_documented_config_with_its_certificates(pki, tmp_path, caplog, monkeypatch):
    """MindIE's documented config.json unchanged, its files made at the paths it names: one
    summary warning, and the management port (127.0.0.2 != 127.0.0.1) gets the management files."""
    for name in ("MIES_CONTAINER_IP", "MIES_CONTAINER_MANAGEMENT_IP"):
        monkeypatch.delenv(name, raising=False)
    shutil.copy(DOCUMENTED, tmp_path / "config.json")
    sec = tmp_path / "security"
    files = {"certs/server.pem": "enc_server.pem", "keys/server.key.pem": "enc_server.key.pem",
             "pass/key_pwd.txt": "key_pwd.txt", "ca/ca.pem": "client_ca.pem",
             "certs/management/server.pem": "mgmt_server.pem", "keys/management/server.key.pem": "mgmt_server.key.pem",
             "pass/management/key_pwd.txt": "key_pwd.txt", "ca/management_ca.pem": "client_ca.pem"}
    for dest, src in files.items():
        (sec / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(pki / src, sec / dest)
    with caplog.at_level(logging.WARNING):
        tls = load_config(tmp_path / "config.json").server.tls
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "MindIE keys not implemented by mindspec (ignored): " in warnings[0], warnings
    assert "ServerConfig.kmcKsfMaster" in warnings[0] and "ServerConfig.tlsCaFile" not in warnings[0]
    assert tls.business.cert_file == str(sec / "certs/server.pem") and tls.business.key_password == PASSWORD
    assert tls.business.ca_files == (str(sec / "ca/ca.pem"),)
    assert tls.management.cert_file == str(sec / "certs/management/server.pem")
    assert tls.management.ca_files == (str(sec / "ca/management_ca.pem"),)
    assert tls.metrics == tls.management  # no metricsTls* keys: the metrics port uses the management files


def test_one_address_uses_the_business_files_everywhere(pki, tmp_path):
    """MindIE reads managementTls* only when managementIpAddress differs from ipAddress."""
    tls = load_config(_server_cfg(tmp_path, tlsCert=str(pki / "server.pem"), tlsPk=str(pki / "server.key.pem"),
                                  managementTlsCert="nope.pem")).server.tls
    assert tls.management is tls.business and tls.metrics is tls.business


# ---- a real server over HTTPS -----------------------------------------------------------------


def _trust(ca: str, cert=None) -> ssl.SSLContext:
    """A client TLS context trusting ``ca``, presenting ``cert`` = (certificate, key) if given."""
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(*cert)
    return context


def _complete(client: openai.OpenAI) -> str:
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    return out.choices[0].text


def test_openai_client_over_https(pki, tiny_model, tmp_path):
    ports = (free_port(), free_port(), free_port())
    cfg = write_config(tmp_path / "c.json", tiny_model, ports, **{
        "ServerConfig.httpsEnabled": True, "ServerConfig.tlsCert": str(pki / "server.pem"),
        "ServerConfig.tlsPk": str(pki / "server.key.pem")})
    ca = _trust(str(pki / "server_ca.pem"))
    proc = start_serve(cfg, lambda: httpx.get(f"https://127.0.0.1:{ports[1]}/health", verify=ca, timeout=2))
    try:
        with httpx.Client(verify=ca) as http:
            client = openai.OpenAI(base_url=f"https://127.0.0.1:{ports[0]}/v1", api_key="none", http_client=http)
            assert [m.id for m in client.models.list().data] == ["tiny"]
            assert isinstance(_complete(client), str)
            chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3, temperature=0)
            assert chat.choices[0].finish_reason in ("length", "stop")
            assert http.get(f"https://127.0.0.1:{ports[2]}/metrics").status_code == 200
        # plain HTTP is not served, and a client that does not trust the CA is refused
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{ports[0]}/v1/models", timeout=5)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"https://127.0.0.1:{ports[0]}/v1/models", timeout=5)
    finally:
        out = stop_serve(proc)
    assert f"listening on https://127.0.0.1:{ports[0]}" in out, out


def test_encrypted_key_client_certificates_and_management_files(pki, tiny_model, tmp_path):
    """Encrypted key + password file, client certificates required (tlsCaFile), and the
    management port on 127.0.0.2 with its own certificate from another CA."""
    ports = (free_port(), free_port(), free_port())
    cfg = write_config(tmp_path / "c.json", tiny_model, ports, **{
        "ServerConfig.httpsEnabled": True, "ServerConfig.managementIpAddress": "127.0.0.2",
        "ServerConfig.tlsCert": str(pki / "enc_server.pem"), "ServerConfig.tlsPk": str(pki / "enc_server.key.pem"),
        "ServerConfig.tlsPkPwd": str(pki / "key_pwd.txt"), "ServerConfig.tlsCaPath": str(pki),
        # the client CA second: uvicorn itself loads only the first file (load_extra_cas the rest)
        "ServerConfig.tlsCaFile": ["management_ca.pem", "client_ca.pem"],
        "ServerConfig.managementTlsCert": str(pki / "mgmt_server.pem"),
        "ServerConfig.managementTlsPk": str(pki / "mgmt_server.key.pem")})
    client_cert = (str(pki / "client.pem"), str(pki / "client.key.pem"))
    server_ca, mgmt_ca = str(pki / "server_ca.pem"), str(pki / "management_ca.pem")
    proc = start_serve(cfg, lambda: httpx.get(f"https://127.0.0.2:{ports[1]}/health", verify=_trust(mgmt_ca, client_cert),
                                         timeout=2))
    try:
        with httpx.Client(verify=_trust(server_ca, client_cert)) as http:
            client = openai.OpenAI(base_url=f"https://127.0.0.1:{ports[0]}/v1", api_key="none", http_client=http)
            assert isinstance(_complete(client), str)
        # no client certificate, or one from a CA the server does not trust: the handshake fails
        for cert in (None, (str(pki / "rogue_client.pem"), str(pki / "rogue_client.key.pem"))):
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"https://127.0.0.1:{ports[0]}/v1/models", verify=_trust(server_ca, cert), timeout=5)
        # the management and metrics ports present the management certificate, not the business one
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"https://127.0.0.2:{ports[1]}/health", verify=_trust(server_ca, client_cert), timeout=5)
        r = httpx.get(f"https://127.0.0.2:{ports[2]}/metrics", verify=_trust(mgmt_ca, client_cert), timeout=5)
        assert r.status_code == 200
    finally:
        stop_serve(proc)
