from benchmarks.research.spec_tail_sim import tokens_per_step


def test_certain_and_no_acceptance_keep_their_fixed_counts():
    # p = 1: every step keeps N + 1 (the last step what is left); p = 0: one token a step
    assert tokens_per_step(4, 41, 3, 1.0, runs=10)["mean"] == 40 / 10
    assert tokens_per_step(4, 41, 3, 0.0, runs=10)["mean"] == 1.0


def test_the_slowest_request_sets_the_run_so_more_requests_keep_less():
    one, many = (tokens_per_step(c, 48, 3, 0.8, runs=400)["mean"] for c in (1, 16))
    assert many < one < 0.8 ** 0 + 0.8 + 0.8 ** 2 + 0.8 ** 3
