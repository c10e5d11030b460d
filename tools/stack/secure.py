"""The secure stack's material beyond the broker's own (``tools/kafka_secure.py``):
Redis ACL users and their password files, the broker's topics and ACLs, and the
settings by which one process is one role.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from aiokafka.admin import AIOKafkaAdminClient

from app.errors import StackError
from app.settings import Settings
from app.topics import ensure_topics, kafka_auth
from tools import kafka_acls, kafka_secure

__all__ = ["PER_ROLE", "provision_secure", "redis_password_path", "role_env", "write_acl"]

#: Settings each role sets for itself on the secure stack.
PER_ROLE = ("FRAUD_KAFKA_SASL_USERNAME", "FRAUD_KAFKA_SASL_PASSWORD_FILE")


def role_env(state_dir: Path, kafka_user: str | None = None, redis_user: str | None = None) -> dict[str, str]:
    """The settings by which one process of the secure stack in ``state_dir`` is
    ``kafka_user`` on the broker (a SCRAM user: ``kafka_acls.ROLES``' values) and
    ``redis_user`` on Redis (``app.redis_keys.ACL_KEY_PATTERNS``' keys): user
    names and password files, never a password."""
    state_dir = state_dir.resolve()
    env: dict[str, str] = {}
    if kafka_user is not None:
        if kafka_user not in kafka_secure.USERS:
            raise StackError(f"no Kafka user {kafka_user!r} on the secure broker (users: {', '.join(kafka_secure.USERS)})")
        env["FRAUD_KAFKA_SASL_USERNAME"] = kafka_user
        env["FRAUD_KAFKA_SASL_PASSWORD_FILE"] = str(kafka_secure.password_file(state_dir, kafka_user))
    if redis_user is not None:
        path = redis_password_path(state_dir, redis_user)
        if not path.is_file():
            raise StackError(f"no Redis user {redis_user!r} in {state_dir}: is the secure stack up there?")
        env["FRAUD_REDIS_USERNAME"] = redis_user
        env["FRAUD_REDIS_PASSWORD_FILE"] = str(path)
    return env


def redis_password_path(workdir: Path, role: str) -> Path:
    """Where ``start_redis(secure=True)`` wrote the password of ``role``'s ACL user."""
    return workdir / "redis-users" / f"{role}.password"


async def provision_secure(admin_settings: Settings) -> None:
    """As the super user (``admin_settings`` carries its connection): the topics
    ``admin_settings`` names, then every role's ACLs for those names and its app id."""
    await ensure_topics(admin_settings, wait_s=30.0)
    admin = AIOKafkaAdminClient(bootstrap_servers=admin_settings.kafka_bootstrap, **kafka_auth(admin_settings))
    await admin.start()
    try:
        await kafka_acls.create_acls(admin, kafka_acls.acls(admin_settings))
    finally:
        await admin.close()


def write_acl(acl_file: Path, workdir: Path) -> str:
    """An ACL file of the role users and ``admin``, passwords stored as SHA-256; returns admin's password."""
    from app.redis_acl import ROLE_CODE, acl_rule

    lines = ["user default off"]
    admin = ""
    for role in (*ROLE_CODE, "admin"):
        password = secrets.token_hex(24)
        path = redis_password_path(workdir, role)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(password + "\n")
        # admin's channels: the Sentinels (as admin) talk through __sentinel__:hello.
        rules = "resetchannels &__sentinel__:* ~* +@all" if role == "admin" else acl_rule(role)
        digest = hashlib.sha256(password.encode()).hexdigest()
        lines.append(f"user {role} on #{digest} {rules}")
        if role == "admin":
            admin = password
    acl_file.write_text("\n".join(lines) + "\n")
    acl_file.chmod(0o600)
    return admin

