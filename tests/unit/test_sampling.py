"""Choosing the next tokens (greedy, temperature, top-k, top-p from a seeded generator) and
stopping at the end-of-document id, checked against values worked out by hand."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_mesh.inference.continuations import Continuations
from megatron_mesh.inference.sampling import Sampling, next_tokens

PROBS = [0.5, 0.3, 0.15, 0.05]


def logits(rows: int = 1) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in PROBS]] * rows)


def test_greedy_is_the_argmax() -> None:
    x = torch.tensor([[0.1, 2.0, -1.0], [3.0, 2.9, 0.0]])
    assert next_tokens(x, Sampling()).tolist() == [1, 0]


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 50, generator=g)
    got = next_tokens(x, Sampling(temperature=3.0, top_k=1), g)
    assert torch.equal(got, x.argmax(-1))


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    """top_p 0.7 over (0.5, 0.3, 0.15, 0.05): tokens 0 and 1 (mass 0.8), drawn 5 : 3."""
    g = torch.Generator().manual_seed(1)
    drawn = next_tokens(logits(4000), Sampling(temperature=1.0, top_p=0.7), g)
    assert set(drawn.tolist()) == {0, 1}
    share = (drawn == 0).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.03, share


def test_top_k_and_temperature() -> None:
    """top_k 3 never draws the 4th token; temperature 1 draws the rest in proportion."""
    g = torch.Generator().manual_seed(2)
    drawn = next_tokens(logits(6000), Sampling(temperature=1.0, top_k=3), g)
    assert set(drawn.tolist()) == {0, 1, 2}
    share = (drawn == 2).float().mean().item()
    assert abs(share - 0.15 / 0.95) < 0.03, share


def test_the_same_seed_draws_the_same_tokens() -> None:
    s = Sampling(temperature=1.3, top_k=3, top_p=0.9)
    a = next_tokens(logits(100), s, torch.Generator().manual_seed(5))
    b = next_tokens(logits(100), s, torch.Generator().manual_seed(5))
    c = next_tokens(logits(100), s, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_sequence_stops_after_its_eod_token() -> None:
    made = Continuations(3, eod=9)
    made.add(torch.tensor([1, 9, 2]), torch.tensor([-0.1, -0.2, -0.3]))
    made.add(torch.tensor([9, 4, 3]), torch.tensor([-1.0, -2.0, -3.0]))
    assert made.ids == [[1, 9], [9], [2, 3]]
    assert [lp for row in made.logprobs for lp in row] == pytest.approx([-0.1, -1.0, -0.2,
                                                                         -0.3, -3.0])
    assert not made.finished
    made.add(torch.tensor([5, 5, 9]), torch.zeros(3))
    assert made.finished and made.ids[2] == [2, 3, 9]


@pytest.mark.parametrize("kw, message", [
    ({"temperature": math.nan}, "temperature must be a finite number >= 0 (0: greedy), got nan"),
    ({"temperature": math.inf}, "temperature must be a finite number >= 0 (0: greedy), got inf"),
    ({"temperature": -0.5}, "temperature must be a finite number >= 0 (0: greedy), got -0.5"),
    ({"temperature": 1.0, "top_k": -1}, "top_k must be >= 0 (0: all tokens), got -1"),
    ({"temperature": 1.0, "top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"temperature": 1.0, "top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"temperature": 1.0, "top_p": math.nan}, "top_p must be in (0, 1], got nan"),
])
def test_sampling_settings_that_cannot_draw_are_refused(kw: dict, message: str) -> None:
    """A nan or infinite temperature made every probability nan (torch.multinomial raised
    after the model had loaded); each bad setting is refused when the settings are made."""
    with pytest.raises(ValueError) as e:
        Sampling(**kw)
    assert str(e.value) == message
