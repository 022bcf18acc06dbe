"""The exchange catalog (flashsgd.exchanges) is the one home of every exchange fact: these tests fail
when a copy reappears (a name list, a default, a rule) or when a reader drifts from it."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from flashsgd import exchanges as X

SRC = Path(__file__).resolve().parents[1] / "src" / "flashsgd"


def test_catalog_is_torch_free_and_at_the_bottom():
    code = ("import sys; import flashsgd.exchanges; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or (m.startswith('flashsgd.') "
            "and m not in ('flashsgd.exchanges', 'flashsgd.registry'))); assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_every_catalog_entry_has_its_implementation_and_its_cost():
    """The catalog walked, not pinned (issue 34): a new entry is checked by its family, so one that
    registers without an implementation fails here, not at its first backward."""
    from flashsgd.comm.dense import ALLREDUCE, DENSE
    from flashsgd.comm.dense_native import NativeChain
    from flashsgd.comm.hooks import HOOKS
    from flashsgd.comm.sparse.hooks import EXCHANGE_STEPS, SPARSE_EXCHANGES
    from flashsgd.sim.algorithms import SIMULATED as SIMULATED

    assert HOOKS.names() == X.names()
    assert list(SPARSE_EXCHANGES) == X.names("sparse") and set(EXCHANGE_STEPS) == set(SPARSE_EXCHANGES)
    # one registration per dense algorithm: its record (function + NCCL path) is all there is
    assert DENSE.names() == X.names("dense") and {n: r.fn for n, r in DENSE.items()} == dict(ALLREDUCE)
    for name, exchange in X.EXCHANGES.items():
        assert exchange.family in ("dense", "sparse", "lowrank", "none"), name
        if exchange.family == "dense":  # runs on NCCL, or says it is Gloo-only (refused there)
            assert name in DENSE, f"dense exchange {name!r} has no record in flashsgd.comm.dense.DENSE"
            record = DENSE[name]
            assert record.name == name and callable(record.fn), name
            assert record.native is None or isinstance(record.native, NativeChain), \
                f"dense exchange {name!r}: native must be a NativeChain, or None for Gloo-only"
        if exchange.family == "sparse":
            assert name in EXCHANGE_STEPS, f"sparse exchange {name!r} has no exchange step"
        if exchange.cost is None:
            assert exchange.family == "none", f"{name!r} sends something but has no cost"
        else:
            assert name in SIMULATED, f"{name!r} has no cost function in the simulator"
        assert set(exchange.ignores) <= set(exchange.option_names()), name
    assert X.names("none") == ["noop"]  # the one exchange that sends nothing (the benchmark ceiling)


def test_every_option_is_documented_and_defaults_agree():
    from flashsgd.train.config import UNSET_BY_PLAN, CommConfig, field_docs

    for exchange in X.EXCHANGES.values():
        docs = {}
        for cls in exchange.options.__mro__[::-1]:
            if dataclasses.is_dataclass(cls):
                docs.update(field_docs(cls))
        assert set(exchange.option_names()) <= set(docs), exchange.name
        exchange.options()  # the defaults pass the options' own checks
    # every [comm] key that is an exchange option has the catalog's default (never restated)
    shared = {f.name: f.default for f in dataclasses.fields(CommConfig)
              if any(f.name in e.option_names() for e in X.EXCHANGES.values())}
    assert {"density", "selection", "node_split", "matrix_approximation_rank", "threshold_every"} <= set(shared)
    for name, default in shared.items():
        if name in ("ranks_per_node", "grid", "local_clip"):
            assert default is None and X.option_default(name) is None
        elif name == "density_warmup":  # a run warms up by default (its length is known), a hook not
            assert default == X.DENSITY_WARMUP_START and X.option_default(name) is None
        elif name in UNSET_BY_PLAN or len({repr(v) for v in X.option_readers(name).values()}) > 1:
            assert default is None, name  # unset: the plan derives it / each exchange keeps its own
        elif name != "momentum_correction":  # [comm] holds a switch; the hook the recipe's factor
            assert default == X.option_default(name), name


def test_unknown_and_bad_options_name_what_is_valid():
    gtopk = X.EXCHANGES["gtopk"]
    with pytest.raises(ValueError, match="hook 'gtopk' got unknown option\\(s\\) grid; valid: timeout_s, density"):
        gtopk.make_options(grid="2x2")
    assert gtopk.options_from(grid="2x2", density=0.01) == X.SparseOptions(density=0.01)
    for bad, message in (({"density": 0}, "density must be a number in \\(0, 1\\]"),
                         ({"selection": "fast"}, "selection must be one of auto, exact, sampled, threshold"),
                         ({"start_iter": 1}, "start_iter must be an integer >= 2"),
                         ({"timeout_s": float("inf")}, "timeout_s must be a finite number")):
        with pytest.raises(ValueError, match=message):
            gtopk.make_options(**bad)
    with pytest.raises(ValueError, match="node_split must be one of leader, slices, sparse"):
        X.EXCHANGES["hgtopk"].make_options(node_split="ring")


def test_coverage_and_wire_rules():
    o = X.SparseOptions(density=0.01)
    assert X.coverage(2002, o) == pytest.approx(20.0)
    assert X.steps_for_coverage(o) == 2002 and X.coverage(X.steps_for_coverage(o), o) >= X.MIN_COVERAGE
    warm = X.SparseOptions(density=0.001, density_warmup=0.25, density_warmup_steps=100)
    assert X.coverage(1000, warm) > X.coverage(1000, X.SparseOptions(density=0.001))
    assert X.wire_index_bytes(2 ** 31 - 1) == 4 and X.wire_index_bytes(2 ** 31) == 8
    assert X.WIRE_INDEX_BYTES == X.wire_index_bytes(25_557_032)


def _literal_copies(tree: ast.AST, value: float, names: tuple[str, ...]) -> list[int]:
    """Lines where ``value`` is the default of a parameter / field / keyword named in ``names``."""
    lines = []
    for node in ast.walk(tree):
        pairs: list[tuple[str, ast.AST]] = []
        if isinstance(node, ast.arguments):
            args = node.posonlyargs + node.args
            pairs += list(zip([a.arg for a in args[len(args) - len(node.defaults):]], node.defaults))
            pairs += [(a.arg, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            pairs.append((node.target.id, node.value))
        elif isinstance(node, ast.Call):  # add_argument("--density", default=0.001)
            flag = next((a.value for a in node.args if isinstance(a, ast.Constant)
                         and isinstance(a.value, str) and a.value.startswith("--")), "")
            pairs += [(flag.lstrip("-").replace("-", "_"), k.value) for k in node.keywords if k.arg == "default"]
        lines += [v.lineno for n, v in pairs if n in names and isinstance(v, ast.Constant) and v.value == value]
    return lines


@pytest.mark.parametrize("value, names", [
    (0.001, ("density",)),
    (2, ("start_iter",)),
    (20.0, ("MIN_COVERAGE", "min_coverage")),
])
def test_no_copy_of_a_catalog_default(value, names):
    found = {}
    for path in SRC.rglob("*.py"):
        if path.name == "exchanges.py":
            continue
        lines = _literal_copies(ast.parse(path.read_text()), value, names)
        if lines:
            found[str(path.relative_to(SRC))] = lines
    assert not found, f"defaults restated outside flashsgd/exchanges.py: {found}"


def test_simulator_and_planner_read_the_catalog():
    from flashsgd.comm.hooks import HOOKS
    from flashsgd.sim import planner
    from flashsgd.sim.algorithms import SIMULATED, REFERENCES

    costed = [n for n, e in X.EXCHANGES.items() if e.cost is not None]
    assert SIMULATED.names() == costed + list(REFERENCES)  # every hook's exchange, then references
    assert set(costed) == set(HOOKS) - {"noop"}
    from flashsgd.sim.network import CLUSTERS

    offered = {c.algorithm for c in planner.candidates(8, CLUSTERS.get("abci"))}
    assert offered == set(costed), "the planner offers exactly the exchanges the hooks run"
    assert planner.coverage is X.coverage and planner.MIN_COVERAGE == X.MIN_COVERAGE
