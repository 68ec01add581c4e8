"""D's whole answer is checked before its bytes are relayed: a JSON object passes, its
members unread; anything else is D's failure (502), never the client's 200."""

from __future__ import annotations

import pytest

from proxy.config import EndpointConfig, Limits, Timeouts
from proxy.errors import UpstreamProtocolError
from proxy.flow.exchange import _check_whole_answer
from proxy.pool.endpoints import ClusterName, Endpoint
from proxy.upstream.client import UpstreamClient

D = Endpoint(EndpointConfig(url="http://d:8000"), ClusterName.DECODE)
CLIENT = UpstreamClient(Timeouts(), Limits())


@pytest.mark.parametrize("body", [
    b'{"id":"cmpl-1","choices":[{"index":0,"text":"t","logprobs":null}],"usage":{"a":1}}',
    b"{}",
    b' {"deep": [[[{"x": [1.5e3, true, null, "\\u00e9"]}]]]} ',
])
def test_a_json_object_passes(body: bytes) -> None:
    _check_whole_answer(body, D, CLIENT)


@pytest.mark.parametrize("body", [
    b"[1]", b'"text"', b"null", b"", b"<html>bad gateway</html>",
    b'{"choices": [', b'{"a": 1} trailing', b'{"a": tru}',
])
def test_anything_else_is_ds_failure(body: bytes) -> None:
    with pytest.raises(UpstreamProtocolError) as raised:
        _check_whole_answer(body, D, CLIENT)
    assert raised.value.status == 502
    assert "not a JSON object" in str(raised.value)
