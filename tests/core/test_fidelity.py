"""Fidelity helpers on hand-computed cases."""

import math

import torch

from retopk_core.fidelity import full_probabilities, mass_recall, output_cosine, retained_mass, support_recall
from retopk_core.kv import PagedKV


def test_support_recall_counts_shared_positions_and_ignores_padding():
    exact = torch.tensor([[3, 1, 7, -1]])
    selected = torch.tensor([[1, 9, 3, -1]])
    assert abs(support_recall(selected, exact).item() - 2 / 3) < 1e-6


def test_mass_recall_weighs_each_found_position_by_its_softmax_weight():
    exact = torch.tensor([[3, 1, 7, -1], [-1, -1, -1, -1]])  # the second row: an empty exact support
    scores = torch.tensor([[2.0, 0.0, 1.0, 9.0], [0.0, 0.0, 0.0, 0.0]])  # the padded score is ignored
    selected = torch.tensor([[1, 9, 3, -1, -1], [4, -1, -1, -1, -1]])  # finds 3 and 1, misses 7
    z = math.e ** 2 + 1 + math.e
    torch.testing.assert_close(mass_recall(selected, exact, scores), torch.tensor([(math.e ** 2 + 1) / z, 1.0]))
    assert abs(support_recall(selected[:1], exact[:1]).item() - 2 / 3) < 1e-6  # the count misses as much for 7 as 1


def test_full_probabilities_and_retained_mass():
    # one head, d = 1, keys 0, 1, 2 and a padded fourth position: scores are q*k (scale 1)
    k = torch.tensor([0.0, 1.0, 2.0, 5.0]).view(1, 1, 4, 1)
    kv = PagedKV.contiguous(k, torch.zeros_like(k), torch.tensor([3]))
    probs = full_probabilities(torch.ones(1, 1, 1), kv, scale=1.0)
    z = 1 + math.e + math.e ** 2
    torch.testing.assert_close(probs[0, 0], torch.tensor([1 / z, math.e / z, math.e ** 2 / z]))  # up to the length
    mass = retained_mass(probs, torch.tensor([[[2, 1, -1]]]))
    assert abs(mass.item() - (math.e + math.e ** 2) / z) < 1e-6


def test_output_cosine():
    a = torch.tensor([[[1.0, 0.0]]])
    assert output_cosine(a, torch.tensor([[[2.0, 0.0]]])).item() == 1.0
    assert abs(output_cosine(a, torch.tensor([[[0.0, 3.0]]])).item()) < 1e-7
