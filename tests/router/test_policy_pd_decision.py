import pytest

from router.policies.pd_decision import PDDecision, decide_prefill

CASES = [
    # prompt, decode-cached, threshold, prefill available → decision
    (100, 0, 512, True, PDDecision(False, "short_prompt")),
    (511, 0, 512, True, PDDecision(False, "short_prompt")),
    (512, 0, 512, True, PDDecision(True, "long_prompt")),
    (4096, 0, 512, True, PDDecision(True, "long_prompt")),
    (4096, 0, 512, False, PDDecision(False, "no_prefill_worker")),
    (4096, 3800, 512, True, PDDecision(False, "short_prompt")),  # decode already holds most of it
    (10, 0, 0, True, PDDecision(True, "long_prompt")),  # threshold 0: always disaggregate
    (10, 50, 0, True, PDDecision(True, "long_prompt")),
]


@pytest.mark.parametrize("prompt,cached,threshold,available,want", CASES)
def test_pd_decision(prompt, cached, threshold, available, want):
    assert decide_prefill(prompt, cached, threshold, available) == want
