"""The shared sections are identical in every script that defines them, so a bug fixed
in one file is fixed in all, and `diff grpo.py passk.py` shows only the method."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["grpo.py", "passk.py", "w2spo.py", "rse_search.py", "sampling_evolve.py"]
SHARED = [  # top-level functions, classes and constants that must not drift
    "CPU_AUTO_DTYPE", "add_common_args", "die", "run_cli", "check_args", "seed_everything", "resolve_compute_dtype", "autocast",
    "DEFAULT_MODELS", "resolve_model_path", "load_model", "encode_prompt", "left_pad", "right_pad", "cut_at_eos",
    "choose_backend", "create_vllm_engine", "Sampler", "build_batch", "token_logprobs", "policy_loss", "aggregate_loss", "trim_columns", "train_step",
    "evaluate", "save_checkpoint", "rng_states", "set_rng_states", "find_resume_state", "open_log", "load_data",
]


def top_level_sources(path):
    """name -> exact source text of each top-level def/class/assignment in a file."""
    text = path.read_text()
    found = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = ast.get_source_segment(text, node)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = ast.get_source_segment(text, node)
    return found


def existing_scripts():
    return [ROOT / name for name in SCRIPTS if (ROOT / name).exists()]


def test_grpo_defines_every_shared_name():
    missing = [name for name in SHARED if name not in top_level_sources(ROOT / "grpo.py")]
    assert not missing, f"grpo.py (the skeleton) lacks shared names: {missing}"


@pytest.mark.parametrize("name", SHARED)
def test_shared_source_is_identical(name):
    reference = top_level_sources(ROOT / "grpo.py")[name]
    for script in existing_scripts()[1:]:
        source = top_level_sources(script).get(name)
        if source is not None:
            assert source == reference, f"{script.name}: {name} differs from grpo.py; copy the fix to every script"
