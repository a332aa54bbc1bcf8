"""rl_core.masked.segment_mean: each run of set mask entries replaced by its mean (ROLL's agentic segment ratio)."""

import pytest
import torch

from rl_core.masked import segment_mean


def _loop_reference(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Row by row, run by run, as ROLL's compute_segment_masked_mean walks them."""
    out = torch.zeros_like(values)
    for row in range(values.shape[0]):
        column = 0
        while column < values.shape[1]:
            if not mask[row, column]:
                column += 1
                continue
            end = column
            while end < values.shape[1] and mask[row, end]:
                end += 1
            out[row, column:end] = values[row, column:end].mean()
            column = end
    return out


def test_by_hand():
    values = torch.tensor([[1.0, 3.0, 100.0, 4.0, 6.0, 8.0], [5.0, float("nan"), 7.0, 7.0, 7.0, 2.0]])
    mask = torch.tensor([[1, 1, 0, 1, 1, 1], [0, 0, 1, 0, 0, 1]])
    assert segment_mean(values, mask).tolist() == [[2.0, 2.0, 0.0, 6.0, 6.0, 6.0], [0.0, 0.0, 7.0, 0.0, 0.0, 2.0]]


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (8, 33)])
def test_matches_the_loop_over_random_masks_and_passes_gradients_to_each_run(shape):
    g = torch.Generator().manual_seed(shape[1])
    values = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(shape, generator=g) < 0.6
    mask[0] = False  # an empty row gives zeros, not NaN
    got = segment_mean(values, mask)
    assert torch.allclose(got, _loop_reference(values.detach(), mask), atol=1e-12)
    weights = torch.randn(shape, generator=g, dtype=torch.float64)
    (got * weights).sum().backward()
    expected = torch.autograd.functional.vjp(lambda v: _loop_reference(v, mask), values.detach(), weights)[1]
    assert torch.allclose(values.grad, expected, atol=1e-12)
