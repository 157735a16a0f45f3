"""The live capture and PyTorch's fused fast path (issue 34: no silent case on any frontend).

Eager ``nn.TransformerEncoder`` in eval under ``no_grad`` runs fused and writes 0 at the positions a padding mask
hides; Dynamo traces the standard path (as ``torch.compile(model)`` does), which computes values there. The live
module agrees with eager at every real position and says so in a note; a training-mode call needs no note."""

from __future__ import annotations

import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2,
                                         enable_nested_tensor=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.enc(x, src_key_padding_mask=mask)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(2, 5, 16), torch.tensor([[False] * 5, [False] * 3 + [True] * 2])


def test_fast_path_in_eager_is_a_note_and_real_positions_agree() -> None:
    model = Encoder().eval()
    x, mask = _inputs()
    with torch.no_grad():
        ref = model(x, mask)
        dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x, mask))
        out = dbg(x, mask)
    torch.testing.assert_close(out[~mask], ref[~mask], rtol=1e-5, atol=1e-5)
    notes = [n for n in dbg.report().notes if "fast path" in n]
    assert len(notes) == 1 and "'enc'" in notes[0] and "padding mask" in notes[0], dbg.report().notes


def test_training_mode_takes_no_fast_path_and_gives_no_note() -> None:
    model = Encoder().train()
    x, mask = _inputs()
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x, mask))
    dbg(x, mask)
    assert not [n for n in dbg.report().notes if "fast path" in n]
