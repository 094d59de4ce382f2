"""The scripts share their plumbing word for word, so that a bug fixed in one is fixed in all and
`diff grpo.py passk.py` shows the method and nothing else.

- Below the marker line, every trainer's text is grpo.py's, character for character; rse_search.py
  (a search: no training) has a subset of grpo.py's definitions there, each identical.
- Above it, the update that every trainer shares (policy_loss, aggregate_loss, train_step) is
  grpo.py's, except where a method owns its own version: exactly the names in OWN below.
- grpo.py carries no code that only another method uses."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINERS = ["passk.py", "w2spo.py", "sampling_evolve.py"]
MARKER = re.compile(r"^# =+ plumbing$", re.MULTILINE)
UPDATE = ["group_advantages", "policy_loss", "aggregate_loss", "train_step"]
OWN = {"w2spo.py": {"policy_loss", "train_step"}}  # W2SPO's off-policy update


def split(path):
    """(text above the marker line, text from it on)."""
    text = (ROOT / path).read_text()
    found = list(MARKER.finditer(text))
    assert len(found) == 1, f"{path}: expected one plumbing marker line, found {len(found)}"
    return text[: found[0].start()], text[found[0].start():]


def definitions(text):
    """name -> source of each top-level function, class or assignment."""
    found = {}
    for node in ast.parse(text).body:
        names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [
            t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        for name in names:
            found[name] = ast.get_source_segment(text, node)
    return found


@pytest.mark.parametrize("script", TRAINERS)
def test_trainer_plumbing_is_grpo_plumbing(script):
    assert split(script)[1] == split("grpo.py")[1], (
        f"{script}: the plumbing differs from grpo.py's; copy the change to every script")


def test_search_plumbing_is_a_subset_of_grpo_plumbing():
    reference = definitions(split("grpo.py")[1])
    own = definitions(split("rse_search.py")[1])
    assert own, "rse_search.py has no plumbing below its marker"
    for name, source in own.items():
        assert name in reference, f"rse_search.py: {name} is below the marker but not in grpo.py"
        assert source == reference[name], f"rse_search.py: {name} differs from grpo.py's"
    assert "sync_weights" not in own and "Run" not in own  # a search trains nothing


@pytest.mark.parametrize("script", TRAINERS)
def test_shared_update_is_grpo_update(script):
    reference, own = definitions(split("grpo.py")[0]), definitions(split(script)[0])
    for name in UPDATE:
        if name in OWN.get(script, set()):
            assert own.get(name) and own[name] != reference[name], (
                f"{script} is said to own {name}, but it is grpo.py's or missing")
        elif name in own:
            assert own[name] == reference[name], f"{script}: {name} differs from grpo.py's"


def test_grpo_carries_no_other_method():
    text = (ROOT / "grpo.py").read_text()
    for word in ("behaviour", "off_policy", "is_mode", "is_cap", "aux_", "passk_", "evolved"):
        assert word not in text, f"grpo.py mentions {word!r}: that belongs to another method"
