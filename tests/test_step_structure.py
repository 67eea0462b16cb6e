"""The step's seams, read from the source (each assertion is one of issue 30's done-when checks, so
a change that weaves a feature back into the core fails here, by name, in milliseconds)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from engine_svc.sequence import Sequence

ROOT = Path(__file__).resolve().parents[1]


def _tree(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text(), path)


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def test_the_kv_manager_writes_no_sequence_counter():
    counters = {f.name for f in dataclasses.fields(Sequence) if f.type in ("int", int)}
    assert "num_computed_tokens" in counters
    written = []
    for node in ast.walk(_tree("engine_svc/kv_cache_manager.py")):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in counters:
                written.append(f"line {node.lineno}: {t.attr}")
    assert not written, f"kv_cache_manager.py assigns Sequence counters: {written}"


def test_the_engine_reaches_into_no_kv_manager_between_schedule_and_update():
    step = _function(_tree("engine_svc/engine.py"), "step")
    calls = [n for n in ast.walk(step) if isinstance(n, ast.Attribute)]
    kv = [n.lineno for n in calls if isinstance(n.value, ast.Attribute) and n.value.attr == "kv"]
    assert not kv, f"LLMEngine.step uses the KV manager directly at lines {kv}"
    names = {n.attr for n in calls}
    assert {"schedule", "execute", "update_from_output"} <= names


def test_the_input_batch_is_updated_in_one_place():
    callers = []
    for path in sorted((ROOT / "engine_svc").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "apply" and getattr(node.func.value, "attr", None) == "batch":
                    callers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(callers) == 1 and callers[0].startswith("engine_svc/model_runner.py"), callers


def test_the_model_code_has_no_lora():
    names = [
        n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else n.arg
        for n in ast.walk(_tree("engine_svc/models/decoder.py"))
        if isinstance(n, ast.Name | ast.Attribute | ast.arg)
    ]
    assert not [n for n in names if "lora" in n.lower()]


def test_the_scheduler_keeps_no_step_between_its_methods():
    init = _function(_tree("engine_svc/scheduler.py"), "__init__")
    fields = {
        t.attr
        for n in ast.walk(init)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute)
    }
    assert not fields & {"failed", "verified", "drafts", "propose", "pending"}, fields


def test_the_scheduler_hands_out_no_draft_placeholders_and_makes_no_proposals():
    """Drafts flow one way: the runner's proposer makes them after sampling and the step result
    carries them back; the scheduler neither proposes nor hands out places to fill."""
    tree = _tree("engine_svc/scheduler.py")
    placeholders = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.BinOp)
        and isinstance(n.op, ast.Mult)
        and any(
            isinstance(side, ast.List)
            and side.elts
            and all(isinstance(e, ast.Constant) and isinstance(e.value, int) for e in side.elts)
            for side in (n.left, n.right)
        )
    ]
    assert not placeholders, f"token placeholders ([0] * k) in scheduler.py at lines {placeholders}"
    calls = [
        n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    ]
    assert "propose" not in calls, "the scheduler proposes drafts"
    modules = [m for m, _ in _imports(ROOT / "engine_svc/scheduler.py")]
    assert not [m for m in modules if m.split(".")[-1] in ("ngram", "proposer", "draft_model")], modules
    update = _function(tree, "update_from_output")
    reads = [n for n in ast.walk(update) if isinstance(n, ast.Attribute) and n.attr == "drafts"]
    assert [n for n in reads if getattr(n.value, "id", None) == "result"], "the update ignores result.drafts"


def test_the_runner_proposes_after_sampling_and_returns_the_drafts():
    execute = _function(_tree("engine_svc/model_runner.py"), "execute")
    calls = {
        n.func.attr: n.lineno
        for n in ast.walk(execute)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    }
    assert calls["sampler"] < calls["propose"], "the proposer runs before the sampler"
    stored = [
        t.attr
        for n in ast.walk(execute)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute)
    ]
    assert "drafts" in stored, "the drafts do not go into the step result"


def test_paged_inputs_are_built_in_one_place():
    """Positions, slot mapping and block tables of a forward (the target's and the draft model's)
    come from step_inputs.py: nobody else gathers block tables or computes a slot."""
    gathering = []
    for path in sorted((ROOT / "engine_svc").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "gather_tables":
                gathering.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert gathering and all(g.startswith("engine_svc/step_inputs.py") for g in gathering), gathering
    for path in ("engine_svc/model_runner.py", "engine_svc/spec_decode/draft_model.py"):
        mods = [n for n in ast.walk(_tree(path)) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod)]
        assert not mods, f"{path} computes slots itself (a % at line {mods[0].lineno})"


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``import``/``from`` in a file, functions included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
    return out


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_no_import_circles_and_no_private_names_across_packages():
    files = [
        p
        for d in ("engine_svc", "kernels", "benchmarks", "gateway")
        for p in (ROOT / d).rglob("*.py")
        if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)  # the peers' venvs
    ]
    # ``from a import b`` may import module a.b: count both.
    graph = {
        _module_of(p): {d for m, names in _imports(p) for d in (m, *(f"{m}.{n}" for n in names))}
        for p in files
    }
    circles = sorted(
        f"{a} <-> {b}" for a, deps in graph.items() for b in deps if a < b and a in graph.get(b, ())
    )
    assert not circles, circles
    private = []
    for p in files:
        here = _module_of(p).rsplit(".", 1)[0]
        for module, names in _imports(p):
            if module.rsplit(".", 1)[0] != here and any(n.startswith("_") for n in names):
                private.append(
                    f"{_module_of(p)} imports {[n for n in names if n.startswith('_')]} from {module}"
                )
    assert not private, private


def test_the_engine_does_not_run_the_kernels_twins_for_planning():
    for p in (ROOT / "engine_svc").rglob("*.py"):
        assert not [m for m, _ in _imports(p) if m.startswith("kernels.reference.lora")], p


def test_a_rank_is_built_in_one_place():
    """Issue 41, part 4: the engine (rank 0, its draft model) and every tensor-parallel worker
    build their rank through ``RankRuntime``; nothing else loads a model or allocates its KV
    cache, and the worker imports nothing from the engine above it."""
    users = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for path in (ROOT / "engine_svc").rglob("*.py")
        for module, names in _imports(path)
        if module in ("engine_svc.model_setup", "engine_svc")
        for name in names
        if name in ("load_model", "allocate_kv_caches", "model_setup")
    )
    assert users and all(u.startswith("engine_svc/rank_runtime.py") for u in users), users
    worker = ROOT / "engine_svc/parallel/worker.py"
    upward = [m for m, _ in _imports(worker) if m == "engine_svc.engine"]
    assert not upward, "parallel/worker.py imports the engine"
    assert any("RankRuntime" in names for _, names in _imports(worker))


def _declared_model_attributes() -> set[str]:
    """What ``DecoderForCausalLM`` sets on itself (``self.x = ...`` in its own methods)."""
    cls = next(
        n
        for n in ast.walk(_tree("engine_svc/models/decoder.py"))
        if isinstance(n, ast.ClassDef) and n.name == "DecoderForCausalLM"
    )
    return {
        t.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Assign)
        for e in n.targets
        for t in (e.elts if isinstance(e, ast.Tuple) else [e])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def test_what_a_load_decided_is_declared_not_set_on_the_model():
    """Issue 41, part 4: a load's decisions (quantization path, activations, activation dtype, the
    parameters it freed) are fields of its ``LoadResult``; outside its class, code sets on a model
    only what the class declares (no ``model.quantization = ...`` added after construction), and
    no freed parameter carries a ``released`` attribute."""
    declared = _declared_model_attributes()
    assert {"embed_blocks", "linear_backend"} <= declared
    added = []
    for path in sorted((ROOT / "engine_svc").rglob("*.py")):
        if path == ROOT / "engine_svc/models/decoder.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                on = getattr(t, "value", None)
                named = getattr(on, "id", None) or getattr(on, "attr", None)
                if isinstance(t, ast.Attribute) and named == "model" and t.attr not in declared:
                    added.append(f"{path.relative_to(ROOT)}:{node.lineno}: model.{t.attr}")
                if isinstance(t, ast.Attribute) and t.attr == "released":  # the load's result says
                    added.append(f"{path.relative_to(ROOT)}:{node.lineno}: {named}.released")
    assert not added, added


# --- issue 41: one owner per piece of state -------------------------------------------------------
# The modules on the runner's side of the step, and the engine that drives it: they read sequences,
# and none of them writes one (the scheduler owns them; its update applies what the runner returns).
RUNNER_SIDE = (
    "engine_svc/engine.py",
    "engine_svc/model_runner.py",
    "engine_svc/input_batch.py",
    "engine_svc/step_inputs.py",
    "engine_svc/logits_layout.py",
    "engine_svc/sampler.py",
    "engine_svc/pooling.py",
    "engine_svc/kv_cache_manager.py",
    "engine_svc/logits_processors",
    "engine_svc/spec_decode",
    "engine_svc/lora",
    "engine_svc/parallel",
    "engine_svc/kv_tiers",
)


def _files(entries) -> list[Path]:
    out = []
    for entry in entries:
        path = ROOT / entry
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


def _assigned_attributes(tree: ast.AST):
    """(node, attribute target) for every assignment to an attribute (tuples unpacked)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute):
                    yield node, t


def test_no_sequence_attribute_is_written_outside_the_scheduler():
    """A proposer's index, a draft model's progress: the runner keeps them by seq id, not on the
    scheduler's ``Sequence``. Its slots make an undeclared attribute fail at run time; a declared
    one written on the runner's side fails here."""
    assert hasattr(Sequence, "__slots__"), "Sequence takes attributes nobody declared"
    fields = {f.name for f in dataclasses.fields(Sequence)}
    written = []
    for path in _files(RUNNER_SIDE):
        for node, t in _assigned_attributes(ast.parse(path.read_text(), str(path))):
            if t.attr in fields and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                written.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(t)}")
    assert not written, f"Sequence attributes written outside the scheduler: {written}"


def test_the_scheduler_takes_kv_blocks_in_one_place():
    """One allocation call for a sequence's step (its tokens and lookahead slots), named once: no
    alias, no second call for the drafts, none anywhere else."""

    def kv_allocations(path: Path) -> list[int]:
        return [
            n.lineno
            for n in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(n, ast.Attribute)
            and n.attr == "allocate"
            and (getattr(n.value, "attr", None) == "kv" or getattr(n.value, "id", None) == "kv")
        ]

    lines = kv_allocations(ROOT / "engine_svc/scheduler.py")
    assert len(lines) == 1, f"scheduler.py names the KV manager's allocate at lines {lines}"
    elsewhere = {
        str(p.relative_to(ROOT)): kv_allocations(p)
        for p in (ROOT / "engine_svc").rglob("*.py")
        if p.name != "scheduler.py"
    }
    assert not any(elsewhere.values()), {p: v for p, v in elsewhere.items() if v}
    allocate = _function(_tree("engine_svc/kv_cache_manager.py"), "allocate")
    assert "num_lookahead" in [a.arg for a in allocate.args.args], "allocate takes no lookahead"


def test_the_step_flags_are_derived_once_from_the_plan():
    """``only_decodes`` and ``all_decoding`` are set once, from what ``schedule()`` committed, and
    no budget of 0 stands for something else ('it does not decode: verify nothing')."""
    tree = _tree("engine_svc/scheduler.py")
    for flag in ("only_decodes", "all_decoding"):
        sets = [node.lineno for node, t in _assigned_attributes(tree) if t.attr == flag]
        assert len(sets) == 1, f"scheduler.py sets {flag} at lines {sets}"
    sentinels = [
        n.lineno
        for call in ast.walk(tree)
        if isinstance(call, ast.Call)
        for n in call.args
        if isinstance(n, ast.IfExp)
        and any(isinstance(side, ast.Constant) and side.value == 0 for side in (n.body, n.orelse))
        and "budget" in ast.unparse(n.body) + ast.unparse(n.orelse)
    ]
    assert not sentinels, f"a budget of 0 passed for 'none' at lines {sentinels}"


def test_quantized_blocks_travel_in_a_declared_map_not_on_parameters():
    """Issue 41, part 4: the blocks a load made or kept for a linear reach ``make_linear`` as an
    argument (the load's ``QuantizedBlocks``), never as a ``quantized`` attribute added to a
    parameter after construction (written, or read back with ``getattr``)."""
    found = []
    for path in _files(("engine_svc", "kernels")):
        tree = ast.parse(path.read_text(), str(path))
        for node, t in _assigned_attributes(tree):
            if t.attr == "quantized":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(t)} = ...")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == "quantized"
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, f"quantized blocks carried as a parameter attribute: {found}"
    make_linear = _function(_tree("kernels/cpu/linear.py"), "make_linear")
    assert "blocks" in [a.arg for a in make_linear.args.args], "make_linear takes no blocks"


# --- issue 41, part 1: the scheduler's output is plain data; the runner keeps its own state ------
def _types_reachable(cls) -> set[type]:
    """Every class named in ``cls``'s field annotations, and in theirs, recursively."""
    import typing

    seen: set[type] = set()
    todo = [cls]
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        if dataclasses.is_dataclass(c):
            hints = typing.get_type_hints(c)
            stack = list(hints.values())
            while stack:
                t = stack.pop()
                stack += list(typing.get_args(t))
                origin = typing.get_origin(t)
                for candidate in (t, origin):
                    if isinstance(candidate, type) and candidate not in seen:
                        todo.append(candidate)
    return seen


def test_the_scheduler_output_holds_no_sequence():
    """Issue 41, part 1: ``SchedulerOutput`` is ids, token ids, block ids and counts: nothing it
    declares (nor what they declare) is a ``Sequence``, a ``Request`` or a layout over them, and its
    module imports neither; so it could cross a process boundary, and tensor parallelism sends it."""
    from engine_svc.logits_layout import LogitsLayout
    from engine_svc.scheduler_output import SchedulerOutput
    from engine_svc.sequence import Request

    live = {Sequence, Request, LogitsLayout} & _types_reachable(SchedulerOutput)
    assert not live, f"SchedulerOutput reaches live scheduler objects: {live}"
    imported = [
        name
        for module, names in _imports(ROOT / "engine_svc/scheduler_output.py")
        if module in ("engine_svc.sequence", "engine_svc.logits_layout")
        for name in names
    ]
    assert not imported, f"scheduler_output.py imports {imported}"


# The runner's side of the step: it reads the plain output and its own per-request state.
RUNNER_ONLY = (
    "engine_svc/model_runner.py",
    "engine_svc/input_batch.py",
    "engine_svc/step_inputs.py",
    "engine_svc/runner_state.py",
    "engine_svc/pooling.py",
    "engine_svc/logits_processors",
    "engine_svc/spec_decode/proposer.py",
    "engine_svc/spec_decode/ngram.py",
    "engine_svc/spec_decode/draft_model.py",
    "engine_svc/parallel/worker.py",
)


def test_the_runner_never_touches_a_sequence():
    """Issue 41, part 1: the runner keeps its own state per seq id (``runner_state.RequestState``)
    and reads nothing of the scheduler's: no module on its side imports ``Sequence`` or ``Request``,
    nor reads what only they carry (``.request``, ``.matcher``, ``.spec_token_ids``, ``.seqs``)."""
    found = []
    for path in _files(RUNNER_ONLY):
        rel = path.relative_to(ROOT)
        for module, names in _imports(path):
            if module == "engine_svc.sequence" and {"Sequence", "Request"} & set(names):
                found.append(f"{rel}: imports {sorted({'Sequence', 'Request'} & set(names))}")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in (
                "request",
                "matcher",
                "spec_token_ids",
                "seqs",
            ):
                found.append(f"{rel}:{node.lineno}: .{node.attr}")
    assert not found, f"the runner's side reads the scheduler's sequences: {found}"
    execute = _function(_tree("engine_svc/model_runner.py"), "execute")
    assert ast.unparse(execute.args.args[1].annotation) == "SchedulerOutput"


def test_tensor_parallelism_sends_the_scheduler_output():
    """Issue 41, part 1: one form of a step for every rank: the group broadcasts the output's wire
    form and the worker follows it with the runner's own code; no second, flattened form."""
    broadcast = _function(_tree("engine_svc/parallel/group.py"), "broadcast")
    assert "to_wire" in {n.attr for n in ast.walk(broadcast) if isinstance(n, ast.Attribute)}
    worker = _tree("engine_svc/parallel/worker.py")
    attrs = {n.attr for n in ast.walk(worker) if isinstance(n, ast.Attribute)}
    assert {"from_wire", "follow"} <= attrs, attrs
    step_inputs = _tree("engine_svc/step_inputs.py")
    defined = {n.name for n in ast.walk(step_inputs) if isinstance(n, ast.FunctionDef)}
    assert not defined & {"pack", "unpack"}, "StepInputs still has a wire form of its own"
