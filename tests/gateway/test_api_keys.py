"""Document keys in ``/docs/{key}``: the raw path segment percent-decoded to bytes, which must be UTF-8
(docs/gateway.md, "Keys"). A non-UTF-8 key is a 400, never an alias of its literal escaped text."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from yarl import URL

from gateway.broker import Broker
from gateway.service import GatewayService
from tests.gateway.api_harness import expect_error, run


def test_non_utf8_key_is_rejected_and_does_not_alias_its_escaped_text(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        def raw(path: str) -> URL:
            return URL(f"{url}{path}", encoded=True)  # sent exactly as written

        # the literal three-character key "%FF" is /docs/%25FF
        r = await http.put(raw("/docs/%25FF"), data=b"literal")
        assert r.status == 200, await r.text()
        for bad in ("/docs/%FF", "/docs/%E2%82", "/docs/a%C0%AF", "/docs/%ED%A0%80"):
            body = await expect_error(await http.get(raw(bad)), 400, "invalid_argument")
            assert "UTF-8" in body["message"]
            await expect_error(await http.put(raw(bad), data=b"x"), 400, "invalid_argument")
            await expect_error(await http.delete(raw(bad)), 400, "invalid_argument")
        r = await http.get(raw("/docs/%25FF"))
        assert r.status == 200 and await r.read() == b"literal"
        assert svc.bucket is not None and svc.bucket.get(b"%FF").value == b"literal"
        # UTF-8 keys (escaped or not), '+', spaces and an escaped '/' are keys as decoded
        for path, key in (("/docs/%C3%A9t%C3%A9", "été".encode()), ("/docs/a+b%20c", b"a+b c"),
                          ("/docs/a%2Fb", b"a/b")):
            r = await http.put(raw(path), data=path.encode())
            assert r.status == 200, (path, await r.text())
            assert svc.bucket.get(key).value == path.encode()
            r = await http.get(raw(path))
            assert r.status == 200 and await r.read() == path.encode()
        # the 250-byte limit counts the decoded bytes
        r = await http.put(raw("/docs/" + "%C3%A9" * 125), data=b"x")
        assert r.status == 200
        await expect_error(await http.put(raw("/docs/" + "%C3%A9" * 125 + "x"), data=b"x"), 400, "invalid_argument")

    run(kafka_broker, tmp_path, scenario)
