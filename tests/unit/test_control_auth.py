"""The control-route guard every engine runs: public inference and health routes pass, control routes need the
run's secret (a FastAPI app, as vLLM's server is one, stands in for it; the e2e test checks a real engine)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from vime.backends.vllm_utils import control_auth


@pytest.fixture
def client(monkeypatch):
    monkeypatch.setenv(control_auth.SECRET_ENV, "s3cret")

    app = FastAPI()
    for path in [
        "/v1/completions",
        "/health",
        "/pause",
        "/collective_rpc",
        "/inference/v1/generate",
        "/sleep",
    ]:
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST"])
    app.middleware("http")(control_auth.require_control_secret)
    return TestClient(app)


def test_public_routes_need_no_secret(client):
    assert client.post("/v1/completions").status_code == 200
    assert client.get("/health").status_code == 200
    assert client.post("/inference/v1/generate").status_code == 200


@pytest.mark.parametrize("path", ["/pause", "/collective_rpc", "/sleep"])
def test_control_routes_need_the_runs_secret(client, path):
    refused = client.post(path)
    assert refused.status_code == 403 and "needs the run's X-Vime-Control-Secret" in refused.json()["error"]
    assert client.post(path, headers={control_auth.HEADER: "wrong"}).status_code == 403
    assert client.post(path, headers={control_auth.HEADER: "s3cret"}).status_code == 200


def test_the_secret_is_made_once_per_process_tree(monkeypatch):
    monkeypatch.delenv(control_auth.SECRET_ENV, raising=False)
    first = control_auth.run_secret()
    assert len(first) == 32 and control_auth.run_secret() == first
