"""Who a caller is: its tenant, its tier and the tier's limits, from API keys and JWT bearer tokens.

Sources, each read again when its file changes (checked at most once a second; a file that no longer
parses is logged and the last good one kept, so a typo never locks every caller out):

- INFERMESH_API_KEYS: keys, comma-separated: tier "standard", each key a tenant of its own.
- INFERMESH_API_KEYS_FILE: a key per line, then optional fields,
  `KEY [tenant=NAME] [tier=NAME] [signing_secret=SECRET]`; keys sharing a tenant share its sessions,
  prefix caches and cached responses; a signing secret makes HMAC-signed requests mandatory for
  the key (mesh/signing.py).
- INFERMESH_TIERS_FILE: JSON, tier name -> {"requests": "60/m", "tokens": "20000/m", "class":
  "interactive"|"batch" (or its older name "priority"), "weight": 3, "cache_class": "premium"|"standard"|
  "batch"}; every field optional.  `class` and `weight` schedule the tier's requests inside the engines
  (interactive before batch; within a class, tokens shared between tenants in the ratio of their tiers'
  weights, 1 by default).  The tier "standard" (any key without one) takes the edge's --rate-limit and
  --token-limit unless the file names it.
- JWT bearer tokens (services/edge/gateway/jwt_auth.py): a `tenant` claim and an optional `tier` claim.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Hashable

from mesh.apikeys import digest, find_digest, tenant_of
from mesh.files import WatchedFile
from mesh.ratelimit import Rate, parse_rate
from mesh.request_limits import MAX_WEIGHT

log = logging.getLogger(__name__)

STANDARD = "standard"
PRIORITIES = ("interactive", "batch")
CACHE_CLASSES = ("premium", "standard", "batch")     # services/cache/eviction.py's SLA classes
# Whole-string matches only (fullmatch): `$` would let a trailing newline through.
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
RELOAD_EVERY_S = 1.0


@dataclasses.dataclass(frozen=True)
class TenantTier:
    """A tier of the tiers file (--tiers-file): its request and token rates, scheduling priority and cache class."""

    name: str
    requests: Rate | None = None
    tokens: Rate | None = None
    priority: str = "interactive"        # the scheduling class (the file's "class")
    cache_class: str = STANDARD
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class AuthenticatedCaller:
    """An authenticated caller.  `bucket` keys its rate limits; `tenant` is what the router namespaces
    sessions and caches by (never a secret); `label` names it in metrics."""

    bucket: Hashable
    tenant: str
    tier: TenantTier
    label: str
    signing_secret: bytes | None = None


@dataclasses.dataclass(frozen=True)
class KeyEntry:
    tenant: str          # "" : the key is a tenant of its own
    tier: str
    signing_secret: bytes | None


def parse_tiers(text: str, standard: TenantTier) -> dict[str, TenantTier]:
    """The tiers file's JSON; ValueError names what is wrong."""
    raw = json.loads(text) if text.strip() else {}
    if not isinstance(raw, dict):
        raise ValueError("the tiers file must hold a JSON object: tier name -> settings")
    tiers = {STANDARD: standard}
    for name, fields in raw.items():
        if not NAME.fullmatch(name) or not isinstance(fields, dict):
            raise ValueError(f"tier {name!r}: give a name of letters, digits, '.', '_', '-' and an object")
        unknown = set(fields) - {"requests", "tokens", "class", "priority", "weight", "cache_class"}
        if unknown:
            raise ValueError(f"tier {name!r}: unknown field(s) {', '.join(sorted(unknown))}; "
                             "known: requests, tokens, class, weight, cache_class")
        tiers[name] = TenantTier(name, parse_rate(str(fields.get("requests", ""))),
                                 parse_rate(str(fields.get("tokens", "")), default_unit="m"), _class(name, fields),
                                 fields.get("cache_class", STANDARD), _weight(name, fields))
        if tiers[name].cache_class not in CACHE_CLASSES:
            raise ValueError(f"tier {name!r}: cache_class {tiers[name].cache_class!r} is not one of "
                             f"{', '.join(CACHE_CLASSES)}")
    return tiers


def _class(tier: str, fields: dict[str, object]) -> str:
    if "class" in fields and "priority" in fields and fields["class"] != fields["priority"]:
        raise ValueError(f"tier {tier!r}: class and priority (its older name) disagree; give one")
    value = fields.get("class", fields.get("priority", "interactive"))
    if value not in PRIORITIES:
        raise ValueError(f"tier {tier!r}: class {value!r} is not one of {', '.join(PRIORITIES)}")
    return str(value)


def _weight(tier: str, fields: dict[str, object]) -> float:
    value = fields.get("weight", 1)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_WEIGHT:
        raise ValueError(f"tier {tier!r}: weight {value!r} must be a number above 0 and at most {MAX_WEIGHT:g}")
    return float(value)


def parse_keys(text: str) -> dict[bytes, KeyEntry]:
    """The keys file: `KEY [tenant=NAME] [tier=NAME] [signing_secret=SECRET]` a line, # comments."""
    keys: dict[bytes, KeyEntry] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        key, *fields = words
        options: dict[str, str] = {}
        for f in fields:
            name, sep, value = f.partition("=")
            if not sep or name not in ("tenant", "tier", "signing_secret") or not value:
                raise ValueError(f"keys file line {number}: {name!r} is not tenant=, tier= or signing_secret=")
            options[name] = value
        for name in ("tenant", "tier"):
            if name in options and not NAME.fullmatch(options[name]):
                raise ValueError(f"keys file line {number}: {name} {options[name]!r}: use 1 to 64 letters, digits, "
                                 "'.', '_' or '-'")
        secret = options.get("signing_secret")
        keys[digest(key)] = KeyEntry(options.get("tenant", ""), options.get("tier", STANDARD),
                                     secret.encode() if secret else None)
    return keys


class Directory:
    """Callers by API key, tiers by name; files reloaded when they change."""

    def __init__(self, env_digests: tuple[bytes, ...] = (), keys_file: str = "", tiers_file: str = "",
                 standard: TenantTier = TenantTier(STANDARD)):
        self.env_keys = {d: KeyEntry("", STANDARD, None) for d in env_digests}
        self.standard = standard
        self._keys = WatchedFile(keys_file, parse_keys) if keys_file else None
        self._tiers = WatchedFile(tiers_file, lambda text: parse_tiers(text, standard)) if tiers_file else None
        self._checked = time.monotonic()
        self.keys: dict[bytes, KeyEntry] = {}
        self.tiers: dict[str, TenantTier] = {}
        self._build()

    def _build(self) -> None:
        tiers = self._tiers.value if self._tiers else {STANDARD: self.standard}
        keys = {**self.env_keys, **(self._keys.value if self._keys else {})}
        missing = sorted({e.tier for e in keys.values()} - set(tiers))
        if missing:
            raise ValueError(f"keys name tier(s) {', '.join(missing)}, which the tiers file does not define")
        self.keys, self.tiers = keys, tiers

    def refresh(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now - self._checked < RELOAD_EVERY_S:
            return
        self._checked = now
        changed = [w.refresh() for w in (self._keys, self._tiers) if w is not None]
        if any(changed):
            try:
                self._build()
            except ValueError as exc:
                log.error("keys and tiers not applied, the last good ones stay: %s", exc)

    @property
    def enabled(self) -> bool:
        return bool(self.keys) or self._keys is not None

    def tier(self, name: str) -> TenantTier | None:
        return self.tiers.get(name)

    def by_key(self, key: str) -> AuthenticatedCaller | None:
        """The caller a key names, or None; every configured digest is compared, in constant time."""
        found = find_digest(key, self.keys)
        if found is None:
            return None
        entry = self.keys[found]
        tier = self.tiers[entry.tier]
        tenant = f"t:{entry.tenant}" if entry.tenant else tenant_of(found)
        return AuthenticatedCaller(found, tenant, tier, entry.tenant or tenant, entry.signing_secret)
