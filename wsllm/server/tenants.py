"""Tenants: who a bearer key belongs to, and that tenant's limits.

`--api-keys-file keys.toml` holds one table per tenant (docs/deployment.md):

    [tenants.alice]
    keys = ["sk-alice-1"]     # required: at least one; unique across tenants
    rpm = 60                  # requests per minute          (absent: unlimited)
    tpm = 20000               # prompt + completion tokens per minute
    max_concurrent = 4        # requests in flight at once
    max_priority = 10         # the highest priority its requests may ask for
    models = ["*"]            # names or globs of the models it may use (absent: all)
    roles = ["metrics"]       # "metrics": /metrics shows every tenant's usage (an operator)
    cache_salt = "team-a"     # share cached prompt prefixes with the tenants of this salt

`--api-key K` alone is one unlimited tenant, `default`, the operator's own key (it has
the `metrics` role); with a keys file too, it is added as that tenant. No key at all:
every client is the tenant `anonymous`, limited by `--anonymous-rpm`, `--anonymous-tpm`
and `--anonymous-max-concurrent` (`anonymous_tenant`), alone on /metrics, and not the
operator unless `--anonymous-operator`.
The file is read once, at start; a bad file stops the start with a message that names
the file, the tenant and the field.

The prefix cache is sealed per tenant: a request's KV blocks are shared only within its
tenant's namespace (`Tenant.cache_namespace`: the tenant's name, or the `cache_salt`
the operator gives several tenants on purpose), narrowed by the request's own
`cache_salt`. Another tenant's prompt is never a hit, so `cached_tokens` tells a key
nothing of what others sent."""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wsllm.bounds import MAX_CACHE_SALT_CHARS
from wsllm.broker.limits import Limits

DEFAULT_TENANT = "default"  # the tenant of --api-key
ANONYMOUS_TENANT = "anonymous"  # everyone, when no key is required
# Tenant names go into Redis keys and (later) metric labels.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_FIELDS = {"keys", "rpm", "tpm", "max_concurrent", "max_priority", "models", "roles", "cache_salt"}
#: between a namespace's tenant part and a request's salt (no tenant name or salt has it)
SALT_SEPARATOR = "\x1f"
ROLE_METRICS = "metrics"  # sees every tenant's figures on /metrics
ROLES = (ROLE_METRICS,)


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    limits: Limits = Limits()
    max_priority: int | None = None  # the highest `priority` its requests may ask for (None: --max-priority)
    models: tuple[str, ...] = ("*",)  # fnmatch globs, case-sensitive
    roles: frozenset[str] = frozenset()  # ROLES it has
    cache_salt: str = ""  # the keys file's: tenants of one salt share cached prefixes ("": its own)

    def may_use(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)

    def cache_namespace(self, request_salt: str = "") -> str:
        """The prefix cache namespace of this tenant's request (GenerateRequest.cache_salt):
        the tenant's own, or its operator-given salt's, narrowed by `request_salt`."""
        base = f"salt:{self.cache_salt}" if self.cache_salt else f"tenant:{self.name}"
        return f"{base}{SALT_SEPARATOR}{request_salt}" if request_salt else base

    @property
    def operator(self) -> bool:
        """May see every tenant's usage on /metrics."""
        return ROLE_METRICS in self.roles


ANONYMOUS = Tenant(ANONYMOUS_TENANT)


def anonymous_tenant(rpm: int, tpm: int, max_concurrent: int, operator: bool = False) -> Tenant:
    """Every client of a gateway that requires no key, with these limits (0: none). It is
    the only tenant there, so it sees its own figures on /metrics (status.py); it is the
    operator (adapter loads) only when `operator` says so (`--anonymous-operator`)."""
    limits = Limits(rpm or None, tpm or None, max_concurrent or None)
    return Tenant(ANONYMOUS_TENANT, limits, roles=frozenset({ROLE_METRICS}) if operator else frozenset())


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Tenants:
    """The keys of every tenant. `authenticate` compares the presented key with every
    stored key in constant time (fixed-length digests, no early exit), so its timing
    tells nothing about which key, or which prefix, is close."""

    def __init__(self, entries: list[tuple[Tenant, list[str]]]) -> None:
        self._keys: list[tuple[bytes, Tenant]] = []
        for tenant, keys in entries:
            self._keys += [(_digest(k), tenant) for k in keys]
        self.by_name = {t.name: t for t, _ in entries}

    def authenticate(self, key: str) -> Tenant | None:
        presented = _digest(key)
        found: Tenant | None = None
        for digest, tenant in self._keys:
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found

    @classmethod
    def from_settings(cls, api_key: str | None, api_keys_file: str | None) -> Tenants | None:
        """The tenants of `--api-key` and `--api-keys-file`; None when neither is set
        (no key required). Raises ValueError with a clear message on a bad file."""
        entries = load_keys_file(api_keys_file) if api_keys_file else []
        if api_key:
            where = f"--api-key and {api_keys_file}"
            if any(t.name == DEFAULT_TENANT for t, _ in entries):
                raise ValueError(f"{where}: a tenant named {DEFAULT_TENANT!r} is reserved for --api-key")
            if any(api_key in keys for _, keys in entries):
                raise ValueError(f"{where}: the --api-key is also a key of a tenant in the file")
            entries.append((Tenant(DEFAULT_TENANT, roles=frozenset({ROLE_METRICS})), [api_key]))
        return cls(entries) if entries else None


def load_keys_file(path: str | Path) -> list[tuple[Tenant, list[str]]]:
    """Parse and check a keys file: [(tenant, its keys)]."""
    where = str(path)
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"keys file {where}: cannot read it: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"keys file {where}: not valid TOML: {e}") from None
    extra = set(doc) - {"tenants"}
    if extra:
        raise ValueError(
            f"keys file {where}: unknown top-level key(s) {sorted(extra)}; expected [tenants.NAME]"
        )
    tables = doc.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise ValueError(f"keys file {where}: no tenants; add a [tenants.NAME] table with keys = [...]")
    entries: list[tuple[Tenant, list[str]]] = []
    owner: dict[str, str] = {}
    for name, table in tables.items():
        tenant, keys = _tenant(where, name, table)
        for k in keys:
            if k in owner:
                raise ValueError(
                    f"keys file {where}: tenant {name!r}: a key of its keys is also a key of tenant {owner[k]!r}"
                )
            owner[k] = name
        entries.append((tenant, keys))
    return entries


def _tenant(where: str, name: str, table: Any) -> tuple[Tenant, list[str]]:
    at = f"keys file {where}: tenant {name!r}"
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"{at}: a name is 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    if not isinstance(table, dict):
        raise ValueError(f"{at}: expected a table [tenants.{name}]")
    unknown = set(table) - _FIELDS
    if unknown:
        raise ValueError(f"{at}: unknown field(s) {sorted(unknown)}; known: {sorted(_FIELDS)}")
    keys = table.get("keys")
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
        raise ValueError(f"{at}: keys: required, a non-empty list of non-empty strings")
    if len(set(keys)) != len(keys):
        raise ValueError(f"{at}: keys: a key is listed twice")
    for fld in ("rpm", "tpm", "max_concurrent", "max_priority"):
        v = table.get(fld)
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, int) or v < (0 if fld == "max_priority" else 1)
        ):
            low = 0 if fld == "max_priority" else 1
            raise ValueError(f"{at}: {fld}: must be an integer >= {low}, got {v!r}")
    models = table.get("models", ["*"])
    if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
        raise ValueError(f'{at}: models: a non-empty list of model names or globs ("*": all)')
    roles = table.get("roles", [])
    if not isinstance(roles, list) or not all(isinstance(r, str) and r in ROLES for r in roles):
        raise ValueError(f"{at}: roles: a list of {', '.join(repr(r) for r in ROLES)}, got {roles!r}")
    salt = table.get("cache_salt", "")
    ok = isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS and salt.isprintable()
    if "cache_salt" in table and not ok:
        raise ValueError(f"{at}: cache_salt: 1 to {MAX_CACHE_SALT_CHARS} printable characters, got {salt!r}")
    limits = Limits(table.get("rpm"), table.get("tpm"), table.get("max_concurrent"))
    tenant = Tenant(name, limits, table.get("max_priority"), tuple(models), frozenset(roles), salt)
    return tenant, list(keys)
