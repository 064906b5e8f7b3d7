"""The worker's measured cost of verifying several positions (no timing asserted:
only what the curve is)."""

from mlxd.worker_proc.verify_cost import MOST_POSITIONS, measure_verify_costs
from support import load_reference


def test_the_measured_curve_is_relative_and_non_decreasing(llama_model):
    model, _ = load_reference(llama_model)
    curve = measure_verify_costs(model, budget_s=0.5)
    assert len(curve) == MOST_POSITIONS and curve[0] == 1.0
    assert all(b >= a > 0 for a, b in zip(curve, curve[1:]))


def test_a_spent_budget_still_measures_one_and_eight_positions(llama_model):
    model, _ = load_reference(llama_model)
    curve = measure_verify_costs(model, budget_s=0.0)
    # 1 and 8 measured, linear from there: the slope between them goes on
    slope = (curve[7] - curve[0]) / 7
    assert abs((curve[15] - curve[7]) - 8 * slope) < 1e-3
