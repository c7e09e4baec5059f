"""Engine/router launch plumbing without vLLM: commands, environment, host check, process groups, start
errors, and the control client's requests and errors against a fake server."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from aiohttp import web

from vime.backends.vllm_utils import engine as engine_mod
from vime.backends.vllm_utils import fork_server, process_guard
from vime.backends.vllm_utils import router as router_mod
from vime.backends.vllm_utils.control_client import EngineControlClient, EngineControlError
from vime.backends.vllm_utils.engine import (
    PORT_TAKEN,
    EngineStartError,
    ServerProcess,
    VLLMEngine,
    build_engine_command,
    build_engine_env,
    check_private_host,
    server_module,
)
from vime.backends.vllm_utils.router import (
    RouterProcess,
    build_router_command,
    router_executable,
    start_router,
)
from vime.utils.arguments import parse_args

BASE = (
    "--train-backend fsdp --hf-checkpoint /models/tiny --prompt-data /d.jsonl --rollout-batch-size 4 "
    "--n-samples-per-prompt 4 --num-rollout 3"
).split()


def _args(*flags: str):
    return parse_args([*BASE, *flags])


def test_engine_command_has_vime_flags_then_extra_then_passthrough_in_order():
    args = _args(
        *"--rollout-seed 7 --vllm-max-model-len 256 --vllm-enforce-eager --vllm-dtype float32".split()
    )
    cmd = build_engine_command(args, "127.0.0.1", 8123, extra_args=["--worker-extension-cls", "x.Y"])
    assert cmd == [
        sys.executable, "-m", server_module(),
        "--model", "/models/tiny", "--host", "127.0.0.1", "--port", "8123", "--seed", "7",
        "--tensor-parallel-size", "1", "--logprobs-mode", "processed_logprobs",
        "--middleware", "vime.backends.vllm_utils.control_auth.require_control_secret",
        "--worker-extension-cls", "x.Y",
        "--max-model-len", "256", "--enforce-eager", "--dtype", "float32",
    ]  # fmt: skip


def test_engine_command_model_path_overrides_hf_checkpoint():
    cmd = build_engine_command(_args(), "10.0.0.5", 9000, model_path="/ckpt/iter_3")
    assert cmd[cmd.index("--model") + 1] == "/ckpt/iter_3"
    assert cmd[cmd.index("--host") + 1] == "10.0.0.5"
    assert cmd[-2:] == ["--middleware", "vime.backends.vllm_utils.control_auth.require_control_secret"]


@pytest.mark.parametrize(
    ("flags", "base_env", "cuda", "expected_kv_space"),
    [
        ([], {}, False, "1"),  # CPU, nothing sized: vime sizes it
        ([], {"VLLM_CPU_KVCACHE_SPACE": "4"}, False, "4"),  # the user's env var wins
        (["--vllm-kv-cache-memory-bytes", "2G"], {}, False, None),  # the env var would override the flag
        (["--vllm-gpu-memory-utilization", "0.3"], {}, False, None),
        ([], {}, True, None),  # GPU: vLLM's own sizing
    ],
)
def test_engine_env_sizes_the_cpu_kv_cache_only_when_the_user_did_not(
    monkeypatch, flags, base_env, cuda, expected_kv_space
):
    from vime.backends.vllm_utils import engine

    monkeypatch.setattr(engine, "cuda_available", lambda: cuda)
    base = {"PATH": "/bin", **base_env}
    env = build_engine_env(_args(*flags), base_env=base)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert len(env["VIME_CONTROL_SECRET"]) == 32  # the run's control-route secret
    assert env["PATH"] == "/bin"
    assert env.get("VLLM_CPU_KVCACHE_SPACE") == expected_kv_space
    assert "VLLM_SERVER_DEV_MODE" not in base  # the caller's mapping is not modified


@pytest.mark.parametrize(
    ("host_env", "expected"),
    [
        ({}, None),  # multicast allowed: vLLM's own choice
        ({"NCCL_NVLS_ENABLE": "0"}, "trtllm"),
        ({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}, "trtllm"),
        ({"NCCL_NVLS_ENABLE": "1"}, None),
        ({"NCCL_NVLS_ENABLE": "0", "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm"}, "trtllm"),
    ],
)
def test_flashinfer_allreduce_stays_off_multicast_where_the_host_turns_it_off(host_env, expected):
    env = build_engine_env(_args(), base_env={"PATH": "/bin", **host_env})
    assert env.get("VLLM_FLASHINFER_ALLREDUCE_BACKEND") == expected


@pytest.mark.parametrize(
    ("flags", "host_env", "expected"),
    [
        (["--vllm-dtype", "float32"], {}, "ieee"),
        (["--vllm-dtype=float"], {}, "ieee"),
        (
            ["--vllm-dtype", "float32", "--vllm-dtype", "bfloat16"],
            {},
            None,
        ),  # the last one counts, as for vLLM
        (["--vllm-dtype", "bfloat16"], {}, None),
        ([], {}, None),
        (["--vllm-dtype", "float32"], {"TRITON_F32_DEFAULT": "tf32"}, "tf32"),  # the user's setting stands
    ],
)
def test_a_float32_engine_computes_triton_dots_in_float32(monkeypatch, flags, host_env, expected):
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    monkeypatch.setenv("VLLM_RAY_EXTRA_ENV_VARS_TO_COPY", "MY_VAR")
    for key, value in host_env.items():
        monkeypatch.setenv(key, value)
    env = VLLMEngine(_args(*flags)).env
    assert env.get("TRITON_F32_DEFAULT") == expected
    # vLLM's Ray executor copies only the variables it is told to into the workers it starts
    copied = env["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"].split(",")
    assert copied == (["MY_VAR", "TRITON_F32_DEFAULT"] if expected else ["MY_VAR"])


def test_a_multicast_allreduce_backend_is_refused_where_the_host_turns_multicast_off():
    base = {"NCCL_NVLS_ENABLE": "0", "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "mnnvl"}
    with pytest.raises(ValueError, match=r"mnnvl .*NCCL_NVLS_ENABLE=0.*fuse_allreduce_rms"):
        build_engine_env(_args(), base_env=base)
    # without the host's setting, the user's choice stands
    assert (
        build_engine_env(_args(), base_env={"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "mnnvl"})[
            "VLLM_FLASHINFER_ALLREDUCE_BACKEND"
        ]
        == "mnnvl"
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "8.8.8.8"])
def test_public_or_wildcard_hosts_are_refused(host):
    with pytest.raises(ValueError, match="no authentication"):
        check_private_host(host)
    with pytest.raises(ValueError, match="refusing to listen"):
        VLLMEngine(_args(), host=host)
    with pytest.raises(ValueError, match="refusing to listen"):
        RouterProcess(_args(), host=host)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "10.1.2.3", "192.168.0.7"])
def test_loopback_and_private_hosts_are_accepted(host):
    check_private_host(host)


def test_router_command_passes_router_flags_after_a_free_metrics_port():
    exe = router_executable()
    assert exe.endswith("vllm-router")
    args = _args("--router-policy", "round_robin", "--router-prometheus-port", "29100")
    cmd = build_router_command(args, "127.0.0.1", 30001)
    assert cmd[:6] == [exe, "--host", "127.0.0.1", "--port", "30001", "--prometheus-port"]
    assert int(cmd[6]) not in (29000, 30001)
    assert cmd[7:] == ["--policy", "round_robin", "--prometheus-port", "29100"]  # the user's port wins
    assert len(build_router_command(_args(), "127.0.0.1", 30001)) == 7


def test_a_router_whose_metrics_port_was_taken_starts_again_on_another(tmp_path, monkeypatch):
    """Another process binds the free metrics port chosen for the router before the router does (seen with three runs
    starting side by side): the router exits at start, and :func:`start_router` starts it again on a new port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]  # the first choice: already taken
        real_free_port = router_mod.free_port
        monkeypatch.setattr(router_mod, "free_port", lambda: ports.pop() if ports else real_free_port())
        router = start_router(_args(), log_path=tmp_path / "router.log")
        try:
            assert router.is_alive() and not ports
            assert PORT_TAKEN in (tmp_path / "router.log").read_text()  # the first start lost its port
        finally:
            router.stop()


def test_a_router_that_fails_otherwise_is_not_started_again(tmp_path, monkeypatch):
    chosen = []
    real_free_port = router_mod.free_port
    monkeypatch.setattr(router_mod, "free_port", lambda: chosen.append(real_free_port()) or chosen[-1])
    monkeypatch.setattr(router_mod, "router_executable", lambda: "false")  # exits at once, with code 1
    with pytest.raises(EngineStartError, match="exited with code 1"):
        start_router(_args(), log_path=tmp_path / "router.log")
    assert len(chosen) == 1  # one start


@pytest.fixture(params=["popen", "forked"])
def launch(request, tmp_path, monkeypatch) -> str:
    """How a server's ``python -m`` command starts: under a process guard started by Popen, or forked (guard and
    server) by a fork server (:mod:`vime.backends.vllm_utils.fork_server`, started here, importing nothing)."""
    monkeypatch.delenv(fork_server.SOCKET_ENV, raising=False)  # the e2e tests' one, when they ran first here
    if request.param == "forked":
        path = tmp_path / "fork.sock"
        server = fork_server.start_server(path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=30)
        request.addfinalizer(server.kill)
        monkeypatch.setenv(fork_server.SOCKET_ENV, str(path))
    return request.param


def _module_command(tmp_path, script: str) -> list[str]:
    """``python -m fake_server``, ``script`` written as that module in ``tmp_path`` (run with ``PYTHONPATH``)."""
    (tmp_path / "fake_server.py").write_text(script)
    return [sys.executable, "-m", "fake_server"]


def _server(tmp_path, script: str) -> ServerProcess:
    env = {"PYTHONPATH": str(tmp_path)}
    return ServerProcess(
        "fake server",
        _module_command(tmp_path, script),
        env,
        "127.0.0.1",
        1,
        tmp_path / "s.log",
        start_timeout=60,
    )


def test_start_error_names_command_exit_code_and_log_tail(launch, tmp_path):
    script = "import sys\nfor i in range(100): print('line', i)\nsys.exit(3)"
    server = _server(tmp_path, script).start()
    start = time.monotonic()
    with pytest.raises(EngineStartError) as err:
        server.wait_ready_sync()
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert "exited with code 3" in message and "fake_server" in message  # the command
    assert "line 99" in message and "line 60" in message and "line 59" not in message  # the last 40 lines
    assert not server.is_alive()


def test_a_servers_processes_show_its_environment_and_command(launch, tmp_path):
    # forked ones too: their /proc/PID/environ is empty and their command line is the process title
    script = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(300)"
    server = _server(tmp_path, script)
    server.env["VIME_TEST_MARK"] = "m1"
    with server:
        deadline = time.monotonic() + 10
        while "up" not in server.log_tail() and time.monotonic() < deadline:
            time.sleep(0.1)
        members = server.live_processes()
        assert len(members) == 2  # the guard and the server
        assert [fork_server.environ_of(p).get("VIME_TEST_MARK") for p in members] == ["m1", "m1"]
        commands = [fork_server.command_of(p) for p in members]
        assert [c[1:] for c in commands if c[1:3] == ["-m", "fake_server"]] == [["-m", "fake_server"]], (
            commands
        )
        # a server that outlives its SIGKILLed guard (until the watchdog ends it) still shows whose it is
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=10)
        (left,) = [p for p in members if p.pid != server.proc.pid]
        assert left.is_running() and fork_server.environ_of(left).get("VIME_TEST_MARK") == "m1"


def test_start_timeout_stops_the_whole_group(launch, tmp_path):
    # The leader starts a child in its group, then never serves /health.
    script = "import subprocess, time\nsubprocess.Popen(['sleep', '300'])\nprint('up', flush=True)\ntime.sleep(300)"
    server = _server(tmp_path, script).start()
    deadline = time.monotonic() + 10
    while len(server.live_processes()) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    members = server.live_processes()
    assert len(members) == 3  # the process guard, the leader and its child
    with pytest.raises(EngineStartError, match=r"timed out after 1s(.|\n)*up"):
        asyncio.run(server.wait_ready(timeout=1))
    assert server.live_processes() == []
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in members)
    server.stop()  # idempotent


# A server whose leader forks a grandchild (like vLLM's API server and engine core) and, like vLLM, takes the
# grandchild down when it gets SIGTERM.
SERVER_SCRIPT = """
import signal, subprocess, sys, time
child = subprocess.Popen(['sleep', '300'])
def stop(*_):
    child.kill()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
time.sleep(300)
"""


# A server that hangs in its SIGTERM shutdown (as a vLLM API server can, once its engine core has died).
HANGING_SERVER_SCRIPT = """
import signal, subprocess, time
child = subprocess.Popen(['sleep', '300'])
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(300)
"""


@pytest.mark.parametrize(
    "server_script, guard_killed_too",
    [(SERVER_SCRIPT, False), (SERVER_SCRIPT, True), (HANGING_SERVER_SCRIPT, True)],
    ids=["launcher-killed", "guard-killed-too", "guard-killed-server-hangs"],
)
def test_servers_die_with_their_launcher_even_when_it_is_sigkilled(
    launch, tmp_path, server_script, guard_killed_too
):
    # The launcher is SIGKILLed, so nothing runs stop(); Ray also SIGKILLs a dead actor's direct children (the
    # guard). Either way the whole group must go, even a server that ignores the SIGTERM (the guard's watchdog).
    command, env = _module_command(tmp_path, server_script), {"PYTHONPATH": str(tmp_path)}
    launcher_script = (
        "import sys, time\n"
        "from vime.backends.vllm_utils.engine import ServerProcess\n"
        f"s = ServerProcess('fake', {command!r}, {env!r}, '127.0.0.1', 1, {str(tmp_path / 's.log')!r}, 60)\n"
        "s.start()\nprint(s.proc.pid, flush=True)\ntime.sleep(300)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", launcher_script], stdout=subprocess.PIPE, text=True)
    group = int(launcher.stdout.readline())  # the guard's pid, which is also the group id
    deadline = time.monotonic() + 10
    while len(_members(group)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_members(group)) == 3  # guard, leader, grandchild
    launcher.kill()
    if guard_killed_too:
        os.kill(group, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + process_guard.GRACE_S + 20
    while _members(group) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _members(group) == []


def _members(pgid: int) -> list[int]:
    alive = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return alive


def test_nothing_the_guard_started_outlives_stop(launch, tmp_path):
    # The guard's watchdog lives in a session of its own, outside the group stop() ends: the guard ends it too.
    server = _server(tmp_path, SERVER_SCRIPT).start()
    guard = psutil.Process(server.proc.pid)
    deadline = time.monotonic() + 10
    while len(guard.children(recursive=True)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    started = guard.children(recursive=True)
    [watchdog] = [p for p in started if "--watch" in p.cmdline()]  # and the server, and its child
    watchdog.suspend()  # a slow one: left alone, it would be alive after stop() returns
    server.stop()
    left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for proc in left:
        proc.kill()
    assert left == []


def test_stop_escalates_to_sigkill_and_the_safety_net_stops_running_servers(launch, tmp_path):
    script = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(300)"
    server = _server(tmp_path, script)
    with server:
        deadline = time.monotonic() + 10
        while "up" not in server.log_tail() and time.monotonic() < deadline:
            time.sleep(0.1)
        start = time.monotonic()
        server.stop(grace_s=0.5)
        assert 0.5 <= time.monotonic() - start < 5
        assert server.proc.returncode == -9 and server.live_processes() == []

    forgotten = _server(tmp_path, "import time; time.sleep(300)").start()
    assert forgotten in engine_mod._RUNNING
    engine_mod._stop_running_servers()
    assert not forgotten.is_alive() and forgotten not in engine_mod._RUNNING


def test_control_client_requests_and_errors():
    seen: list[tuple[str, str, list, object]] = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        seen.append((request.method, request.path, list(request.query.items()), body))
        routes = {
            "/is_paused": {"is_paused": True},
            "/is_sleeping": {"is_sleeping": False},
            "/reset_prefix_cache": {"success": True},
            "/collective_rpc": {"results": [None]},
        }
        if request.path == "/broken":
            return web.Response(status=500, text="x" * 1000)
        return web.json_response(routes.get(request.path, {}))

    async def main():
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with EngineControlClient(url + "/") as client:
                assert await client.health()
                await client.pause()
                await client.pause("abort")
                with pytest.raises(ValueError, match="keep, wait or abort"):
                    await client.pause("drop")
                await client.resume()
                assert await client.is_paused() is True
                assert await client.reset_prefix_cache() is True
                assert await client.reload_weights("/w/iter_1") == [None]
                await client.sleep(level=2)
                await client.wake_up(tags=["weights", "kv_cache"])
                assert await client.is_sleeping() is False
                with pytest.raises(EngineControlError) as err:
                    await client._call("broken", "POST", "/broken")
                message = str(err.value)
                assert "broken" in message and f"{url}/broken" in message and "HTTP 500" in message
                assert "x" * 300 in message and "x" * 301 not in message
            async with EngineControlClient("http://127.0.0.1:1", timeout_s=2) as dead:
                assert await dead.health() is False
                with pytest.raises(EngineControlError, match="no response"):
                    await dead.resume()
        finally:
            await runner.cleanup()

    asyncio.run(main())
    assert seen == [
        ("GET", "/health", [], None),
        ("POST", "/pause", [("mode", "keep")], None),
        ("POST", "/pause", [("mode", "abort")], None),
        ("POST", "/resume", [], None),
        ("GET", "/is_paused", [], None),
        ("POST", "/reset_prefix_cache", [], None),
        (
            "POST",
            "/collective_rpc",
            [],
            {
                "method": "reload_weights",
                "args": [],
                "kwargs": {"weights_path": "/w/iter_1", "is_checkpoint_format": True},
            },
        ),
        ("POST", "/sleep", [("level", "2")], None),
        ("POST", "/wake_up", [("tags", "weights"), ("tags", "kv_cache")], None),
        ("GET", "/is_sleeping", [], None),
        ("POST", "/broken", [], None),
    ]


def _vllms_adjustment(cls, vllm_config) -> None:
    """What vLLM's CPU platform does to the multiprocessing method."""
    from vime.backends.vllm_utils import cpu_server

    os.environ[cpu_server.METHOD_ENV] = "spawn"


@pytest.fixture
def cpu_platform_choosing_spawn(monkeypatch):
    """vLLM's CPU platform as far as the method goes, and no method in the environment, before the test and after
    it whatever the test sets (set, then deleted: ``monkeypatch.delenv`` of an absent variable restores nothing, and a
    method left in this process's environment made every CPU engine a later test here started spawn its core)."""
    from vllm.platforms.cpu import CpuPlatform

    from vime.backends.vllm_utils import cpu_server

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(_vllms_adjustment))
    monkeypatch.setenv(cpu_server.METHOD_ENV, "unset-by-the-test")
    monkeypatch.delenv(cpu_server.METHOD_ENV)
    return CpuPlatform


def test_cpu_server_puts_fork_back_after_vllms_cpu_platform_chose_spawn(
    cpu_platform_choosing_spawn, monkeypatch
):
    from vime.backends.vllm_utils import cpu_server

    CpuPlatform = cpu_platform_choosing_spawn
    cpu_server.keep_fork()
    CpuPlatform.check_and_update_config(None)
    assert os.environ[cpu_server.METHOD_ENV] == "fork"

    # a method the user chose stays
    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(_vllms_adjustment))
    monkeypatch.setenv(cpu_server.METHOD_ENV, "forkserver")
    cpu_server.keep_fork()
    CpuPlatform.check_and_update_config(None)
    assert os.environ[cpu_server.METHOD_ENV] == "spawn"  # vLLM's own choice, untouched by vime


def test_a_fork_server_that_cannot_listen_is_reported(tmp_path):
    with pytest.raises(RuntimeError, match="did not start"):
        fork_server.start_server(tmp_path / "missing-dir" / "fork.sock", timeout=60)


@pytest.mark.parametrize("cuda", [False, True])
def test_several_api_servers_run_through_vllms_serve_and_one_keeps_the_single_server(monkeypatch, cuda):
    monkeypatch.setattr(engine_mod, "cuda_available", lambda: cuda)
    single = "vllm.entrypoints.openai.api_server" if cuda else "vime.backends.vllm_utils.cpu_server"
    one = build_engine_command(_args("--vllm-api-server-count", "1"), "127.0.0.1", 8000)
    assert one[:3] == [sys.executable, "-m", single] and one[-2:] == ["--api-server-count", "1"]
    assert build_engine_command(_args(), "127.0.0.1", 8000)[:3] == [sys.executable, "-m", single]
    # the OpenAI server would accept --api-server-count 4 and run one front-end: vLLM's serve starts four
    four = build_engine_command(_args("--vllm-api-server-count", "4"), "127.0.0.1", 8000)
    assert four[:3] == [sys.executable, "-m", "vime.backends.vllm_utils.serve"]
    assert four[3:] == one[3:-1] + ["4"]  # the same flags, the count passed through


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], 1),
        (["--api-server-count", "3"], 3),
        (["--api-server-count=3"], 3),
        (["-asc", "2"], 2),
        (["-asc", "4", "--enforce-eager", "--api-server-count", "1"], 1),  # the last wins, as in vLLM
    ],
)
def test_api_server_count_is_the_last_one_given(flags, expected):
    assert engine_mod.api_server_count(flags) == expected


def test_an_engine_without_an_api_server_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--vllm-api-server-count 0: an engine vime starts needs at least"):
        build_engine_command(_args("--vllm-api-server-count", "0"), "127.0.0.1", 8000)


def test_a_config_groups_api_server_count_wins(monkeypatch):
    monkeypatch.setattr(engine_mod, "cuda_available", lambda: True)
    cmd = build_engine_command(
        _args("--vllm-api-server-count", "4"), "127.0.0.1", 8000, override_args=["--api-server-count", "1"]
    )
    assert cmd[2] == "vllm.entrypoints.openai.api_server"


def test_serve_runs_vllms_serve_subcommand_with_the_engine_core_forked_on_cpu(
    cpu_platform_choosing_spawn, monkeypatch
):
    from vllm.entrypoints.cli.serve import ServeSubcommand

    from vime.backends.vllm_utils import cpu_server, serve

    CpuPlatform = cpu_platform_choosing_spawn
    ran = []
    monkeypatch.setattr(ServeSubcommand, "cmd", staticmethod(ran.append))
    serve.main(["--model", "/m", "--api-server-count", "2", "--middleware", "x.y"])
    assert [(run.model, run.api_server_count, run.middleware) for run in ran] == [("/m", 2, ["x.y"])]
    CpuPlatform.check_and_update_config(None)  # as the serving process does, after vLLM's CLI set-up
    assert os.environ[cpu_server.METHOD_ENV] == "fork"
