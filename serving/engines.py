"""Each engine's own OpenAI-compatible server, as the command that starts it on a node.

The engine runs from the node's training environment: the `transformers`, `vllm` or `python` beside the
node's torchrun (`/opt/venv/bin/torchrun` -> `/opt/venv/bin/transformers`; `pixi run -e cuda torchrun`
-> `pixi run -e cuda transformers`). UGRO never serves a model itself.
"""

from __future__ import annotations

import os
import shlex

from cluster.models import Node

# {model}: the checkpoint's directory on the node; {host} {port}: where it listens; {gpus}: how many it has
TEMPLATES = {
    "transformers": "{transformers} serve {model} --host {host} --port {port}",
    "vllm": "{vllm} serve {model} --host {host} --port {port} --tensor-parallel-size {gpus} --served-model-name {name}",
    "sglang": "{python} -m sglang.launch_server --model-path {model} --host {host} --port {port} --tp {gpus} "
    "--served-model-name {name}",
}
# How long a request waits for a sleeping service's first replica to answer (--cold-start-timeout's default):
# transformers serve loads the weights and answers; vLLM and SGLang also profile memory and capture CUDA graphs
COLD_START_S = {"transformers": 180, "vllm": 600, "sglang": 600, "custom": 300}
FIELDS = ("model", "host", "port", "gpus", "name", "python", "transformers", "vllm")


class EngineError(ValueError):
    """A command that cannot be made; the message is one line."""


def beside_torchrun(node: Node, program: str) -> list[str]:
    """argv that runs `program` from the node's training environment."""
    argv = node.torchrun_argv or ["torchrun"]
    last = argv[-1]
    head, tail = os.path.split(last)
    if tail != "torchrun":
        raise EngineError(f"node {node.name}'s torchrun command {node.torchrun_command!r} does not end in torchrun: "
                          "give the engine's command with --engine custom --command")  # fmt: skip
    return [*argv[:-1], os.path.join(head, program) if head else program]


def check_template(engine: str, template: str) -> None:
    """EngineError unless the engine and its command template can make a command."""
    if engine == "custom":
        if not template.strip():
            raise EngineError("--engine custom needs --command, e.g. '{python} -m my_server --port {port}'")
        if "{port}" not in template:
            raise EngineError("--command must name {port}: each replica listens on a port UGRO picks")
    elif engine not in TEMPLATES:
        raise EngineError(f"--engine must be one of transformers, vllm, sglang, custom, not {engine!r}")
    elif template:
        raise EngineError("--command is for --engine custom only")
    try:
        shlex.split(template or TEMPLATES[engine])
        for part in shlex.split(template or TEMPLATES[engine]):
            part.format(**dict.fromkeys(FIELDS, ""))
    except (ValueError, KeyError, IndexError) as exc:
        raise EngineError(f"--command cannot be read: {exc} (fields: {', '.join(FIELDS)})") from None


def engine_argv(engine: str, template: str, node: Node, *, model: str, port: int, gpus: int, name: str) -> list[str]:
    """The argv of one replica's engine on its node (no shell: each part is one argument)."""
    parts = shlex.split(template if engine == "custom" else TEMPLATES[engine])
    values = {"model": model, "host": node.address, "port": str(port), "gpus": str(max(gpus, 1)), "name": name}
    out: list[str] = []
    for part in parts:
        program = part[1:-1] if part.startswith("{") and part.endswith("}") else None
        if program in ("python", "transformers", "vllm"):
            out += beside_torchrun(node, program)  # may be several words (pixi run -e cuda ...)
        else:
            out.append(part.format(**values, python="python", transformers="transformers", vllm="vllm"))
    return out
