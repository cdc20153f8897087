"""JWT bearer tokens for multi-tenant access (PyJWT): HS256 with a shared secret, RS256 with a JWKS file.

Settings (environment, as the edge's keys are):
  INFERMESH_JWT_SECRET      HS256's shared secret
  INFERMESH_JWT_JWKS_FILE   RS256's public keys, a JWKS document ({"keys": [...]}); the token's `kid`
                            picks one (a single key needs none); read again when the file changes
  INFERMESH_JWT_AUDIENCE    when set, the `aud` claim must name it
  INFERMESH_JWT_ISSUER      when set, the `iss` claim must equal it

A token must carry `exp` and the tenant claim; its tier claim (default "standard") must be a tier the
tiers file defines.  Every refusal is a JwtRefused with the reason a person can act on.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt

from services.edge.gateway.tenants import NAME

LEEWAY_S = 5.0           # clock skew allowed on exp / nbf / iat


class JwtRefused(Exception):
    pass


@dataclass(frozen=True)
class Claims:
    tenant: str
    tier: str
    subject: str


def looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2 and token.startswith("eyJ")


class JwtVerifier:
    def __init__(self, secret: str = "", jwks_file: str = "", audience: str = "", issuer: str = "",
                 tenant_claim: str = "tenant", tier_claim: str = "tier"):
        if not secret and not jwks_file:
            raise ValueError("JWT needs INFERMESH_JWT_SECRET (HS256) or INFERMESH_JWT_JWKS_FILE (RS256)")
        self.secret, self.jwks_file = secret, jwks_file
        self.audience, self.issuer = audience or None, issuer or None
        self.tenant_claim, self.tier_claim = tenant_claim, tier_claim
        self._jwks: tuple[tuple[int, int], jwt.PyJWKSet] | None = None
        if jwks_file:
            self._keys()            # a missing or malformed file fails at start

    def _keys(self) -> jwt.PyJWKSet:
        st = os.stat(self.jwks_file)
        stamp = (st.st_mtime_ns, st.st_size)
        if self._jwks is None or self._jwks[0] != stamp:
            self._jwks = (stamp, jwt.PyJWKSet.from_dict(json.loads(Path(self.jwks_file).read_text())))
        return self._jwks[1]

    def _key(self, token: str) -> tuple[Any, list[str]]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise JwtRefused(f"the bearer token is not a well-formed JWT: {exc}") from None
        alg = header.get("alg")
        if alg == "HS256" and self.secret:
            return self.secret, ["HS256"]
        if alg == "RS256" and self.jwks_file:
            keys = self._keys().keys
            kid = header.get("kid")
            chosen = [k for k in keys if k.key_id == kid] if kid else keys[:1] if len(keys) == 1 else []
            if not chosen:
                raise JwtRefused(f"the JWT's key id {kid!r} is not in the JWKS file" if kid else
                                 "the JWT has no 'kid' and the JWKS file holds several keys")
            return chosen[0], ["RS256"]
        accepted = [a for a, on in (("HS256", self.secret), ("RS256", self.jwks_file)) if on]
        raise JwtRefused(f"JWT algorithm {alg!r} is not accepted here; use {' or '.join(accepted)}")

    def verify(self, token: str) -> Claims:
        key, algorithms = self._key(token)
        try:
            claims = jwt.decode(token, key, algorithms=algorithms, audience=self.audience, issuer=self.issuer,
                                leeway=LEEWAY_S, options={"require": ["exp"]})
        except jwt.ExpiredSignatureError:
            raise JwtRefused("the JWT has expired (its 'exp' is past); get a new token") from None
        except jwt.PyJWTError as exc:
            raise JwtRefused(f"the JWT was refused: {exc}") from None
        tenant, tier = claims.get(self.tenant_claim), claims.get(self.tier_claim, "standard")
        if not isinstance(tenant, str) or not NAME.fullmatch(tenant):
            raise JwtRefused(f"the JWT's {self.tenant_claim!r} claim must be a tenant name (1 to 64 letters, "
                             "digits, '.', '_' or '-')")
        if not isinstance(tier, str):
            raise JwtRefused(f"the JWT's {self.tier_claim!r} claim must be a string")
        return Claims(tenant, tier, str(claims.get("sub", "")))
