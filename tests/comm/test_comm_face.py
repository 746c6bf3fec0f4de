"""The communicator's declared face (runner/comm/face.py): ``Comm`` and the tests' ``FakeComm`` have every
method it declares with the same parameters (names, kinds, defaults), so a signature changed in one of them
and not in the other fails here; no process is started."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from runner.comm import face
from runner.comm.counter import Counter, FileCounter
from runner.comm.membership import Membership
from runner.comm.mpi import Comm
from runner.comm.requests import BackgroundRequest, DistRequest, Request
from tests.helpers.fakecomm import FakeComm, FakeCounter, FakeRequest, FakeWorld
from tests.helpers.lossy import LossyComm, LossyCounter

#: Each declared face, and the classes that must satisfy it.
FACES = {
    face.CommLike: [Comm, FakeComm, LossyComm],
    face.CounterLike: [Counter, FileCounter, FakeCounter, LossyCounter],
    face.RequestLike: [Request, BackgroundRequest, DistRequest, FakeRequest],
    face.MembershipLike: [Comm, LossyComm],
}


def methods(protocol: type) -> list[str]:
    """The public methods ``protocol`` declares."""
    return sorted(n for n, v in vars(protocol).items() if not n.startswith("_") and inspect.isfunction(v))


def attributes(protocol: type) -> list[str]:
    """The public data attributes ``protocol`` declares."""
    return sorted(n for n in vars(protocol).get("__annotations__", {}) if not n.startswith("_"))


def parameters(fn: object) -> list[tuple[str, str, object]]:
    """``(name, kind, default)`` of each parameter of ``fn`` (annotations aside: the fake returns its own
    request and counter types)."""
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]


def mismatches(protocol: type, cls: type) -> list[str]:
    """How ``cls``'s methods differ from those ``protocol`` declares (missing, or another signature)."""
    out = []
    for name in methods(protocol):
        declared = parameters(getattr(protocol, name))
        if not callable(getattr(cls, name, None)):
            out.append(f"{cls.__name__}.{name} is missing")
        elif parameters(getattr(cls, name)) != declared:
            out.append(f"{cls.__name__}.{name}{parameters(getattr(cls, name))} != declared {declared}")
    return out


def assigned(cls: type) -> set[str]:
    """The attributes ``cls`` (and its bases in the package) set on ``self`` or declare at class level."""
    names = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith(("runner.", "tests.")):
            names |= set(vars(klass)) | set(vars(klass).get("__annotations__", {}))
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
            for node in ast.walk(tree):
                target = node.target if isinstance(node, ast.AnnAssign) else None
                targets = node.targets if isinstance(node, ast.Assign) else [target] if target else []
                for t in targets:
                    for leaf in ast.walk(t):
                        if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name):
                            if leaf.value.id == "self":
                                names.add(leaf.attr)
    return names


@pytest.mark.parametrize("protocol, cls", [(p, c) for p, cs in FACES.items() for c in cs], ids=str)
def test_each_communicator_has_the_declared_signatures(protocol, cls):
    assert methods(protocol), "the walker sees no method"
    assert mismatches(protocol, cls) == []


@pytest.mark.parametrize("protocol, cls", [(p, c) for p, cs in FACES.items() for c in cs], ids=str)
def test_each_communicator_has_the_declared_attributes(protocol, cls):
    assert not set(attributes(protocol)) - assigned(cls)


def test_a_fake_communicator_satisfies_the_face_at_run_time():
    fake = FakeWorld(2).comms[0]
    assert isinstance(fake, face.CommLike) and not isinstance(fake, face.MembershipLike)
    assert attributes(face.CommLike) == ["cuda_aware", "rank", "size", "stats", "tolerant"]


def test_a_changed_signature_is_seen():
    """A parameter renamed, given another default, or made keyword-only in one class only is a mismatch."""

    class Renamed(FakeComm):
        def broadcast(self, t, source=0):  # noqa: ANN001, ANN202
            return t

    class Defaulted(FakeComm):
        def allreduce(self, t, op="max", wire=None):  # noqa: ANN001, ANN202
            return t

    class KeywordOnly(FakeComm):
        def send(self, t, dest, *, tag=0, wire=None):  # noqa: ANN001, ANN202
            return None

    class Missing:
        pass

    for cls, name in [(Renamed, "broadcast"), (Defaulted, "allreduce"), (KeywordOnly, "send")]:
        found = mismatches(face.CommLike, cls)
        assert len(found) == 1 and found[0].startswith(f"{cls.__name__}.{name}"), found
    assert "Missing.barrier is missing" in mismatches(face.CommLike, Missing)
    assert not {"ids", "grown"} <= assigned(FakeComm) and {"ids", "grown", "tolerant"} <= assigned(Membership)
