"""torch's private rendezvous members (issue 53.2): each one enn_core.runtime.torch_private
relies on still exists in the installed torch, with the parameters it is called or overridden
with; torch still calls the two overridden hooks; and no other module names any of them.

A failure here after a torch upgrade names the member, what it is used for and what breaks:
docs/design.md, "When torch moves"."""

from __future__ import annotations

import ast
import datetime as dt
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from enn_core.runtime import torch_private
from enn_core.runtime.bound_store import tcp_store
from enn_core.runtime.launch import free_port
from enn_core.runtime.torch_private import PRIVATE, Private

ROOT = Path(__file__).resolve().parents[3]
PRODUCT = ("enn_core", "tasks", "flows")
HOME = Path(torch_private.__file__).resolve()
# torch's modules whose private names only torch_private may use
GUARDED = ("torch.distributed.elastic", "torch.distributed.distributed_c10d")
SUBCLASSED = {"DynamicRendezvousHandler", "C10dRendezvousBackend"}


def _params(run_id: str = "job-p") -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(
        "enn-c10d", "127.0.0.1:0", run_id, 1, 1, local_addr="127.0.0.1", join_timeout=20
    )


@pytest.fixture(scope="module")
def instances() -> dict[str, Any]:
    """A real handler and backend of torch's, as torch makes them (no rendezvous run)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    store = dist.HashStore()
    backend = C10dRendezvousBackend(store, "job-i")
    handler = create_handler(store, backend, _params("job-i"))
    return {"DynamicRendezvousHandler": handler, "C10dRendezvousBackend": backend}


def _says(p: Private, what: str) -> str:
    return (
        f"torch {torch.__version__}: {p.where} {p.owner or ''} {p.name!r}: {what}. We use it "
        f"for: {p.use}. When it changes: {p.breaks}. See docs/design.md, 'When torch moves'"
    )


def _has(cls: type, name: str) -> bool:
    fields = getattr(cls, "__dataclass_fields__", {})
    return hasattr(cls, name) or name in fields or name in inspect.get_annotations(cls)


@pytest.mark.parametrize("p", PRIVATE, ids=[f"{p.owner}.{p.name}".lstrip(".") for p in PRIVATE])
def test_each_private_member_is_in_the_installed_torch(p: Private, instances):
    module = importlib.import_module(p.where)
    if p.on == "source":
        assert p.name in inspect.getsource(module), _says(p, "no longer in the module's source")
        return
    if p.on == "module":
        assert hasattr(module, p.name), _says(p, "gone from the module")
        found = getattr(module, p.name)
    elif p.on == "class":
        owner = getattr(module, p.owner, None)
        assert owner is not None, _says(p, f"class {p.owner} gone")
        assert _has(owner, p.name), _says(p, "gone from the class")
        found = getattr(owner, p.name, None)
    else:
        found = instances[p.owner]
        for i, part in enumerate(p.name.split(".")):
            chain = ".".join(p.name.split(".")[: i + 1])
            assert hasattr(found, part), _says(p, f"a real {p.owner} has no {chain}")
            found = getattr(found, part)
    if p.params is not None:
        got = tuple(inspect.signature(found).parameters)
        assert got == p.params, _says(p, f"its parameters are now {got}, not {p.params}")


def test_torchs_create_handler_makes_a_handler_whose_class_we_can_swap(instances):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    handler = instances["DynamicRendezvousHandler"]
    assert type(handler) is DynamicRendezvousHandler, (
        f"torch {torch.__version__}'s create_handler returns {type(handler).__name__}: "
        "torch_private.make_handler swaps its class for a subclass of DynamicRendezvousHandler"
    )
    assert "__slots__" not in vars(DynamicRendezvousHandler)


class Recorded:
    """torch_private.Hooks that record what torch called (a unit test of torch_private)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def workers_store_server(self, addr: str, port: int) -> dist.TCPStore:
        self.calls.append(("workers_store_server", addr, port))
        return tcp_store(addr, port, is_master=True, timeout=dt.timedelta(seconds=30))

    def agent_store(self, store: dist.Store, round_: int) -> Any:
        self.calls.append(("agent_store", round_))
        return store

    def next_rendezvous(self, handler: Any, join: Any) -> Any:
        self.calls.append(("next_rendezvous",))
        return join()

    def shutdown(self, handler: Any, close: Any) -> bool:
        self.calls.append(("shutdown",))
        return bool(close())


def test_torch_calls_our_hooks_in_a_one_node_rendezvous(monkeypatch):
    """A renamed private hook would still pass hasattr: this runs torch's own rendezvous (one
    node, its shared workers' store on) and checks that it calls ours."""
    monkeypatch.delenv(torch_private.NO_SHARED_STORE, raising=False)
    store = tcp_store("127.0.0.1", free_port(), is_master=True, timeout=dt.timedelta(seconds=20))
    sealed: list[bytes] = []

    def seal(state: bytes) -> bytes:
        sealed.append(state)
        return b"sealed:" + state

    def unseal(raw: bytes) -> bytes:
        assert raw.startswith(b"sealed:"), raw
        return raw[len(b"sealed:") :]

    backend = torch_private.sealed_backend(store, "job-h", "enn-c10d", seal, unseal)
    hooks = Recorded()
    handler = torch_private.make_handler(store, backend, _params("job-h"), hooks)
    info = handler.next_rendezvous()
    state = torch_private.state_of(handler)
    assert (info.rank, info.world_size) == (0, 1)
    assert state.participants == ("127.0.0.1",) and state.waiting == ()
    assert hooks.calls[0] == ("next_rendezvous",)
    assert ("workers_store_server", "127.0.0.1", 0) in hooks.calls
    assert ("agent_store", state.round) in hooks.calls
    assert sealed and backend.get_state()[0] == sealed[-1]  # torch's state went through ours
    assert handler.shutdown()
    assert hooks.calls[-1] == ("shutdown",)


@pytest.fixture(scope="module")
def product() -> dict[Path, str]:
    """The source of each product module but torch_private, by path."""
    files = [f for d in PRODUCT for f in sorted((ROOT / d).rglob("*.py"))]
    return {f.relative_to(ROOT): f.read_text() for f in files if f.resolve() != HOME}


def test_only_torch_private_names_torchs_private_rendezvous_members(product):
    rules = [(p, re.compile("|".join(p.patterns()))) for p in PRIVATE if p.patterns()]
    found = []
    for path, text in product.items():
        for p, rx in rules:
            if not rx.search(text):
                continue
            for n, line in enumerate(text.splitlines(), 1):
                if rx.search(line):
                    found.append(f"{path}:{n}: {p.name} ({line.strip()})")
    assert not found, (
        "torch's private rendezvous members are named only in enn_core/runtime/"
        "torch_private.py (call its functions): " + "; ".join(found[:20])
    )


def _guarded(module: str) -> bool:
    return any(module == g or module.startswith(g + ".") for g in GUARDED)


def _subclass_or_swap(node: ast.AST) -> str | None:
    if isinstance(node, ast.ClassDef):
        bases = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
        if bases & SUBCLASSED:
            return f"subclasses {sorted(bases & SUBCLASSED)}"
    if isinstance(node, ast.Assign):
        if any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in node.targets):
            return "swaps an object's class"
    return None


def _reaches_in(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) for each reach into torch's guarded internals in one module."""
    found, names = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if _guarded(node.module) or _guarded(full):
                    names.add(alias.asname or alias.name)
                    if alias.name.startswith("_") or "._" in node.module:
                        found.append((node.lineno, f"imports {full}"))
        elif (what := _subclass_or_swap(node)) is not None:
            found.append((getattr(node, "lineno", 0), what))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if isinstance(node.value, ast.Name) and node.value.id in names:
                found.append((node.lineno, f"uses {node.value.id}.{node.attr}"))
    return found


def test_no_other_module_reaches_into_torchs_rendezvous_undeclared(product):
    """What the declared names cannot catch: a new private import from torch's elastic or c10d
    modules, a private attribute of such a module, a subclass of torch's handler or backend,
    or a class swap, anywhere but torch_private."""
    found = [
        f"{path}:{line}: {what}"
        for path, text in product.items()
        if "torch" in text or "__class__" in text
        for line, what in _reaches_in(ast.parse(text))
    ]
    assert not found, (
        "only enn_core/runtime/torch_private.py reaches into torch's rendezvous, elastic agent "
        "and c10d internals (declare the member in its PRIVATE): " + "; ".join(found[:20])
    )
