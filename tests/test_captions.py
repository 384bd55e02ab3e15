"""adaptive_load.caption_dropout (train/captions.py): the choice is a function of (seed, epoch, sample id) near the
share p, both micro-batch forms get the empty prompt's embedding in the dropped rows only, a missing embedding file
is a user error naming it, and the schema checks the range."""
import pytest
import torch

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.train.captions import apply, dropped, load_empty_prompt
from ds_adaptiveload.train.config import AdaptiveLoadConfig


def test_the_choice_follows_seed_epoch_and_id_at_the_share_p():
    ids = [f"clip{i}.mp4" for i in range(4000)]
    chosen = [dropped(0, 0, i, 0.1) for i in ids]
    assert 0.08 < sum(chosen) / len(ids) < 0.12
    assert chosen == [dropped(0, 0, i, 0.1) for i in ids]  # a resume, another rank: the same
    assert chosen != [dropped(0, 1, i, 0.1) for i in ids]  # another epoch drops others
    assert chosen != [dropped(1, 0, i, 0.1) for i in ids]
    assert not any(dropped(0, 0, i, 0.0) for i in ids) and all(dropped(0, 0, i, 1.0) for i in ids)


def test_apply_replaces_only_the_dropped_rows_in_both_batch_forms():
    empty = torch.full((2, 4), 7.0)
    ids = [f"s{i}" for i in range(40)]
    want = [dropped(3, 0, i, 0.5) for i in ids]
    assert 5 < sum(want) < 35
    stacked = {"ids": ids, "text": torch.ones(40, 6, 4)}
    assert apply(stacked, empty, 3, 0, 0.5) == sum(want)
    for b, w in enumerate(want):
        row = stacked["text"][b]
        if w:
            assert torch.equal(row[:2], empty) and not row[2:].any()
        else:
            assert torch.equal(row, torch.ones(6, 4))
    packed = {"ids": ids, "text": [torch.ones(3, 4, dtype=torch.bfloat16) for _ in ids]}
    apply(packed, empty, 3, 0, 0.5)
    for t, w in zip(packed["text"], want):
        assert t.dtype == torch.bfloat16 and torch.equal(t.float(), empty if w else torch.ones(3, 4))


def test_missing_or_wrong_empty_prompt_file_is_named(tmp_path):
    from safetensors.torch import save_file

    manifest = tmp_path / "manifest.jsonl"
    with pytest.raises(UserError, match=r"caption_dropout needs .*empty_prompt.safetensors.*encode"):
        load_empty_prompt(str(manifest), 4)
    save_file({"text": torch.zeros(1, 5)}, str(tmp_path / "empty_prompt.safetensors"))
    with pytest.raises(UserError, match=r"empty_prompt.safetensors: tensor 'text' has shape \[1, 5\].*\[L, 4\]"):
        load_empty_prompt(str(manifest), 4)
    assert load_empty_prompt(str(manifest), 5).shape == (1, 5)


def test_the_schema_checks_caption_dropout_and_ema_decay():
    cfg = AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "caption_dropout": 0.1, "ema_decay": 0.999}, "ds.json")
    assert cfg.caption_dropout == 0.1 and cfg.ema_decay == 0.999
    assert AdaptiveLoadConfig.from_dict({"profile": "p.yaml"}, "ds.json").ema_decay is None
    with pytest.raises(UserError, match=r"ds.json: adaptive_load.caption_dropout must be a number in \[0, 1\], got 1.5"):
        AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "caption_dropout": 1.5}, "ds.json")
    with pytest.raises(UserError, match=r"adaptive_load.ema_decay must be a number in \[0, 1\) or null, got 1.0"):
        AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "ema_decay": 1.0}, "ds.json")
