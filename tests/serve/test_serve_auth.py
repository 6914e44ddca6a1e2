"""With --api-key every route but /health needs the key: /openapi.json, and /metrics unless
--metrics-public; the scheme is case-insensitive ("bearer KEY"). /docs and /redoc are off (they load
from a CDN), and a 404 points at GET /openapi.json."""

from __future__ import annotations

import httpx
import pytest
from serve_checks import error_of

from infer.serve.app import create_app

MODEL = "tiny"
KEY = "sk-auth-test"


@pytest.fixture(scope="module")
def guarded(tiny, live):
    return live(create_app({MODEL: tiny.engine}, api_key=KEY))


@pytest.fixture(scope="module")
def public_metrics(tiny, live):
    return live(create_app({MODEL: tiny.engine}, api_key=KEY, metrics_public=True))


@pytest.mark.parametrize("path", ["/openapi.json", "/metrics", "/v1/models"])
def test_the_key_guards_every_route_but_health(guarded, path):
    assert error_of(httpx.get(guarded.root + path), 401)["type"] == "authentication_error"
    assert httpx.get(guarded.root + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{guarded.root}/health").status_code == 200


@pytest.mark.parametrize("header", [f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}"])
def test_the_scheme_is_case_insensitive(guarded, header):
    assert httpx.get(f"{guarded.url}/models", headers={"Authorization": header}).status_code == 200


@pytest.mark.parametrize("header", ["Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x", "Bearer", ""])
def test_anything_else_is_a_401(guarded, header):
    response = httpx.get(f"{guarded.url}/models", headers={"Authorization": header})
    assert error_of(response, 401)["code"] == "invalid_api_key"
    assert response.headers["WWW-Authenticate"] == "Bearer"


def test_metrics_public_opens_metrics_only(public_metrics):
    assert httpx.get(f"{public_metrics.root}/metrics").status_code == 200
    assert error_of(httpx.get(f"{public_metrics.root}/openapi.json"), 401)
    assert error_of(httpx.get(f"{public_metrics.url}/models"), 401)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("path", ["/docs", "/redoc", "/docs/oauth2-redirect"])
def test_the_cdn_pages_are_off_and_404s_point_at_the_schema(guarded, path):
    error = error_of(httpx.get(guarded.root + path, headers={"Authorization": f"Bearer {KEY}"}), 404)
    assert "GET /openapi.json" in error["message"]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_without_a_key_the_schema_is_open(tiny):
    from fastapi.testclient import TestClient

    with TestClient(create_app({MODEL: tiny.engine})) as client:
        schema = client.get("/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"] and "/openapi.json" not in schema["paths"]
