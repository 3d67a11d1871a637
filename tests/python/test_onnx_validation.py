"""The ONNX importer validates a graph before building anything from it: malformed graphs (cycles, duplicate names,
nodes that break their operator's schema, sizes the data does not hold, versions it does not read) are refused with
one clear error naming the node or tensor, from Python (ValueError, the interpreter survives) and from the CLI (one
line, a non-zero exit), never a crash."""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

import fusetrain
from cli_support import CLI, data, error_line, run, tiny_model, train_args  # noqa: F401 (fixtures)

VOCAB, HIDDEN, CLASSES = 10, 4, 3


def _tensor(name: str, shape: list[int], seed: int = 0) -> TP:
    values = np.random.default_rng(seed).random(int(np.prod(shape))).astype(np.float32)
    return helper.make_tensor(name, TP.FLOAT, shape, values.tolist())


def graph(nodes=None, initializers=None, inputs=None, outputs=None, opset: int = 17, ir_version: int = 8):
    """A token-classification graph (Gather, MatMul; logits (batch, sequence, 3)), or its parts replaced."""
    if nodes is None:
        nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["h"], name="embed"),
                 helper.make_node("MatMul", ["h", "w"], ["logits"], name="head")]
    if initializers is None:
        initializers = [_tensor("emb", [VOCAB, HIDDEN]), _tensor("w", [HIDDEN, CLASSES], 1)]
    if inputs is None:
        inputs = [helper.make_tensor_value_info("input_ids", TP.INT64, ["batch", "sequence"])]
    if outputs is None:
        outputs = [helper.make_tensor_value_info("logits", TP.FLOAT, ["batch", "sequence", CLASSES])]
    g = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)


def refused(model: onnx.ModelProto, tmp_path: pathlib.Path) -> str:
    """from_onnx's ValueError on `model` (the process survives it)."""
    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(ValueError) as err:
        fusetrain.Model.from_onnx(path, "token-cls")
    return str(err.value)


def test_the_valid_graph_imports_and_trains(tmp_path):
    """The base of every bad graph below is itself accepted, so each refusal is the one change's doing."""
    path = tmp_path / "model.onnx"
    onnx.checker.check_model(graph(), full_check=True)
    path.write_bytes(graph().SerializeToString())
    model = fusetrain.Model.from_onnx(path, "token-cls")
    ids = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=np.int64)
    loss, grads = model.loss_and_grads(input_ids=ids, attention_mask=np.ones_like(ids),
                                       labels=np.array([[0, 1, 2, 0], [1, 2, 0, 1]], dtype=np.int64))
    assert np.isfinite(loss) and set(grads) == {"emb", "w"}


# ---- the three graphs that crashed the process ------------------------------------------------------------------

def _cycle():
    return graph(nodes=[helper.make_node("Gather", ["emb", "input_ids"], ["h"], name="embed"),
                        helper.make_node("MatMul", ["h", "logits"], ["logits"], name="head")])


def _duplicate_initializers():
    return graph(initializers=[_tensor("emb", [VOCAB, HIDDEN]), _tensor("w", [HIDDEN, CLASSES], 1),
                               _tensor("w", [HIDDEN, CLASSES], 2)])


def _short_layer_norm():
    return graph(nodes=[helper.make_node("Gather", ["emb", "input_ids"], ["h"], name="embed"),
                        helper.make_node("LayerNormalization", ["h"], ["n"], name="ln"),
                        helper.make_node("MatMul", ["n", "w"], ["logits"], name="head")])


CRASHES = {
    "cycle": (_cycle, 'node 1 (MatMul "head") reads its own output "logits" (a cycle)'),
    "duplicate-initializers": (_duplicate_initializers, 'two initializers are named "w"'),
    "short-layer-norm": (_short_layer_norm,
                         'node 1 (LayerNormalization "ln") has 1 input; LayerNormalization-17 (the version opset 17 '
                         'runs) takes 2 to 3'),
}


@pytest.mark.parametrize("case", list(CRASHES))
def test_graphs_that_crashed_are_refused_in_python(tmp_path, case):
    make, expected = CRASHES[case]
    message = refused(make(), tmp_path)
    assert expected in message and str(tmp_path / "model.onnx") in message, message


@pytest.fixture(scope="module")
def graph_dir(tiny_model, tmp_path_factory):
    """A directory holding the tiny BERT's tokenizer files, for a model.onnx written beside them."""
    out = tmp_path_factory.mktemp("graph")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(tiny_model / name, out / name)
    return out


@pytest.mark.skipif(not CLI.exists(), reason=f"{CLI} is not built (bash scripts/build.sh)")
@pytest.mark.parametrize("case", list(CRASHES))
def test_graphs_that_crashed_are_refused_by_the_cli(graph_dir, data, tmp_path, case):
    make, expected = CRASHES[case]
    (graph_dir / "model.onnx").write_bytes(make().SerializeToString())
    result = run(*train_args(graph_dir / "model.onnx", data, tmp_path / "out", "--max-steps", "1"))
    assert result.returncode == 1, (result.returncode, result.stderr)  # an error exit, not a signal (139)
    assert expected in error_line(result)


def test_a_cycle_through_two_nodes_names_both(tmp_path):
    model = graph(nodes=[helper.make_node("Gather", ["emb", "input_ids"], ["h"], name="embed"),
                         helper.make_node("Add", ["h", "b"], ["a"], name="first"),
                         helper.make_node("Relu", ["a"], ["b"], name="second"),
                         helper.make_node("MatMul", ["b", "w"], ["logits"], name="head")])
    message = refused(model, tmp_path)
    assert ('node 1 (Add "first") reads "b", which node 2 (Relu "second") writes after it (the nodes are not in '
            'topological order, or form a cycle)') in message, message


# ---- values that are not defined once ------------------------------------------------------------------------

@pytest.mark.parametrize("case, expected", [
    ("node-rewrites-initializer", 'node 0 (Gather "embed") writes "w", which an initializer already defines'),
    ("two-nodes-write-one-value", 'node 1 (Relu "again") writes "h", which node 0 (Gather "embed") already defines'),
    ("output-nobody-computes", 'graph output "missing" is not computed by any node'),
    ("reads-undefined", 'node 1 (MatMul "head") reads "nowhere", which no initializer, graph input or node defines'),
    ("duplicate-inputs", 'two graph inputs are named "input_ids"'),
])
def test_values_defined_more_than_once_or_never(tmp_path, case, expected):
    gather = helper.make_node("Gather", ["emb", "input_ids"], ["h"], name="embed")
    head = helper.make_node("MatMul", ["h", "w"], ["logits"], name="head")
    ids = helper.make_tensor_value_info("input_ids", TP.INT64, ["batch", "sequence"])
    logits = helper.make_tensor_value_info("logits", TP.FLOAT, ["batch", "sequence", CLASSES])
    model = {
        "node-rewrites-initializer": lambda: graph(nodes=[helper.make_node("Gather", ["emb", "input_ids"], ["w"],
                                                                           name="embed"), head]),
        "two-nodes-write-one-value": lambda: graph(nodes=[gather, helper.make_node("Relu", ["h"], ["h"], name="again"),
                                                          head]),
        "output-nobody-computes": lambda: graph(outputs=[logits, helper.make_tensor_value_info("missing", TP.FLOAT,
                                                                                               [1])]),
        "reads-undefined": lambda: graph(nodes=[gather, helper.make_node("MatMul", ["h", "nowhere"], ["logits"],
                                                                         name="head")]),
        "duplicate-inputs": lambda: graph(inputs=[ids, ids]),
    }[case]()
    message = refused(model, tmp_path)
    assert expected in message, message


# ---- nodes against their operator's schema ---------------------------------------------------------------------

def _with_node(node, *more):
    return graph(nodes=[helper.make_node("Gather", ["emb", "input_ids"], ["h"], name="embed"), node, *more,
                        helper.make_node("MatMul", ["x", "w"], ["logits"], name="head")])


@pytest.mark.parametrize("node, expected", [
    (helper.make_node("Cast", ["h"], ["x"], name="cast"), 'Cast-13 (the version opset 17 runs) requires attribute "to"'),
    (helper.make_node("Softmax", ["h"], ["x"], name="sm", axis=1.5),
     'node 1 (Softmax "sm"): attribute "axis" is a FLOAT; Softmax-13 (the version opset 17 runs) expects a INT'),
    (helper.make_node("Relu", ["h"], ["x"], name="relu", alpha=0.1),
     'node 1 (Relu "relu") has attribute "alpha", which Relu-14 (the version opset 17 runs) does not define (it '
     'takes none)'),
    (helper.make_node("Add", ["h"], ["x"], name="add"), 'node 1 (Add "add") has 1 input; Add-14'),
    (helper.make_node("Relu", ["h"], ["x", "y"], name="relu"), 'node 1 (Relu "relu") has 2 outputs; Relu-14'),
    (helper.make_node("Add", ["h", ""], ["x"], name="add"), 'node 1 (Add "add"): input 1 is empty, but Add-14'),
    (helper.make_node("HardSwish2", ["h"], ["x"], name="mine"), "HardSwish2 is not an operator of ONNX opset 17"),
    (helper.make_node("FusedMatMul", ["h", "h"], ["x"], name="ort", domain="com.microsoft"),
     'node 1 (FusedMatMul "ort") is an operator of domain "com.microsoft"; fusetrain imports operators of the '
     'default ONNX domain only'),
], ids=["missing-required-attribute", "attribute-type", "unknown-attribute", "too-few-inputs", "too-many-outputs",
        "empty-required-input", "unknown-op", "other-domain"])
def test_nodes_are_checked_against_their_schema(tmp_path, node, expected):
    message = refused(_with_node(node), tmp_path)
    assert expected in message, message


def test_the_schema_version_follows_the_opset(tmp_path):
    """ReduceMean takes its axes as an attribute up to opset 17 and as an input from 18: each form is accepted at
    its own opsets and refused at the other's."""
    attribute = helper.make_node("ReduceMean", ["h"], ["m"], name="mean", axes=[2], keepdims=1)
    axes = helper.make_tensor("axes", TP.INT64, [1], [2])
    as_input = helper.make_node("ReduceMean", ["h", "axes"], ["m"], name="mean", keepdims=1)
    centre = helper.make_node("Sub", ["h", "m"], ["x"], name="centre")
    for node, opset, extra, ok in [(attribute, 17, [], True), (as_input, 18, [axes], True),
                                   (attribute, 18, [], False), (as_input, 17, [axes], False)]:
        model = _with_node(node, centre)
        model.opset_import[0].version = opset
        model.graph.initializer.extend(extra)
        path = tmp_path / f"mean-{opset}-{len(extra)}.onnx"
        path.write_bytes(model.SerializeToString())
        if ok:
            fusetrain.Model.from_onnx(path, "token-cls")
        else:
            with pytest.raises(ValueError, match=f"ReduceMean-{18 if opset == 18 else 13} "):
                fusetrain.Model.from_onnx(path, "token-cls")


# ---- versions, input types, tensor sizes --------------------------------------------------------------------

@pytest.mark.parametrize("opset, ir_version, expected", [
    (30, 8, "opset 30; fusetrain imports opsets 13 to 20 of the default ONNX domain (re-export with opset_version=20)"),
    (12, 8, "opset 12; fusetrain imports opsets 13 to 20 of the default ONNX domain (re-export with opset_version=17)"),
    (17, 99, "IR version 99; fusetrain reads ONNX IR versions 3 to "),
    (17, 0, "IR version 0; fusetrain reads ONNX IR versions 3 to "),
])
def test_versions_the_importer_does_not_read_are_refused(tmp_path, opset, ir_version, expected):
    message = refused(graph(opset=opset, ir_version=ir_version), tmp_path)
    assert expected in message, message


def test_the_default_domain_must_be_imported_once(tmp_path):
    model = graph()
    model.opset_import.append(helper.make_opsetid("ai.onnx", 18))
    assert "the default ONNX domain is imported twice (opsets 17 and 18)" in refused(model, tmp_path)
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("ai.onnx.ml", 3))
    assert "the model imports no opset of the default ONNX domain" in refused(model, tmp_path)


@pytest.mark.parametrize("declared", [TP.FLOAT, TP.INT32])
def test_input_ids_must_be_declared_int64(tmp_path, declared):
    """A float input_ids trained and wrote a model.onnx that ONNX Runtime refuses to run with the ids it gets."""
    model = graph(inputs=[helper.make_tensor_value_info("input_ids", declared, ["batch", "sequence"])])
    message = refused(model, tmp_path)
    name = TP.DataType.Name(declared)
    assert f'graph input "input_ids" is declared {name}; fusetrain feeds it as INT64' in message, message


@pytest.mark.parametrize("dims, expected", [
    ([2**40, 32], 'ONNX tensor "w": raw_data holds 48 bytes, expected 140737488355328 for shape (1099511627776, 32)'),
    ([2**62, 2**62], 'ONNX tensor "w": its shape (4611686018427387904, 4611686018427387904) holds more elements than '
                     'a 64-bit count can hold'),
    ([-1, 3], 'ONNX tensor "w": negative extent in its shape (-1, 3)'),
])
def test_declared_sizes_are_checked_against_the_data_before_allocating(tmp_path, dims, expected):
    """(2^40, 32) ended in std::bad_alloc; (2^62, 2^62) overflowed the size check into "expected 0 bytes"."""
    w = helper.make_tensor("w", TP.FLOAT, [HIDDEN, CLASSES], np.ones(HIDDEN * CLASSES, np.float32).tobytes(),
                           raw=True)
    del w.dims[:]
    w.dims.extend(dims)
    message = refused(graph(initializers=[_tensor("emb", [VOCAB, HIDDEN]), w]), tmp_path)
    assert expected in message, message


def test_external_data_entries_must_be_integers_within_the_file(tmp_path):
    w = helper.make_tensor("w", TP.FLOAT, [HIDDEN, CLASSES], np.ones(HIDDEN * CLASSES, np.float32).tobytes(),
                           raw=True)
    (tmp_path / "weights.bin").write_bytes(w.raw_data)
    w.ClearField("raw_data")
    w.data_location = TP.EXTERNAL
    for offset, expected in [("zero", 'external data "offset" is "zero", expected a non-negative integer'),
                             ("-4", 'external data "offset" is "-4", expected a non-negative integer'),
                             ("8", "(48 bytes) ends before offset 8 + 48 bytes")]:
        del w.external_data[:]
        w.external_data.add(key="location", value="weights.bin")
        w.external_data.add(key="offset", value=offset)
        message = refused(graph(initializers=[_tensor("emb", [VOCAB, HIDDEN]), w]), tmp_path)
        assert expected in message, message


def test_a_nul_byte_in_a_name_does_not_cut_the_message_short(tmp_path):
    model = graph(nodes=[helper.make_node("Gather", ["emb", "input_ids"], ["h"], name="embed"),
                         helper.make_node("MatMul", ["h", "w"], ["logits"], name="he\0ad", alpha=1.0)])
    message = refused(model, tmp_path)
    assert 'node 1 (MatMul "he\\x00ad") has attribute "alpha", which MatMul-13' in message, message


def test_the_generated_schema_table_is_onnx_registry():
    """src/onnx/schemas.inc is the installed onnx package's schema registry for opsets up to 20, row for row (the
    header names the onnx release it was written from; old opsets' schemas do not change between releases)."""
    import importlib.util

    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("gen_onnx_schemas", root / "scripts" / "gen_onnx_schemas.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    table = (root / "src" / "onnx" / "schemas.inc").read_text().splitlines()
    committed = [line for line in table if line.startswith(' {"')]
    assert committed == generator.rows(20)
    assert len(committed) > 400 and any('"LayerNormalization", 17' in line for line in committed)
