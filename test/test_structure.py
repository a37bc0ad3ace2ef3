"""The package's structure, measured from its code (issue 39), as test_layers measures the layering:

* outside model/, nothing branches on the model's kind: the kinds are told apart once (model.kinds.split_model)
  and every other part asks the SplitModel interface;
* "is the front a whole VLM" is written once (VLAConfig.vlm_front);
* no circle between the package's files (every import counted, function-level ones included);
* one prefix and one suffix frame loop (runtime.loops): nothing else paces frames, applies split requests or
  takes frames from a SuffixRunner, and the nodes, the bench and the GPU check run those loops;
* the one split-layer control (runtime.split_control) moves K for the node, the bench and the GPU check;
* no function in tools/ longer than 100 lines.
"""
import ast

from test_layers import PACKAGE_DIR, _imports, _modules

MODEL_PACKAGE = "hybrid_vla_ros.model"
#: Attributes that say which kind a model is (its config's parts, the transformers layout it came in).
KIND_ATTRIBUTES = {"kind", "projector", "vlm_type", "readout_type", "vlm_front", "vision_type", "llm_type", "hf"}


def _trees():
    for path, module, is_init in _modules():
        yield path, module, is_init, ast.parse(path.read_text(), str(path))


def _model_classes() -> set[str]:
    """Every class defined in model/ but its errors (``except`` / isinstance on an error is no kind branch)."""
    return {node.name for path, module, _, tree in _trees() if module.startswith(MODEL_PACKAGE)
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and not node.name.endswith("Error")}


def _names(node) -> list[str]:
    """The plain names of an isinstance / issubclass class argument (a name, an attribute, or a tuple of them)."""
    if isinstance(node, ast.Tuple):
        return [n for elt in node.elts for n in _names(elt)]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return [node.id] if isinstance(node, ast.Name) else []


def test_nothing_outside_model_branches_on_the_model_kind():
    classes = _model_classes()
    found = []
    for path, module, _, tree in _trees():
        if module.startswith(MODEL_PACKAGE):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in KIND_ATTRIBUTES:
                found.append(f"{path.relative_to(PACKAGE_DIR)}:{node.lineno} .{node.attr}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
                for name in set(_names(node.args[1])) & classes:
                    found.append(f"{path.relative_to(PACKAGE_DIR)}:{node.lineno} isinstance(..., {name})")
    assert found == [], "ask the SplitModel (model.kinds) instead:\n" + "\n".join(found)


def test_the_check_itself_sees_a_kind_branch(tmp_path):
    """The walk above finds the two shapes of a kind branch (a control: the check can fail)."""
    tree = ast.parse("if isinstance(cfg, VLAConfig) and cfg.projector['type'] == 'vlm':\n    pass\n")
    attrs = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in KIND_ATTRIBUTES]
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "isinstance"]
    assert attrs == ["projector"] and set(_names(calls[0].args[1])) & _model_classes() == {"VLAConfig"}


def test_the_vlm_front_test_is_written_once():
    """A comparison with the constant "vlm" that reads a ``projector``: only VLAConfig.vlm_front."""
    places = []
    for path, module, _, tree in _trees():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            if (any(isinstance(o, ast.Constant) and o.value == "vlm" for o in operands)
                    and any(isinstance(n, ast.Attribute) and n.attr == "projector" for n in ast.walk(node))):
                places.append(f"{module}:{node.lineno}")
    assert len(places) == 1 and places[0].startswith("hybrid_vla_ros.model.config:"), places


def _import_graph() -> dict[str, set[str]]:
    modules = {module: (path, is_init) for path, module, is_init in _modules()}
    graph = {}
    for module, (path, is_init) in modules.items():
        targets = set()
        for _, target in _imports(path, module, is_init):
            while target and target not in modules:  # `from a.b import name`: the module a.b
                target = target.rpartition(".")[0]
            if target and target != module and not modules[target][1]:  # a package's __init__ is no file of code
                targets.add(target)
        graph[module] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_circle_between_the_package_files():
    graph = _import_graph()
    assert len(graph) > 100 and graph["hybrid_vla_ros.model.kinds"] >= {"hybrid_vla_ros.model.modeling"}
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the search finds one


def _calls(tree, names: set[str]) -> list[int]:
    """Lines calling a method of ``names`` on another object (a runner applying its own request is not a loop)."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in names and not (isinstance(n.func.value, ast.Name) and n.func.value.id == "self")]


def test_one_prefix_and_one_suffix_frame_loop():
    """Pacing (``pacing_delay_s``), applying split requests (``apply_split_request``) and taking frames from a
    SuffixRunner (``poll``) happen in runtime.loops only; the nodes, the bench and the GPU check run its loops."""
    owners = {}
    for path, module, _, tree in _trees():
        for line in _calls(tree, {"pacing_delay_s", "apply_split_request"}):
            owners.setdefault(module, []).append(line)
        source = path.read_text()
        if "SuffixRunner" in source or "ctx.runner()" in source:
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "poll"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "runner"):
                    owners.setdefault(module, []).append(node.lineno)
    assert set(owners) == {"hybrid_vla_ros.runtime.loops"}, owners
    users = {"PrefixLoop": ("ros.prefix_worker", "tools.bench.pipeline", "tools.bench.preprocess",
                            "tools.bench.decode_overlap", "tools.gpu_check.workers"),
             "SuffixLoop": ("ros.suffix_worker", "tools.bench.pipeline", "tools.bench.decode_overlap",
                            "tools.gpu_check.workers"),
             "SplitLayerControl": ("ros.prefix_node", "tools.bench.pipeline", "tools.gpu_check.workers")}
    for name, modules in users.items():
        for module in modules:
            assert name in (PACKAGE_DIR / (module.replace(".", "/") + ".py")).read_text(), (name, module)


def test_no_function_in_tools_over_100_lines():
    long = []
    for path, module, _, tree in _trees():
        if not module.startswith("hybrid_vla_ros.tools"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 100:
                    long.append(f"{path.relative_to(PACKAGE_DIR)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == [], long
