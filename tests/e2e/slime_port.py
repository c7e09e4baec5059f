"""slime's own example files run as a migrating user runs them: the copies in ``tests/e2e/data/slime`` (slime at
``SLIME_COMMIT``, Apache-2.0, unmodified; see its README) with only the rename applied at test time
(``slime.`` → ``vime.``, ``sglang_rollout`` → ``vllm_rollout``).

Run scripts are read, not run (they start Ray clusters and kill every ``python``): their ``*_ARGS=( ... )`` arrays
are evaluated by bash, and :func:`fit_to_tiny` swaps what names the author's machine (checkpoint and data paths,
GPU counts, Megatron parallelism and kernels, W&B, sizes) for the tiny model on the shared CPU engines; every other
flag of the script is kept as written.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import re
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from aiohttp import web

SLIME_DATA = Path(__file__).resolve().parent / "data" / "slime"
SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
RENAMES = (("slime.", "vime."), ("sglang_rollout", "vllm_rollout"))

# Flags naming the author's machine: dropped (fit_to_tiny sets what the tiny run needs instead).
MACHINE_FLAGS = {
    # checkpoints and where runs save
    "--hf-checkpoint", "--ref-load", "--load", "--save", "--save-interval", "--rotary-base",
    # GPUs, Megatron parallelism and kernels (Megatron does not run on CPU; the tests train with FSDP)
    "--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus", "--rollout-num-gpus-per-engine",
    "--colocate", "--tensor-model-parallel-size", "--sequence-parallel", "--pipeline-model-parallel-size",
    "--context-parallel-size", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--attention-dropout",
    "--hidden-dropout", "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32",
    "--attention-backend", "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
    "--use-precision-aware-optimizer",
    # the engines' memory and graphs (the tests attach to the shared engines)
    "--sglang-mem-fraction-static", "--sglang-cuda-graph-bs",
    # experiment tracking
    "--use-wandb", "--wandb-project", "--wandb-group", "--wandb-key",
}  # fmt: skip
# Sizes scaled down to a seconds-long run on 2 cores (replaced where the script sets them).
TINY_SIZES = {
    "--num-rollout": "2", "--rollout-batch-size": "2", "--n-samples-per-prompt": "2",
    "--rollout-max-response-len": "8", "--global-batch-size": "4", "--max-tokens-per-gpu": "2048",
    "--n-samples-per-eval-prompt": "1", "--eval-max-response-len": "8", "--eval-interval": "1",
}  # fmt: skip
# The shared engines' context (conftest.POOL_CONTEXT): a prompt and its response fit in it (slime's scripts assume
# 16k-40k contexts; vLLM refuses a request whose max_tokens exceeds the engine's)
CONTEXT = ["--rollout-max-context-len", "2048"]


def rename(text: str) -> str:
    """What a migrating user changes in slime's files, and nothing else."""
    for old, new in RENAMES:
        text = text.replace(old, new)
    return text


def renamed_examples(dest: Path) -> Path:
    """A renamed copy of the stored slime tree (``dest/examples/...``); returns ``dest``."""
    for path in sorted((SLIME_DATA / "examples").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            target = dest / path.relative_to(SLIME_DATA)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(rename(path.read_text()))
    return dest


@contextlib.contextmanager
def importable(root: Path, *flat_dirs: str) -> Iterator[None]:
    """slime's ``examples`` package (``root/examples``, a regular package: it wins over vime's namespace package of
    that name) and the example folders slime's run scripts put on ``PYTHONPATH`` (``flat_dirs``, under
    ``root/examples``) importable in this process until the block ends; vime's own ``examples`` modules come back
    after."""
    paths = [str(root), *(str(root / "examples" / d) for d in flat_dirs)]
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] == "examples"}
    sys.path[:0] = paths
    importlib.invalidate_caches()
    try:
        yield
    finally:
        for path in paths:
            sys.path.remove(path)
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(str(root)):
                del sys.modules[name]
        sys.modules.update(saved)
        importlib.invalidate_caches()


def script_arrays(script: Path, **env: str) -> dict[str, list[str]]:
    """The ``NAME=( ... )`` arrays of a renamed slime run script, as bash expands them with ``env`` set."""
    text = script.read_text()
    arrays = re.findall(r"^(\w+)=\(\n(.*?)^\)", text, flags=re.S | re.M)
    program = "".join(
        f"{name}=(\n{body})\nprintf '%s\\0' {name} ${{#{name}[@]}} \"${{{name}[@]}}\"\n"
        for name, body in arrays
    )
    out = subprocess.run(["bash", "-c", program], env=env, capture_output=True, text=True, check=True).stdout
    result, parts = {}, out.split("\0")[:-1]
    while parts:
        name, count, parts = parts[0], int(parts[1]), parts[2:]
        result[name], parts = parts[:count], parts[count:]
    return result


def flag_pairs(tokens: list[str]) -> list[tuple[str, list[str]]]:
    """``--flag value...`` tokens as (flag, values) pairs, in order."""
    pairs: list[tuple[str, list[str]]] = []
    for token in tokens:
        if token.startswith("--"):
            pairs.append((token, []))
        else:
            pairs[-1][1].append(token)
    return pairs


def fit_to_tiny(arrays: dict[str, list[str]], data: Path, *extra: str) -> list[str]:
    """Every flag of the script's arrays except its machine's (:data:`MACHINE_FLAGS`, ``MODEL_ARGS``), sizes
    scaled down (:data:`TINY_SIZES`), every data path (``--prompt-data``, each ``--eval-prompt-data`` dataset) made
    ``data``, the engines' :data:`CONTEXT`, then ``extra`` (the tiny model, engines, and what the test needs)."""
    argv: list[str] = []
    for name, tokens in arrays.items():
        if name == "MODEL_ARGS":  # the model's architecture: the tiny model's config.json says it
            continue
        for flag, values in flag_pairs(tokens):
            if flag in MACHINE_FLAGS or flag.startswith("--wandb-"):
                continue
            if flag == "--prompt-data":
                values = [str(data)]
            elif flag == "--eval-prompt-data":  # NAME PATH pairs
                values = [v if i % 2 == 0 else str(data) for i, v in enumerate(values)]
            argv += [flag, TINY_SIZES[flag]] if flag in TINY_SIZES else [flag, *values]
    return [*argv, *CONTEXT, *extra]


def flag_value(argv: list[str], flag: str) -> list[str]:
    """The values of the last ``flag`` in ``argv`` (``[]`` for a switch); ``KeyError`` when absent."""
    pairs = [values for name, values in flag_pairs(argv) if name == flag]
    if not pairs:
        raise KeyError(flag)
    return pairs[-1]


class StandInService:
    """A local HTTP service in a thread of this process, answering POSTs with ``handler(body) -> json``; records
    every request body in :attr:`calls`."""

    def __init__(self, routes: dict[str, Callable[[dict], Any]]):
        self.routes = routes
        self.calls: list[tuple[str, dict]] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="stand-in-service", daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())

    async def _start(self) -> None:
        app = web.Application()
        for path, handler in self.routes.items():
            app.router.add_post(path, self._answer(path, handler))
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    def _answer(
        self, path: str, handler: Callable[[dict], Any]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def answer(request: web.Request) -> web.Response:
            body = await request.json()
            self.calls.append((path, body))
            return web.json_response(handler(body))

        return answer

    def __enter__(self) -> StandInService:
        self._thread.start()
        assert self._ready.wait(10), "the stand-in service did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


# ------------------------------------------------------------------------------------------------------------------
# The examples' generate functions with their output format forced by vLLM's structured outputs (SGLang's ``regex``
# sampling field, which vime's /generate translation hands to vLLM): the random tiny model then takes the
# example's tool / search / agent path. Each calls the example's own function, loaded from the renamed copy.

SEARCH_QUERY = "capital of france"
SEARCH_TURN = f"<think>a</think><search>{SEARCH_QUERY}</search>"
PYTHON_CODE = "print(3+4)"
CODE_TURN = f"<code>{PYTHON_CODE}</code>"
AGENT_TURN = r"<think>[a-z]{1,3}</think>[0-9]{1,2}"  # a reasoning part, then the answer the agents pass on


def regex_of(text: str) -> str:
    """A regex matching ``text`` exactly."""
    return "".join("\\" + ch if ch in "()+*?.[]{}|^$\\" else ch for ch in text)


GenerateFunction = Callable[[Any, Any, dict], Awaitable[Any]]


def _forced(path: str, regex: str) -> GenerateFunction:
    """The generate function at ``path`` (loaded when called), its requests constrained to ``regex``."""

    async def generate(args: Any, sample: Any, sampling_params: dict) -> Any:
        module, name = path.rsplit(".", 1)
        example = getattr(importlib.import_module(module), name)
        params = sampling_params.copy()  # vime's SamplingParams: slime's names (max_new_tokens) keep working
        params["regex"] = regex
        return await example(args, sample, params)

    return generate


search_r1 = _forced("generate_with_search.generate", regex_of(SEARCH_TURN))
retool = _forced("generate_with_retool.generate", regex_of(CODE_TURN))
multi_agent = _forced("examples.multi_agent.rollout_with_multi_agents.generate_with_multi_agents", AGENT_TURN)
