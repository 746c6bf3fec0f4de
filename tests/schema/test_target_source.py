"""A ``_target_`` of the user's own code is checked from its source before anything starts: a class its
module does not define, or a keyword argument the class does not take, is named with the key; nothing of
the user's code is imported, and what the source cannot tell (a base class's ``__init__``, ``**kwargs``, a
decorator, a star import) is left to the rank that builds it."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from runner.schema.target import Target
from runner.schema.target_source import keyword_arguments, missing_name, unknown_keys

SOURCE = """
import torch  # (never imported by the check: the module would fail to import without it here)
from torch import nn
from .other import Imported

raise RuntimeError("the user's module was run")

class Net(nn.Module):
    def __init__(self, width, depth=2, *, act="relu"):
        super().__init__()

class Inherits(Net):
    pass

class Open(nn.Module):
    def __init__(self, width, **kwargs):
        super().__init__()

@dataclass_like
class Decorated:
    width: int = 1

def make(hidden, layers=2):
    return None

def factory_of(self_like, /, size):
    return None

try:
    from fast import Maybe
except ImportError:
    Maybe = None
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    package = tmp_path / "proj_t"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('the package was run')\n")
    (package / "nets.py").write_text(textwrap.dedent(SOURCE))
    (package / "star.py").write_text("from .nets import *\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "proj_t"
    assert not [m for m in sys.modules if m.startswith("proj_t")], "the user's code was imported"


def test_the_arguments_a_plain_class_or_function_takes_are_read_from_its_source(project):
    nets = f"{project}.nets"
    assert keyword_arguments(nets, "Net") == ["width", "depth", "act"]
    assert keyword_arguments(nets, "make") == ["hidden", "layers"]
    assert keyword_arguments(nets, "factory_of") == ["size"], "positional-only ones are not keywords"
    for unknown in ("Inherits", "Open", "Decorated", "Imported", "Maybe"):
        assert keyword_arguments(nets, unknown) is None, unknown
    assert unknown_keys(nets, "Net", ["width", "dept", "colour"]) == [
        ("dept", "did you mean depth?"),
        ("colour", "it takes width, depth, act"),
    ]
    assert unknown_keys(nets, "Open", ["anything"]) == []


def test_a_name_is_missing_only_where_the_source_surely_binds_none(project):
    nets = f"{project}.nets"
    assert missing_name(nets, "Nett")
    assert not any(missing_name(nets, n) for n in ("Net", "Imported", "Maybe", "make"))
    assert not missing_name(f"{project}.star", "Nett"), "a star import: cannot be told"
    assert not missing_name("no_such_module_t", "Net")


def test_a_custom_options_mistakes_are_named_before_launch(project):
    with pytest.raises(ValueError, match=r"model.dept: Net takes no such argument \(did you mean depth\?\)"):
        Target.of("model", {"_target_": f"{project}.nets.Net", "width": 3, "dept": 2})
    with pytest.raises(ValueError, match=rf"_target_={project}.nets.Nett: {project}.nets has no 'Nett'"):
        Target.of("model", {"_target_": f"{project}.nets.Nett"})
    ok = Target.of("model", {"_target_": f"{project}.nets.Net", "width": 3, "act": "gelu"})
    assert ok.args == {"width": 3, "act": "gelu"}
    assert Target.of("model", {"_target_": f"{project}.nets.Open", "whatever": 1}).args == {"whatever": 1}


LAZY = {
    "assigned": "import lazy_loader\n__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, ['Net'])\n",
    "replaced": "import sys\nsys.modules[__name__] = object()\n",
    "nested": "try:\n    import fast\nexcept ImportError:\n\n    def __getattr__(name):\n        return 1\n",
}


@pytest.mark.parametrize("kind", sorted(LAZY))
def test_a_module_that_makes_its_names_at_run_time_is_left_to_the_rank(project, tmp_path, kind):
    """A lazy loader's ``__getattr__`` (assigned, or defined inside a try) or a module that replaces itself
    in ``sys.modules``: the source cannot tell which names it has, so nothing is refused."""
    (tmp_path / project / f"{kind}.py").write_text(LAZY[kind])
    importlib.invalidate_caches()
    assert missing_name(f"{project}.{kind}", "Net") is None


def test_the_last_definition_is_the_one_read_and_a_missing_class_is_offered_the_defined_ones(
    project, tmp_path
):
    nets = f"{project}.nets"
    (tmp_path / project / "twice.py").write_text("def make(a):\n    pass\n\ndef make(b, c=1):\n    pass\n")
    importlib.invalidate_caches()
    assert keyword_arguments(f"{project}.twice", "make") == ["b", "c"]
    assert missing_name(nets, "Nett")[0] == "Net"
    with pytest.raises(ValueError, match=rf"it defines Net, .*e\.g\. model\._target_={project}\.nets\.Net$"):
        Target.of("model", {"_target_": f"{nets}.Nett"})
