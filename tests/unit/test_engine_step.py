"""The engine's step reads as schedule, run, update (docs/architecture.md, "Contract 1"), read off
its source: `LLMEngine.step` calls the scheduler twice (`schedule`, `update_from_output`) and the
speculator at most twice; tokens are appended on one path (`Sequence.keep_samples`, called once,
by the scheduler's update); one step-cost model, observed once a step, which the scheduler and
the speculator both read; `ModelRunner.run` returns a typed `ModelOutput`; `add_request` takes
one `GenerateRequest` on every engine and in the worker's Protocol; no capability of an engine or
a broker is probed with getattr in wsllm/engine/. Each count is checked to see what it forbids."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path

from wsllm.engine import fake, model_runner, worker
from wsllm.engine.engine import LLMEngine
from wsllm.engine.model_output import ModelOutput
from wsllm.engine.scheduler import Scheduler

ENGINE = Path(__file__).resolve().parents[2] / "wsllm" / "engine"


def _function(cls: type, name: str) -> ast.FunctionDef:
    node = ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, name))))
    fn = node.body[0]
    assert isinstance(fn, ast.FunctionDef)
    return fn


def calls_on(fn: ast.AST, attr: str) -> list[str]:
    """The methods called on `self.<attr>` inside `fn`, in order."""
    found = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if (
                isinstance(owner, ast.Attribute)
                and owner.attr == attr
                and isinstance(owner.value, ast.Name)
                and owner.value.id == "self"
            ):
                found.append(node.func.attr)
    return sorted(found)


def calls_of(name: str) -> list[str]:
    """`file:line` of every call of a method or function named `name` in wsllm/engine."""
    where = []
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if called == name:
                    where.append(f"{path.name}:{node.lineno}")
    return where


def test_the_step_is_schedule_run_update() -> None:
    step = _function(LLMEngine, "step")
    assert calls_on(step, "scheduler") == ["schedule", "update_from_output"]
    assert len(calls_on(step, "spec")) <= 2, calls_on(step, "spec")
    assert calls_on(step, "runner") == ["run"]
    assert calls_on(step, "cost") == ["observe"], "the step-cost model, observed once a step"


def test_the_counts_see_a_third_scheduler_call() -> None:
    bad = ast.parse(
        "def step(self):\n    self.scheduler.schedule()\n    self.scheduler.finish_step()\n    self.scheduler.update_from_output()"
    )
    assert len(calls_on(bad.body[0], "scheduler")) == 3


def test_one_sample_and_append_path() -> None:
    # appended once: by a sequence keeping its samples, which the scheduler's update calls once
    assert calls_of("append_token") == [c for c in calls_of("append_token") if c.startswith("sequence.py")]
    assert len(calls_of("append_token")) == 1
    assert len(calls_of("keep_samples")) == 1 and calls_of("keep_samples")[0].startswith("scheduler.py")
    # sampled once: the token stage's draw, from the model runner (a retry row by row aside)
    assert [c.split(":")[0] for c in calls_of("draw")] == ["model_runner.py", "sampler.py"]


def test_one_step_cost_model() -> None:
    classes = [
        n.name
        for p in ENGINE.rglob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.ClassDef) and any(k in n.name for k in ("Cost", "Pacer"))
    ]
    assert classes == ["StepCost"], classes
    observes = [c for c in calls_of("observe") if c.startswith("engine.py")]
    assert len(observes) == 1
    init = _function(LLMEngine, "__init__")
    # built once, handed to the scheduler and the speculator
    assert (
        sum(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "StepCost" for n in ast.walk(init)) == 1
    )


def test_the_runner_returns_a_typed_output_and_requests_come_whole() -> None:
    assert inspect.signature(model_runner.ModelRunner.run).return_annotation == "ModelOutput"
    # a dataclass of named results, each a list of its own typed records (no tuple to unpack)
    fields = {f.name: f.type for f in dataclasses.fields(ModelOutput)}
    assert fields == {
        "sampled": "list[Sampled]",
        "prompt_logprobs": "list[PromptLogprobs]",
        "pooled": "list[Pooled]",
    }
    update = inspect.signature(Scheduler.update_from_output).parameters
    assert update["output"].annotation == "ModelOutput"
    for add in (LLMEngine.add_request, fake.FakeEngine.add_request, worker.Engine.add_request):
        params = inspect.signature(add).parameters
        assert list(params) == ["self", "request"] and params["request"].annotation == "GenerateRequest", add
    assert inspect.signature(LLMEngine.step).return_annotation == "list[RequestOutput]"
    assert inspect.signature(worker.Engine.step).return_annotation == "list[RequestOutput]"


def probes(source: str) -> list[int]:
    """Lines where an attribute named by a literal is probed: hasattr(x, "a"), getattr(x, "a", d)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
        ):
            literal = len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
            if literal and (node.func.id == "hasattr" or len(node.args) == 3):
                name = node.args[1].value
                if name != "request_id":  # a field of a delivered item that failed its wire check
                    lines.append(node.lineno)
    return lines


def test_no_capability_is_probed_with_getattr() -> None:
    found = {p.name: probes(p.read_text()) for p in sorted(ENGINE.rglob("*.py"))}
    assert {f: lines for f, lines in found.items() if lines} == {}
    assert probes('x = getattr(engine, "adapters", None)\nhasattr(b, "commands")') == [1, 2]
