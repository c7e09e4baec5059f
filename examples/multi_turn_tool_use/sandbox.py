"""Run model-written Python in a separate, limited process.

Each call starts a fresh ``python -I`` (isolated: no user site-packages, no PYTHON* environment) in an empty
temporary directory with an empty environment, CPU-time, memory, file-size and process-count limits, and a
wall-clock timeout after which the whole process group is killed. Output is truncated.

This keeps a runaway or crashing snippet away from the rollout, not a determined attacker: the process can still
read world-readable files and open sockets. Run untrusted workloads in a container or VM (e.g. behind an HTTP
sandbox service) and swap :func:`run_python` for a call to it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile

MAX_OUTPUT_CHARS = 1000


# Runs first in the child (instead of a preexec_fn, which is unsafe in a threaded parent): set hard limits, then
# execute the snippet passed as argv[1] as __main__.
_PRELUDE = """\
import resource, sys
for limit, value in ((resource.RLIMIT_CPU, {cpu}), (resource.RLIMIT_AS, {memory}), (resource.RLIMIT_FSIZE, 1 << 20),
                     (resource.RLIMIT_NPROC, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
code = sys.argv.pop(1)
del limit, value, resource
exec(compile(code, "<tool>", "exec"), {{"__name__": "__main__"}})
"""


async def run_python(code: str, timeout: float = 5.0, memory_bytes: int = 512 << 20) -> str:
    """Execute ``code``; its stdout and stderr (truncated), or an error line on timeout."""
    with tempfile.TemporaryDirectory(prefix="vime-sandbox-") as workdir:
        prelude = _PRELUDE.format(cpu=max(1, int(timeout)), memory=memory_bytes)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", prelude, code,
            cwd=workdir,
            env={"PATH": "/usr/bin:/bin"},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # its own process group, killed as a whole on timeout
        )  # fmt: skip
        try:
            output, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            return f"Error: the code ran longer than {timeout:g} s and was stopped"
    text = output.decode(errors="replace")
    if len(text) > MAX_OUTPUT_CHARS:
        text = text[:MAX_OUTPUT_CHARS] + "\n... (output truncated)"
    return text if proc.returncode == 0 else f"{text}\n(exit code {proc.returncode})".lstrip()
