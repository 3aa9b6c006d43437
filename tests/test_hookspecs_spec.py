"""The hook specifications themselves: import hygiene and the conventions every spec follows."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pluggy
import pytest

import hookspecs
from hookspecs import PROJECT_NAME, spec

SPEC_MARK = f"{PROJECT_NAME}_spec"


def _spec_functions() -> dict[str, object]:
    return {
        name: func
        for name, func in vars(spec).items()
        if inspect.isfunction(func) and hasattr(func, SPEC_MARK)
    }


SPECS = _spec_functions()


def test_import_pulls_in_neither_torch_nor_megatron():
    # A fresh interpreter: this test process has torch loaded by other tests.
    code = (
        "import sys\n"
        "import hookspecs, hookspecs.spec, hookspecs.run, hookspecs.manager\n"
        "import hookspecs.host_defaults\n"
        "pm = hookspecs.get_plugin_manager(load_entrypoints=False)\n"
        "with hookspecs.TrainingRun(pm, None, train_iters=1) as run:\n"
        "    with run.train_step(0):\n"
        "        pass\n"
        "heavy = sorted(m for m in sys.modules\n"
        "               if m.split('.')[0] in ('torch', 'megatron', 'transformer_engine'))\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "HEAVY []" in out, out


def test_public_api():
    assert set(hookspecs.__all__) <= set(dir(hookspecs))
    assert hookspecs.hookimpl.project_name == PROJECT_NAME == "mcgraph"
    assert hookspecs.hookspec.project_name == PROJECT_NAME


def test_every_function_in_spec_module_is_a_marked_spec():
    defined_here = {
        name
        for name, obj in vars(spec).items()
        if inspect.isfunction(obj) and obj.__module__ == spec.__name__
    }
    assert defined_here == set(SPECS), "a function in hookspecs/spec.py lacks @hookspec"
    assert len(SPECS) >= 15


def test_plugin_manager_knows_exactly_the_specs():
    pm = hookspecs.get_plugin_manager(load_entrypoints=False)
    known = {name for name in vars(pm.hook) if not name.startswith("_")}
    with_spec = {name for name in known if getattr(pm.hook, name).has_spec()}
    assert with_spec == set(SPECS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_name_has_project_prefix(name):
    assert name.startswith(f"{PROJECT_NAME}_")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_parameters_are_plain_named_without_defaults(name):
    # pluggy drops parameters with defaults and *args/**kwargs from the call contract.
    for param in inspect.signature(SPECS[name]).parameters.values():
        assert param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, (name, param)
        assert param.default is inspect.Parameter.empty, (name, param)
        assert param.annotation is not inspect.Parameter.empty, (name, param)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_docstring_documents_every_parameter_and_the_result(name):
    func = SPECS[name]
    doc = inspect.getdoc(func)
    assert doc, f"{name} has no docstring"
    params = list(inspect.signature(func).parameters)
    documented = re.findall(r"^:param (\w+):", doc, flags=re.MULTILINE)
    assert documented == params, f"{name}: :param lines {documented} != parameters {params}"
    result_lines = [line for line in doc.splitlines() if line.startswith("Result:")]
    assert len(result_lines) == 1, f"{name} needs exactly one 'Result:' line"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_result_line_agrees_with_the_spec_options(name):
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(spec)
    opts = getattr(pm.hook, name).spec.opts
    doc = inspect.getdoc(SPECS[name])
    result = next(line for line in doc.splitlines() if line.startswith("Result:"))
    returns = inspect.signature(SPECS[name]).return_annotation
    assert ("firstresult" in result) == bool(opts["firstresult"]), result
    assert ("historic" in result) == bool(opts["historic"]), result
    if not opts["firstresult"]:
        # Returning nothing means a notification; returning something, a collected list.
        kind = "notification" if returns == "None" else "collected"
        assert kind in result, (name, returns, result)
