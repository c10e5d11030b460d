"""The secure local broker's material: a throw-away CA, the broker's certificate,
random SCRAM passwords, the listener settings and the clients' settings.

Used by ``tools.stack.start_broker(secure=True)``. Everything lives under the
broker's workdir::

    tls/ca.pem              the CA certificate clients trust (FRAUD_KAFKA_SSL_CAFILE)
    tls/broker.p12          the broker's key and certificate (PKCS#12, 0600)
    secrets/<user>.password one random password per SCRAM user (0600)

The CA's key is deleted once it has signed the broker's certificate: nobody
can issue another certificate under it. Passwords are never logged; clients
read them from their file (``FRAUD_KAFKA_SASL_PASSWORD_FILE``).

Listeners: ``SASL_SSL`` (SCRAM-SHA-512 over TLS) for clients and between the
broker and itself; the KRaft controller listener (127.0.0.1 only) uses SASL
PLAIN, as KRaft controllers cannot use SCRAM (its credentials live in the
metadata log the controller serves); on the replicated stack
(``tools/cluster.py``) the controllers listen on that listener only, and the
brokers reach them through it. Authorization: ``StandardAuthorizer``,
``admin`` the only super user, no ACL means no access.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

from app.errors import StackError
from app.settings import Settings
from tools.kafka_acls import ROLES

__all__ = [
    "ADMIN",
    "MECHANISM",
    "USERS",
    "client_env",
    "client_settings",
    "ensure_material",
    "format_scram_args",
    "password_file",
    "secure_properties",
]

ADMIN = "admin"
MECHANISM = "SCRAM-SHA-512"
#: Every SCRAM user the secure broker knows: the super user and one per role.
USERS: tuple[str, ...] = (ADMIN, *ROLES.values())
_CERT_DAYS = 30


def password_file(workdir: Path, user: str) -> Path:
    return workdir / "secrets" / f"{user}.password"


def _password(workdir: Path, user: str) -> str:
    return password_file(workdir, user).read_text().strip()


def _write_secret(path: Path, text: str) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")


def ensure_material(workdir: Path) -> None:
    """Create the CA, the broker's keystore and the passwords unless they exist
    (a restart on the same workdir keeps them: the SCRAM credentials are in the
    formatted log dir)."""
    for user in (*USERS, "keystore"):
        if not password_file(workdir, user).exists():
            _write_secret(password_file(workdir, user), secrets.token_urlsafe(24))
    tls = workdir / "tls"
    if (tls / "broker.p12").exists() and (tls / "ca.pem").exists():
        return
    tls.mkdir(mode=0o700, parents=True, exist_ok=True)
    (tls / "san.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "basicConstraints=CA:FALSE\n"
    )
    steps = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
         "-days", str(_CERT_DAYS), "-subj", "/CN=fraud-pipeline local CA",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "broker.key", "-out", "broker.csr",
         "-subj", "/CN=localhost"],
        ["x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "broker.pem", "-days", str(_CERT_DAYS), "-extfile", "san.cnf"],
        ["pkcs12", "-export", "-in", "broker.pem", "-inkey", "broker.key", "-certfile", "ca.pem",
         "-name", "broker", "-out", "broker.p12",
         "-passout", f"file:{password_file(workdir, 'keystore')}"],
    ]  # fmt: skip
    old_umask = os.umask(0o077)
    try:
        for args in steps:
            result = subprocess.run(
                ["openssl", *args], cwd=tls, capture_output=True, text=True, check=False, timeout=60
            )
            if result.returncode != 0:
                raise StackError(f"openssl {args[0]} failed:\n{result.stderr}")
    except FileNotFoundError as exc:
        raise StackError("openssl is not on PATH: the secure broker needs it") from exc
    finally:
        os.umask(old_umask)
        for name in ("ca.key", "broker.key", "broker.csr", "ca.srl", "san.cnf"):
            (tls / name).unlink(missing_ok=True)
    (tls / "ca.pem").chmod(0o644)


def secure_properties(workdir: Path, port: int | None, controller_port: int | None) -> dict[str, str]:
    """Listener, TLS, SASL and authorizer settings (they replace the plaintext
    ones) of a broker listening on ``port`` and a controller on ``controller_port``:
    one process both (the single node), or a broker only (``controller_port``
    None: it reaches the controllers as a client, SASL PLAIN) or a controller
    only (``port`` None: no client listener, no TLS)."""
    admin = _password(workdir, ADMIN)
    plain = (
        "org.apache.kafka.common.security.plain.PlainLoginModule required "
        f'username="{ADMIN}" password="{admin}" user_{ADMIN}="{admin}";'
    )
    props = {
        "sasl.mechanism.controller.protocol": "PLAIN",
        "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
        "listener.name.controller.plain.sasl.jaas.config": plain,
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": f"User:{ADMIN}",
        "allow.everyone.if.no.acl.found": "false",
    }
    if port is None:
        assert controller_port is not None
        return {
            "listeners": f"CONTROLLER://127.0.0.1:{controller_port}",
            "listener.security.protocol.map": "CONTROLLER:SASL_PLAINTEXT",
            **props,
        }
    keystore = _password(workdir, "keystore")
    tls = workdir / "tls"
    scram = f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{ADMIN}" password="{admin}";'
    listeners = f"SASL_SSL://127.0.0.1:{port}"
    if controller_port is not None:
        listeners += f",CONTROLLER://127.0.0.1:{controller_port}"
    return {
        "listeners": listeners,
        "advertised.listeners": f"SASL_SSL://127.0.0.1:{port}",
        "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:SASL_PLAINTEXT",
        "inter.broker.listener.name": "SASL_SSL",
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        "listener.name.sasl_ssl.sasl.enabled.mechanisms": MECHANISM,
        f"listener.name.sasl_ssl.{MECHANISM.lower()}.sasl.jaas.config": scram,
        **props,
        "ssl.keystore.type": "PKCS12",
        "ssl.keystore.location": str(tls / "broker.p12"),
        "ssl.keystore.password": keystore,
        "ssl.key.password": keystore,
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(tls / "ca.pem"),
        "ssl.enabled.protocols": "TLSv1.3,TLSv1.2",
    }


def format_scram_args(workdir: Path) -> list[str]:
    """``kafka-storage format`` options that create every user's SCRAM credentials."""
    args: list[str] = []
    for user in USERS:
        args += ["--add-scram", f"{MECHANISM}=[name={user},password={_password(workdir, user)}]"]
    return args


def client_env(workdir: Path, user: str, bootstrap: str) -> dict[str, str]:
    """``FRAUD_*`` settings with which ``user`` reaches the secure broker."""
    return {
        "FRAUD_KAFKA_BOOTSTRAP": bootstrap,
        "FRAUD_KAFKA_SSL": "true",
        "FRAUD_KAFKA_SSL_CAFILE": str(workdir / "tls" / "ca.pem"),
        "FRAUD_KAFKA_SASL_MECHANISM": MECHANISM,
        "FRAUD_KAFKA_SASL_USERNAME": user,
        "FRAUD_KAFKA_SASL_PASSWORD_FILE": str(password_file(workdir, user)),
    }


def client_settings(workdir: Path, user: str, bootstrap: str) -> Settings:
    """:func:`client_env` as a ``Settings`` (for clients in this process)."""
    env = client_env(workdir, user, bootstrap)
    return Settings.model_validate({key.removeprefix("FRAUD_").lower(): value for key, value in env.items()})
