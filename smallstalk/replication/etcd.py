"""A small client of etcd's v3 JSON gateway: leases, keys, and one-shot transactions.

etcd (v3 API) serves its gRPC services as JSON over plain HTTP POSTs, with
keys and values in base64 (`/v3/kv/range`, `/v3/kv/txn`, `/v3/lease/grant`,
`/v3/lease/keepalive`, ...). This module speaks exactly the part the HA
member (ha.py) needs, over httpx, which runs on trio through anyio. Given
several endpoints it tries them in turn, starting with the last that
answered. Any failure to get an answer is `StoreUnavailable`: the caller
decides what an unreachable store means (for a primary: fence itself).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any

import attrs
import httpx


class StoreUnavailable(Exception):
    """No endpoint of the store answered (or answered with an error)."""


def b64(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with `prefix` (etcd's rule)."""
    data = bytearray(prefix.encode())
    data[-1] += 1
    return b64(bytes(data))


@attrs.frozen
class KV:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int

    def json(self) -> Any:
        return json.loads(self.value)


def _kv(raw: dict) -> KV:
    return KV(unb64(raw["key"]).decode(), unb64(raw.get("value", "")),
              int(raw.get("create_revision", 0)), int(raw.get("mod_revision", 0)),
              int(raw.get("lease", 0)))


# Compare and operation builders for `Etcd.txn` (the gateway's JSON shapes).
def created(key: str, revision: int) -> dict:
    """Compare: the key's create revision is `revision` (0: the key does not exist)."""
    return {"target": "CREATE", "key": b64(key), "result": "EQUAL",
            "createRevision": str(revision)}


def modified(key: str, revision: int) -> dict:
    """Compare: the key was last written at `revision` (0: it does not exist)."""
    return {"target": "MOD", "key": b64(key), "result": "EQUAL", "modRevision": str(revision)}


def value_is(key: str, value: bytes) -> dict:
    return {"target": "VALUE", "key": b64(key), "result": "EQUAL", "value": b64(value)}


def put(key: str, value: bytes, lease: int = 0) -> dict:
    req: dict = {"key": b64(key), "value": b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"requestPut": req}


def delete(key: str) -> dict:
    return {"requestDeleteRange": {"key": b64(key)}}


class Etcd:
    """One store, reached through any of `endpoints` (http://host:port)."""

    def __init__(self, endpoints: Sequence[str], timeout: float = 1.0):
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout = timeout
        self._first = 0  # the endpoint that answered last
        self._http: httpx.AsyncClient | None = None

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _post(self, path: str, body: dict) -> dict:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.timeout)
        errors = []
        n = len(self.endpoints)
        for i in range(n):
            k = (self._first + i) % n
            url = self.endpoints[k] + path
            try:
                resp = await self._http.post(url, json=body)
            except httpx.HTTPError as e:
                errors.append(f"{self.endpoints[k]}: {type(e).__name__}")
                continue
            if resp.status_code != 200:
                errors.append(f"{self.endpoints[k]}: HTTP {resp.status_code} "
                              f"{resp.text[:120].strip()}")
                continue
            self._first = k
            try:
                return resp.json()
            except ValueError:
                errors.append(f"{self.endpoints[k]}: not JSON")
        raise StoreUnavailable("; ".join(errors))

    # --- leases -------------------------------------------------------------------

    async def grant(self, ttl: int) -> int:
        out = await self._post("/v3/lease/grant", {"TTL": ttl})
        return int(out["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew `lease`; its TTL now (0: it expired and is gone)."""
        out = await self._post("/v3/lease/keepalive", {"ID": str(lease)})
        return int(out.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self._post("/v3/lease/revoke", {"ID": str(lease)})

    # --- keys ----------------------------------------------------------------------

    async def get_prefix(self, prefix: str) -> tuple[int, list[KV]]:
        """Every key under `prefix`, and the store's revision of that read."""
        out = await self._post("/v3/kv/range", {"key": b64(prefix),
                                                "range_end": prefix_end(prefix)})
        return int(out["header"]["revision"]), [_kv(kv) for kv in out.get("kvs", [])]

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        req = put(key, value, lease)["requestPut"]
        out = await self._post("/v3/kv/put", req)
        return int(out["header"]["revision"])

    async def delete(self, key: str) -> None:
        await self._post("/v3/kv/deleterange", {"key": b64(key)})

    async def txn(self, compare: list[dict], success: list[dict],
                  failure: list[dict] = ()) -> tuple[bool, int]:
        """One transaction: (whether every compare held, the store's revision after it)."""
        out = await self._post("/v3/kv/txn", {"compare": compare, "success": success,
                                              "failure": list(failure)})
        return bool(out.get("succeeded", False)), int(out["header"]["revision"])
