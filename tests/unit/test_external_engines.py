"""``--rollout-external-engine-addrs``: what it excludes at parse time, and the attach check against a fake engine
(the e2e runs in ``tests/e2e/test_loop_learns.py`` and ``test_train_loop.py`` attach to real ones)."""

from __future__ import annotations

import contextlib
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vime.backends.vllm_utils import control_auth
from vime.backends.vllm_utils.external_engines import (
    WORKER_EXTENSION_CLS,
    ExternalEngineError,
    ExternalEngines,
    describe_engine,
    served_dtype,
)
from vime.utils.arguments import parse_args
from vime.utils.vllm_config import engine_specs, serving_config

BASE = (
    "--train-backend fsdp --hf-checkpoint /m --prompt-data /d.jsonl --rollout-batch-size 4 "
    "--n-samples-per-prompt 4 --num-rollout 3 --rollout-external-engine-addrs 127.0.0.1:8001 http://10.0.0.2:8002"
).split()


def _parse_error(argv: list[str]) -> str:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit):
        parse_args(argv)
    return stderr.getvalue()


def test_external_engines_are_the_policys_only_engines():
    args = parse_args(BASE)
    assert args.rollout_num_gpus == 0  # no bundle of the run's own for engines
    assert len(engine_specs(serving_config(args))) == 2


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--colocate"], "--colocate"),
        (["--offload-rollout"], "--offload-rollout"),
        (["--use-fault-tolerance"], "unlike slime"),
        (["--rollout-num-gpus", "2"], "--rollout-num-gpus 2"),
        (["--vllm-enforce-eager"], "--vllm-enforce-eager"),
        (["--rollout-external-engine-addrs", "127.0.0.1"], "'127.0.0.1' is not an engine address"),
        (["--rollout-external-engine-addrs", "127.0.0.1:80/v1"], "is not an engine address"),
    ],
)
def test_what_needs_engines_vime_starts_is_refused_with_the_reason(flags, named):
    assert named in _parse_error(BASE + flags)


class FakeEngine(BaseHTTPRequestHandler):
    """A vLLM server's /health, /server_info (JSON config) and a control route behind vime's secret."""

    config: dict = {}
    secured = True
    secret = ""  # the one it was started with

    def do_GET(self):  # noqa: N802 -- http.server's name
        if self.path == "/health":
            self._send(200, {})
        elif self.path.startswith("/server_info"):
            self._send(200, {"vllm_config": self.config})
        elif self.path == "/is_paused":
            allowed = not self.secured or self.headers.get(control_auth.HEADER) == self.secret
            self._send(200 if allowed else 403, {"is_paused": False})
        else:
            self._send(404, {})

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def _config(**changes) -> dict:
    model = {
        "model": "/m",
        "served_model_name": "/m",
        "logprobs_mode": "processed_logprobs",
        "dtype": "torch.float32",
    }
    parallel = {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "worker_extension_cls": WORKER_EXTENSION_CLS,
    }
    for key, value in changes.items():
        (model if key in model else parallel)[key] = value
    return {"model_config": model, "parallel_config": parallel, "device_config": {"device": "cpu"}}


@pytest.fixture
def fake_engine(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeEngine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(FakeEngine, "config", _config())
    monkeypatch.setattr(FakeEngine, "secured", True)
    monkeypatch.setattr(FakeEngine, "secret", control_auth.run_secret())
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_engine_started_as_vime_starts_them_is_described(fake_engine):
    info = describe_engine(fake_engine, "/m", 1)
    assert (info.model, info.num_workers, info.on_gpu, info.dtype) == ("/m", 1, False, "float32")
    assert served_dtype(fake_engine) == "float32"
    launcher = ExternalEngines([fake_engine], "/m", 1)
    engine = launcher.launch(None, 0, None, [])
    assert engine.start() is engine and engine.is_alive() and engine.url == fake_engine
    engine.stop()  # leaves it running
    assert engine.is_alive()


@pytest.mark.parametrize(
    ("changes", "secured", "secret", "missing"),
    [
        ({"worker_extension_cls": ""}, True, None, "vime's worker extension"),
        ({"logprobs_mode": "raw_logprobs"}, True, None, "--logprobs-mode processed_logprobs"),
        ({"tensor_parallel_size": 2}, True, None, "pass --rollout-num-gpus-per-engine 2"),
        ({"served_model_name": "other", "model": "/other"}, True, None, "--served-model-name /m"),
        ({}, False, None, f"--middleware {control_auth.MIDDLEWARE}"),
        ({}, True, "another-runs-secret", f"the same {control_auth.SECRET_ENV}"),
    ],
)
def test_an_engine_missing_a_requirement_is_refused_naming_it(
    fake_engine, monkeypatch, changes, secured, secret, missing
):
    monkeypatch.setattr(FakeEngine, "config", _config(**changes))
    monkeypatch.setattr(FakeEngine, "secured", secured)
    if secret is not None:  # this run has another secret than the one the engine started with
        monkeypatch.setenv(control_auth.SECRET_ENV, secret)
    with pytest.raises(ExternalEngineError) as raised:
        describe_engine(fake_engine, "/m", 1)
    assert missing in str(raised.value) and fake_engine in str(raised.value)


def test_a_missing_engine_is_refused_with_its_address():
    with pytest.raises(ExternalEngineError, match="does not answer GET /health"):
        describe_engine("http://127.0.0.1:9", "/m", 1, timeout=2)
