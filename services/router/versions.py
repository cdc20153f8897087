"""Model versions side by side: which version a request goes to.

Per model: a default version and optional canary shares (version -> fraction of requests).
A request may pin a version (`model@version` or the `x-infermesh-model-version` header).
Otherwise a stable hash of the request's key (its session, else its id) picks the share, so
one session stays on one version while a canary runs.  Switching the default only affects
requests routed afterwards: an in-flight request keeps the replica, so the version, it
started on.  Pure code; the admin API (admin.py) calls set().
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from mesh.errors import InvalidArgument, NotFound, Unavailable


def version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    """Natural order: "2" < "10", "1.9" < "1.10"; non-numeric parts compare as text after numbers."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"[.\-_]", version))


def resolve_model(model: str, version: str, default_model: str, served: Collection[str]) -> tuple[str, str]:
    """A request's `name`, `name@version` or "" / "default" (the default model), and its pinned
    version -> (name, pinned version or "").  served: the models that have a replica."""
    name, _, at_version = model.partition("@")
    if at_version and version and at_version != version:
        raise InvalidArgument(f"model {model!r} names version {at_version!r} but the request pins {version!r}")
    name = name if name and name != "default" else default_model
    if name not in served:
        raise NotFound(f"model {name!r} is not served; available: {', '.join(served) or 'none yet'}")
    return name, at_version or version


def unit_interval(key: str) -> float:
    """A stable hash of `key` in [0, 1): the same on every router and every run."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2.0**64


@dataclass
class VersionRouting:
    default: str = ""                                        # "" until set or first seen
    canary: dict[str, float] = field(default_factory=dict)   # version -> share of unpinned requests
    shadow: tuple[str, float] = ("", 0.0)                    # (version, share) mirrored; "": none


class ModelVersions:
    def __init__(self, defaults: Mapping[str, str] | None = None):
        self._routing: dict[str, VersionRouting] = {m: VersionRouting(v) for m, v in (defaults or {}).items()}

    def routing(self, model: str, served: Iterable[str]) -> VersionRouting:
        """The model's routing; the default is the lowest served version until someone sets it."""
        routing = self._routing.setdefault(model, VersionRouting())
        if not routing.default:
            ordered = sorted(set(served), key=version_key)
            routing.default = ordered[0] if ordered else ""
        return routing

    def set(self, model: str, served: Iterable[str], default: str = "",
            canary: Mapping[str, float] | None = None, shadow: tuple[str, float] | None = None) -> VersionRouting:
        """Switch the default version and/or replace the canary shares and/or the shadow rule (None:
        keep); validates everything first."""
        served = set(served)
        if not served:
            raise NotFound(f"model {model!r} has no replicas; nothing to route")
        if default and default not in served:
            raise InvalidArgument(f"version {default!r} of {model!r} is not served (served: {_listed(served)})")
        shares = dict(canary or {})
        for version, share in shares.items():
            if version not in served:
                raise InvalidArgument(f"canary version {version!r} of {model!r} is not served "
                                      f"(served: {_listed(served)})")
            if not 0.0 <= share <= 1.0:
                raise InvalidArgument(f"canary share for version {version!r} is {share}; it must be in [0, 1]")
        if sum(shares.values()) > 1.0 + 1e-9:
            raise InvalidArgument(f"canary shares add up to {sum(shares.values()):.3f}; at most 1")
        if shadow is not None and shadow[0]:
            if shadow[0] not in served:
                raise InvalidArgument(f"shadow version {shadow[0]!r} of {model!r} is not served "
                                      f"(served: {_listed(served)})")
            if not 0.0 < shadow[1] <= 1.0:
                raise InvalidArgument(f"shadow share is {shadow[1]}; it must be in (0, 1]")
        routing = self.routing(model, served)
        if shadow is not None:
            routing.shadow = shadow if shadow[0] else ("", 0.0)
        if default:
            routing.default = default
        if canary is not None:
            routing.canary = {v: s for v, s in shares.items() if s > 0}
        return routing

    def mirror(self, model: str, chosen: str, served: Iterable[str], key: str) -> str:
        """The version to mirror this request to (shadow traffic), or "": a stable hash of `key` picks
        the share; never the version that serves it, never one with no healthy replica."""
        version, share = self.routing(model, served).shadow
        if not version or version == chosen or version not in set(served):
            return ""
        return version if unit_interval("shadow:" + key) < share else ""

    def choose(self, model: str, served: Iterable[str], pinned: str = "", key: str = "") -> str:
        """The version for one request.  served: versions with at least one healthy replica."""
        served = set(served)
        if pinned:
            if pinned not in served:
                raise NotFound(f"version {pinned!r} of {model!r} is not served (served: {_listed(served)})")
            return pinned
        if not served:
            raise Unavailable(f"no healthy engine replica serves {model!r}; retry shortly")
        routing = self.routing(model, served)
        point, edge = unit_interval(key), 0.0
        for version in sorted(routing.canary, key=version_key):
            edge += routing.canary[version]
            if point < edge and version in served:
                return version
        if routing.default in served:
            return routing.default
        # The default has no healthy replica: serve the model rather than fail (newest first).
        return sorted(served, key=version_key)[-1]


def _listed(versions: Iterable[str]) -> str:
    return ", ".join(sorted(versions, key=version_key)) or "none"
