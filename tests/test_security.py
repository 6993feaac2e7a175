"""Kafka security settings: protocol, SASL credentials from the environment or a file, TLS files, masking.

The embedded broker speaks PLAINTEXT only, so these tests check what every client is built with (the
keyword arguments and the TLS context), the errors a person gets for a missing file or credential, and
that no credential is ever printed.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess

import pytest

from consumer.config import ConfigError, KafkaConfig, load_settings
from consumer.kafka import client_options, make_consumer, make_producer

SECRET = "s3cr3t-Pa55word-that-must-never-show"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A self-signed CA and a client certificate/key signed by it (openssl)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")

    def run(*args):
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=client")
    run("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "client.pem", "-days", "2")
    return {"ca": d / "ca.pem", "cert": d / "client.pem", "key": d / "client.key"}


def _settings(tmp_path, monkeypatch, kafka: dict, env: dict | None = None):
    monkeypatch.delenv("LORABATCH_KAFKA_USERNAME", raising=False)
    monkeypatch.delenv("LORABATCH_KAFKA_PASSWORD", raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    return load_settings(None, {f"kafka.{k}": v for k, v in kafka.items()})


def test_plaintext_clients_get_no_security_options():
    assert client_options(KafkaConfig()) == {"bootstrap_servers": "127.0.0.1:9092", "security_protocol": "PLAINTEXT"}


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_credentials_from_the_environment_reach_every_client(tmp_path, monkeypatch, mechanism):
    s = _settings(tmp_path, monkeypatch, {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": mechanism},
                  {"LORABATCH_KAFKA_USERNAME": "svc-lorabatch", "LORABATCH_KAFKA_PASSWORD": SECRET})
    opts = client_options(s.kafka)
    assert opts["sasl_mechanism"] == mechanism and opts["sasl_plain_username"] == "svc-lorabatch"
    assert opts["sasl_plain_password"] == SECRET and "ssl_context" not in opts
    assert SECRET not in s.to_toml() and SECRET not in repr(s) and SECRET not in str(s.model_dump())
    assert "svc-lorabatch" not in s.to_toml()


async def test_producer_and_consumer_are_built_with_the_options(tmp_path, monkeypatch, tls_files):
    s = _settings(tmp_path, monkeypatch, {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                                          "ssl_cafile": str(tls_files["ca"])},
                  {"LORABATCH_KAFKA_USERNAME": "u", "LORABATCH_KAFKA_PASSWORD": SECRET})
    for client in (make_producer(s.kafka), make_consumer(s.kafka, group_id=None)):
        c = getattr(client, "client", None) or client._client  # the producer names it client, the consumer _client
        assert c._security_protocol == "SASL_SSL" and c._sasl_mechanism == "SCRAM-SHA-512"
        assert c._sasl_plain_username == "u" and c._sasl_plain_password == SECRET
        assert isinstance(c._ssl_context, ssl.SSLContext) and c._ssl_context.check_hostname


def test_credentials_from_files_and_the_variable_first(tmp_path, monkeypatch):
    (tmp_path / "user").write_text("file-user\n")
    (tmp_path / "pass").write_text(SECRET + "\n")
    kafka = {"security_protocol": "SASL_SSL", "sasl_username_file": str(tmp_path / "user"),
             "sasl_password_file": str(tmp_path / "pass")}
    s = _settings(tmp_path, monkeypatch, kafka)
    assert s.kafka.sasl_username.get_secret_value() == "file-user"  # the trailing newline is not part of it
    assert s.kafka.sasl_password.get_secret_value() == SECRET
    s = _settings(tmp_path, monkeypatch, kafka, {"LORABATCH_KAFKA_USERNAME": "env-user"})
    assert s.kafka.sasl_username.get_secret_value() == "env-user"
    s = _settings(tmp_path, monkeypatch, {**kafka, "sasl_password_env": "MY_KAFKA_PW"}, {"MY_KAFKA_PW": "other"})
    assert s.kafka.sasl_password.get_secret_value() == "other"


def test_missing_credentials_say_where_to_put_them(tmp_path, monkeypatch):
    with pytest.raises(ConfigError) as e:
        _settings(tmp_path, monkeypatch, {"security_protocol": "SASL_SSL"}, {"LORABATCH_KAFKA_USERNAME": "u"})
    msg = str(e.value)
    assert "password" in msg and "$LORABATCH_KAFKA_PASSWORD" in msg and "kafka.sasl_password_file" in msg
    assert "username" not in msg.split("needs a SASL")[1].split(":")[0], msg


def test_an_unreadable_credential_file_names_the_field(tmp_path, monkeypatch):
    with pytest.raises(ConfigError) as e:
        _settings(tmp_path, monkeypatch, {"security_protocol": "SASL_SSL", "sasl_password_file": str(tmp_path / "nope")},
                  {"LORABATCH_KAFKA_USERNAME": "u"})
    assert "kafka.sasl_password_file" in str(e.value) and "nope" in str(e.value)


def test_credentials_in_the_configuration_file_are_refused_without_echoing_them(tmp_path, monkeypatch):
    p = tmp_path / "lorabatch.toml"
    p.write_text(f'[kafka]\nsecurity_protocol = "SASL_SSL"\nsasl_password = "{SECRET}"\n')
    monkeypatch.delenv("LORABATCH_KAFKA_PASSWORD", raising=False)
    with pytest.raises(ConfigError) as e:
        load_settings(p)
    assert "kafka.sasl_password" in str(e.value) and "$LORABATCH_KAFKA_PASSWORD" in str(e.value)
    assert SECRET not in str(e.value)


@pytest.mark.parametrize("field", ["ssl_cafile", "ssl_certfile", "ssl_keyfile"])
def test_a_missing_tls_file_is_an_error_naming_the_field_and_the_fix(tmp_path, monkeypatch, tls_files, field):
    kafka = {"security_protocol": "SSL", "ssl_certfile": str(tls_files["cert"]), "ssl_keyfile": str(tls_files["key"]),
             field: str(tmp_path / "missing.pem")}
    with pytest.raises(ConfigError) as e:
        _settings(tmp_path, monkeypatch, kafka)
    msg = str(e.value)
    assert f"kafka.{field}" in msg and "missing.pem" in msg and "PEM" in msg


def test_tls_context_loads_the_ca_and_the_client_certificate(tmp_path, monkeypatch, tls_files):
    s = _settings(tmp_path, monkeypatch, {"security_protocol": "SSL", "ssl_cafile": str(tls_files["ca"]),
                                          "ssl_certfile": str(tls_files["cert"]), "ssl_keyfile": str(tls_files["key"]),
                                          "ssl_check_hostname": False})
    ctx = client_options(s.kafka)["ssl_context"]
    assert [c["subject"] for c in ctx.get_ca_certs()] == [((("commonName", "test-ca"),),)]
    assert ctx.check_hostname is False and ctx.verify_mode == ssl.CERT_REQUIRED


def test_a_key_without_its_certificate_is_refused(tmp_path, monkeypatch, tls_files):
    with pytest.raises(ConfigError, match="kafka.ssl_keyfile is set without kafka.ssl_certfile"):
        _settings(tmp_path, monkeypatch, {"security_protocol": "SSL", "ssl_keyfile": str(tls_files["key"])})


def test_a_file_that_is_not_a_pem_fails_when_the_client_is_built(tmp_path, monkeypatch):
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    s = _settings(tmp_path, monkeypatch, {"security_protocol": "SSL", "ssl_cafile": str(bad)})
    with pytest.raises(ssl.SSLError):
        client_options(s.kafka)


def test_config_show_prints_no_credential(tmp_path, monkeypatch):
    """`lorabatch config show` with SASL credentials in the environment and a file: neither is printed."""
    from typer.testing import CliRunner

    from consumer.cli import build_app

    (tmp_path / "user").write_text("user-from-file-xyz")
    p = tmp_path / "lorabatch.toml"
    p.write_text(f'[kafka]\nsecurity_protocol = "SASL_SSL"\nsasl_username_file = "{tmp_path / "user"}"\n')
    monkeypatch.delenv("LORABATCH_KAFKA_USERNAME", raising=False)
    monkeypatch.setenv("LORABATCH_KAFKA_PASSWORD", SECRET)
    out = CliRunner().invoke(build_app(), ["config", "show", "--config", str(p)])
    assert out.exit_code == 0, out.output
    assert 'security_protocol = "SASL_SSL"' in out.output and "sasl_password_env" in out.output
    assert SECRET not in out.output and "user-from-file-xyz" not in out.output


def test_a_password_given_as_a_query_parameter_is_masked_in_what_the_ledger_says():
    """libpq takes `?password=`; SQLAlchemy's hide_password masks only the user part's, and the ledger's errors and log
    lines printed the parameter as written."""
    from sqlalchemy.engine import make_url

    from billing.db import shown_url
    from consumer.services import shown_url as shown_by_the_worker

    url = "postgresql+psycopg://billing:userpart@db:5432/ledger?sslmode=require&PassWord=q-secret&application_name=x"
    for shown in (shown_url(make_url(url)), shown_by_the_worker(url)):
        assert "q-secret" not in shown and "userpart" not in shown, shown
        assert "PassWord=***" in shown and "sslmode=require" in shown and "application_name=x" in shown, shown
