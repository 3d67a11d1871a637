"""Reference models and batches for the Hugging Face parity tests.

Every parity test follows the same recipe: build a small random transformers
model from a config, save it with `save_pretrained` (safetensors), load the
directory in fusetrain, run both frameworks on the same batch and compare.
This module holds the recipe; the test files hold only the assertions.

Shapes: B batch, T sequence, C hidden, V vocab, L labels.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

# Tiny models: one thread is fastest, and more threads spin against each other
# (and against fusetrain's) on a loaded 2-core machine.
torch.set_num_threads(1)
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

BATCH = 3
SEQ = 13
# Padding per row of a padded batch (right padding): 13, 9 and 6 real tokens.
PADDING = (0, 4, 7)
# Token ids below this are special (pad, bos, eos...) and never drawn as text.
FIRST_TEXT_TOKEN = 3

LOGITS_RTOL = 1e-4
LOGITS_ATOL = 1e-5
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


# ----------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Size:
    hidden: int
    heads: int
    layers: int
    intermediate: int
    vocab: int
    positions: int
    num_labels: int


SIZES = {
    "small": Size(hidden=32, heads=4, layers=2, intermediate=37, vocab=99, positions=24, num_labels=2),
    # Odd sizes: head dim 8 from 40/5, vocabulary not a multiple of anything.
    "odd": Size(hidden=40, heads=5, layers=3, intermediate=52, vocab=1001, positions=40, num_labels=3),
}

# transformers class -> (model_type, task)
ARCHITECTURES = {
    "BertModel": ("bert", "base"),
    "BertForMaskedLM": ("bert", "mlm"),
    "BertForSequenceClassification": ("bert", "sequence"),
    "BertForTokenClassification": ("bert", "token"),
    "BertForQuestionAnswering": ("bert", "qa"),
    "RobertaModel": ("roberta", "base"),
    "RobertaForMaskedLM": ("roberta", "mlm"),
    "RobertaForSequenceClassification": ("roberta", "sequence"),
    "RobertaForTokenClassification": ("roberta", "token"),
    "RobertaForQuestionAnswering": ("roberta", "qa"),
    "DistilBertModel": ("distilbert", "base"),
    "DistilBertForMaskedLM": ("distilbert", "mlm"),
    "DistilBertForSequenceClassification": ("distilbert", "sequence"),
    "GPT2Model": ("gpt2", "base"),
    "GPT2LMHeadModel": ("gpt2", "clm"),
    "GPT2ForSequenceClassification": ("gpt2", "sequence"),
}

# The Auto class that loads a saved directory back into the same head.
AUTO_CLASSES = {
    "base": "AutoModel",
    "mlm": "AutoModelForMaskedLM",
    "clm": "AutoModelForCausalLM",
    "sequence": "AutoModelForSequenceClassification",
    "token": "AutoModelForTokenClassification",
    "qa": "AutoModelForQuestionAnswering",
}

# Sequence classification problems: how labels look and which loss is used.
# single: int labels (B), cross-entropy; multi: problem_type="multi_label_classification",
# float labels (B, L), BCE with logits; regression: num_labels=1, float labels (B), MSE.
PROBLEMS = ("single", "multi", "regression")


@dataclasses.dataclass(frozen=True)
class Case:
    """One (architecture, config) pair."""

    architecture: str
    size: str = "small"
    problem: str | None = None  # sequence classification only
    variant: str | None = None  # a key of VARIANTS

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture][0]

    @property
    def task(self) -> str:
        return ARCHITECTURES[self.architecture][1]

    @property
    def id(self) -> str:
        parts = [self.architecture]
        if self.problem:
            parts.append(self.problem)
        if self.variant:
            parts.append(self.variant)
        parts.append(self.size)
        return "-".join(parts)


def cases(model_type: str, sizes=("small", "odd"), problems=PROBLEMS) -> list[Case]:
    """Every head of one model type, in every size (and every problem for sequence heads)."""
    out = []
    for architecture, (mtype, task) in ARCHITECTURES.items():
        if mtype != model_type:
            continue
        for size in sizes:
            if task == "sequence":
                out.extend(Case(architecture, size, problem) for problem in problems)
            else:
                out.append(Case(architecture, size))
    return out


@dataclasses.dataclass(frozen=True)
class Variant:
    """Config values away from the defaults, as real checkpoints carry them."""

    overrides: tuple[tuple[str, object], ...]
    # fusetrain may refuse the variant with a ValueError naming the key; what it
    # must never do is accept it and compute something else.
    may_refuse: bool = False


VARIANTS = {
    # Separate input embeddings and LM decoder (weight, and for BERT/RoBERTa the decoder bias).
    "untied": Variant((("tie_word_embeddings", False),), may_refuse=True),
    "gelu_new": Variant((("hidden_act", "gelu_new"),)),
    "relu": Variant((("hidden_act", "relu"),)),
    "distil_relu": Variant((("activation", "relu"),)),
    "classifier_dropout": Variant((("classifier_dropout", 0.3),)),
    "relative_key": Variant((("position_embedding_type", "relative_key"),), may_refuse=True),
    "sinusoidal": Variant((("sinusoidal_pos_embds", True),), may_refuse=True),
    "gpt2_gelu_layer_scaled": Variant((("activation_function", "gelu"),
                                       ("scale_attn_by_inverse_layer_idx", True))),
    "gpt2_unscaled": Variant((("scale_attn_weights", False),)),
    "gpt2_upcast": Variant((("reorder_and_upcast_attn", True),)),
}


def variant_cases(model_type: str) -> list[Case]:
    """Heads of one model type with non-default config values."""
    table = {
        "bert": [Case("BertForMaskedLM", "small", variant="untied"),
                 Case("BertForSequenceClassification", "odd", "single", variant="gelu_new"),
                 Case("BertForSequenceClassification", "small", "single", variant="classifier_dropout"),
                 Case("BertForMaskedLM", "small", variant="relative_key")],
        "roberta": [Case("RobertaForMaskedLM", "odd", variant="untied"),
                    Case("RobertaForTokenClassification", "small", variant="relu")],
        "distilbert": [Case("DistilBertForMaskedLM", "small", variant="untied"),
                       Case("DistilBertForSequenceClassification", "odd", "multi", variant="distil_relu"),
                       Case("DistilBertForMaskedLM", "small", variant="sinusoidal")],
        "gpt2": [Case("GPT2LMHeadModel", "odd", variant="untied"),
                 Case("GPT2LMHeadModel", "small", variant="gpt2_gelu_layer_scaled"),
                 Case("GPT2ForSequenceClassification", "small", "single", variant="gpt2_unscaled"),
                 Case("GPT2LMHeadModel", "small", variant="gpt2_upcast")],
    }
    return table[model_type]


def pad_token_id(model_type: str) -> int:
    return {"bert": 0, "roberta": 1, "distilbert": 0, "gpt2": 0}[model_type]


def hf_config(case: Case) -> transformers.PretrainedConfig:
    """A small transformers config for the case; dropout stays on in the config
    (eval mode must switch it off on both sides)."""
    config = _base_config(case)
    if case.variant:
        for key, value in VARIANTS[case.variant].overrides:
            setattr(config, key, value)
    return config


def _base_config(case: Case) -> transformers.PretrainedConfig:
    s = SIZES[case.size]
    num_labels = s.num_labels
    problem_type = None  # single-label and regression: inferred, as most checkpoints leave it unset
    if case.problem == "regression":
        num_labels = 1
    elif case.problem == "multi":
        problem_type = "multi_label_classification"
    if case.task == "qa":
        num_labels = 2  # qa_outputs: start and end
    common = dict(vocab_size=s.vocab, num_labels=num_labels, problem_type=problem_type,
                  architectures=[case.architecture], attn_implementation="eager")
    pad = pad_token_id(case.model_type)
    if case.model_type == "bert":
        return transformers.BertConfig(
            hidden_size=s.hidden, num_attention_heads=s.heads, num_hidden_layers=s.layers,
            intermediate_size=s.intermediate, max_position_embeddings=s.positions,
            type_vocab_size=2, pad_token_id=pad, **common)
    if case.model_type == "roberta":
        # Positions start after padding_idx, so the table needs padding_idx + 1 extra rows.
        return transformers.RobertaConfig(
            hidden_size=s.hidden, num_attention_heads=s.heads, num_hidden_layers=s.layers,
            intermediate_size=s.intermediate, max_position_embeddings=s.positions + pad + 1,
            type_vocab_size=1, pad_token_id=pad, bos_token_id=0, eos_token_id=2,
            layer_norm_eps=1e-5, **common)
    if case.model_type == "distilbert":
        return transformers.DistilBertConfig(
            dim=s.hidden, n_heads=s.heads, n_layers=s.layers, hidden_dim=s.intermediate,
            max_position_embeddings=s.positions, pad_token_id=pad, **common)
    if case.model_type == "gpt2":
        # small keeps n_inner=None (4 * n_embd); odd sets it explicitly.
        n_inner = None if case.size == "small" else s.intermediate
        return transformers.GPT2Config(
            n_embd=s.hidden, n_head=s.heads, n_layer=s.layers, n_inner=n_inner,
            n_positions=s.positions, pad_token_id=pad, bos_token_id=s.vocab - 1,
            eos_token_id=s.vocab - 1, **common)
    raise AssertionError(case.model_type)


# ----------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------

def perturb_(model: torch.nn.Module, seed: int, scale: float = 0.1) -> None:
    """Adds noise to every parameter. transformers initialises biases to zero and
    LayerNorm to (1, 0), and a 0.02 weight scale leaves attention almost uniform; with
    those, a missing bias, a swapped LayerNorm or a wrong attention scale would pass."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in model.named_parameters():  # tied weights appear once
            p.add_(torch.randn(p.shape, generator=generator) * scale)


def build_hf_model(case: Case, seed: int = 0, perturb: bool = True) -> torch.nn.Module:
    """A transformers model for the case with (perturbed) random weights, in eval mode."""
    torch.manual_seed(seed)
    model = getattr(transformers, case.architecture)(hf_config(case))
    if perturb:
        perturb_(model, seed)
    return model.float().eval()


_session_dir = tempfile.mkdtemp(prefix="fusetrain-parity-")
atexit.register(shutil.rmtree, _session_dir, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def reference_dir(case: Case, seed: int = 0) -> str:
    """A directory holding the case's transformers model as written by save_pretrained."""
    path = os.path.join(_session_dir, f"{case.id}-seed{seed}")
    build_hf_model(case, seed).save_pretrained(path)
    return path


def load_hf(case: Case, path: str) -> torch.nn.Module:
    """Loads a saved directory with the Auto class of the case's head."""
    auto = getattr(transformers, AUTO_CLASSES[case.task])
    model = auto.from_pretrained(path, attn_implementation="eager")
    return model.float().eval()


def fresh_reference_model(case: Case, seed: int = 0) -> torch.nn.Module:
    """The transformers model loaded back from reference_dir (what fusetrain reads)."""
    model = getattr(transformers, case.architecture).from_pretrained(
        reference_dir(case, seed), attn_implementation="eager")
    return model.float().eval()


@functools.lru_cache(maxsize=None)
def reference_model(case: Case, seed: int = 0) -> torch.nn.Module:
    """fresh_reference_model, shared: callers must not change its weights."""
    return fresh_reference_model(case, seed)


def tied_names(model: torch.nn.Module) -> set[str]:
    """State-dict names that transformers does not list in named_parameters():
    the second name of each tied weight (LM decoders)."""
    buffers = {name for name, _ in model.named_buffers()}
    params = {name for name, _ in model.named_parameters()}
    return set(model.state_dict()) - params - buffers


# ----------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------

def make_batch(case: Case, seed: int = 0, padding: bool = True, batch: int = BATCH,
               seq: int = SEQ, labels: bool = True) -> dict[str, np.ndarray]:
    """Inputs (and labels) for the case as numpy arrays. With padding, rows are
    right-padded by PADDING tokens with the pad token and masked out; without, there is
    no attention mask at all."""
    config = hf_config(case)
    rng = np.random.default_rng(seed)
    pad = pad_token_id(case.model_type)
    if padding:
        lengths = [max(1, seq - PADDING[b % len(PADDING)]) for b in range(batch)]
    else:
        lengths = [seq] * batch

    input_ids = rng.integers(FIRST_TEXT_TOKEN, config.vocab_size, size=(batch, seq), dtype=np.int64)
    mask = np.zeros((batch, seq), dtype=np.int64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    input_ids[mask == 0] = pad
    out = {"input_ids": input_ids}
    if padding:
        out["attention_mask"] = mask
    if case.model_type == "bert":
        # Segment A then segment B, as a sentence pair would be.
        token_types = np.zeros((batch, seq), dtype=np.int64)
        for b, n in enumerate(lengths):
            token_types[b, n // 2:n] = 1
        out["token_type_ids"] = token_types
    if not labels:
        return out

    task = case.task
    if task == "mlm":
        chosen = (rng.random((batch, seq)) < 0.35) & (mask == 1)
        chosen[:, 0] = True  # every row has at least one target
        targets = rng.integers(0, config.vocab_size, size=(batch, seq), dtype=np.int64)
        out["labels"] = np.where(chosen, targets, -100)
    elif task == "clm":
        out["labels"] = np.where(mask == 1, input_ids, -100)
    elif task == "token":
        targets = rng.integers(0, config.num_labels, size=(batch, seq), dtype=np.int64)
        out["labels"] = np.where(mask == 1, targets, -100)
    elif task == "qa":
        start = np.array([rng.integers(0, n) for n in lengths], dtype=np.int64)
        end = np.array([rng.integers(s, n) for s, n in zip(start, lengths)], dtype=np.int64)
        out["start_positions"], out["end_positions"] = start, end
    elif task == "sequence":
        if case.problem == "single":
            out["labels"] = rng.integers(0, config.num_labels, size=(batch,), dtype=np.int64)
        elif case.problem == "multi":
            out["labels"] = (rng.random((batch, config.num_labels)) < 0.5).astype(np.float32)
        elif case.problem == "regression":
            out["labels"] = rng.normal(size=(batch,)).astype(np.float32)
    return out


def without_labels(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in batch.items() if k not in ("labels", "start_positions", "end_positions")}


def to_torch(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}


# ----------------------------------------------------------------------------
# Running transformers
# ----------------------------------------------------------------------------

def hf_outputs(model: torch.nn.Module, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray | float]:
    """Forward in transformers: the tensors fusetrain's forward() should return."""
    with torch.no_grad():
        out = model(**to_torch(batch))
    return _outputs_to_numpy(out)


def _outputs_to_numpy(out) -> dict:
    result = {}
    for key in ("logits", "start_logits", "end_logits", "last_hidden_state", "pooler_output"):
        value = getattr(out, key, None)
        if value is not None:
            result[key] = value.detach().numpy().copy()
    if getattr(out, "loss", None) is not None:
        result["loss"] = out.loss.item()
    return result


def hf_loss_and_grads(model: torch.nn.Module, batch: dict[str, np.ndarray]
                      ) -> tuple[float, dict[str, np.ndarray | None]]:
    """loss.backward() in transformers: the loss and the gradient of every
    parameter under its named_parameters() name (None when unused)."""
    model.zero_grad(set_to_none=True)
    out = model(**to_torch(batch))
    out.loss.backward()
    grads = {name: (None if p.grad is None else p.grad.detach().numpy().copy())
             for name, p in model.named_parameters()}
    return out.loss.item(), grads


def hf_state_dict(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Parameters as numpy, under every name transformers' state_dict() uses."""
    return {name: t.detach().float().numpy().copy() for name, t in model.state_dict().items()
            if t.is_floating_point()}


# ----------------------------------------------------------------------------
# Running fusetrain
# ----------------------------------------------------------------------------

def fusetrain_module():
    import fusetrain  # imported lazily so the transformers side runs without the module
    return fusetrain


def ft_from_reference(case: Case, seed: int = 0):
    return fusetrain_module().Model.from_pretrained(reference_dir(case, seed))


def ft_hidden_state(outputs: dict) -> np.ndarray:
    """The last hidden state of a bare model: fusetrain may name it like transformers
    (last_hidden_state) or return it as the bare model's logits."""
    for key in ("last_hidden_state", "hidden_states", "logits"):
        if key in outputs:
            return np.asarray(outputs[key])
    raise AssertionError(f"fusetrain returned none of the hidden-state keys: {sorted(outputs)}")


# ----------------------------------------------------------------------------
# Comparisons
# ----------------------------------------------------------------------------

def assert_logits_match(case: Case, ft_out: dict, hf_out: dict, rtol=LOGITS_RTOL, atol=LOGITS_ATOL,
                        mask: np.ndarray | None = None):
    """Compares the outputs a head produces (logits; start/end logits for QA; the last
    hidden state for the bare model). Padded positions are compared too: transformers
    defines them. With the attention mask, a failure says whether only they differ."""
    if case.task == "base":
        pairs = [("last_hidden_state", ft_hidden_state(ft_out), hf_out["last_hidden_state"])]
        if "pooler_output" in ft_out and "pooler_output" in hf_out:
            pairs.append(("pooler_output", np.asarray(ft_out["pooler_output"]), hf_out["pooler_output"]))
    elif case.task == "qa":
        pairs = [(k, np.asarray(ft_out[k]), hf_out[k]) for k in ("start_logits", "end_logits")]
    else:
        pairs = [("logits", np.asarray(ft_out["logits"]), hf_out["logits"])]
    for key, got, want in pairs:
        assert got.shape == want.shape, f"{case.id} {key}: shape {got.shape}, transformers {want.shape}"
        where = ""
        bad = ~np.isclose(got, want, rtol=rtol, atol=atol)
        if bad.any() and mask is not None and got.shape[:2] == mask.shape:
            bad_tokens = bad.reshape(mask.shape + (-1,)).any(axis=-1)
            where = (f"; {int(bad_tokens[mask == 1].sum())} real and "
                     f"{int(bad_tokens[mask == 0].sum())} padded positions differ")
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol,
                                   err_msg=f"{case.id} {key} (max |want| {np.abs(want).max():.3g}{where})")


def assert_loss_matches(got: float, want: float, what: str, rtol=LOSS_RTOL):
    assert np.isfinite(got), f"{what}: fusetrain loss {got}"
    assert abs(got - want) <= rtol * abs(want), (
        f"{what}: fusetrain loss {got!r}, transformers {want!r}, "
        f"relative error {abs(got - want) / abs(want):.3g} > {rtol}")


def grad_errors(ft_grads: dict[str, np.ndarray], hf_grads: dict[str, np.ndarray | None],
                rtol: float = GRAD_RTOL) -> list[str]:
    """Norm-wise comparison of every parameter gradient: ‖g_ft − g_hf‖ / ‖g_hf‖ < rtol.
    A gradient transformers reports as None or (numerically) zero must be ~0 in
    fusetrain too; "numerically zero" is relative to the largest gradient, since some
    gradients vanish only mathematically (the attention key bias: softmax ignores a
    shift shared by all keys)."""
    norms = [np.linalg.norm(g) for g in hf_grads.values() if g is not None]
    scale = max(norms) if norms else 1.0
    zero = 1e-6 * scale
    errors = []
    for name, want in hf_grads.items():
        if name not in ft_grads:
            errors.append(f"{name}: no gradient from fusetrain")
            continue
        got = np.asarray(ft_grads[name], dtype=np.float64)
        if want is None:
            want = np.zeros_like(got)
        want = want.astype(np.float64)
        if got.shape != want.shape:
            errors.append(f"{name}: shape {got.shape}, transformers {want.shape}")
            continue
        want_norm = np.linalg.norm(want)
        diff = np.linalg.norm(got - want)
        if want_norm <= zero:
            if np.linalg.norm(got) > 10 * zero:
                errors.append(f"{name}: transformers gradient ~0 (norm {want_norm:.3g}), "
                              f"fusetrain norm {np.linalg.norm(got):.3g}")
        elif diff > rtol * want_norm:
            errors.append(f"{name}: relative error {diff / want_norm:.3g} "
                          f"(norm {want_norm:.3g}, fusetrain norm {np.linalg.norm(got):.3g})")
    return errors


def assert_grads_match(case_id: str, ft_grads: dict, hf_grads: dict, allowed_extra: set[str],
                       rtol: float = GRAD_RTOL):
    extra = set(ft_grads) - set(hf_grads) - allowed_extra
    errors = grad_errors(ft_grads, hf_grads, rtol)
    if extra:
        errors.append(f"fusetrain gradients under names transformers does not have: {sorted(extra)}")
    assert not errors, f"{case_id}: {len(errors)} gradient mismatches:\n  " + "\n  ".join(errors)


# ----------------------------------------------------------------------------
# The checks every architecture runs
# ----------------------------------------------------------------------------

def check_logits(case: Case, padding: bool = True, seed: int = 0):
    """fusetrain's forward (no labels) gives transformers' outputs."""
    batch = without_labels(make_batch(case, seed=seed, padding=padding))
    hf_out = hf_outputs(reference_model(case), batch)
    ft_out = ft_from_reference(case).forward(**batch)
    assert "loss" not in ft_out or ft_out["loss"] is None, f"{case.id}: a loss without labels"
    assert_logits_match(case, ft_out, hf_out, mask=batch.get("attention_mask"))


def check_loss_and_grads(case: Case, padding: bool = True, seed: int = 0):
    """forward() with labels gives transformers' loss and logits; loss_and_grads()
    gives the same loss and every parameter's gradient as loss.backward()."""
    batch = make_batch(case, seed=seed, padding=padding)
    hf_model = reference_model(case)
    hf_out = hf_outputs(hf_model, batch)
    hf_loss, hf_grads = hf_loss_and_grads(hf_model, batch)

    ft_model = ft_from_reference(case)
    ft_out = ft_model.forward(**batch)
    assert "loss" in ft_out, f"{case.id}: forward() with labels returned no loss ({sorted(ft_out)})"
    assert_loss_matches(float(ft_out["loss"]), hf_out["loss"], f"{case.id} forward")
    assert_logits_match(case, ft_out, hf_out, mask=batch.get("attention_mask"))

    ft_loss, ft_grads = ft_model.loss_and_grads(**batch)
    assert_loss_matches(float(ft_loss), hf_loss, f"{case.id} loss_and_grads")
    ft_grads = {name: np.array(g, dtype=np.float32, copy=True) for name, g in ft_grads.items()}
    assert_grads_match(case.id, ft_grads, hf_grads, allowed_extra=tied_names(hf_model))


def check_variant(case: Case):
    """A config variant: refused with a ValueError naming the key (where allowed), or
    the same logits, loss and gradients as transformers."""
    variant = VARIANTS[case.variant]
    try:
        ft_from_reference(case)
    except ValueError as error:
        keys = [key for key, _ in variant.overrides]
        assert variant.may_refuse, f"{case.id}: fusetrain refuses {keys}: {error}"
        assert any(key in str(error) for key in keys), f"{case.id}: the error should name {keys}: {error}"
        return
    check_logits(case, padding=True)
    if case.task != "base":
        check_loss_and_grads(case)
