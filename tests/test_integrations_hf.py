"""``FxDebugTrainerCallback`` under a real ``transformers.Trainer`` on a tiny GPT-2 (no downloads).

The Trainer adds ``num_items_in_batch`` to every call, evaluates in eval mode between steps and
saves the model: the callback must count those calls, never recurse, keep ``trainer.model`` the
user's object with its own keys, log capped ``fxdebug/`` keys where trackers see them, and stop
at the step where a planted overflow makes the first NaN/Inf, naming its module.
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

import fxdebug

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from fxdebug.integrations.hf import FxDebugTrainerCallback  # noqa: E402

BAD_MODULE = "transformer.h.1.mlp.c_fc"


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 100, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Tracker(transformers.TrainerCallback):  # type: ignore[misc]
    """Stands for a report_to tracker: the Trainer runs those before user callbacks, so this one
    is listed before fxdebug's and sees ``logs`` exactly when a tracker would."""

    def __init__(self) -> None:
        self.seen: list[dict[str, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        self.seen.append(dict(logs or {}))


class Overflow(transformers.TrainerCallback):  # type: ignore[misc]
    """After step ``at``, the MLP's input projection of block 1 overflows float32 on the next forward."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.at:
            with torch.no_grad():
                model.get_submodule(BAD_MODULE).weight.fill_(3e38)


def trainer(model: torch.nn.Module, tmp_path, callbacks: list, **args) -> transformers.Trainer:  # type: ignore[no-untyped-def]
    options = dict(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=6,
                   per_device_train_batch_size=4, per_device_eval_batch_size=4, logging_steps=1,
                   save_strategy="no", disable_tqdm=True)
    options.update(args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        targs = transformers.TrainingArguments(**options)
        return transformers.Trainer(model=model, args=targs, train_dataset=Tokens(), eval_dataset=Tokens(),
                                    callbacks=callbacks)


def _per_node(logs: dict[str, float]) -> list[str]:
    return [k for k in logs if k.startswith("fxdebug/") and k.count("/") >= 3]


def test_trainer_logs_capped_keys_and_stops_at_the_planted_overflow(tmp_path):
    model = gpt2()
    keys = list(model.state_dict())
    tracker, cb = Tracker(), FxDebugTrainerCallback(top_k=5)
    tr = trainer(model, tmp_path, [tracker, Overflow(at=2), cb], eval_strategy="steps", eval_steps=2)
    with pytest.warns(RuntimeWarning, match=rf"NaN/Inf at step 3, first at .*module {BAD_MODULE}"):
        tr.train()

    # stopped at the bad step, not at max_steps; the origin is the overflowing projection
    assert tr.state.global_step == 3 and cb.nonfinite_step == 3
    report = cb.report
    assert report.row(report.first_nonfinite)["module"] == BAD_MODULE
    assert report.calls >= 1  # the Trainer's calls (with num_items_in_batch) are counted
    assert cb.session.calls == 3  # one training forward per step; evaluation ran the plain model

    # the Trainer's model is still the user's object, restored, with its own keys
    assert tr.model is model and type(model) is transformers.GPT2LMHeadModel
    assert "forward" not in model.__dict__
    assert list(model.state_dict()) == keys
    tr.save_model(str(tmp_path / "saved"))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert set(saved) <= set(keys) and "transformer.h.1.mlp.c_fc.weight" in saved

    # every step logged fxdebug keys through Trainer.log: in log_history and seen by the tracker
    ours = [e for e in tr.state.log_history if "fxdebug/calls" in e]
    assert [e["step"] for e in ours] == [1, 2, 3]
    assert all(len(_per_node(e)) <= 5 for e in ours) and all(len(_per_node(e)) == 5 for e in ours)
    assert all(isinstance(v, float) for e in ours for k, v in e.items() if k.startswith("fxdebug/"))
    seen = [e for e in tracker.seen if "fxdebug/calls" in e]
    assert len(seen) == 3
    last = seen[-1]
    assert last["fxdebug/ok"] == 0.0 and last["fxdebug/nonfinite_nodes"] >= 1
    # the non-finite nodes come first, the origin before the rest
    first_key = _per_node(last)[0]
    assert first_key.startswith("fxdebug/transformer/h/1/mlp/c_fc/") and first_key.endswith("/nonfinite_calls")
    assert any(k.startswith("eval_loss") for e in tracker.seen for k in e)  # evaluation ran, without recursion


def test_options_are_checked():
    with pytest.raises(fxdebug.UsageError, match="on_nonfinite"):
        FxDebugTrainerCallback(on_nonfinite="explode")
    with pytest.raises(fxdebug.UsageError, match="every"):
        FxDebugTrainerCallback(every=0)
    with pytest.raises(fxdebug.UsageError, match="top_k"):
        FxDebugTrainerCallback(top_k=-1)
