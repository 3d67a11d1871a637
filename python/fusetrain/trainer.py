"""`fusetrain.Trainer`: transformers' `Trainer` API over fusetrain's engine.

    from fusetrain import Trainer, TrainingArguments      # the only line that changes

    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=dev,
                      processing_class=tokenizer, compute_metrics=compute_metrics)
    trainer.train()
    trainer.evaluate()
    model.save_pretrained("out")                          # the trained weights are in `model`

The loop (gradient accumulation, schedules, clipping, evaluation, checkpoints, resume,
mixed precision) is the engine's, the same the `fusetrain` CLI runs. `model` may be a
transformers model object of a supported class, whose config and weights are taken in
and into which the trained weights are written back when training ends; a model
directory; or a `fusetrain.Model`. Callbacks follow transformers' `TrainerCallback`
hooks and receive transformers' `TrainerState` and `TrainerControl`.

Without a `data_collator` the engine's own collator pads each batch (to a multiple of 8
tokens) and, for masked LM, masks it: the fast path. transformers' padding collators
(`DataCollatorWithPadding`, `DataCollatorForTokenClassification`,
`default_data_collator`) compute the same batches up to padding and take that path too;
any other collator is called from the engine's loader thread for every batch.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from transformers.trainer_callback import PrinterCallback, ProgressCallback, TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_utils import BestRun, EvalPrediction, PredictionOutput, TrainOutput, default_compute_objective
from transformers.trainer_utils import default_hp_space_optuna, get_last_checkpoint

from fusetrain import _core, data
from fusetrain._core import Model
from fusetrain.training_args import TrainingArguments

# The dataset labels data.to_engine converts; heads that train on others (question answering's spans) are left
# to the CLI.
_CONVERTED_LABELS = frozenset(data.LABEL_KINDS)
# transformers collators whose batches equal the engine's own up to padding.
_PADDING_COLLATORS = ("DataCollatorWithPadding", "DataCollatorForTokenClassification", "default_data_collator",
                      "DefaultDataCollator")
_EVENTS = ("on_train_begin", "on_epoch_begin", "on_step_begin", "on_step_end", "on_epoch_end", "on_log",
           "on_evaluate", "on_save", "on_train_end")


def _trainable(row: dict) -> bool:
    return bool(row["task"]) and set(row["label_kinds"]) <= _CONVERTED_LABELS


def supported_trainer_classes() -> list[str]:
    """The transformers model classes fusetrain.Trainer trains (rows of fusetrain.architectures())."""
    return [row["architecture"] for row in _core.architectures() if _trainable(row)]


def _registry_row(architecture: str) -> dict | None:
    return next((row for row in _core.architectures() if row["architecture"] == architecture), None)


def _task_of(architecture: str) -> str:
    row = _registry_row(architecture)
    if row is not None and _trainable(row):
        return row["task"]
    raise TypeError(
        f"fusetrain.Trainer cannot train a {architecture}; supported model classes: "
        + ", ".join(supported_trainer_classes())
    )


def engine_model(model: Any) -> Model:
    """A fusetrain.Model from a transformers model object, a model directory or a fusetrain.Model."""
    if isinstance(model, Model):
        return model
    if isinstance(model, (str, os.PathLike)):
        return Model.from_pretrained(os.fspath(model))
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "state_dict"):
        raise TypeError(
            "model must be a transformers model object, a model directory or a fusetrain.Model; got "
            f"{type(model).__name__}"
        )
    architecture = type(model).__name__
    if _registry_row(architecture) is None:
        raise TypeError(
            f"fusetrain does not implement {architecture}; supported model classes: "
            + ", ".join(supported_trainer_classes())
        )
    config_dict = config.to_dict()
    config_dict["architectures"] = [architecture]
    out = Model.from_config(config_dict, architecture=architecture)
    out.load_state_dict(_engine_weights(model, out), strict=True)
    return out


def _engine_weights(hf_model: Any, model: Model) -> dict[str, Any]:
    """The transformers model's tensors under the engine's names (buffers such as position_ids left out)."""
    wanted = set(model.state_dict_names())
    return {k: v for k, v in hf_model.state_dict().items() if k in wanted}


def write_back(model: Model, hf_model: Any) -> None:
    """Copies the engine model's weights into the transformers model object, in place."""
    import torch

    weights = model.state_dict()
    with torch.no_grad():
        params = hf_model.state_dict(keep_vars=True)
        for name, value in weights.items():
            target = params.get(name)
            if target is None:
                raise ValueError(f"the transformers model has no parameter {name!r} to write back")
            target.copy_(torch.from_numpy(value).to(target.dtype))


class Trainer:
    """transformers' Trainer API, run by fusetrain's engine.

    Args:
        model: a transformers model of a supported class (its weights are taken in, and the trained weights are
            written back into it), a model directory, or a fusetrain.Model. Optional when model_init is given.
        args: fusetrain.TrainingArguments, or transformers.TrainingArguments (converted with from_hf).
        data_collator: a transformers collator; None uses the engine's collator (dynamic padding, MLM masking).
        train_dataset, eval_dataset: datasets.Dataset, a list of dicts, or a map-style dataset, tokenized
            (input_ids, optional attention_mask / token_type_ids, labels under labels / label); untokenized text
            columns are tokenized when processing_class (or tokenizer) is given.
        processing_class, tokenizer: the tokenizer, for padding ids, MLM masking, and saving beside the model.
        model_init: a function returning a fresh model (optionally taking the optuna trial); needed by
            hyperparameter_search.
        compute_metrics: a function of a transformers EvalPrediction returning a dict of numbers.
        callbacks: transformers TrainerCallback instances or classes.
    """

    def __init__(
        self,
        model: Any = None,
        args: TrainingArguments | Any = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable | None = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable[[EvalPrediction], dict[str, float]] | None = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: Any = None,
        preprocess_logits_for_metrics: Callable | None = None,
        tokenizer: Any = None,
    ) -> None:
        unsupported = [
            name
            for name, value in (
                ("compute_loss_func", compute_loss_func),
                ("optimizers", None if tuple(optimizers) == (None, None) else optimizers),
                ("optimizer_cls_and_kwargs", optimizer_cls_and_kwargs),
                ("preprocess_logits_for_metrics", preprocess_logits_for_metrics),
            )
            if value is not None
        ]
        if unsupported:
            raise ValueError(
                "fusetrain.Trainer does not take " + ", ".join(unsupported) + ": the engine runs its own loss and "
                "fused AdamW (set learning_rate, weight_decay, adam_* and lr_scheduler_type in TrainingArguments)"
            )
        if args is None:
            args = TrainingArguments()
        elif not isinstance(args, TrainingArguments):
            args = TrainingArguments.from_hf(args)
        self.args = args
        self.processing_class = processing_class if processing_class is not None else tokenizer
        self.model_init = model_init
        if model is None:
            if model_init is None:
                raise ValueError("Trainer needs a model or a model_init function")
            model = self._call_model_init(None)
        self.model = model
        self._model = engine_model(model)
        self._hf_model = None if isinstance(model, (Model, str, os.PathLike)) else model
        self.task = _task_of(self._model.architecture)
        row = _registry_row(self._model.architecture)
        self._language_model = row["language_model"]
        self._token_labels = "token_classes" in row["label_kinds"]  # one label per token: rows scattered back
        if isinstance(eval_dataset, dict):
            raise ValueError("eval_dataset must be one dataset; fusetrain.Trainer does not take a dict of datasets")
        self.data_collator = data_collator
        self.train_dataset = data.tokenize_if_needed(train_dataset, self.processing_class, "train_dataset")
        self.eval_dataset = data.tokenize_if_needed(eval_dataset, self.processing_class, "eval_dataset")
        self.compute_metrics = compute_metrics
        if compute_metrics is not None and self._language_model:
            raise ValueError(
                "compute_metrics is not supported for language modelling: fusetrain reports eval_loss and "
                "eval_perplexity"
            )
        self.callbacks: list[TrainerCallback] = []
        self.add_callback(PrinterCallback if self.args.disable_tqdm else ProgressCallback)
        for callback in callbacks or []:
            self.add_callback(callback)
        self.state = TrainerState()
        self.control = TrainerControl()
        self._engine_train = self._convert(self.train_dataset, "train_dataset")
        self._engine_eval = self._convert(self.eval_dataset, "eval_dataset")
        self._engine: Any = None

    # ------------------------------------------------------------ callbacks

    def add_callback(self, callback: Any) -> None:
        """Adds a TrainerCallback instance, or an instance of a TrainerCallback class."""
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def pop_callback(self, callback: Any) -> Any:
        """Removes and returns the first callback equal to `callback` (or of that class)."""
        for i, cb in enumerate(self.callbacks):
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                return self.callbacks.pop(i)
        return None

    def remove_callback(self, callback: Any) -> None:
        """Removes the first callback equal to `callback` (or of that class)."""
        self.pop_callback(callback)

    def _dispatch(self, event: str, state: dict, control: dict, payload: Any) -> dict:
        s = self._apply_state(state)
        c = self.control
        for flag, value in control.items():
            setattr(c, flag, value)
        kwargs: dict[str, Any] = {}
        if event == "on_log":
            s.log_history.append(dict(payload))
            kwargs["logs"] = {k: v for k, v in payload.items() if k != "step"}
        elif event == "on_evaluate":
            kwargs["metrics"] = payload
        elif event == "on_save" and self.processing_class is not None:
            self.processing_class.save_pretrained(payload)
        if self._hf_model is not None and event in ("on_evaluate", "on_save", "on_train_end"):
            write_back(self._model, self._hf_model)  # callbacks given `model` see the weights just evaluated / saved
        for callback in self.callbacks:
            result = getattr(callback, event)(
                self.args, s, c, model=self.model, processing_class=self.processing_class, optimizer=None,
                lr_scheduler=None, train_dataloader=None, eval_dataloader=None, **kwargs,
            )
            if result is not None:
                c = result
        self.control = c
        return {flag: getattr(c, flag) for flag in control}

    # ------------------------------------------------------------ data

    def _convert(self, dataset: Any, name: str) -> Any:
        if dataset is None:
            return None
        config = self._model.config
        return data.to_engine(
            dataset,
            task=self.task,
            num_labels=int(config.get("num_labels") or len(config.get("id2label") or {}) or 2),
            vocab_size=int(config["vocab_size"]),
            problem_type=config.get("problem_type"),
            name=name,
        )

    def _pad_id(self) -> int:
        tokenizer_pad = getattr(self.processing_class, "pad_token_id", None)
        if tokenizer_pad is not None:
            return int(tokenizer_pad)
        return int(self._model.config.get("pad_token_id") or 0)

    def _mlm_spec(self) -> dict | None:
        if self.task != "mlm":
            return None
        tokenizer = self.processing_class
        mask_id = getattr(tokenizer, "mask_token_id", None)
        if mask_id is None:
            raise ValueError("masked-LM training needs processing_class=<a tokenizer with a mask token>")
        probability = 0.15
        collator = self.data_collator
        if collator is not None and type(collator).__name__ == "DataCollatorForLanguageModeling":
            probability = float(collator.mlm_probability)
        return {
            "mask_id": int(mask_id),
            "vocab_size": int(self._model.config["vocab_size"]),
            "special_ids": [int(i) for i in tokenizer.all_special_ids],
            "probability": probability,
        }

    def _uses_python_collator(self) -> bool:
        collator = self.data_collator
        if collator is None:
            return False
        name = getattr(collator, "__name__", None) or type(collator).__name__
        if name in _PADDING_COLLATORS:
            return False
        # transformers' MLM collator with its standard 80/10/10 split is the engine's masking.
        if name == "DataCollatorForLanguageModeling" and self.task == "mlm":
            standard = getattr(collator, "mask_replace_prob", 0.8) == 0.8 and getattr(
                collator, "random_replace_prob", 0.1) == 0.1
            return not (getattr(collator, "mlm", True) and standard)
        return True

    def _make_engine(self, engine_args: dict) -> Any:
        engine = _core._Trainer(self._model, engine_args, self.task, self._engine_train, self._engine_eval,
                                self._pad_id(), self._mlm_spec())
        engine.set_callbacks(self._dispatch)
        # Without compute_metrics transformers reports the loss alone (and hyperparameter_search's default
        # objective is then the loss), so the engine's built-in accuracy / F1 are left out too; language models
        # keep their perplexity.
        if self.compute_metrics is not None:
            engine.set_compute_metrics(self._metrics_hook)
        elif not self._language_model:
            engine.set_compute_metrics(lambda predictions: {})
        if self._uses_python_collator():
            engine.set_collate(self._collate_hook())
        return engine

    def _collate_hook(self) -> Callable[[np.ndarray, bool], dict]:
        rows = {True: data.model_rows(self.train_dataset) if self.train_dataset is not None else None,
                False: data.model_rows(self.eval_dataset) if self.eval_dataset is not None else None}
        collator, pad_id = self.data_collator, self._pad_id()

        def collate(indices: np.ndarray, training: bool) -> dict:
            return data.pad_batch(collator(rows[training](indices)), pad_id)

        return collate

    def _engine_args(self, **overrides: Any) -> dict:
        engine_args = self.args.engine_dict()
        engine_args["disable_tqdm"] = True  # the bars are transformers' ProgressCallback
        engine_args.update(overrides)
        return engine_args

    def _get_engine(self) -> Any:
        if self._engine is None:
            self._engine = self._make_engine(self._engine_args(resume_from_checkpoint=None))
        return self._engine

    # ------------------------------------------------------------ metrics

    def _eval_prediction(self, predictions: dict, dataset: Any) -> EvalPrediction:
        logits, labels = predictions["logits"], predictions.get("labels", predictions.get("float_labels"))
        if self._token_labels:
            logits, labels = data.scatter_token_rows(logits, dataset.lengths(), dataset.token_labels())
        elif labels is not None and "float_labels" in predictions:
            labels = labels.astype(np.float32)
        return EvalPrediction(predictions=logits, label_ids=labels)

    def _metrics_hook(self, predictions: dict) -> dict:
        dataset = self._metrics_dataset
        result = self.compute_metrics(self._eval_prediction(predictions, dataset))
        if not isinstance(result, dict):
            raise TypeError(f"compute_metrics must return a dict of numbers; it returned a {type(result).__name__}")
        return result

    # ------------------------------------------------------------ API

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any) -> TrainOutput:
        """Trains the model; with resume_from_checkpoint (a checkpoint directory, or True for the last one in
        output_dir) continues that run exactly. Returns transformers' TrainOutput."""
        if kwargs:
            raise ValueError(f"train() got unexpected arguments: {', '.join(sorted(kwargs))}")
        if self._engine_train is None:
            raise ValueError("train() needs a train_dataset")
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"resume_from_checkpoint=True but {self.args.output_dir} holds no checkpoint")
        elif resume_from_checkpoint is False:
            resume_from_checkpoint = None
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self.args.resume_from_checkpoint
        self.state = TrainerState(
            logging_steps=int(self.args.logging_steps), save_steps=int(self.args.save_steps),
            train_batch_size=self.args.per_device_train_batch_size, num_train_epochs=self.args.num_train_epochs,
            is_hyper_param_search=trial is not None,
        )
        self.control = TrainerControl()
        self._engine = self._make_engine(
            self._engine_args(resume_from_checkpoint=os.fspath(resume_from_checkpoint) if resume_from_checkpoint
                              else None))
        self._metrics_dataset = self._engine_eval
        metrics = self._engine.train()  # on_train_end wrote the weights back into a transformers model
        self._sync_state()
        return TrainOutput(self.state.global_step, metrics.get("train_loss", 0.0), metrics)

    def _apply_state(self, state: dict) -> TrainerState:
        """Copies the engine's state (a dict; log_history when it carries one) into self.state."""
        s = self.state
        s.global_step, s.epoch, s.max_steps = state["global_step"], state["epoch"], state["max_steps"]
        s.best_metric, s.best_model_checkpoint = state["best_metric"], state["best_model_checkpoint"]
        if "log_history" in state:
            s.log_history = state["log_history"]
        return s

    def _sync_state(self) -> None:
        self._apply_state(self._engine.state)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss and metrics on eval_dataset (default: the Trainer's), keys prefixed `metric_key_prefix`_."""
        dataset = self._engine_eval if eval_dataset is None else self._convert(
            data.tokenize_if_needed(eval_dataset, self.processing_class, "eval_dataset"), "eval_dataset")
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset")
        if eval_dataset is not None and self._uses_python_collator():
            raise ValueError("evaluate(eval_dataset=...) with a custom data_collator: pass the dataset to the Trainer")
        engine = self._get_engine()
        self._metrics_dataset = dataset
        metrics = engine.evaluate(dataset)
        self._sync_state()
        if self.state.epoch:
            metrics["epoch"] = self.state.epoch
        if metric_key_prefix != "eval":
            metrics = {f"{metric_key_prefix}_{k[5:]}" if k.startswith("eval_") else k: v for k, v in metrics.items()}
        return metrics

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> PredictionOutput:
        """Predictions (logits), label ids (when the dataset has labels) and metrics over test_dataset."""
        dataset = self._convert(data.tokenize_if_needed(test_dataset, self.processing_class, "test_dataset"),
                                "test_dataset")
        engine = self._get_engine()
        self._metrics_dataset = dataset
        started = time.perf_counter()
        out = engine.predict(dataset)
        runtime = time.perf_counter() - started
        if self._language_model:
            raise ValueError("predict() returns logits for classification models; for language models use "
                             "evaluate() (loss and perplexity)")
        prediction = self._eval_prediction(out, dataset)
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in out["metrics"].items()}
        metrics[f"{metric_key_prefix}_runtime"] = runtime
        metrics[f"{metric_key_prefix}_samples_per_second"] = len(dataset) / max(runtime, 1e-9)
        return PredictionOutput(predictions=prediction.predictions, label_ids=prediction.label_ids, metrics=metrics)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Writes the model (config.json + model.safetensors) and the tokenizer to output_dir (default: args')."""
        output_dir = os.fspath(output_dir or self.args.output_dir)
        os.makedirs(output_dir, exist_ok=True)
        if self._hf_model is not None:
            write_back(self._model, self._hf_model)
            self._hf_model.save_pretrained(output_dir)
        else:
            self._model.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    def is_world_process_zero(self) -> bool:
        """True: fusetrain.Trainer runs in one process."""
        return True

    def is_local_process_zero(self) -> bool:
        """True: fusetrain.Trainer runs in one process."""
        return True

    def log_metrics(self, split: str, metrics: dict[str, float]) -> None:
        """Prints metrics as transformers' Trainer.log_metrics does."""
        print(f"***** {split} metrics *****")
        width = max((len(k) for k in metrics), default=0)
        for key in sorted(metrics):
            print(f"  {key: <{width}} = {metrics[key]:>.4g}" if isinstance(metrics[key], float)
                  else f"  {key: <{width}} = {metrics[key]}")

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        """Writes output_dir/<split>_results.json and, with combined, merges the metrics into all_results.json."""
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, f"{split}_results.json"), "w") as f:
            json.dump(metrics, f, indent=4, sort_keys=True)
        if combined:
            path = os.path.join(self.args.output_dir, "all_results.json")
            merged = json.load(open(path)) if os.path.exists(path) else {}
            merged.update(metrics)
            with open(path, "w") as f:
                json.dump(merged, f, indent=4, sort_keys=True)

    def save_state(self) -> None:
        """Writes output_dir/trainer_state.json (transformers' TrainerState)."""
        os.makedirs(self.args.output_dir, exist_ok=True)
        self.state.save_to_json(os.path.join(self.args.output_dir, "trainer_state.json"))

    def hyperparameter_search(
        self,
        hp_space: Callable[[Any], dict[str, Any]] | None = None,
        compute_objective: Callable[[dict[str, float]], float] | None = None,
        n_trials: int = 20,
        direction: str | list[str] = "minimize",
        backend: str | None = None,
        hp_name: Callable[[Any], str] | None = None,
        **kwargs: Any,
    ) -> BestRun:
        """Searches hyperparameters with optuna: each trial builds a fresh model with model_init, trains with the
        TrainingArguments fields hp_space(trial) returns, evaluates, and scores compute_objective(metrics)
        (default: eval_loss, or the sum of the other metrics). Returns transformers' BestRun."""
        if backend not in (None, "optuna"):
            raise ValueError(f"fusetrain.Trainer.hyperparameter_search supports backend='optuna'; got {backend!r}")
        if self.model_init is None:
            raise ValueError("hyperparameter_search needs the Trainer to be given model_init (a fresh model per trial)")
        if self._engine_eval is None:
            raise ValueError("hyperparameter_search needs an eval_dataset")
        import optuna

        hp_space = hp_space or default_hp_space_optuna
        compute_objective = compute_objective or default_compute_objective
        fields = {f.name for f in dataclasses.fields(TrainingArguments)}

        def objective(trial: Any) -> float:
            params = hp_space(trial)
            unknown = sorted(set(params) - fields)
            if unknown:
                raise ValueError(f"hp_space returned fields TrainingArguments does not have: {', '.join(unknown)}")
            run_name = hp_name(trial) if hp_name else f"run-{trial.number}"
            args = dataclasses.replace(self.args, output_dir=os.path.join(self.args.output_dir, run_name), **params)
            trainer = Trainer(
                model=self._call_model_init(trial), args=args, data_collator=self.data_collator,
                train_dataset=self.train_dataset, eval_dataset=self.eval_dataset,
                processing_class=self.processing_class, compute_metrics=self.compute_metrics,
                callbacks=[cb for cb in self.callbacks if not isinstance(cb, (ProgressCallback, PrinterCallback))],
            )
            trainer.train(trial=trial)
            metrics = trainer.evaluate()
            trial.set_user_attr("metrics", metrics)
            return compute_objective(metrics)

        study_args = {k: kwargs.pop(k) for k in ("sampler", "pruner", "study_name", "storage") if k in kwargs}
        if isinstance(direction, list):
            study = optuna.create_study(directions=direction, **study_args)
        else:
            study = optuna.create_study(direction=direction, **study_args)
        study.optimize(objective, n_trials=n_trials, **kwargs)
        if isinstance(direction, list):
            return [BestRun(str(t.number), t.values, t.params, t.user_attrs.get("metrics")) for t in study.best_trials]
        best = study.best_trial
        return BestRun(str(best.number), best.value, best.params, best.user_attrs.get("metrics"))

    def _call_model_init(self, trial: Any) -> Any:
        parameters = inspect.signature(self.model_init).parameters
        model = self.model_init(trial) if len(parameters) >= 1 else self.model_init()
        if model is None:
            raise ValueError("model_init returned None")
        return model
