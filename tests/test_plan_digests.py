"""Plans do not change under refactors: every stored digest (tests/plan_digests.py) is reproduced."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plan_digests  # noqa: E402


def test_plans_match_the_stored_digests():
    with open(plan_digests.STORE) as f:
        stored = json.load(f)
    assert len(stored) == len(list(plan_digests.grid()))
    now = plan_digests.compute()
    changed = [k for k in stored if now.get(k) != stored[k]]
    assert not changed, f"{len(changed)} of {len(stored)} plans changed, e.g. {changed[:3]}"
